"""Peer replicas (docs/FORMAT.md, "Replicas"): a lost node costs no checkpoint and no trip to S3.

Real gloo ranks through ``CheckpointManager(replicas=1)``; "nodes" are directories shared by the
ranks of one node (``tests/recovery_ranks.py``, ``per_node``): 4 ranks on 2 nodes, or 2 ranks on 2.
A replaced node is a node directory removed between two runs of the job. The training is
deterministic, so after each resume every rank compares its state bit for bit with the snapshot an
earlier run wrote for the restored step.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

import ckptstore
from ckptstore.manifest import catalogue, layout
from ckptstore.manifest.placement import part_held, replica_assignment, replica_targets
from ckptstore.testing.dist import run_ranks, run_ranks_raw
from ckptstore.tiers import LocalTier

import recovery_ranks as rr
from store_helpers import cli

FAST = {"start_method": "forkserver", "preload": rr.PRELOAD}
NODES4 = {"per_node": 2, "replicas": 1}


def job(base, world, saves, mgr, remote=None, env=None):
    return run_ranks(rr.job, world, str(base), saves, remote, mgr, None, None, env=env, timeout=300, **FAST)


def node(base, i) -> str:
    return os.path.join(str(base), f"node{i}")


def objects_in(root: str, version: str) -> set[str]:
    """Names of the version's objects (metadata object and shards) present in ``root``."""
    t = LocalTier(root)
    m = catalogue.read_manifest(t, version).manifest
    return {o.name for o in m.all_objects() if t.exists(layout.object_key(version, o.name))}


def all_objects(root: str, version: str) -> set[str]:
    return {o.name for o in catalogue.read_manifest(LocalTier(root), version).manifest.all_objects()}


def records_hold(root: str) -> list[str]:
    """Problems: replica records listing an object that is not there."""
    bad = []
    t = LocalTier(root)
    for info in t.list(layout.VERSIONS + "/"):
        if layout.replica_record_rank(info.key) is not None:
            v = layout.version_of_key(info.key)
            for name in json.loads(t.get(info.key))["objects"]:
                if not t.exists(layout.object_key(v, name)):
                    bad.append(f"{info.key} lists {name}, which is not in {root}")
    return bad


def test_replica_plan_never_lands_on_its_own_root():
    assert replica_targets(2, 1) == [[1], [0]]
    assert replica_targets(3, 1) == [[1], [2], [0]]
    assert replica_targets(3, 5) == [[1, 2], [2, 0], [0, 1]]  # fewer groups than F+1: every other group
    assert replica_targets(1, 2) == [[]]  # a shared root: nowhere to copy to
    pairs = replica_assignment([(0, 1), (2, 3)], 1)
    assert pairs == [(0, 2), (1, 3), (2, 0), (3, 1)]
    assert all((o < 2) != (t < 2) for o, t in pairs)
    assert replica_assignment([(0, 1), (2,)], 1, owners={0, 2}) == [(0, 2), (2, 0)]


def test_replicas_never_land_in_their_own_failure_domain_while_another_exists():
    """docs/FORMAT.md, "Replicas": 4 racks of 2 root groups each; the next F domains, same position."""
    doms = [f"rack{g // 2}" for g in range(8)]
    t = replica_targets(8, 1, doms)
    assert t == [[2], [3], [4], [5], [6], [7], [0], [1]]
    t2 = replica_targets(8, 2, doms)
    for i, ts in enumerate(t2):
        assert len(ts) == 2 and len({doms[x] for x in ts}) == 2 and doms[i] not in {doms[x] for x in ts}
    received = [sum(g in ts for ts in t2) for g in range(8)]
    assert received == [2] * 8  # every root holds the same number of replicas
    # unequal domains: a lone group of the other domain takes every copy; F is capped there
    assert replica_targets(4, 1, ["a", "a", "a", "b"]) == [[3], [3], [3], [0]]
    assert replica_targets(3, 2, ["a", "a", "b"]) == [[2], [2], [0, 1]]
    # one domain (or none recorded): the next F groups, as before domains existed
    assert replica_targets(4, 1, ["host"] * 4) == replica_targets(4, 1) == [[1], [2], [3], [0]]
    pairs = replica_assignment([(0, 1), (2, 3), (4, 5), (6, 7)], 1, domains=["r0", "r0", "r1", "r1"])
    assert pairs == [(0, 4), (1, 5), (2, 6), (3, 7), (4, 0), (5, 1), (6, 2), (7, 3)]


