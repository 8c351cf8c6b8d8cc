"""Node-local roots (docs/FORMAT.md, "Placement"): every rank passes its node's root, each node's root
is a different directory. Real gloo ranks (spawned); the torchrun two-agent version of these runs is
tests/test_multinode.py."""

from __future__ import annotations

import json
import os

import pytest
import torch.distributed.checkpoint as dcp

import ckptstore
import roots_ranks
from ckptstore import retention as R
from ckptstore.errors import VersionExistsError
from ckptstore.manifest import catalogue
from ckptstore.tiers import LocalTier
from ckptstore.testing.dist import run_ranks, run_ranks_raw
from dcp_ranks import full_state

FAST = dict(start_method="forkserver", preload=["roots_ranks"])


def _versions(root) -> list[str]:
    return sorted(catalogue.scan(LocalTier(str(root))))


def _bytes_on_disk(root) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(root) for f in fs)


def test_two_nodes_local_only_save_prune_restore(tmp_path):
    """The representative case: 2 "nodes" (one rank each, own root), 3 saves with keep-last 2,
    restart, restore without a version: each root lists its part of the 2 newest versions only,
    and the restore loads the newest bit-exactly, reading no remote tier."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    keep2 = R.RetentionPolicy(per_tier={"local": (R.KeepLast(2),)})
    placements = run_ranks(roots_ranks.save_versions, 2, roots, ["v1", "v2", "v3"], None, keep2, **FAST)
    assert placements[0] == [[[0], [1]]] * 3  # two root groups, recorded in every manifest
    for r in roots:  # the copies reached node 1, and retention ran there too
        assert _versions(r) == ["v2", "v3"], r
    out = run_ranks(roots_ranks.load, 2, roots, **FAST)
    assert [o["version"] for o in out] == ["v3", "v3"]
    assert all(o["ok"] for o in out)
    assert all(o["stats"]["remote_reads"] == 0 for o in out)
    st = ckptstore.Store(roots[1])
    assert st.latest().version == "v3"


@pytest.mark.slow
def test_shared_and_mixed_roots(tmp_path):
    """A shared root (one group, no placement recorded) and a mixed layout (ranks 0 and 1 share a
    root, rank 2 has its own): both restore bit-exactly, also resharded onto other layouts."""
    shared = [str(tmp_path / "shared")] * 2
    assert run_ranks(roots_ranks.save_versions, 2, shared, ["v1"], **FAST)[0] == [None]
    assert all(o["ok"] for o in run_ranks(roots_ranks.load, 2, shared, **FAST))

    mixed = [str(tmp_path / "a"), str(tmp_path / "a"), str(tmp_path / "b")]
    assert run_ranks(roots_ranks.save_versions, 3, mixed, ["v1"], **FAST)[0] == [[[0, 1], [2]]]
    out = run_ranks(roots_ranks.load, 3, mixed, **FAST)
    assert all(o["ok"] and o["version"] == "v1" for o in out)
    # resharded, local only: 3 -> 2 ranks on roots a and b (objects of rank 2 travel from root b)
    out = run_ranks(roots_ranks.load, 2, [mixed[0], mixed[2]], **FAST)
    assert all(o["ok"] for o in out) and sum(o["stats"]["peer_bytes"] for o in out) > 0
    # 3 -> 4 with a new empty root: its rank reads everything from peers
    out = run_ranks(roots_ranks.load, 4, mixed + [str(tmp_path / "new")], **FAST)
    assert all(o["ok"] for o in out) and out[3]["stats"]["peer_bytes"] > 0
    assert _versions(tmp_path / "new") == []  # it holds no part: nothing is copied there


@pytest.mark.slow
def test_resharded_two_to_three_and_missing_node(tmp_path):
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    run_ranks(roots_ranks.save_versions, 2, roots, ["v1"], **FAST)
    out = run_ranks(roots_ranks.load, 3, roots + [str(tmp_path / "node2")], **FAST)
    assert all(o["ok"] for o in out)
    # a node whose root is lost, no remote tier: every rank fails with the objects named
    empty = [roots[0], str(tmp_path / "replaced")]
    codes = run_ranks_raw(roots_ranks.load_error, 2, empty, **FAST)
    assert codes == {0: 0, 1: 0}


@pytest.mark.slow
def test_crash_between_commit_and_copy_is_repaired_by_the_next_load(tmp_path):
    """Rank 1 (node 1's leader) is killed when it is about to write its copy of v2's manifest: node 1
    then lists v1 only; the next load agrees on v2 on both nodes, repairs node 1 and is bit-exact."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    run_ranks(roots_ranks.save_versions, 2, roots, ["v1"], **FAST)
    env = [{}, {"CKPTSTORE_FAULT": "copy.manifest@1"}]
    run_ranks_raw(roots_ranks.save_versions, 2, roots, ["v2"], env=env, timeout=120, **FAST)
    assert _versions(roots[0]) == ["v1", "v2"]
    assert _versions(roots[1]) == ["v1"]  # node 1 does not report the half-copied version
    out = run_ranks(roots_ranks.load, 2, roots, **FAST)
    assert [o["version"] for o in out] == ["v2", "v2"] and all(o["ok"] for o in out)
    assert _versions(roots[1]) == ["v1", "v2"]  # repaired


@pytest.mark.s3_both(moto_slow=True)
def test_two_nodes_with_s3_restore_reads_no_remote_and_replaced_node_reads_only_its_part(tmp_path, s3_url):
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    pol = R.RetentionPolicy(per_tier={"local": (R.KeepLast(2),), "remote": (R.KeepLast(4),)})
    run_ranks(roots_ranks.save_versions, 2, roots, [f"v{i}" for i in range(1, 6)], s3_url, pol, **FAST)
    for r in roots:
        assert _versions(r) == ["v4", "v5"]
    remote = ckptstore.Store(None, remote=s3_url)
    assert [v.version for v in remote.versions()] == ["v2", "v3", "v4", "v5"]
    out = run_ranks(roots_ranks.load, 2, roots, None, s3_url, **FAST)
    assert all(o["ok"] and o["version"] == "v5" for o in out)
    assert [o["stats"]["remote_reads"] for o in out] == [0, 0]
    # node 1 replaced: its root is empty. Only node 1's objects come from the remote tier (the
    # replicated items DCP stored in rank 1's object are read by rank 0 too); node 0's come from disk
    replaced = [roots[0], str(tmp_path / "node1-new")]
    out = run_ranks(roots_ranks.load, 2, replaced, None, s3_url, **FAST)
    assert all(o["ok"] and o["version"] == "v5" for o in out)
    assert out[1]["stats"]["remote_reads"] > 0
    for o in out:
        assert o["remote_keys"] and all(k.endswith("/r00001.ckd") for k in o["remote_keys"]), o["remote_keys"]


@pytest.mark.s3_both
@pytest.mark.parametrize("durability", ["local", "remote"])
def test_resaving_a_name_from_a_fresh_root_is_refused_before_any_commit(tmp_path, s3_url, durability):
    """Host 1 saves "v" and uploads it; host 2 (empty root, same remote) saves other data as "v":
    refused before anything is committed anywhere; "v" keeps host 1's contents in both tiers."""
    first = ckptstore.StorageWriter(tmp_path / "host1", remote=s3_url, durability="remote")
    dcp.save(full_state(1), checkpoint_id="v", storage_writer=first)
    first.close()
    attempt = ckptstore.Store(None, remote=s3_url).get("v").attempt
    second = ckptstore.StorageWriter(tmp_path / "host2", remote=s3_url, durability=durability)
    with pytest.raises(BaseException) as ei:  # DCP's CheckpointException is a BaseException
        dcp.save(full_state(2), checkpoint_id="v", storage_writer=second)
    second.close()
    assert isinstance(ei.value, VersionExistsError) or "VersionExistsError" in str(ei.value)
    assert "remote tier" in str(ei.value)
    assert _versions(tmp_path / "host2") == []
    assert ckptstore.Store(None, remote=s3_url).get("v").attempt == attempt
    sd = full_state(0)
    dcp.load(sd, checkpoint_id="v", storage_reader=ckptstore.StorageReader(tmp_path / "host2", remote=s3_url))
    assert json.dumps(sd["meta"]) == json.dumps(full_state(1)["meta"])
    assert (sd["w"] == full_state(1)["w"]).all()


@pytest.mark.slow
def test_replaced_node_loads_then_destroy_repeatedly(tmp_path, s3_url):
    """Peer fetch and remote reads in one load, then ``destroy_process_group()`` at once on every
    rank: no rank may abort while tearing down (``CKPTSTORE_TEARDOWN_REPEAT`` times, default 3)."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    run_ranks(roots_ranks.save_versions, 2, roots, ["v1"], s3_url, **FAST)
    for i in range(int(os.environ.get("CKPTSTORE_TEARDOWN_REPEAT", "3"))):
        replaced = [roots[0], str(tmp_path / f"new{i}")]
        out = run_ranks(roots_ranks.load_then_destroy, 2, replaced, s3_url, timeout=120, **FAST)
        assert all(o["ok"] for o in out), out


@pytest.mark.slow  # the default set has the stale-claim test below (files naming a rank in a root it left)
def test_ranks_forked_from_one_process_then_moved_between_roots(tmp_path):
    """Ranks forked from one process that imported ckptstore (a forkserver, ``mp`` fork): a rank that
    wrote to root ``a`` in one job and to root ``b`` in the next is not taken for a member of ``a``'s
    group by what its earlier save left there (claims are per save: docs/FORMAT.md, "Placement"). The replicated save of the second job records
    one group per root, its replicas are in place and both roots load it."""
    import ckptstore.dcp  # noqa: F401 - the parent has imported the writer before it forks its ranks

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    fork = dict(start_method="fork")
    first = run_ranks(roots_ranks.save_replicated, 2, [a, a], ["v1"], **fork)
    assert first[0]["placements"] == [None]
    second = run_ranks(roots_ranks.save_replicated, 2, [a, b], ["v2"], **fork)
    assert second[0]["placements"] == [[[0], [1]]], second
    for root in (a, b):  # both roots hold a valid copy of v2 (its own part + a replica of the other)
        assert "v2" in _versions(root), (root, _versions(root))
        st = ckptstore.Store(root)
        assert not st.problems, st.problems
        m = st.manifest("v2").manifest
        t = LocalTier(root)
        assert all(t.exists(f"versions/v2/{o.name}") for o in m.objects), root
    out = run_ranks(roots_ranks.load, 2, [a, b], "v2", **FAST)
    assert all(o["ok"] and o["version"] == "v2" for o in out), out


@pytest.mark.parametrize("durability,replicas", [pytest.param("local", 0, marks=pytest.mark.slow), ("replicated", 1)])
def test_files_naming_a_rank_in_a_root_it_left_do_not_change_the_root_groups(tmp_path, durability, replicas):
    """Rank 1 left, in root ``a`` that it no longer writes to, another save's claim naming it and a
    probe of an older release. Claims belong to one save (docs/FORMAT.md, "Placement"): the save
    records one group per root (a manifest every reader accepts, Save rule 11), both roots list it,
    its replicas are in place and it loads. (Before claims, such a probe made rank 0 see {0, 1} in
    ``a`` while rank 1 saw only itself in ``b``: a placement readers refuse.)"""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    out = run_ranks(roots_ranks.save_with_stale_probe, 2, [a, b], "v1", durability, replicas, **FAST)
    assert [e for e, _p in out] == ["", ""], out
    assert out[0][1] == [[0], [1]], out
    assert _versions(a) == ["v1"] and _versions(b) == ["v1"]
    res = run_ranks(roots_ranks.load, 2, [a, b], "v1", **FAST)
    assert all(o["ok"] and o["version"] == "v1" for o in res), res


@pytest.mark.slow
def test_drop_on_one_node_while_an_incremental_save_references_what_it_removes(tmp_path):
    """Node-local roots: while ``v2`` (every item a reference to ``v1``) is written, an operator drops
    ``v1`` on rank 1's node. Rank 1's lease keeps ``v1``'s frames there; ``v2`` commits on both roots
    and loads, and no lease is left once the manifest copy reached rank 1's root."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    out = run_ranks(roots_ranks.incremental_drop_race, 2, [a, b], **FAST)
    assert out[1]["drop"] == [0], out
    assert out[0]["leases"] == [] and out[1]["leases"] == [], out
    assert _versions(a) == ["v1", "v2"] and _versions(b) == ["v2"]
    assert ckptstore.Store(b).manifest("v2").manifest.refs  # v2 references v1's frames, also on b
    res = run_ranks(roots_ranks.load, 2, [a, b], "v2", None, "v1", **FAST)  # (v2 holds v1's state)
    assert all(o["ok"] for o in res), res


def test_manager_wait_returns_once_this_nodes_root_lists_the_save(tmp_path):
    """``CheckpointManager.wait()`` means committed on this rank's node too: on node-local roots the
    manifest reaches the second node's root in a background copy (``dcp.save`` may return before it),
    and a node whose disk is slow (its copy 2 s late) still lists the version right after ``wait()``
    returns — an operator's ``ckptstore list`` there, or the user's own check, sees it."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    out = run_ranks(roots_ranks.manager_wait_then_list, 2, roots, 2.0, **FAST)
    assert out == [["step-1"], ["step-1"]], out
