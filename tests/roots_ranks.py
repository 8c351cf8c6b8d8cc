"""Rank functions for tests/test_node_roots.py: every rank gets its own root from ``roots[rank]``
(node-local disks simulated with one directory per node)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptstore
from dcp_ranks import full_state, sharded_state


def _seed(version: str) -> int:
    return 1000 + int(version.lstrip("v") or 0)


def save_versions(rank, world, roots, versions, remote=None, retention=None, durability="local"):
    """Save ``versions`` in turn (state derived from the version name); returns the writer's placement."""
    w = ckptstore.StorageWriter(roots[rank], remote=remote, retention=retention, durability=durability,
                                frame_size=65536)
    placements = []
    for v in versions:
        dcp.save(sharded_state(world, _seed(v)), checkpoint_id=v, storage_writer=w)
        if w.last_manifest is not None:
            placements.append(w.last_manifest.placement)
    w.close()
    return placements


def load(rank, world, roots, version=None, remote=None, expect=None):
    """Load ``version`` (None: the agreed newest) into a blank state; check every byte (against the
    state of the version name ``expect``, default the version loaded)."""
    r = ckptstore.StorageReader(roots[rank], remote=remote, version=version)
    sd = sharded_state(world, 0, blank=True)
    sd["meta"] = {"epoch": 0, "args": {"lr": 0.0, "name": "", "tags": [], "note": 1}}
    dcp.load(sd, storage_reader=r)
    v = r.version
    full = full_state(_seed(expect or v))
    ok = torch.equal(sd["dt"].full_tensor(), full["w"]) and torch.equal(
        sd["dbig"].full_tensor().view(torch.int16), full["big"].view(torch.int16)) and sd["meta"] == full["meta"]
    return {"version": v, "ok": bool(ok), "stats": dict(r.stats), "remote_keys": sorted(r.remote_keys)}


def load_error(rank, world, roots, version=None, remote=None):
    """A load that must fail the same way on every rank, naming the objects no root holds."""
    from ckptstore.errors import VersionNotFoundError

    r = ckptstore.StorageReader(roots[rank], remote=remote, version=version)
    sd = sharded_state(world, 0, blank=True)
    try:
        dcp.load(sd, storage_reader=r)
    except BaseException as e:  # CheckpointException is a BaseException
        msg = str(e)
        assert "VersionNotFoundError" in msg or isinstance(e, VersionNotFoundError), msg
        assert "r00001.ckd" in msg and "are on none of the roots" in msg, msg
        return msg
    raise AssertionError("the load succeeded although rank 1's objects are on no root")


def load_then_destroy(rank, world, roots, remote=None):
    """A load, then ``destroy_process_group()`` at once (no barrier): the teardown must not abort."""
    out = load(rank, world, roots, None, remote)
    dist.destroy_process_group()
    return out


def save_replicated(rank, world, roots, versions):
    """Save ``versions`` with one replica per root group and ``durability="replicated"``; returns the
    placements the commits recorded (the coordinator's)."""
    w = ckptstore.StorageWriter(roots[rank], replicas=1, durability="replicated", frame_size=65536)
    placements = []
    try:
        for v in versions:
            dcp.save(sharded_state(world, _seed(v)), checkpoint_id=v, storage_writer=w)
            if w.last_manifest is not None:
                placements.append(w.last_manifest.placement)
    finally:
        w.close()
    return {"placements": placements}


def save_with_stale_probe(rank, world, roots, version, durability, replicas):
    """Rank 1 leaves files in root 0 that name it (a root it does not write to): the claim of another
    save (``probes/root.<token>``) and a probe of an older release (``probes/r00001.<nonce>``); then
    every rank saves ``version``. Returns ``(what the save raised or "", the committed placement)``."""
    from ckptstore.tiers import LocalTier

    if rank == 1:
        t = LocalTier(roots[0])
        t.put("probes/root.0123456789abcdef", b"1")
        t.put("probes/r00001.5f3a5f3a5f3a5f3a", b"")
    dist.barrier()
    w = ckptstore.StorageWriter(roots[rank], replicas=replicas, durability=durability, frame_size=65536)
    try:
        dcp.save(sharded_state(world, _seed(version)), checkpoint_id=version, storage_writer=w)
        return "", None if w.last_manifest is None else w.last_manifest.placement
    except BaseException as e:  # CheckpointException is a BaseException
        return f"{type(e).__name__}: {e}", None
    finally:
        w.close()