def test_replica_domain_is_checked_before_anything_is_saved(tmp_path, monkeypatch):
    from ckptstore.errors import ManifestError
    from ckptstore.manifest.schema import _domains

    for bad in ("", "x" * 257, "rack\n1"):
        with pytest.raises(ValueError, match="replica domain"):
            ckptstore.StorageWriter(tmp_path, replica_domain=bad)
    monkeypatch.setenv("CKPTSTORE_REPLICA_DOMAIN", "rack7")
    assert ckptstore.StorageWriter(tmp_path).replica_domain == "rack7"
    monkeypatch.delenv("CKPTSTORE_REPLICA_DOMAIN")
    import socket

    assert ckptstore.StorageWriter(tmp_path).replica_domain == socket.gethostname()
    m = ckptstore.CheckpointManager(tmp_path / "m", {}, replica_domain="rack3", save_on_signal=None, event_log=False)
    try:
        assert m._writer.replica_domain == "rack3"  # a writer option of the manager
    finally:
        m.close()
    assert _domains(["a", "b"], [[0], [1]]) == ["a", "b"]
    for bad, placement in ((["a"], [[0], [1]]), ([1, 2], [[0], [1]]), (["a"], None)):
        with pytest.raises(ManifestError, match="domains"):
            _domains(bad, placement)


def test_a_whole_failure_domain_lost_restores_from_the_replicas_in_the_other_one(tmp_path):
    """4 ranks, each its own root (4 root groups), in 2 racks (``CKPTSTORE_REPLICA_DOMAIN``), F = 1, no
    remote tier. The manifest records each group's rack and ``list --json`` shows it; rack 1's roots
    both wiped, the job resumes bit-exact from the replicas rack 0 holds (before: group 2's only
    replica was on group 3, in the same rack, so the version was lost with it)."""
    base = tmp_path
    env = [{"CKPTSTORE_REPLICA_DOMAIN": f"rack{r // 2}"} for r in range(4)]
    mgr = {"per_node": 1, "replicas": 1}
    job(base, 4, 2, {**mgr, "durability": "replicated"}, env=env)
    m = catalogue.read_manifest(LocalTier(node(base, 0)), "step-2").manifest
    assert m.placement == [[0], [1], [2], [3]] and m.domains == ["rack0", "rack0", "rack1", "rack1"]
    listed = json.loads(cli("list", node(base, 2), "--json").stdout)["versions"][-1]
    assert listed["domains"] == [{"ranks": [r], "domain": f"rack{r // 2}"} for r in range(4)]
    assert listed["parts"]["local"]["domain"] == "rack1"
    for i in (0, 1):  # rack 0 holds rack 1's objects as replicas, and the other way round
        assert objects_in(node(base, i), "step-2") >= {o.name for o in m.objects if o.rank == i + 2}
    shutil.rmtree(node(base, 2))
    shutil.rmtree(node(base, 3))
    outs = job(base, 4, 0, mgr, env=env)
    rr_check(outs, 3)
    assert all(o["restore"]["reads"]["remote_reads"] == 0 for o in outs)


@pytest.mark.slow
@pytest.mark.s3
def test_four_racks_of_two_nodes_one_rack_lost_restores_with_zero_s3_gets(tmp_path, s3_url, seaweed):
    """8 root groups in 4 racks, F = 1, S3 behind the counting proxy: rack 1 (groups 2 and 3) wiped;
    the restore makes no GET at all and is bit-exact."""
    from test_multinode import CountingProxy

    base = tmp_path
    proxy = CountingProxy(seaweed.endpoint)
    try:
        env = [{"AWS_ENDPOINT_URL": proxy.endpoint, "CKPTSTORE_REPLICA_DOMAIN": f"rack{r // 2}"} for r in range(8)]
        mgr = {"per_node": 1, "replicas": 1}
        outs = job(base, 8, 2, {**mgr, "durability": "remote"}, remote=s3_url, env=env)
        assert all(o["close_error"] is None for o in outs), outs
        m = catalogue.read_manifest(LocalTier(node(base, 0)), "step-2").manifest
        assert m.domains == [f"rack{g // 2}" for g in range(8)]
        shutil.rmtree(node(base, 2))
        shutil.rmtree(node(base, 3))
        proxy.reset()
        outs = job(base, 8, 0, mgr, remote=s3_url, env=env)
        rr_check(outs, 3)
        counts = proxy.summary()
        print(f"rack 1 of 4 lost, restore on 8 ranks: S3 requests {counts}")
        assert counts["object_gets"] == 0 and counts["manifest_gets"] == 0, counts
    finally:
        proxy.close()


