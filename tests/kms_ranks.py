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


def process_save(rank, world, root, key_id):
    """``dcp.async_save`` under ``AsyncCheckpointerType.PROCESS``: the writer (and its ``KmsKey``) is
    pickled into DCP's checkpoint subprocess, which asks KMS itself; then a load here. Returns
    (saved digest, loaded digest, the manifest's ``encryption.alg``, this process's KMS requests
    for the save)."""
    import json
    import os

    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import ckptstore

    key = ckptstore.KmsKey(key_id)
    w = ckptstore.StorageWriter(root, key=key)
    sd = _state(rank, 1)
    dcp.async_save(sd, checkpoint_id="v1", storage_writer=w, async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    w.close()
    save_calls = dict(key.calls)
    with open(os.path.join(root, "versions", "v1", "manifest.json"), "rb") as f:
        alg = json.load(f)["body"]["encryption"]["alg"]  # manifest.json is JSON (docs/FORMAT.md, "Manifest")
    _calls, got = load(rank, world, root, key_id, "v1")
    return digest(sd), got, alg, save_calls
