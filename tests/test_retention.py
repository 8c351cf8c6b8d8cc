"""Retention rules and policies: pure decisions over version records (no storage, no I/O here;
the planner and deletion are tested in tests/test_gc.py)."""

from __future__ import annotations

import datetime as dt
import json
import pickle
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore import retention as R
from ckptstore.manifest.catalogue import VersionRecord

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 1, 1, tzinfo=UTC)


def rec(v, minutes, step=None, pinned=False, damaged=False, **user) -> VersionRecord:
    return VersionRecord(
        version=v, created=T0 + dt.timedelta(minutes=minutes), step=step, world_size=1, nbytes=1, stored_bytes=1,
        tiers=frozenset({"local"}), pinned=pinned, damaged=damaged, attempt=f"a-{v}", encrypted=False, key_id=None, user=user,
    )


def kept(decisions):
    return [d.version for d in decisions if d.keep]


# -- durations ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,secs", [("7d", 604800), ("12h", 43200), ("1d12h", 129600), ("90m", 5400), ("30s", 30),
                                       ("2w", 1209600), ("0", 0), ("1.5h", 5400), (" 10 ", 10), (3600, 3600)])
def test_parse_duration(text, secs):
    assert R.parse_duration(text) == secs


@pytest.mark.parametrize("bad", ["", "h", "7x", "7d junk", "-1h", "d7", -5])
def test_parse_duration_rejects(bad):
    with pytest.raises(ValueError):
        R.parse_duration(bad)


def test_format_duration():
    assert R.format_duration(5400) == "1h30m"
    assert R.format_duration(0) == "0s"
    assert R.format_duration(90061) == "1d1h1m1s"


# -- rules ---------------------------------------------------------------------------------------------
def test_no_rule_keeps_everything():
    vs = [rec(f"v{i}", i) for i in range(5)]
    ds = R.evaluate(vs, [], T0)
    assert all(d.keep for d in ds)
    assert all(R.REASON_NO_RULES in d.reasons for d in ds)


def test_keep_last_and_newest():
    vs = [rec(f"v{i}", i) for i in range(5)]
    ds = R.evaluate(vs, [R.KeepLast(2)], T0)
    assert kept(ds) == ["v3", "v4"]
    assert R.REASON_NEWEST in ds[-1].reasons
    assert "keep-last 2: 2nd newest" in ds[3].reasons
    assert ds[0].reasons == ("not kept by any rule (keep-last 2)",)
    # keep-last 0 still keeps the newest committed version
    assert kept(R.evaluate(vs, [R.KeepLast(0)], T0)) == ["v4"]


def test_input_order_does_not_matter():
    vs = [rec(f"v{i}", i) for i in range(6)]
    shuffled = vs[:]
    random.Random(1).shuffle(shuffled)
    rules = [R.KeepLast(2), R.KeepEverySteps(3)]
    assert R.evaluate(vs, rules, T0) == R.evaluate(shuffled, rules, T0)


def test_keep_every_steps_first_in_each_bucket():
    vs = [rec("a", 0, step=9_990), rec("b", 1, step=10_010), rec("c", 2, step=15_000), rec("d", 3, step=20_000),
          rec("e", 4, step=25_000), rec("nostep", 5), rec("f", 6, step=26_000)]
    ds = R.evaluate(vs, [R.KeepEverySteps(10_000)], T0)
    assert kept(ds) == ["a", "b", "d", "f"]  # f: newest
    by = {d.version: d for d in ds}
    assert any("first version at or after step 10000 (step 10010)" in r for r in by["b"].reasons)


def test_keep_within():
    now = T0 + dt.timedelta(hours=30)
    vs = [rec("old", 0), rec("edge", 6 * 60), rec("young", 29 * 60), rec("new", 30 * 60 - 1)]
    ds = R.evaluate(vs, [R.KeepWithin(R.parse_duration("1d"))], now)
    assert kept(ds) == ["edge", "young", "new"]  # edge: exactly 24h old
    assert "keep-within 1d: committed 1h ago" in {d.version: d for d in ds}["young"].reasons


def test_keep_best_min_max_nested_and_missing():
    vs = [rec("a", 0, loss=0.5), rec("b", 1, loss=0.1), rec("c", 2, loss=0.3), rec("d", 3, eval={"acc": 0.9}),
          rec("e", 4, loss=float("nan")), rec("f", 5, loss="x"), rec("g", 6, loss=True), rec("h", 7)]
    assert kept(R.evaluate(vs, [R.KeepBest(2, "loss", "min")], T0)) == ["b", "c", "h"]
    assert kept(R.evaluate(vs, [R.KeepBest(1, "loss", "max")], T0)) == ["a", "h"]
    assert kept(R.evaluate(vs, [R.KeepBest(1, "eval.acc", "max")], T0)) == ["d", "h"]
    d = {x.version: x for x in R.evaluate(vs, [R.KeepBest(2, "loss")], T0)}
    assert "keep-best 2 by min loss: loss=0.1, 1st best" in d["b"].reasons


