"""Races — concurrent saves of one version, gc/scrub during a save, listing during commits.

* Two processes save the same version at once (local tier: one root; S3: two nodes with their own
  local roots and one bucket prefix). A barrier in each process holds its manifest put-if-absent
  until both reached it, so the two commits really collide. Exactly one commits; the other gets
  :class:`VersionExistsError`; the committed version loads bit-exactly with the winner's data; the
  loser's attempt is garbage that gc removes after the grace period; scrub is clean.
* gc (with a retention rule) and scrub run while a 2-rank save is paused mid-shard and again just
  before its manifest: nothing of the save is deleted, scrub reports no damage, the save then
  commits and loads bit-exactly.
* Two ``Store`` objects list in a loop while a job commits versions: never an error, never a
  version whose objects are not all there.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
import time

import pytest

import ckptstore
from ckptstore.manifest import catalogue, layout

import crash_ranks

OUTCOMES: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def race_report():
    yield
    if OUTCOMES:
        print("\n\nrace outcomes:\n" + "\n".join(f"  {o}" for o in OUTCOMES) + "\n")


def _outcome(job: crash_ranks.Job) -> tuple:
    st, val = job.results.get(0, ("missing", None))
    if st != "ok":
        return ("crashed", val)
    return val


def _race(tmp_path, roots: list, remote, tier_cls: str, rounds: int):
    """``rounds`` races of two 1-rank jobs saving the same version; returns per-round winners."""
    summary = []
    for i in range(rounds):
        version = f"race{i}"
        bdir = tmp_path / f"barrier{i}"
        bdir.mkdir()
        jobs = []
        for j, root in enumerate(roots):
            opts = {"barrier": (str(bdir), f"job{j}", 2, tier_cls), "remote": remote,
                    "durability": "remote" if remote else "local"}
            jobs.append(crash_ranks.Job(crash_ranks.race_save, 1, root, version, 10 + j, opts))
        codes = [job.wait(90) for job in jobs]
        assert all(c == {0: 0} for c in codes), codes
        outs = [_outcome(job) for job in jobs]
        ok = [j for j, o in enumerate(outs) if o[0] == "ok"]
        lost = [j for j, o in enumerate(outs) if o[0] == "error"]
        assert len(ok) == 1 and len(lost) == 1, outs
        errs = outs[lost[0]][1]
        assert [n for n, _t, _m in errs] == ["VersionExistsError"], errs
        assert len(os.listdir(bdir)) == 2  # both reached the manifest step before either committed
        summary.append((version, ok[0]))
    return summary


def test_two_processes_save_one_version_local(tmp_path):
    root = str(tmp_path / "root")
    crash_ranks.local_save(root, "v0", 0, world=1)
    summary = _race(tmp_path, [root, root], None, "local", rounds=3)
    expected = {"v0": [(0, 1, False)]}
    for version, winner in summary:
        expected[version] = [(10 + winner, 1, False)]  # the winner's data, nothing else
    state, viol = crash_ranks.audit(root, None, None, expected)
    assert not viol, viol
    assert set(state["local"]) == set(expected)
    OUTCOMES.append(f"local, same version saved by 2 processes x{len(summary)}: exactly one committed each time "
                    f"(winners {[w for _v, w in summary]}), the other got VersionExistsError; "
                    "winner's data loads bit-exact; gc removed the loser's attempt; scrub clean")


@pytest.mark.s3
def test_two_nodes_save_one_version_s3(tmp_path, s3_url):
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    summary = _race(tmp_path, roots, s3_url, "s3", rounds=2)
    for version, winner in summary:
        # the bucket holds the winner's data
        idx, why = crash_ranks.match_content(None, s3_url, version, [(10 + winner, 1, False)], None)
        assert idx == 0, why
        # each node committed its own attempt locally first; both load their own data
        for j, root in enumerate(roots):
            idx, why = crash_ranks.match_content(root, None, version, [(10 + j, 1, False)], None)
            assert idx == 0, why
    for j, root in enumerate(roots):
        expected = {v: [(10 + j, 1, False)] for v, _w in summary}
        state, viol = crash_ranks.audit(root, None, None, expected)
        assert not viol, viol
    expected = {v: [(10 + w, 1, False)] for v, w in summary}
    state, viol = crash_ranks.audit(None, s3_url, None, expected)
    assert not viol, viol
    assert set(state["remote"]) == set(expected)
    OUTCOMES.append(f"s3, same version from 2 nodes x{len(summary)}: exactly one remote commit each time "
                    f"(winners {[w for _v, w in summary]}), the other got VersionExistsError from If-None-Match; "
                    "remote loads the winner's data; gc removed the loser's uploads; scrub clean")


def _attempt_files(root, version):
    d = os.path.join(root, layout.version_dir(version), "attempts")
    out = {}
    for dp, _dn, fns in os.walk(d):
        for f in fns:
            p = os.path.join(dp, f)
            out[p] = os.path.getsize(p)
    return out


def test_gc_and_scrub_during_a_save(tmp_path):
    from ckptstore import gc as _gc
    from ckptstore import scrub as _scrub
    from ckptstore.retention import KeepLast, RetentionPolicy

    root = str(tmp_path / "root")
    for i in range(2):
        crash_ranks.local_save(root, f"v{i}", i)
    pdir = str(tmp_path / "pause")
    os.makedirs(pdir)
    pauses = [("write.frame", 2, 1, pdir, "mid"), ("commit.manifest", 1, 0, pdir, "pre")]
    job = crash_ranks.Job(crash_ranks.race_save, 2, root, "v2", 2, {"pauses": pauses})
    st = ckptstore.Store(root)
    checks = []
    for tag in ("mid", "pre"):
        waiter = os.path.join(pdir, f"paused.{tag}.r{1 if tag == 'mid' else 0}")
        crash_ranks.wait_for(waiter, 60)
        before = _attempt_files(root, "v2")
        assert before, "the paused save has written nothing yet"
        # gc with a retention rule, at the real time (grace 1 h): in-flight objects are young
        policy = RetentionPolicy(rules=(KeepLast(1),))
        plan, res = _gc.run(st.tiers, policy, now=dt.datetime.now(dt.timezone.utc), grace=3600)
        assert res.ok, res.failed
        assert not [a for a in plan.actions if "/v2/" in a.key], [a.key for a in plan.actions]
        after = _attempt_files(root, "v2")
        # every in-flight object is still there, none shrank (rank 0 may still be appending to its shard)
        gone = [p for p in before if p not in after or after[p] < before[p]]
        assert not gone, f"gc touched the save in flight: {gone}"
        rep = _scrub.scrub(st, deep=True)
        assert rep.exit_code == 0, _scrub.format_report(rep)
        assert "v2" not in {r.version for r in st.versions()}
        checks.append(f"{tag}: {len(before)} in-flight objects kept, gc removed {len(res.applied)} objects of older versions")
        open(os.path.join(pdir, f"go.{tag}"), "w").close()
    assert job.wait(60) == {0: 0, 1: 0}
    assert [job.results[r][1][0] for r in (0, 1)] == ["ok", "ok"], job.results
    assert [r.version for r in st.versions()] == ["v1", "v2"]
    state, viol = crash_ranks.audit(root, None, None, {"v1": [(1, 2, False)], "v2": [(2, 2, False)]})
    assert not viol, viol
    OUTCOMES.append("gc (keep-last 1) + deep scrub during a 2-rank save paused mid-shard and before the manifest: "
                    "nothing of the save deleted, scrub clean, save committed and loads bit-exact (" + "; ".join(checks) + ")")


def _listing_loop(root, remote, stop, stats, errors):
    st = ckptstore.Store(root, remote=remote)
    while not stop.is_set():
        try:
            recs = st.versions()
            stats["listings"] += 1
            for r in recs:
                for tname in r.tiers:
                    tier = st.tier(tname)
                    m = catalogue.read_manifest(tier, r.version).manifest
                    for o in m.all_objects():
                        info = tier.stat(layout.object_key(r.version, o.name))
                        if info.size != o.size:
                            errors.append(f"{r.version}: {o.name} has {info.size} bytes, manifest says {o.size}")
                    stats["versions checked"] += 1
            if st.problems:
                errors.append(f"problems: {st.problems}")
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")


@pytest.mark.parametrize("tier", ["local", pytest.param("s3", marks=[pytest.mark.s3, pytest.mark.slow])])
def test_listing_while_committing(tmp_path, tier, request):
    remote = request.getfixturevalue("s3_url") if tier == "s3" else None
    root = str(tmp_path / "root")
    os.makedirs(root)  # made by the launcher: an empty directory is an empty store (a missing one is refused)
    n = 6
    jobs = [dict(root=root, version=f"v{i}", seed=i, remote=remote, durability="remote" if remote else "local") for i in range(n)]
    stop = threading.Event()
    stats = {"listings": 0, "versions checked": 0}
    errors: list = []
    threads = [threading.Thread(target=_listing_loop, args=(root, remote, stop, stats, errors)) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        codes = crash_ranks.run_ranks_fast(crash_ranks.save_many, 2, jobs, timeout=120)
    finally:
        time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join()
    assert codes == {0: 0, 1: 0}
    assert not errors, errors[:10]
    assert stats["listings"] > 10
    assert [r.version for r in ckptstore.Store(root, remote=remote).versions()] == [f"v{i}" for i in range(n)]
    OUTCOMES.append(f"{tier}: 2 Store objects listed {stats['listings']} times ({stats['versions checked']} version "
                    f"copies checked object by object) while {n} versions were committed: 0 errors, 0 half versions")
