"""What a rank receives, lists and stats for a restore does not grow with the job (docs/FORMAT.md,
"Restore choice", "Placement"); a clean save-then-load reports no crash; listings enumerate versions,
not objects. Real gloo ranks (``ckptstore.testing.dist.run_ranks``); the 32-rank figures and the
simulated 16,384-rank job are in ``benchmarks/restore_bytes.py`` and ``benchmarks/scale_sim.py``."""

from __future__ import annotations

import os
import pickle

import pytest

import ckptstore
import scale_ranks
from ckptstore.choice import decide
from ckptstore.dcp import _job, _roots
from ckptstore.manifest import catalogue, layout
from ckptstore.manifest.objsets import ObjSet
from ckptstore.testing.dist import run_ranks, run_ranks_raw
from ckptstore.tiers import LocalTier

FAST = dict(start_method="forkserver", preload=["scale_ranks"])
VERSIONS = ["s0", "s1", "s2"]


def _job_of(tmp_path, world: int, per_root: int | None, tag: str) -> list:
    """Save VERSIONS in one job, load the newest in a second: each rank's load report."""
    base = tmp_path / tag
    roots = [str(base / ("shared" if per_root is None else f"node{r // per_root}")) for r in range(world)]
    run_ranks(scale_ranks.save, world, roots, VERSIONS, timeout=300, **FAST)
    out = run_ranks(scale_ranks.load, world, roots, timeout=300, **FAST)
    assert all(o["ok"] and o["version"] == VERSIONS[-1] for o in out), out
    assert not any(o["log"] for o in out), [o["log"] for o in out]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("per_root", [None, 2], ids=["shared-root", "node-roots"])
def test_restore_bytes_per_rank_do_not_grow_with_the_square(tmp_path, per_root):
    """2 → 8 ranks: what ckptstore's collectives deliver to a rank grows at most linearly (the old
    all-gather of every rank's full report grew with ranks × ranks: ~10x here)."""
    small = _job_of(tmp_path, 2, per_root, "2")
    big = _job_of(tmp_path, 8, per_root, "8")
    b2 = max(o["received"] for o in small)
    b8 = max(o["received"] for o in big)
    assert 0 < b8 <= 4 * b2, (b2, b8)  # 4x the ranks: at most 4x the bytes (squared would be 16x)


@pytest.mark.slow
def test_listings_per_rank_do_not_grow_with_ranks_on_a_shared_root(tmp_path):
    """4 → 16 ranks on one shared root: one rank lists it, the others do not list or stat it at all."""
    fs4 = sorted(o["fs"] for o in _job_of(tmp_path, 4, None, "4"))
    fs16 = sorted(o["fs"] for o in _job_of(tmp_path, 16, None, "16"))
    assert fs4[-1] == fs16[-1] > 0  # the root's one lister: the same listings whatever the job's size
    assert fs4[:-1] == [0] * 3 and fs16[:-1] == [0] * 15


@pytest.mark.slow
def test_clean_16_rank_save_then_load_on_4_node_roots_reports_nothing(tmp_path):
    """16 ranks, 4 node-local roots, 3 saves, then at once a load in the same processes: dcp.save
    returned on the other nodes' ranks before their roots held the manifest copy (docs/FORMAT.md,
    "Placement"); the load waits for those copies, so it repairs nothing and warns nothing."""
    roots = [str(tmp_path / f"node{r // 4}") for r in range(16)]
    out = run_ranks(scale_ranks.save_then_load, 16, roots, VERSIONS, timeout=600, **FAST)
    assert [o["version"] for o in out] == [VERSIONS[-1]] * 16 and all(o["ok"] for o in out)
    assert [o["log"] for o in out] == [""] * 16
    for k in range(4):
        assert [r.version for r in ckptstore.Store(roots[4 * k]).versions()] == VERSIONS