def save_keyed(rank, world, roots, version, remote=None, replicas=0):
    """Save ``version`` (encrypted with the key in ``CKPTSTORE_KEY``) into node-local ``roots``, with
    ``replicas`` and an optional remote tier (uploaded before the save returns)."""
    w = ckptstore.StorageWriter(roots[rank], remote=remote, replicas=replicas, frame_size=65536,
                                durability="remote" if remote else ("replicated" if replicas else "local"))
    try:
        dcp.save(sharded_state(world, _seed(version)), checkpoint_id=version, storage_writer=w)
    finally:
        w.close()
    return True


def load_or_error(rank, world, roots, version=None, remote=None):
    """:func:`load`, or the text of what it raised."""
    try:
        return load(rank, world, roots, version, remote)
    except BaseException as e:  # CheckpointException is a BaseException
        return f"{type(e).__name__}: {e}"


def manager_with_replica_gap(rank, world, roots, nbytes):
    """A ``CheckpointManager(replicas=1)`` (``durability="local"``) saves step 1 of a per-rank state of
    ``nbytes`` random bytes; rank 0's root is too small for the replica of rank 1's object. Returns
    what ``close()`` raised ("" if nothing), this rank's metrics and, on rank 0, the save events."""
    from ckptstore import events

    g = torch.Generator().manual_seed(rank)
    state = {"w": torch.randint(0, 255, (nbytes,), dtype=torch.uint8, generator=g)}
    mgr = ckptstore.CheckpointManager(roots[rank], state, replicas=1, per_rank_keys=("w",), save_rng=False,
                                      save_on_signal=None)
    mgr.save(1)
    err = ""
    try:
        mgr.close()
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    saves = [e for e in events.read_events(events.default_path(roots[rank])) if e["kind"] == "save"] if rank == 0 else []
    return {"close": err, "metrics": mgr.metrics_text(), "saves": saves}


def incremental_drop_race(rank, world, roots):
    """Node-local roots, ``StorageWriter(incremental=True)``: ``v1``, then ``v2`` (same state, so every
    item references ``v1``) while, on rank 1, ``ckptstore drop ROOT v1`` runs on rank 1's root (another
    process) after rank 1's first item was matched. Returns the leases left in this rank's root."""
    import os
    import subprocess
    import sys

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ckptstore.tiers import LocalTier

    class Gated(DefaultSavePlanner):
        ran = []

        def resolve_data(self, write_item):
            if rank == 1 and len(self.ran) == 0 and write_item.index.fqn == "i32":
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
                self.ran.append(subprocess.run([sys.executable, "-m", "ckptstore.cli", "drop", roots[rank], "v1", "--yes"],
                                               env=env, capture_output=True, text=True, timeout=120).returncode)
            return super().resolve_data(write_item)

    w = ckptstore.StorageWriter(roots[rank], incremental=True, frame_size=65536)
    dcp.save(sharded_state(world, _seed("v1")), checkpoint_id="v1", storage_writer=w)
    dcp.save(sharded_state(world, _seed("v1")), checkpoint_id="v2", storage_writer=w, planner=Gated())
    w.close()
    dist.barrier()
    return {"leases": sorted(i.key for i in LocalTier(roots[rank]).list("leases/")), "drop": Gated.ran}


