"""The restore choice as a pure function (ckptstore/choice.py): reports in, a view with reasons out.

Job reports are built by hand the way ``ckptstore/dcp/_job.py`` builds them from real roots (here
every rank has a root of its own); the multi-process and real-storage cases are in
tests/test_recovery.py and tests/test_restore_scale.py.
"""

from __future__ import annotations

import pytest

from ckptstore.choice import decide, restore_count, version_pattern
from ckptstore.errors import (DamagedVersionError, IntegrityError, ManifestError, TransientStorageError,
                              VersionNotFoundError)
from ckptstore.manifest.objsets import ObjSet
from ckptstore.manifest.order import next_seq, order_key, resolve


def entry(v, *, attempt=None, step=None, seq=None, created="2026-12-01T10:00:00.000000Z", ranks=(0, 1), damaged=False,
          world=2, supersedes=()):
    attempt = attempt or f"20261201T100000-{abs(hash(v)) % 10**12:012d}-00001"
    objs = [f"attempts/{attempt}/metadata.ckd"] + [f"attempts/{attempt}/r{r:05d}.ckd" for r in ranks]
    return {"attempt": attempt, "created": created, "seq": seq, "step": step, "damaged": damaged, "objects": objs,
            "world_size": world, "nbytes": 1, "supersedes": list(supersedes), "groups": 1}


def report(rank, committed: dict, *, own=None, remote=None, remote_error=None, restores=None, invalid=None):
    """Rank ``rank`` with a root of its own holding ``committed`` ({name: entry}); its root holds the
    metadata objects and the shard objects of ranks ``own`` (default: its own rank only)."""
    own = (rank,) if own is None else own
    held = {}
    for v, e in committed.items():
        a = e["attempt"]
        held[v] = {a: [n for n in e["objects"] if n.endswith("metadata.ckd") or any(n.endswith(f"r{r:05d}.ckd") for r in own)]}
    return {"rank": rank, "root": f"/node{rank}", "committed": committed, "held": held, "remote": remote,
            "remote_error": remote_error, "restores": restores or [], "invalid": invalid or {}}


_FACTS = ("attempt", "created", "seq", "step", "world_size", "nbytes", "supersedes", "groups")


def job(reports: list) -> dict:
    """The job report (ckptstore/choice.py) of ranks that each have a root of their own: one root
    report per rank, each manifest's facts once (keyed by a digest of its attempt), the remote tier
    and the restore log from the first rank."""
    manifests = {}

    def digest(e):
        d = "md5-" + e["attempt"]
        manifests[d] = {**{k: e[k] for k in _FACTS}, "objects": ObjSet.of_names(e["attempt"], e["objects"]).to_json(),
                        "refs": []}
        return d

    roots = [{"root": r["root"], "leader": k, "invalid": r["invalid"],
              "committed": {v: [digest(e), e["damaged"]] for v, e in r["committed"].items()},
              "held": {v: {a: ObjSet.of_names(a, names).to_json() for a, names in per.items()} for v, per in r["held"].items()}}
             for k, r in enumerate(reports)]
    r0 = reports[0]
    remote = None if r0["remote"] is None else {v: {"manifest": digest(e), "damaged": e["damaged"]} for v, e in r0["remote"].items()}
    return {"ranks": [[r["rank"], k] for k, r in enumerate(reports)], "roots": roots, "manifests": manifests,
            "remote": remote, "remote_error": r0["remote_error"], "invalid": {}, "restores": r0["restores"]}


def two_ranks(versions: dict, **kw0):
    return job([report(0, dict(versions), **kw0), report(1, dict(versions))])


def test_newest_loadable_every_rank_agrees():
    vs = {"s1": entry("s1", step=1), "s2": entry("s2", step=2)}
    v = decide(two_ranks(vs), None)
    assert (v.version, v.skipped, v.newer) == ("s2", [], {})
    assert v.source(0, vs["s2"]["objects"][2]) == 1  # rank 1's object comes from rank 1's root


def test_a_damage_mark_on_one_root_skips_the_version_on_every_rank():
    s1, s2 = entry("s1", step=1), entry("s2", step=2)
    reps = [report(0, {"s1": s1, "s2": s2}), report(1, {"s1": s1, "s2": {**s2, "damaged": True}})]
    v = decide(job(reps), None)
    assert v.version == "s1" and [(s.version, s.kind, s.where) for s in v.skipped] == [("s2", "damaged", "the root of rank 1 (/node1)")]
    assert v.newer == {"s2": [s2["attempt"]]}  # the next save of s2 supersedes it
    with pytest.raises(DamagedVersionError):
        decide(job(reps), "s2")


def test_a_damage_mark_with_a_remote_copy_reads_the_marked_part_from_s3():
    s2 = entry("s2", step=2)
    remote = {"s2": dict(s2)}
    reps = [report(0, {"s2": s2}, remote=remote), report(1, {"s2": {**s2, "damaged": True}})]
    v = decide(job(reps), None)
    assert v.version == "s2" and v.remote_ok and v.skipped == []
    assert v.source(1, s2["objects"][2]) == "remote" and v.source(0, s2["objects"][1]) == "local"