def test_keep_best_ties_prefer_newer():
    vs = [rec("a", 0, loss=1.0), rec("b", 1, loss=1.0), rec("c", 2, loss=2.0)]
    assert kept(R.evaluate(vs, [R.KeepBest(1, "loss")], T0)) == ["b", "c"]


def test_rules_union_lists_every_reason():
    vs = [rec("a", 0, step=0, loss=0.1), rec("b", 1, step=5), rec("c", 2, step=10)]
    ds = R.evaluate(vs, [R.KeepLast(1), R.KeepEverySteps(10), R.KeepBest(1, "loss")], T0)
    by = {d.version: d for d in ds}
    assert kept(ds) == ["a", "c"]
    assert len(by["a"].reasons) == 2 and len(by["c"].reasons) == 3


def test_pinned_always_kept():
    vs = [rec("a", 0, pinned=True), rec("b", 1), rec("c", 2)]
    for rules in ([R.KeepLast(1)], [R.KeepWithin(0)], [R.KeepBest(1, "loss")], [R.KeepEverySteps(1)]):
        ds = R.evaluate(vs, rules, T0 + dt.timedelta(days=9))
        assert kept(ds) == ["a", "c"]
        assert R.REASON_PINNED in ds[0].reasons


def test_damaged_versions_take_no_slot():
    vs = [rec("a", 0), rec("b", 1), rec("c", 2, damaged=True)]
    ds = R.evaluate(vs, [R.KeepLast(1)], T0)
    by = {d.version: d for d in ds}
    assert kept(ds) == ["b", "c"]
    assert R.REASON_NEWEST in by["c"].reasons  # newest committed is never deleted, even damaged
    assert R.REASON_LOADABLE in by["b"].reasons
    vs = [rec("a", 0, damaged=True), rec("b", 1), rec("c", 2)]
    ds = R.evaluate(vs, [R.KeepLast(5)], T0)
    assert kept(ds) == ["b", "c"]
    assert "marked damaged" in ds[0].reasons[0]


def test_rule_validation():
    for bad in (lambda: R.KeepLast(-1), lambda: R.KeepEverySteps(0), lambda: R.KeepWithin(-1),
                lambda: R.KeepBest(1, ""), lambda: R.KeepBest(1, "loss", "median"), lambda: R.KeepLast(True)):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError):
        R.rules_from_options(keep_best=2)  # no metric
    with pytest.raises(ValueError):
        R.RetentionPolicy(per_tier={"nvme": [R.KeepLast(1)]})
    with pytest.raises(ValueError):
        R.evaluate([], [], dt.datetime(2026, 1, 1))  # naive now


def test_policy_per_tier_pickle_and_json():
    p = R.RetentionPolicy(rules=[R.KeepBest(3, "loss")],
                          per_tier={"local": [R.KeepLast(2)], "remote": [R.KeepLast(20), R.KeepEverySteps(10_000)]})
    assert p.rules_for("local") == (R.KeepBest(3, "loss"), R.KeepLast(2))
    assert p.rules_for("remote")[1:] == (R.KeepLast(20), R.KeepEverySteps(10_000))
    assert pickle.loads(pickle.dumps(p)) == p
    assert R.RetentionPolicy.from_json(json.loads(json.dumps(p.to_json()))) == p
    assert "remote: keep-last 20, keep-every-steps 10000" in p.describe()
    assert R.RetentionPolicy().is_empty() and R.RetentionPolicy().describe("local").startswith("keep everything")
    vs = [rec(f"v{i}", i, step=i * 5000) for i in range(10)]
    local = R.RetentionPolicy(per_tier={"local": [R.KeepLast(2)]})
    assert kept(local.decide("local", vs, T0)) == ["v8", "v9"]
    assert len(kept(local.decide("remote", vs, T0))) == 10  # no rule for remote: keep all


# -- properties ----------------------------------------------------------------------------------------------
rules_st = st.lists(
    st.one_of(
        st.builds(R.KeepLast, st.integers(0, 6)),
        st.builds(R.KeepEverySteps, st.integers(1, 500)),
        st.builds(R.KeepWithin, st.floats(0, 5e5)),
        st.builds(R.KeepBest, st.integers(0, 4), st.just("loss"), st.sampled_from(["min", "max"])),
    ),
    max_size=4,
)
versions_st = st.lists(
    st.tuples(st.integers(0, 10_000), st.one_of(st.none(), st.integers(0, 3000)), st.booleans(), st.booleans(),
              st.one_of(st.none(), st.floats(-5, 5, allow_nan=False))),
    max_size=12,
)


