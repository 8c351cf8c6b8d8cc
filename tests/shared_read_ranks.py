"""Rank bodies for tests/test_shared_reads.py and benchmarks/shared_read_bench.py (module-level so
spawned ranks can import them): a DDP-like state — a 1 MiB replicated fp32 weight (every rank holds
all of it; DCP stores one copy) — plus DTensors sharded on dim 0 and a non-tensor entry, saved by N
ranks with every rank's own root (node-local disks) and the remote tier, then loaded by M ranks whose
roots are all empty (every node replaced): an S3-only restore.
"""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ckptstore

PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "ckptstore", "ckptstore.dcp.reader",
           "shared_read_ranks"]


def full(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "rep": torch.randn(1 << 18, generator=g),  # 1 MiB, replicated (DDP): random, so stored as is
        "w": torch.randn(256, 1024, generator=g),  # 1 MiB, sharded on dim 0
        "b": torch.randn(64, 512, generator=g).to(torch.bfloat16),  # 64 KiB, sharded on dim 0
        "meta": {"epoch": 3, "tags": ["a", "b"]},
    }


def state(world: int, seed: int, blank: bool = False) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    f = full(seed)
    z = torch.zeros_like if blank else (lambda t: t)
    return {
        "rep": z(f["rep"]).clone(),
        "w": distribute_tensor(z(f["w"]), mesh, [Shard(0)]),
        "b": distribute_tensor(z(f["b"]), mesh, [Shard(0)]),
        "meta": {"epoch": 0, "tags": []} if blank else f["meta"],
    }


def save(rank, world, base, url, version, seed=0):
    """Every rank its own root ``base/save-<version>/r<rank>``; committed remotely before it returns."""
    root = os.path.join(base, f"save-{version}", f"r{rank}")
    w = ckptstore.StorageWriter(root, remote=url, durability="remote", step=seed)
    dcp.save(state(world, seed), checkpoint_id=version, storage_writer=w)
    w.close()
    return True


def load(rank, world, base, url, version, seed=0, tag="load", corrupt=None, roots=None):
    """Load ``version`` into blank state with an empty root per rank (only the remote tier holds it;
    ``roots``: each rank's root instead); returns whether every value is bit-exact and the reader's
    counters. ``corrupt="sender"``: the ranks that read for others flip a byte of what they send
    *after* their check (the manifest, the metadata object and every chunk: bytes damaged between
    the sender's check and the receivers), so every receiver must catch it."""
    root = roots[rank] if roots else os.path.join(base, f"{tag}-{version}-{world}", f"r{rank}")
    sd = state(world, seed, blank=True)
    r = ckptstore.StorageReader(root, remote=url)
    if corrupt == "sender":
        _corrupt_what_is_sent()
    dcp.load(sd, checkpoint_id=version, storage_reader=r)
    f = full(seed)
    ok = {
        "rep": torch.equal(sd["rep"].view(torch.int32), f["rep"].view(torch.int32)),
        "w": torch.equal(sd["w"].full_tensor().view(torch.int32), f["w"].view(torch.int32)),
        "b": torch.equal(sd["b"].full_tensor().view(torch.int16), f["b"].view(torch.int16)),
        "meta": sd["meta"] == f["meta"],
    }
    return {"ok": ok, "stats": dict(r.stats), "left": os.listdir(root) if os.path.isdir(root) else []}


def _corrupt_what_is_sent() -> None:
    """Flip one byte in every chunk this rank sends (after the sender's own verification), as a bad
    link or a faulty relay would: the receivers must detect it and read the chunk themselves."""
    from ckptstore.dcp import _peers

    real = _peers._message
    real_bcast = _peers.broadcast_bytes

    def damaged_bcast(parts, src, pg):
        if parts is not None:
            parts = [p[:len(p) // 2] + bytes([p[len(p) // 2] ^ 0x40]) + p[len(p) // 2 + 1:] for p in parts]
        return real_bcast(parts, src, pg)

    def damaged(xp, ks, held):
        out = real(xp, ks, held)
        pos = len(ks)
        for j, k in enumerate(ks):
            if out[j] and xp.chunks[k].nbytes:
                out[pos + xp.chunks[k].nbytes // 2] ^= 0x40
            pos += xp.chunks[k].nbytes
        return out

    _peers._message = damaged
    _peers.broadcast_bytes = damaged_bcast