def test_a_replaced_node_restores_from_replicas_on_four_and_on_two_ranks(tmp_path):
    """4 ranks on 2 nodes, F = 1, no remote tier: 3 saves (durability="replicated": each commits once
    both nodes hold every object); node 1's root wiped: the job resumes on 4 ranks bit-exact from
    node 0's replicas and gives node 1 its part back; then node 1 wiped again and a 2-rank job
    (one rank per node) resumes resharded, also from the replicas."""
    base = tmp_path
    outs = job(base, 4, 3, {**NODES4, "durability": "replicated"})
    assert [o["saved"] for o in outs] == [[1, 2, 3]] * 4
    for i in (0, 1):
        for v in ("step-1", "step-2", "step-3"):
            assert objects_in(node(base, i), v) == all_objects(node(base, i), v), (i, v)  # primaries + replicas
        assert records_hold(node(base, i)) == []
    labels = [r["tiers"] for r in json.loads(cli("list", node(base, 1), "--json").stdout)["versions"]]
    text = cli("list", node(base, 1)).stdout
    assert "local(part 2/2 + replica of part 1)" in text, text
    assert labels == [["local"]] * 3

    shutil.rmtree(node(base, 1))  # a replaced machine: its disk is empty
    outs = job(base, 4, 0, NODES4)
    rr_check(outs, 4)
    assert all(o["restore"]["reads"]["remote_reads"] == 0 for o in outs)
    assert objects_in(node(base, 1), "step-3") == all_objects(node(base, 1), "step-3")  # re-replicated
    assert "step-3" in [r.version for r in ckptstore.Store(node(base, 1)).versions()]

    shutil.rmtree(node(base, 1))
    outs = job(base, 2, 0, {"per_node": 1, "replicas": 1, "reshard": True})
    for o in outs:
        assert o["start"] == 4 and o["restore"]["version"] == "step-3" and o["restore"]["world_size"] == 4
        assert o["same"]["model"] and o["same"]["optim"] and o["same"]["sched"], o["same"]


def rr_check(outs, start):
    for o in outs:
        assert o["start"] == start and o["restore"]["version"] == f"step-{start - 1}", o["restore"]
        assert all(o["same"].values()), o["same"]


def test_incremental_versions_survive_one_node_replacement_after_another(tmp_path):
    """Incremental saves (docs/FORMAT.md "References") with F = 1: a frozen block is stored once, by
    step-1, and every later version references it; KeepLast(2) un-commits step-1 but keeps what is
    referenced. Node 0 replaced: the job restores step-4 from node 1's replicas, referenced objects
    included, and the heal gives node 0 back the referenced objects too; one more save; then node 1
    replaced: the job restores step-5 from node 0 alone (before: "no version is loadable", the heal
    had copied only the version's own objects)."""
    from ckptstore.retention import KeepLast, RetentionPolicy

    base = tmp_path
    opts = {**NODES4, "incremental": True, "frozen": True, "retention": RetentionPolicy([KeepLast(2)])}
    job(base, 4, 4, {**opts, "durability": "replicated"})
    m = catalogue.read_manifest(LocalTier(node(base, 1)), "step-4").manifest
    assert {r.version for r in m.refs} >= {"step-1"}, m.refs  # the frozen block of step-1
    assert [r.version for r in ckptstore.Store(node(base, 0)).versions()] == ["step-3", "step-4"]

    shutil.rmtree(node(base, 0))
    outs = job(base, 4, 1, opts)
    rr_check(outs, 5)
    assert all(o["restore"]["reads"]["remote_reads"] == 0 for o in outs)
    assert outs[0]["restore"]["reads"]["peer_bytes"] > 0

    shutil.rmtree(node(base, 1))
    outs = job(base, 4, 0, opts)
    rr_check(outs, 6)
    for i in (0, 1):
        assert cli("scrub", node(base, i)).exit_code == 0
        assert records_hold(node(base, i)) == []


@pytest.mark.s3
def test_a_replaced_node_restores_with_zero_s3_gets(tmp_path, s3_url, seaweed):
    """The same with S3 behind a request-counting proxy: the restore of the replaced node makes no GET."""
    from test_multinode import CountingProxy

    base = tmp_path
    proxy = CountingProxy(seaweed.endpoint)
    try:
        env = {"AWS_ENDPOINT_URL": proxy.endpoint}
        outs = job(base, 4, 3, {**NODES4, "durability": "remote"}, remote=s3_url, env=env)
        assert all(o["close_error"] is None for o in outs), outs
        shutil.rmtree(node(base, 1))
        proxy.reset()
        outs = job(base, 4, 0, NODES4, remote=s3_url, env=env)
        rr_check(outs, 4)
        counts = proxy.summary()
        assert counts["object_gets"] == 0 and counts["manifest_gets"] == 0, counts
    finally:
        proxy.close()