def _records(spec):
    out = []
    for i, (minute, step, pinned, damaged, loss) in enumerate(spec):
        user = {} if loss is None else {"loss": loss}
        out.append(rec(f"v{i:02d}", minute, step, pinned, damaged and i % 3 == 0, **user))
    return out


@settings(max_examples=300, deadline=None)
@given(versions_st, rules_st, st.integers(0, 20_000))
def test_property_newest_and_pinned_never_deleted(spec, rules, now_min):
    vs = _records(spec)
    now = T0 + dt.timedelta(minutes=now_min)
    ds = R.evaluate(vs, rules, now)
    assert len(ds) == len(vs)
    assert all(d.reasons for d in ds)
    by = {d.version: d for d in ds}
    if vs:
        newest = max(vs, key=lambda r: r.order)  # step, commit sequence (docs/FORMAT.md, "Order")
        assert by[newest.version].keep
        loadable = [r for r in vs if not r.damaged]
        if loadable:
            assert by[max(loadable, key=lambda r: r.order).version].keep
    for r in vs:
        if r.pinned:
            assert by[r.version].keep
    if not rules:
        assert all(d.keep for d in ds)
    # pure: same input (any order) → same output
    assert R.evaluate(list(reversed(vs)), rules, now) == ds
    # adding a rule never deletes more
    more = R.evaluate(vs, list(rules) + [R.KeepLast(1)], now)
    assert set(kept(ds)) <= set(kept(more)) or not rules


# -- the cross-tier rule -------------------------------------------------------------------------------------
def test_across_tiers_pins_travel_and_local_waits_for_upload():
    local = [rec(f"v{i}", i) for i in range(5)]
    remote = [rec("v0", 0), rec("v1", 1, pinned=True), rec("v2", 2)]
    recs, protect = R.across_tiers("local", local, {"remote": remote})
    assert [r.version for r in recs if r.pinned] == ["v1"]  # a pin travels
    assert sorted(protect) == ["v3", "v4"] and "not yet committed in the remote tier" in protect["v3"]
    # an older local-only version is not waited for, unless its upload is known to be running
    recs2 = local + [rec("old", -5)]
    assert "old" not in R.across_tiers("local", recs2, {"remote": remote})[1]
    assert "old" in R.across_tiers("local", recs2, {"remote": remote}, in_flight={"old"})[1]
    # remote catalogue unknown / empty: the newest PENDING_KEPT local versions not known remotely wait
    assert sorted(R.across_tiers("local", local, {"remote": None})[1]) == ["v3", "v4"]
    assert sorted(R.across_tiers("local", local, {"remote": []})[1]) == ["v3", "v4"]
    # ... and whatever is uploading
    assert sorted(R.across_tiers("local", local, {"remote": None}, in_flight={"v0"})[1]) == ["v0", "v3", "v4"]


def test_a_long_outage_protects_a_bounded_number_of_local_versions():
    """S3 unreachable (or refusing this host) for 50 saves: the local tier waits for the newest two
    versions' uploads, not for all 50 — a long outage never fills the local root (before: every
    version was kept until the root was full, then every save failed)."""
    local = [rec(f"s{i}", i) for i in range(50)]
    remote = [rec("s0", 0)]  # the last remote commit before the outage
    for others in ({"remote": None}, {"remote": remote}):
        _recs, protect = R.across_tiers("local", local, others)
        assert sorted(protect, key=lambda v: int(v[1:])) == ["s48", "s49"], protect
        ds = R.evaluate(_recs, R.RetentionPolicy([R.KeepLast(3)]).rules_for("local"), T0, protect=protect)
        assert kept(ds) == ["s47", "s48", "s49"], kept(ds)  # the policy's 3: the local root holds 3 versions, not 50
    # no remote tier in the run: nothing to wait for
    assert R.across_tiers("local", local, {})[1] == {}
    # nothing protects a remote version: an absent or empty local tier keeps nothing there
    for others in ({}, {"local": []}, {"local": None}, {"local": local[:1]}):
        recs, protect = R.across_tiers("remote", remote + [rec("v9", 9)], others)
        assert protect == {}
    recs, _ = R.across_tiers("remote", [rec("v4", 4)], {"local": [rec("v4", 4, pinned=True)]})
    assert recs[0].pinned


def test_retention_is_pure():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(R))
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m in ("gc", "os", "logging", "ckptstore.gc") or m.startswith("tiers") for m in imported), imported
