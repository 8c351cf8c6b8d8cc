"""Rank bodies for tests/test_kms.py: incremental saves and a load through ``StorageWriter`` /
``StorageReader`` with an AWS KMS key (moto's KMS, reached through the environment), each rank
reporting the KMS requests its ``KmsKey`` made."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed.checkpoint as dcp


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    return {f"frozen{rank}": torch.randn(4096, generator=g),  # identical at every save: referenced
            f"live{rank}": torch.full((256,), float(step + 10 * rank)),
            "step": step}


def digest(sd: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(sd):
        v = sd[k]
        h.update(k.encode() + (v.numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode()))
    return h.hexdigest()


def save(rank, world, root, key_id, steps):
    """``steps`` incremental saves ``v1``…; returns (this rank's KMS requests, digest of each state)."""
    import ckptstore

    key = ckptstore.KmsKey(key_id)
    w = ckptstore.StorageWriter(root, key=key, incremental=True)
    out = {}
    for step in range(1, steps + 1):
        sd = _state(rank, step)
        dcp.save(sd, checkpoint_id=f"v{step}", storage_writer=w)
        out[f"v{step}"] = digest(sd)
    w.close()
    return dict(key.calls), out


def load(rank, world, root, key_id, version):
    """``version`` loaded into a fresh state; returns (this rank's KMS requests, its digest)."""
    import ckptstore

    key = ckptstore.KmsKey(key_id)
    sd = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in _state(rank, 0).items()}
    dcp.load(sd, checkpoint_id=version, storage_reader=ckptstore.StorageReader(root, key=key))
    return dict(key.calls), digest(sd)