def test_keep_last_bounds_every_root_including_its_replicas(tmp_path):
    from ckptstore.retention import KeepLast, RetentionPolicy

    base = tmp_path
    job(base, 4, 6, {**NODES4, "durability": "replicated", "retention": RetentionPolicy([KeepLast(2)])})
    for i in (0, 1):
        root = node(base, i)
        names = [r.version for r in ckptstore.Store(root).versions()]
        assert names == ["step-5", "step-6"], (i, names)
        dirs = os.listdir(os.path.join(root, layout.VERSIONS))
        held = [d for d in dirs if os.listdir(os.path.join(root, layout.VERSIONS, d, layout.ATTEMPTS))]
        assert sorted(held) == ["step-5", "step-6"], (i, dirs)


def test_scrub_covers_replicas_and_a_damaged_replica_is_not_the_version(tmp_path):
    base = tmp_path
    job(base, 2, 2, {"per_node": 1, "replicas": 1, "durability": "replicated"})
    root0 = node(base, 0)
    assert cli("scrub", root0).exit_code == 0
    m = catalogue.read_manifest(LocalTier(root0), "step-2").manifest
    replica = next(o for o in m.objects if o.rank == 1)  # node 0 holds rank 1's object as a replica
    path = os.path.join(root0, *layout.object_key("step-2", replica.name).split("/"))
    b = bytearray(open(path, "rb").read())
    b[100] ^= 1
    open(path, "wb").write(b)
    r = cli("scrub", root0)
    assert r.exit_code == 10 and "replica" in r.output and replica.name in r.output, r.output
    part = part_held(LocalTier(root0), m)
    assert part.replica_of == (2,) and replica in part.objects
    # the job still restores step-2 bit-exact: rank 1 reads its own copy on node 1
    outs = job(base, 2, 0, {"per_node": 1, "replicas": 1})
    rr_check(outs, 3)


# -- kill points: a node dies while sending, while receiving, between the fsync and the record -------------
def kill_job(rank, world, base, saves, mgr, scratch):
    """:func:`recovery_ranks.job` under the peer watchdog: when a rank dies (the armed fault point),
    the other rank dies with it, as a whole node or job does."""
    from crash_ranks import Watchdog

    wd = Watchdog(scratch, rank, world)
    out = rr.job(rank, world, base, saves, None, mgr)
    wd.done()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["replica.send@1", "replica.receive@0", "replica.rename@0", "replica.record@0"])
def test_a_node_killed_during_replication_leaves_nothing_listed_that_is_not_there(tmp_path, fault):
    base = tmp_path
    mgr = {"per_node": 1, "replicas": 1}
    job(base, 2, 2, mgr)  # steps 1, 2 with their replicas
    point, _, rank = fault.partition("@")
    env = [{}, {}]
    env[int(rank)] = {"CKPTSTORE_FAULT": f"{point}@{rank}"}
    codes = run_ranks_raw(kill_job, 2, str(base), 1, mgr, str(tmp_path / "scratch"), env=env, timeout=120, **FAST)
    assert -9 in codes.values(), codes
    for i in (0, 1):
        assert records_hold(node(base, i)) == []  # no replica listed that is not there
        assert cli("scrub", node(base, i)).exit_code == 0  # what is there verifies (a .tmp- file is garbage)
    outs = job(base, 2, 0, mgr)  # the next load repairs what is missing
    newest = outs[0]["restore"]["version"]
    assert newest in ("step-2", "step-3")
    for o in outs:
        assert all(o["same"].values()), o["same"]
    for i in (0, 1):
        assert objects_in(node(base, i), newest) == all_objects(node(base, i), newest), (i, newest)


