"""Rank functions for tests/test_restore_scale.py: a tiny state (one replicated tensor and one small
tensor per rank, so every rank writes an object) saved and loaded through ``StorageWriter`` /
``StorageReader`` with ``roots[rank]`` as the rank's root; loads report what
``ckptstore.testing.meter`` counted and what the ``ckptstore`` logger said."""

from __future__ import annotations

import io
import logging

import torch
import torch.distributed.checkpoint as dcp

import ckptstore


def _state(rank: int, step: int) -> dict:
    return {"step": torch.full((4,), float(step)), f"rank{rank}": torch.arange(8) + 100 * rank + step}


def _blank(rank: int) -> dict:
    return {"step": torch.zeros(4), f"rank{rank}": torch.zeros(8, dtype=torch.int64)}


def _log() -> io.StringIO:
    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    h.setLevel(logging.WARNING)
    logging.getLogger("ckptstore").addHandler(h)
    return buf


def save(rank, world, roots, versions):
    w = ckptstore.StorageWriter(roots[rank], frame_size=65536)
    for i, v in enumerate(versions):
        dcp.save(_state(rank, i), checkpoint_id=v, storage_writer=w)
    w.close()


def load(rank, world, roots):
    """Load the newest version, metered; check every byte."""
    from ckptstore.testing.meter import metered

    buf = _log()
    r = ckptstore.StorageReader(roots[rank])
    sd = _blank(rank)
    with metered() as m:
        dcp.load(sd, storage_reader=r)
    step = int(sd["step"][0].item())
    ok = torch.equal(sd[f"rank{rank}"], torch.arange(8) + 100 * rank + step)
    return {"version": r.version, "ok": bool(ok), "received": m.received.get("ckptstore", 0),
            "fs": m.fs_calls("ckptstore"), "log": buf.getvalue()}


def save_then_load(rank, world, roots, versions):
    """Save ``versions``, then at once (same processes, same job) load the newest: what the load logged."""
    buf = _log()
    w = ckptstore.StorageWriter(roots[rank], frame_size=65536)
    for i, v in enumerate(versions):
        dcp.save(_state(rank, i), checkpoint_id=v, storage_writer=w)
    r = ckptstore.StorageReader(roots[rank])
    sd = _blank(rank)
    dcp.load(sd, storage_reader=r)
    w.close()
    step = int(sd["step"][0].item())
    ok = torch.equal(sd[f"rank{rank}"], torch.arange(8) + 100 * rank + step)
    return {"version": r.version, "ok": bool(ok), "log": buf.getvalue()}


def sim_roots(base: str, n: int, per_root: int | None, versions: int) -> list:
    """Roots on disk of a job of ``n`` ranks that committed ``versions`` versions, without running
    ranks (as ``benchmarks/scale_sim.py`` builds them): one real sealed manifest per version,
    hard-linked into every root (the copies of one commit are byte-identical), and in each root its
    group's shard objects and the metadata object (empty files: a restore's listing reads names).
    ``per_root`` ranks share a root (None: one shared root). Returns each rank's root directory."""
    import os

    from ckptstore.manifest import layout
    from ckptstore.manifest.schema import Manifest, ObjectEntry

    os.makedirs(base, exist_ok=True)
    per = per_root or n
    groups = [list(range(k, min(k + per, n))) for k in range(0, n, per)]
    dirs = [os.path.join(base, f"node{k:05d}") for k in range(len(groups))]
    for i in range(versions):
        v = f"step-{i:04d}"
        attempt = layout.new_attempt()
        objects = [ObjectEntry(layout.shard_name(attempt, r), 1 << 20, f"{r:016x}", 4, r, 4 << 20) for r in range(n)]
        meta = ObjectEntry(layout.metadata_name(attempt), 1 << 16, "0" * 16, 1, None, 1 << 17)
        m = Manifest(version=v, attempt=attempt, created=f"2026-12-01T10:{i:02d}:00.000000Z", world_size=n, objects=objects,
                     metadata_object=meta, nbytes=n * (4 << 20), stored_bytes=n * (1 << 20), step=i + 1, writer="test",
                     placement=groups if len(groups) > 1 else None, seq=i + 1)
        master = os.path.join(base, f"manifest-{i}.json")
        with open(master, "wb") as f:
            f.write(m.to_bytes(None))
        for k, rd in enumerate(dirs):
            os.makedirs(os.path.join(rd, *layout.object_key(v, layout.attempt_dir(attempt)).split("/")), exist_ok=True)
            for name in [meta.name] + [layout.shard_name(attempt, r) for r in groups[k]]:
                open(os.path.join(rd, *layout.object_key(v, name).split("/")), "wb").close()
            os.link(master, os.path.join(rd, *layout.manifest_key(v).split("/")))
    return [dirs[r // per] for r in range(n)]