@pytest.mark.slow
def test_a_real_crash_between_commit_and_copy_is_repaired_and_reported_once(tmp_path):
    """The leader of node 1 dies right before it writes its copy of s1's manifest: the next job's
    load repairs node 1 and says so once (the rank that listed node 1), not once per rank."""
    roots = [str(tmp_path / f"node{r // 2}") for r in range(4)]
    run_ranks(scale_ranks.save, 4, roots, ["s0"], timeout=300, **FAST)
    # whichever of ranks 2 and 3 claimed node 1 first leads it and dies before writing the copy
    env = [{"CKPTSTORE_FAULT": "copy.manifest"} if r >= 2 else {} for r in range(4)]
    run_ranks_raw(scale_ranks.save, 4, roots, ["s1"], env=env, timeout=120, **FAST)
    assert [r.version for r in ckptstore.Store(roots[2]).versions()] == ["s0"]
    out = run_ranks(scale_ranks.load, 4, roots, timeout=300, **FAST)
    assert [o["version"] for o in out] == ["s1"] * 4 and all(o["ok"] for o in out)
    said = [o["log"] for o in out if "repaired root" in o["log"]]
    assert len(said) == 1 and "node1" in said[0] and "'s1'" in said[0], [o["log"] for o in out]
    assert [r.version for r in ckptstore.Store(roots[2]).versions()] == ["s0", "s1"]


# -- the pieces, without ranks ----------------------------------------------------------------------
def test_claims_pick_one_leader_per_root_and_read_only_roots_stand_alone(tmp_path):
    shared, other = LocalTier(str(tmp_path / "a")), LocalTier(str(tmp_path / "b"))
    leaders = [_roots.claim(t, "tok1", r) for r, t in enumerate([shared, shared, other, shared, other])]
    assert leaders == [0, 0, 2, 0, 2]
    assert _roots.placement(list(enumerate(leaders))) == [[0, 1, 3], [2, 4]]
    assert _roots.placement([(0, 0), (1, 0)]) is None  # one group: no placement recorded
    _roots.release(shared, "tok1")
    assert not os.path.exists(os.path.join(shared.root, "probes", "root.tok1"))
    assert _roots.claim(None, "tok1", 3) == -1  # no root
    ro = tmp_path / "ro"
    (ro / "probes").mkdir(parents=True)
    os.chmod(ro / "probes", 0o555)
    try:
        if os.access(ro / "probes", os.W_OK):
            pytest.skip("running as a user who can write a read-only directory")
        assert [_roots.claim(LocalTier(str(ro)), "tok2", r) for r in (5, 6)] == [5, 6]
    finally:
        os.chmod(ro / "probes", 0o755)


def test_object_sets_hold_a_nodes_part_as_one_run():
    a = "20261201T100000-000000000001-00001"
    names = [layout.metadata_name(a)] + [layout.shard_name(a, r) for r in (8, 9, 10, 11, 13)] + [f"attempts/{a}/odd.bin"]
    s = ObjSet.of_names(a, names)
    assert s.to_json() == [1, [8, 12, 13, 14], [f"attempts/{a}/odd.bin"]]
    assert ObjSet.from_json(a, s.to_json()) == s and len(s) == 7 and list(s) == names
    assert layout.shard_name(a, 12) not in s and layout.shard_name(a, 13) in s and f"attempts/{a}/r0013.ckd" not in s
    whole = ObjSet(a, True, [(0, 16)])
    assert whole.minus(s).to_json() == [0, [0, 8, 12, 13, 14, 16], []]
    assert whole.minus(ObjSet.union(a, [s, ObjSet(a, False, [(0, 8), (12, 13), (14, 16)])])).to_json() == [0, [], []]
    assert s.without([layout.shard_name(a, 9)]).to_json() == [1, [8, 9, 10, 12, 13, 14], [f"attempts/{a}/odd.bin"]]
    with pytest.raises(ValueError):
        ObjSet.from_json(a, [1, [3], []])