# -- a writer's replica group is released by close() ---------------------------------------------------
def writers_in_a_row(rank, world, base, n):
    """``n`` saves, each through a new ``StorageWriter(replicas=1)`` closed after it (the README's
    writer-per-save pattern); returns this process's open file descriptors after each close, and
    what a save through a closed writer raised."""
    import torch
    import torch.distributed.checkpoint as dcp

    fds = []
    root = os.path.join(base, f"node{rank}")
    for i in range(n):
        w = ckptstore.StorageWriter(root, replicas=1, durability="replicated")
        dcp.save({"x": torch.arange(8)}, checkpoint_id=f"v{i}", storage_writer=w)
        w.close()
        w.close()  # twice is fine
        fds.append(len(os.listdir("/proc/self/fd")))
    try:
        dcp.save({"x": torch.arange(8)}, checkpoint_id="after-close", storage_writer=w)
        raised = None
    except BaseException as e:  # noqa: BLE001 - DCP wraps it in a CheckpointException
        raised = f"{type(e).__name__}: {e}"
    return {"fds": fds, "raised": raised}


def test_closing_a_writer_releases_its_replica_group(tmp_path):
    """Each ``StorageWriter(replicas=F)`` makes a gloo group of its own (a connection to every rank);
    ``close()`` must release it, or a job that makes a writer per save runs out of file descriptors.
    A save through a closed writer fails with a clear error instead of saving without replicas."""
    outs = run_ranks(writers_in_a_row, 2, str(tmp_path), 6, timeout=300, **FAST)
    for o in outs:
        fds = o["fds"]
        assert fds[-1] - fds[0] <= 2, fds  # before the fix: +5 per writer on 2 ranks (more with more ranks)
        assert o["raised"] is not None and "replica copies were closed" in o["raised"], o["raised"]
    for v in ("v0", "v5"):
        assert objects_in(node(tmp_path, 0), v) == all_objects(node(tmp_path, 0), v)  # replicas were made


def test_a_replica_that_was_never_made_is_reported(tmp_path):
    """``durability="local"``: the receiver's root is full (a real 2 MiB tmpfs) when rank 1's object
    is copied to rank 0's node. The save commits (its primaries stand), but the redundancy gap is
    known before a node is lost: ``close()`` raises ``ReplicaError`` naming the version and the
    replica, the save event says ``replicas: "gap"`` with the error, and the metrics count it."""
    from helpers import small_tmpfs

    import roots_ranks

    b = str(tmp_path / "b")
    with small_tmpfs(tmp_path / "a", size="2m") as a:
        out = run_ranks(roots_ranks.manager_with_replica_gap, 2, [a, b], 1 << 20, timeout=240,
                        start_method="forkserver", preload=["roots_ranks"])
        assert "step-1" in catalogue.scan(LocalTier(a)) and "step-1" in catalogue.scan(LocalTier(b))
    for o in out:
        assert o["close"].startswith("ReplicaError") and "step-1" in o["close"] and "r00001.ckd" in o["close"], o["close"]
        assert 'ckptstore_replica_gaps_total{rank=' in o["metrics"] and "} 1" in o["metrics"].split(
            "ckptstore_replica_gaps_total{")[1].splitlines()[0], o["metrics"]
    (save,) = out[0]["saves"]
    assert save["outcome"] == "committed" and save["replicas"] == "gap", save
    assert "StorageFullError" in save["error"] and "r00001.ckd" in save["error"], save


@pytest.mark.parametrize("replicas", [1, 0], ids=["replicated", "no-replicas"])
def test_saves_that_fail_on_a_full_disk_leave_nothing_behind(tmp_path, replicas):
    """The chaos run's full disk: rank 1's root (a real 4 MiB tmpfs) is full for five saves of a
    ``durability="replicated"`` manager; each fails (rank 1 cannot write; rank 0's replica cannot land
    there). Before, every failed save left rank 0's 1 MiB object in rank 0's root — on a real node
    that filled the other disk too, and every later save failed although the cause was gone. Now each
    rank reclaims what its failed write left (and the coordinator what the commit point does not
    name: ``no-replicas``, where rank 0's own write succeeded), so rank 0's root holds no shard object of a
    failed save, and once space is back the next save commits on both roots."""
    from helpers import small_tmpfs

    import roots_ranks
    from ckptstore.demo.chaos.inject import fill

    a = str(tmp_path / "a")
    with small_tmpfs(tmp_path / "b", size="4m") as b:
        filler = os.path.join(b, "filler")
        fill(b, filler)
        out = run_ranks(roots_ranks.manager_saves_while_a_root_is_full, 2, [a, b], 1 << 20, filler, 5, replicas, timeout=300,
                        start_method="forkserver", preload=["roots_ranks"])
    (left0, committed0), (left1, committed1) = out
    assert left0 == [] and left1 == [], (left0, left1)
    assert committed0 == committed1 == ["step-6"], (committed0, committed1)
