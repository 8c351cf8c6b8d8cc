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


def load(rank, world, roots, version=None, remote=None):
    """Load ``version`` (None: the agreed newest) into a blank state; check every byte."""
    r = ckptstore.StorageReader(roots[rank], remote=remote, version=version)
    sd = sharded_state(world, 0, blank=True)
    sd["meta"] = {"epoch": 0, "args": {"lr": 0.0, "name": "", "tags": [], "note": 1}}
    dcp.load(sd, storage_reader=r)
    v = r.version
    full = full_state(_seed(v))
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
