"""Retention policies (pure) and the gc planner over synthetic stores (no torch saves here).

The synthetic stores hold real manifests (``Manifest.to_bytes``) and placeholder objects in a real
``LocalTier``; gc never reads object contents, so that is all it needs.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import pickle
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore import gc as G
from ckptstore import retention as R
from ckptstore.manifest import catalogue, layout
from ckptstore.manifest.catalogue import VersionRecord
from ckptstore.manifest.schema import Manifest, ObjectEntry
from ckptstore.tiers import LocalTier

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
        newest = max(vs, key=lambda r: (r.created, r.version))
        assert by[newest.version].keep
        loadable = [r for r in vs if not r.damaged]
        if loadable:
            assert by[max(loadable, key=lambda r: (r.created, r.version)).version].keep
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


# -- synthetic stores ----------------------------------------------------------------------------------------
def fake_version(tier: LocalTier, version: str, created: dt.datetime, *, step=None, user=None, pinned=False,
                 damaged=False, ranks=2, mtime=None) -> Manifest:
    attempt = f"{created.strftime('%Y%m%dT%H%M%S')}-{abs(hash(version)) % 10**12:012d}-00001"
    objs = []
    for r in ranks and range(ranks) or []:
        name = layout.shard_name(attempt, r)
        data = os.urandom(64 + r)
        tier.put(layout.object_key(version, name), data)
        objs.append(ObjectEntry(name, len(data), "0" * 16, 1, r, len(data)))
    meta_name = layout.metadata_name(attempt)
    tier.put(layout.object_key(version, meta_name), b"m" * 10)
    m = Manifest(version=version, attempt=attempt, created=created.isoformat().replace("+00:00", "Z"),
                 world_size=ranks, objects=objs, metadata_object=ObjectEntry(meta_name, 10, "0" * 16, 1, None, 10),
                 step=step, user=user or {})
    tier.put_if_absent(layout.manifest_key(version), m.to_bytes(None))
    if pinned:
        tier.put(layout.pin_key(version), b"{}")
    if damaged:
        tier.put(layout.damaged_key(version), json.dumps({"reason": "test"}).encode())
    if mtime is not None:
        for i in tier.list(layout.version_dir(version) + "/"):
            os.utime(tier.local_path(i.key), (mtime, mtime))
    return m


def put_garbage(tier: LocalTier, key: str, mtime: float, size: int = 7) -> None:
    tier.put(key, b"g" * size)
    os.utime(tier.local_path(key), (mtime, mtime))


def files(root) -> set[str]:
    out = set()
    for d, _dn, fns in os.walk(root):
        for f in fns:
            out.add(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"))
    return out


def test_plan_and_apply_synthetic(tmp_path):
    t = LocalTier(tmp_path)
    now = T0 + dt.timedelta(days=3)
    old = (now - dt.timedelta(hours=5)).timestamp()
    young = (now - dt.timedelta(minutes=5)).timestamp()
    ms = {}
    for i in range(5):
        ms[f"v{i}"] = fake_version(t, f"v{i}", T0 + dt.timedelta(hours=i), step=i * 100, pinned=(i == 0), damaged=(i == 1),
                                   mtime=old)
    att = ms["v4"].attempt
    # garbage: an aborted attempt of a new version (old and young), a superseded attempt of v4,
    # temp files, an upload marker, a leftover damage mark, an empty dir
    put_garbage(t, "versions/v9/attempts/20260101T000000-aaaaaaaaaaaa-00001/r00000.ckd", old)
    put_garbage(t, "versions/v8/attempts/20260101T000000-bbbbbbbbbbbb-00001/r00000.ckd", young)
    put_garbage(t, "versions/v4/attempts/20250101T000000-cccccccccccc-00001/r00000.ckd", old)
    put_garbage(t, "versions/v4/.tmp-0123456789abcdef", old)
    put_garbage(t, f"versions/v4/attempts/{att}/uploaded.r00000.json", old)
    put_garbage(t, "versions/v7/damaged.json", old)
    put_garbage(t, "stray.txt", old)
    os.makedirs(tmp_path / "versions" / "v6" / "attempts" / "x")
    os.utime(tmp_path / "versions" / "v6" / "attempts" / "x", (old, old))
    policy = R.RetentionPolicy(per_tier={"local": [R.KeepLast(2)]})
    before = files(tmp_path)

    p1 = G.plan([G.collect(t, "local")], policy, now, 3600)
    p2 = G.plan([G.collect(t, "local")], policy, now, 3600)
    assert p1.to_json() == p2.to_json()  # the dry run's plan is the real run's plan
    assert files(tmp_path) == before  # planning touches nothing
    d = {x.version: x for x in p1.decisions["local"]}
    assert [v for v, x in d.items() if not x.keep] == ["v1", "v2"]
    assert R.REASON_PINNED in d["v0"].reasons
    # every un-commit comes before every object deletion
    ops = [a.op for a in p1.actions]
    assert ops.index("delete") > max(i for i, o in enumerate(ops) if o == "uncommit")
    deleted = {a.key for a in p1.actions if a.op == "delete"}
    assert "versions/v1/damaged.json" in deleted
    assert "versions/v9/attempts/20260101T000000-aaaaaaaaaaaa-00001/r00000.ckd" in deleted
    assert "versions/v4/attempts/20250101T000000-cccccccccccc-00001/r00000.ckd" in deleted
    assert "versions/v4/.tmp-0123456789abcdef" in deleted
    assert f"versions/v4/attempts/{att}/uploaded.r00000.json" in deleted
    assert "versions/v7/damaged.json" in deleted
    surv = {s.key: s.reason for s in p1.survivors}
    assert "younger than the grace period" in surv["versions/v8/attempts/20260101T000000-bbbbbbbbbbbb-00001/r00000.ckd"]
    assert "stray.txt" not in deleted and "stray.txt" not in surv  # outside versions/: not even listed
    assert [a.key for a in p1.actions if a.op == "rmdir"] == ["versions/v6/attempts/x"]

    res = G.apply({"local": t}, p1)
    assert res.ok and not res.skipped
    assert res.applied == p1.actions
    after = files(tmp_path)
    for v in ("v0", "v3", "v4"):
        m = ms[v]
        assert layout.manifest_key(v) in after
        assert all(layout.object_key(v, o.name) in after for o in m.all_objects())
    assert "versions/v0/pinned" in after
    assert not any(k.startswith(("versions/v1/", "versions/v2/", "versions/v9/", "versions/v7/", "versions/v6/")) for k in after)
    assert not os.path.exists(tmp_path / "versions" / "v6")
    assert "stray.txt" in after
    # idempotent: a second run finds nothing more to do
    p3 = G.plan([G.collect(t, "local")], policy, now, 3600)
    assert p3.actions == []


def test_apply_rechecks_pin_and_reattempt(tmp_path):
    t = LocalTier(tmp_path)
    for i in range(3):
        fake_version(t, f"v{i}", T0 + dt.timedelta(hours=i))
    now = T0 + dt.timedelta(days=1)
    p = G.plan([G.collect(t, "local")], R.RetentionPolicy(rules=[R.KeepLast(1)]), now, 0)
    assert sorted(G.plan([G.collect(t, "local")], R.RetentionPolicy(rules=[R.KeepLast(1)]), now, 0).deleted_versions["local"]) == ["v0", "v1"]
    # meanwhile: v0 gets pinned and v1 is re-committed by another attempt
    t.put(layout.pin_key("v0"), b"{}")
    t.delete(layout.manifest_key("v1"))
    m1 = fake_version(t, "v1", T0 + dt.timedelta(hours=5))
    res = G.apply({"local": t}, p)
    skipped = {(a.op, a.version) for a, _why in res.skipped}
    assert ("uncommit", "v0") in skipped and ("uncommit", "v1") in skipped
    assert t.exists(layout.manifest_key("v0")) and t.exists(layout.manifest_key("v1"))
    assert all(t.exists(layout.object_key("v1", o.name)) for o in m1.all_objects())
    # the objects of v0 were not deleted either (their un-commit was skipped)
    assert not any(a.version == "v0" for a in res.applied)


def test_garbage_that_changed_is_skipped(tmp_path):
    t = LocalTier(tmp_path)
    key = "versions/v9/attempts/20260101T000000-aaaaaaaaaaaa-00001/r00000.ckd"
    put_garbage(t, key, (T0 - dt.timedelta(hours=3)).timestamp())
    p = G.plan([G.collect(t, "local")], None, T0, 3600)
    assert [a.key for a in p.actions] == [key]
    with open(t.local_path(key), "ab") as f:  # still being written
        f.write(b"more")
    res = G.apply({"local": t}, p)
    assert res.skipped and "changed since the plan" in res.skipped[0][1]
    assert t.exists(key)


def test_invalid_manifest_dir_left_alone(tmp_path):
    t = LocalTier(tmp_path)
    fake_version(t, "v0", T0, mtime=(T0 - dt.timedelta(days=1)).timestamp())
    fake_version(t, "v1", T0 + dt.timedelta(hours=1))
    path = t.local_path(layout.manifest_key("v0"))
    data = bytearray(open(path, "rb").read())
    data[30] ^= 1
    open(path, "wb").write(bytes(data))
    p = G.plan([G.collect(t, "local")], R.RetentionPolicy(rules=[R.KeepLast(1)]), T0 + dt.timedelta(days=2), 0)
    assert p.actions == []
    assert p.problems and p.problems[0][1] == layout.manifest_key("v0")
    assert all("invalid" in s.reason for s in p.survivors)


def test_pin_in_one_tier_protects_in_all(tmp_path):
    a, b = LocalTier(tmp_path / "a"), LocalTier(tmp_path / "b")
    for i in range(3):
        fake_version(a, f"v{i}", T0 + dt.timedelta(hours=i), pinned=(i == 0))
        fake_version(b, f"v{i}", T0 + dt.timedelta(hours=i))
    p = G.plan([G.collect(a, "local"), G.collect(b, "remote")], R.RetentionPolicy(rules=[R.KeepLast(1)]), T0 + dt.timedelta(days=1), 0)
    assert p.deleted_versions == {"local": ["v1"], "remote": ["v1"]}


def test_versions_not_yet_uploaded_are_kept_locally(tmp_path):
    local, remote = LocalTier(tmp_path / "l"), LocalTier(tmp_path / "r")
    for i in range(4):
        fake_version(local, f"v{i}", T0 + dt.timedelta(hours=i))
        if i < 2:
            fake_version(remote, f"v{i}", T0 + dt.timedelta(hours=i))
    policy = R.RetentionPolicy(rules=[R.KeepLast(1)])
    p = G.plan([G.collect(local, "local"), G.collect(remote, "remote")], policy, T0 + dt.timedelta(days=1), 0)
    assert p.deleted_versions == {"local": ["v0", "v1"], "remote": ["v0"]}
    v2 = next(d for d in p.decisions["local"] if d.version == "v2")
    assert v2.keep and "not yet committed in the remote tier (its upload may be pending)" in v2.reasons
    # without the remote tier in the run, the local rules alone decide
    p = G.plan([G.collect(local, "local")], policy, T0 + dt.timedelta(days=1), 0)
    assert p.deleted_versions == {"local": ["v0", "v1", "v2"]}
    ds = R.apply_after_commit(local, policy, catalogue.read_manifest(local, "v3").manifest,
                              protect={"v2": "upload pending"})
    assert kept(ds) == ["v2", "v3"] and "upload pending" in ds[2].reasons


def test_multipart_uploads_aborted_after_grace(tmp_path):
    class UploadsTier(LocalTier):
        """A local tier that also tracks multipart uploads (as the S3 tier does)."""

        supports_multipart = True

        def __init__(self, root, uploads):
            super().__init__(root)
            self.uploads = uploads
            self.aborted = []

        def list_multipart_uploads(self, prefix=""):
            return [u for u in self.uploads if u[0].startswith(prefix)]

        def abort_multipart_upload(self, key, upload_id):
            self.aborted.append((key, upload_id))

    now = T0
    t = UploadsTier(tmp_path, [("versions/v1/attempts/a-1/r00000.ckd", "old", now - dt.timedelta(hours=2)),
                               ("versions/v1/attempts/a-1/r00001.ckd", "new", (now - dt.timedelta(minutes=1)).timestamp())])
    p, res = G.run({"remote": t}, None, now=now, grace=3600)
    assert [(a.op, a.upload_id) for a in p.actions] == [("abort-upload", "old")]
    assert t.aborted == [("versions/v1/attempts/a-1/r00000.ckd", "old")]
    assert any("in progress" in s.reason for s in p.survivors)


def test_apply_after_commit_window(tmp_path):
    t = LocalTier(tmp_path)
    ms = [fake_version(t, f"v{i}", T0 + dt.timedelta(hours=i)) for i in range(4)]
    # a newer save committed before the retention of v2 ran: it is neither counted nor deleted
    ds = R.apply_after_commit(t, R.RetentionPolicy(rules=[R.KeepLast(1)]), ms[2])
    assert [d.version for d in ds] == ["v0", "v1", "v2"]
    assert kept(ds) == ["v2"]
    assert {r.version for r in catalogue.merge({"local": catalogue.scan(t)})} == {"v2", "v3"}
    assert "just committed" in ds[-1].reasons
    # a pin in another tier protects the version here too
    other = LocalTier(tmp_path / "other")
    m4 = fake_version(t, "v4", T0 + dt.timedelta(hours=4))
    fake_version(other, "v3", T0 + dt.timedelta(hours=3), pinned=True)
    ds = R.apply_after_commit(t, R.RetentionPolicy(rules=[R.KeepLast(1)]), m4, other_tiers=[other])
    assert kept(ds) == ["v3", "v4"] and R.REASON_PINNED in ds[1].reasons
    ds = R.apply_after_commit(t, R.RetentionPolicy(rules=[R.KeepLast(1)]), m4)
    assert kept(ds) == ["v4"]
    # no rule for this tier: nothing happens
    assert R.apply_after_commit(t, R.RetentionPolicy(per_tier={"remote": [R.KeepLast(1)]}), m4) == []
    assert R.apply_after_commit(t, None, m4) == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(versions_st, rules_st, st.lists(st.tuples(st.integers(0, 9), st.integers(0, 7200)), max_size=6), st.integers(0, 7200))
def test_property_dry_run_plan_equals_applied_plan(tmp_path_factory, spec, rules, garbage, grace):
    root = tmp_path_factory.mktemp("prop")
    t = LocalTier(root)
    vs = _records(spec)
    now = T0 + dt.timedelta(days=10)
    ms = {}
    for r in vs:
        ms[r.version] = fake_version(t, r.version, r.created, step=r.step, user=r.user, pinned=r.pinned,
                                     damaged=r.damaged, ranks=1, mtime=(now - dt.timedelta(hours=3)).timestamp())
    for i, (v, age) in enumerate(garbage):
        put_garbage(t, f"versions/g{v}/attempts/20260101T000000-{i:012d}-00001/r00000.ckd", now.timestamp() - age)
    policy = R.RetentionPolicy(rules=rules)
    dry = G.plan([G.collect(t, "local")], policy, now, grace)
    real = G.plan([G.collect(t, "local")], policy, now, grace)
    assert dry.to_json() == real.to_json()
    res = G.apply({"local": t}, real)
    assert res.ok and res.applied == real.actions
    left = catalogue.merge({"local": catalogue.scan(t)})
    keep = [d.version for d in real.decisions["local"] if d.keep]
    assert [r.version for r in left] == keep
    if vs:
        assert max(vs, key=lambda r: (r.created, r.version)).version in keep
    assert {r.version for r in vs if r.pinned} <= set(keep)
    for r in left:  # every surviving committed version still has all its objects
        assert all(t.exists(layout.object_key(r.version, o.name)) for o in ms[r.version].all_objects())
    for i, (v, age) in enumerate(garbage):
        key = f"versions/g{v}/attempts/20260101T000000-{i:012d}-00001/r00000.ckd"
        assert t.exists(key) == (age < grace)
    assert G.plan([G.collect(t, "local")], policy, now, grace).actions == []