def test_missing_everywhere_and_unverified_are_skipped_with_reasons():
    s1, s2, s3 = entry("s1", step=1), entry("s2", step=2), entry("s3", step=3)
    reps = [report(0, {"s1": s1, "s2": s2, "s3": s3}), report(1, {"s1": s1, "s2": s2, "s3": s3}, own=())]
    reps[1]["held"]["s1"] = {s1["attempt"]: s1["objects"]}  # only s1 has rank 1's object anywhere
    v = decide(job(reps), None, exclude={})
    assert v.version == "s1" and [s.kind for s in v.skipped] == ["missing", "missing"]
    assert "r00001.ckd" in v.skipped[0].reason and v.skipped[0].object.endswith("r00001.ckd")
    with pytest.raises(IntegrityError):
        decide(job(reps), "s3")
    reps = two_ranks({"s1": s1, "s2": s2})
    v = decide(reps, None, exclude={("s2", s2["attempt"]): ("rank 1: frame 0 payload checksum mismatch", "obj")})
    assert v.version == "s1" and [(s.kind, s.object) for s in v.skipped] == [("unverified", "obj")]


def test_order_is_step_then_sequence_never_the_clock():
    ahead = "2026-12-01T12:00:00.000000Z"  # a host 2 h ahead
    vs = {"s1": entry("s1", step=1), "s2": entry("s2", step=2, created=ahead), "s3": entry("s3", step=3)}
    assert decide(two_ranks(vs), None).version == "s3"
    vs = {"a": entry("a", seq=10), "b": entry("b", seq=20, created=ahead), "c": entry("c", seq=21)}
    assert decide(two_ranks(vs), None).version == "c"
    assert order_key(None, 99, ahead, "x") < order_key(0, 1, "2000-01-01T00:00:00.000000Z", "y")  # no step sorts first
    assert next_seq([5, 1_000_000_000_000_000_000], now_us=7) == 1_000_000_000_000_000_001
    assert next_seq([5, None], now_us=7) == 7


def test_identity_supersedes_then_remote_then_sequence():
    a = {"attempt": "20261201T100000-000000000001-00001", "supersedes": [], "remote": False, "seq": 5, "created": "x"}
    b = {"attempt": "20261201T100000-000000000002-00001", "supersedes": [], "remote": True, "seq": 1, "created": "x"}
    c = {"attempt": "20261201T100000-000000000003-00001", "supersedes": [a["attempt"], b["attempt"]], "remote": False,
         "seq": 0, "created": "x"}
    assert resolve([a, b]) == b["attempt"]  # the remote copy is the store of record
    assert resolve([a, b, c]) == c["attempt"]  # a superseding copy wins
    assert resolve([a, {**b, "remote": False}]) == a["attempt"]  # else the higher sequence
    local = entry("ckpt", attempt=a["attempt"], step=1)
    other = entry("ckpt", attempt=b["attempt"], step=1)
    reps = [report(0, {"ckpt": local}, remote={"ckpt": other}), report(1, {"ckpt": local})]
    v = decide(job(reps), None)
    assert v.attempt == other["attempt"] and v.remote_ok and v.holders == []
    assert [w for w, _a in v.stale] == ["the root of rank 0 (/node0)", "the root of rank 1 (/node1)"]
    assert v.source(0, other["objects"][1]) == "remote"  # never the stale root copy


def test_job_shape_needs_reshard():
    vs = {"s1": entry("s1", step=1), "s2": entry("s2", step=2, world=4, ranks=(0, 1, 2, 3))}
    reps = [report(0, vs, own=(0, 2)), report(1, vs, own=(1, 3))]
    v = decide(job(reps), None, world_size=2, reshard=False)
    assert v.version == "s1" and [s.kind for s in v.skipped] == ["shape"]
    assert decide(job(reps), None, world_size=2, reshard=True).version == "s2"


def test_restart_loop_counted_and_bounded():
    vs = {"s1": entry("s1", step=1), "s2": entry("s2", step=2)}
    newest = ["s2", vs["s2"]["attempt"]]
    log = [{"version": "s2", "attempt": vs["s2"]["attempt"], "newest": newest}] * 3
    assert restore_count(log, "s2", vs["s2"]["attempt"], tuple(newest)) == 3
    assert restore_count(log[:1] + [{"version": "s1"}], "s2", vs["s2"]["attempt"], tuple(newest)) == 0
    v = decide(two_ranks(vs, restores=log), None)
    assert v.version == "s2" and v.restore_count == 3
    v = decide(two_ranks(vs, restores=log), None, fall_back_after=3)
    assert v.version == "s1" and [s.kind for s in v.skipped] == ["restarts"]


def test_scope_and_patterns():
    vs = {"model-6": entry("model-6", step=6), "loader-3": entry("loader-3", step=3)}
    assert decide(two_ranks(vs), None, scope=version_pattern("loader-")).version == "loader-3"
    assert version_pattern("step-", "run/{step:06d}-x") == r"run/\d+\-x"
    assert decide(two_ranks(vs), None, scope=version_pattern("nope-"), empty_ok=True) is None


def test_remote_unreachable_restores_from_the_roots():
    vs = {"s1": entry("s1", step=1)}
    v = decide(two_ranks(vs, remote_error="could not connect"), None)
    assert v.version == "s1" and v.remote_error == "could not connect" and not v.remote_ok
    with pytest.raises(TransientStorageError):  # the roots hold nothing: the remote tier may
        decide(two_ranks({}, remote_error="could not connect"), None, empty_ok=True)
    with pytest.raises(TransientStorageError):
        decide(two_ranks(vs, remote_error="could not connect"), "s9")


def test_explicit_versions_raise_their_problem():
    vs = {"s1": entry("s1", step=1)}
    with pytest.raises(VersionNotFoundError):
        decide(two_ranks(vs), "s2")
    with pytest.raises(ManifestError):
        decide(two_ranks(vs, invalid={"s2": "checksum mismatch (in /node0)"}), "s2")
    with pytest.raises(VersionNotFoundError) as ei:
        decide(job([report(0, vs), report(1, vs, own=())]), None)
    assert "s1: objects" in str(ei.value)  # why each version was skipped