def save_while_a_rank_is_refused(rank, world, roots, remote, n, keep_last, upload_timeout):
    """``n`` saves (``durability="local"``, local keep-last ``keep_last``) while S3 refuses rank 1's
    requests (its credentials, set by the test): after each save, the number of versions in this
    rank's root; then ``close()``'s error (None if it raised nothing)."""
    from ckptstore import retention as R

    pol = R.RetentionPolicy(per_tier={"local": (R.KeepLast(keep_last),)})
    w = ckptstore.StorageWriter(roots[rank], remote=remote, retention=pol, durability="local", frame_size=65536,
                                upload_timeout=upload_timeout)
    counts = []
    for i in range(1, n + 1):
        dcp.save(sharded_state(world, _seed(f"v{i}")), checkpoint_id=f"v{i}", storage_writer=w)
        dist.barrier()
        counts.append(len(ckptstore.Store(roots[rank]).versions()))
    try:
        w.close()
    except ckptstore.errors.CkptStoreError as e:
        return counts, f"{type(e).__name__}: {e}"
    return counts, None


def save_back_to_back(rank, world, roots, remote, n):
    """``n`` saves back to back through one ``durability="local"`` writer, then ``close()``; returns the
    versions the writer did not stage because newer ones were (the bounded queue)."""
    w = ckptstore.StorageWriter(roots[rank], remote=remote, durability="local", frame_size=65536)
    for i in range(1, n + 1):
        dcp.save(sharded_state(world, _seed(f"v{i}")), checkpoint_id=f"v{i}", storage_writer=w)
    w.close()
    return w.skipped_uploads


def manager_saves_while_a_root_is_full(rank, world, roots, nbytes, filler, k, replicas=1):
    """``CheckpointManager(replicas=1, durability="replicated")`` (or without replicas) on node-local
    roots; rank 1's root is full (``filler`` holds its free space) for ``k`` saves, each of which fails
    (rank 1 cannot write; with replicas, rank 0's replica cannot land there either; without, rank 0's
    write succeeds and DCP aborts the save at the coordinator). Returns the shard objects each failed save left in this rank's root,
    then — after rank 1 deleted ``filler`` — the versions committed in this root by one more save."""
    import os

    from ckptstore.tiers import LocalTier
    from ckptstore.manifest import catalogue

    g = torch.Generator().manual_seed(rank)
    state = {"w": torch.randint(0, 255, (nbytes,), dtype=torch.uint8, generator=g)}
    mgr = ckptstore.CheckpointManager(roots[rank], state, replicas=replicas,
                                      durability="replicated" if replicas else "local", per_rank_keys=("w",),
                                      save_rng=False, save_on_signal=None, raise_errors=False)
    for step in range(1, k + 1):
        mgr.save(step, force=True)
        mgr.wait()
    dist.barrier()
    left = sorted(os.path.relpath(os.path.join(d, f), roots[rank]) for d, _s, fs in os.walk(roots[rank])
                  for f in fs if f.endswith(".ckd"))
    dist.barrier()
    if rank == 1:
        os.remove(filler)
    dist.barrier()
    mgr.save(k + 1, force=True)
    mgr.wait()
    dist.barrier()
    committed = sorted(catalogue.scan(LocalTier(roots[rank])))
    mgr.close()
    return left, committed


def manager_wait_then_list(rank, world, roots, delay_s):
    """``CheckpointManager`` on node-local roots whose second node writes slowly: rank 1's manifest
    copy takes ``delay_s`` seconds more (its ``copy_into`` sleeps first, as a busy disk would). Returns
    the versions this rank's root lists right after ``save(); wait()``."""
    import time

    from ckptstore.dcp import _roots
    from ckptstore.manifest import catalogue
    from ckptstore.tiers import LocalTier

    if rank == 1:
        real = _roots.copy_into

        def slow(*a, **k):
            time.sleep(delay_s)
            return real(*a, **k)

        _roots.copy_into = slow
    state = {"w": torch.arange(4096, dtype=torch.float32) + rank}
    mgr = ckptstore.CheckpointManager(roots[rank], state, per_rank_keys=("w",), save_rng=False,
                                      save_on_signal=None)
    mgr.save(1, force=True)
    mgr.wait()
    listed = sorted(catalogue.scan(LocalTier(roots[rank])))
    mgr.close()
    return listed
