"""Rank bodies for tests/test_subclass.py: DTensors whose local tensors are a wrapper subclass."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import ckptstore

from qtensor import QInt8Tensor

ROWS, COLS = 16, 8


def full_values(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, COLS, generator=g) * (1 + torch.arange(ROWS, dtype=torch.float32)[:, None])


def qdtensor(world: int, seed: int, dim: int = 0) -> DTensor:
    """A DTensor sharded on ``dim`` whose local tensor is this rank's QInt8Tensor shard."""
    mesh = init_device_mesh("cpu", (world,))
    local = full_values(seed).chunk(world, dim=dim)[dist.get_rank()]
    return DTensor.from_local(QInt8Tensor.from_float(local.contiguous()), mesh, [Shard(dim)], run_check=False)


def _state(world: int, seed: int) -> dict:
    return {"q": qdtensor(world, seed), "plain": full_values(seed + 1)}


def _inner(sd: dict) -> tuple:
    loc = sd["q"].to_local()
    return type(loc).__name__, loc.qdata.numpy().tobytes(), loc.scale.numpy().tobytes(), sd["plain"].numpy().tobytes()


def round_trip(rank, world, root, how):
    """Save through ckptstore (``how``: "sync", "thread", "process") and DCP's FileSystemWriter; load both
    into fresh states; return the inner tensors of the source, of ckptstore's load and of DCP's."""
    src = _state(world, seed=0)
    version = f"v-{how}"
    w = ckptstore.StorageWriter(root)
    if how == "sync":
        dcp.save(src, checkpoint_id=version, storage_writer=w)
    else:
        kind = AsyncCheckpointerType.PROCESS if how == "process" else AsyncCheckpointerType.THREAD
        dcp.async_save(src, checkpoint_id=version, storage_writer=w, async_checkpointer_type=kind).result()
        w.close()
    fs = os.path.join(root, "dcp-fs-" + how)
    dcp.save(src, checkpoint_id=fs)
    ours, theirs = _state(world, seed=5), _state(world, seed=5)
    dcp.load(ours, checkpoint_id=version, storage_reader=ckptstore.StorageReader(root))
    dcp.load(theirs, checkpoint_id=fs)
    return _inner(src), _inner(ours), _inner(theirs)


def save_sharded(rank, world, root, dim):
    dcp.save({"q": qdtensor(world, seed=0, dim=dim)}, checkpoint_id="v", storage_writer=ckptstore.StorageWriter(root))
    return True


def load_resharded(rank, world, root, dim):
    """Load version "v" into QInt8Tensor locals sharded on ``dim`` over ``world`` ranks; the inner
    tensors, or the error."""
    tgt = {"q": qdtensor(world, seed=5, dim=dim)}
    try:
        dcp.load(tgt, checkpoint_id="v", storage_reader=ckptstore.StorageReader(root))
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        fails = [f for f, _tb in e.failures.values()] if hasattr(e, "failures") else [e]
        return "err", [f"{type(f).__name__}: {f}" for f in fails]
    loc = tgt["q"].to_local()
    return "ok", (type(loc).__name__, loc.qdata.numpy().tobytes(), loc.scale.numpy().tobytes())
