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