def test_a_root_report_lists_versions_and_attempts_not_every_object_with_a_stat(tmp_path):
    """One root of one node (ranks 2-3 of 4): the report of _job (a run of ranks per version, each
    manifest's facts once), made with one scandir/listdir per directory level and no stat per object."""
    from ckptstore.testing.meter import metered

    roots = scale_ranks.sim_roots(str(tmp_path), 4, 2, 3)
    tier = LocalTier(roots[2])
    with metered() as m:
        rep, facts = _job.root_report(tier, first=True)
    assert sorted(rep["committed"]) == ["step-0000", "step-0001", "step-0002"] and len(facts) == 3
    for v, per in rep["held"].items():
        [(a, st)] = per.items()
        assert st == [1, [2, 4], []]  # the metadata object and ranks 2-3: node 1's part
        assert facts[rep["committed"][v][0]]["objects"] == [1, [0, 4], []]
    calls = {f: n for (_w, f), n in m.fs.items()}
    assert calls.get("stat", 0) == 0 and calls.get("scandir", 0) + calls.get("listdir", 0) == 1 + 3 * 3
    known = frozenset(d for d, _x in rep["committed"].values())
    rep2, facts2 = _job.root_report(tier, known)
    assert facts2 == {} and rep2["committed"] == rep["committed"] and "restores" not in rep2


@pytest.mark.parametrize("per_root", [None, 4], ids=["shared-root", "node-roots"])
def test_the_job_report_grows_with_roots_not_with_ranks_squared(tmp_path, per_root):
    """16 → 128 simulated ranks (real roots, real manifests, the real listing and assembly of
    ``_job``; no process group): the job report every rank receives stays the same on one shared
    root and grows with the roots (8x here) on node roots — never with ranks × ranks (64x), as the
    old all-gather of every rank's full report did. Each root is listed once, by its leader."""
    size = {}
    for n in (16, 128):
        roots = scale_ranks.sim_roots(str(tmp_path / str(n)), n, per_root, 3)
        tiers = {d: LocalTier(d) for d in set(roots)}
        leaders = [_roots.claim(tiers[d], "load-t", r) for r, d in enumerate(roots)]
        order = _job._root_order(leaders)
        assert len(order) == len(tiers)
        got = {0: _job.root_report(tiers[roots[0]], first=True)}
        known = frozenset(got[0][1])
        got.update({lead: _job.root_report(tiers[roots[lead]], known) for lead in order if lead != 0})
        job = _job._assemble(order, got)
        size[n] = len(pickle.dumps(job))
        index = {lead: k for k, lead in enumerate(order)}
        job["ranks"] = [[i, index[lead]] for i, lead in enumerate(leaders)]
        view = decide(job, None)
        assert view.version == "step-0002" and not view.missing()[0]
        assert all(view.has_manifest(i) for i in range(n))
        if per_root:  # the view's root ids: ranks of one node share one, for the read-once exchange
            assert view.root_id(0) == view.root_id(per_root - 1) != view.root_id(per_root)
    limit = 1.3 if per_root is None else 8 * 1.3
    assert size[128] <= limit * size[16], size


@pytest.mark.s3
def test_remote_listing_is_one_request_per_version_directory(tmp_path, s3_url, monkeypatch):
    """The restore's and the catalogue's S3 listing ask for version directories (Delimiter "/"), not
    for every object: 1 + V LIST requests whatever the number of objects per version."""
    from ckptstore.tiers.s3 import listing

    st = ckptstore.Store(None, remote=s3_url)
    remote = st.remote
    for v in ("v1", "v2"):
        a = layout.new_attempt()
        for r in range(60):
            remote.put(layout.object_key(v, layout.shard_name(a, r)), b"x")
        remote.put(layout.manifest_key(v), b"not a manifest")
    remote.list_page_size = 10  # 60 objects per version: 6 pages each, if the listing walked them
    calls = []
    real = listing.pages

    def counted(conn, operation, prefix="", **kw):
        calls.append((prefix, kw.get("delimiter")))
        return real(conn, operation, prefix, **kw)

    monkeypatch.setattr(listing, "pages", counted)
    dirs = catalogue.version_dirs(remote)
    assert sorted(dirs) == ["v1", "v2"] and all(d.manifest is not None and d.attempts for d in dirs.values())
    assert len(calls) == 3 and all(d == "/" for _p, d in calls)
    calls.clear()
    problems: list = []
    assert catalogue.scan(remote, problems) == {} and len(problems) == 2  # both manifests invalid
    assert len(calls) == 3
