"""Per-rank bodies for the multi-process DCP tests (module-level so spawned ranks can import them)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import ckptstore


def full_state(seed: int = 0) -> dict:
    """A state with big and small tensors of several dtypes and non-tensor values."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(37, 19, generator=g),
        "big": torch.randn(1 << 18, generator=g).to(torch.bfloat16),  # spans several frames at 64 KiB frames
        "i32": torch.tensor([16777217, -5, 2**31 - 1], dtype=torch.int32),
        "meta": {"epoch": 20, "args": {"lr": 3e-4, "name": "run/ü", "tags": ["a", "b"], "note": None}},
    }


def sharded_state(world: int, seed: int, blank: bool = False) -> dict:
    """``full_state(seed)`` with ``w`` and ``big`` as DTensors sharded on dim 0 (zeros if ``blank``)."""
    mesh = init_device_mesh("cpu", (world,))
    full = full_state(seed)
    fill = torch.zeros_like if blank else (lambda t: t)
    return {
        "dt": distribute_tensor(fill(full["w"]), mesh, [Shard(0)]),
        "dbig": distribute_tensor(fill(full["big"]), mesh, [Shard(0)]),
        "i32": torch.zeros(3, dtype=torch.int32) if blank else full["i32"],
        "meta": full["meta"],
    }


def save_sharded(rank, world, root, version, seed, key=None, frame_size=65536):
    """DTensor sharded on dim 0 + plain replicated tensors + non-tensor state."""
    sd = sharded_state(world, seed)
    w = ckptstore.StorageWriter(root, key=key, step=seed, frame_size=frame_size)
    dcp.save(sd, checkpoint_id=version, storage_writer=w)
    return True


def load_sharded(rank, world, root, version, seed, key=None):
    full = full_state(seed)
    sd = sharded_state(world, seed, blank=True)
    sd["meta"] = {"epoch": 0, "args": {"lr": 0.0, "name": "", "tags": [], "note": 1}}
    dcp.load(sd, checkpoint_id=version, storage_reader=ckptstore.StorageReader(root, key=key))
    ok = {
        "dt": torch.equal(sd["dt"].full_tensor(), full["w"]),
        "dbig": torch.equal(sd["dbig"].full_tensor().view(torch.int16), full["big"].view(torch.int16)),
        "local_shape": tuple(sd["dt"].to_local().shape),
        "i32": sd["i32"].tolist(),
        "meta": sd["meta"],
    }
    return ok


def async_mutate(rank, world, root, version, kind):
    mesh = init_device_mesh("cpu", (world,))
    base = torch.arange(64, dtype=torch.float32).reshape(16, 4) + 1
    sd = {"dt": distribute_tensor(base.clone(), mesh, [Shard(0)]), "plain": torch.ones(5) * 3, "step": torch.tensor(7.0)}
    w = ckptstore.StorageWriter(root)
    t = AsyncCheckpointerType.PROCESS if kind == "process" else AsyncCheckpointerType.THREAD
    fut = dcp.async_save(sd, checkpoint_id=version, storage_writer=w, async_checkpointer_type=t)
    # training continues and mutates every tensor in place right away
    sd["dt"].to_local().mul_(-100)
    sd["plain"].fill_(-1)
    sd["step"].fill_(99)
    fut.result()
    tgt = {"dt": distribute_tensor(torch.zeros(16, 4), mesh, [Shard(0)]), "plain": torch.zeros(5), "step": torch.tensor(0.0)}
    dcp.load(tgt, checkpoint_id=version, storage_reader=ckptstore.StorageReader(root))
    return {
        "dt": torch.equal(tgt["dt"].full_tensor(), base),
        "plain": tgt["plain"].tolist(),
        "step": tgt["step"].item(),
    }


def uneven_save(rank, world, root, version):
    mesh = init_device_mesh("cpu", (world,))
    sd = {
        "v6": distribute_tensor(torch.arange(6, dtype=torch.float32) + 0.5, mesh, [Shard(0)]),
        "e_bf16": torch.zeros(0, 4, dtype=torch.bfloat16),
        "e_i8": torch.zeros(0, dtype=torch.int8),
    }
    local = tuple(sd["v6"].to_local().shape)
    dcp.save(sd, checkpoint_id=version, storage_writer=ckptstore.StorageWriter(root))
    return local


def uneven_load(rank, world, root, version):
    mesh = init_device_mesh("cpu", (world,))
    sd = {
        "v6": distribute_tensor(torch.zeros(6), mesh, [Shard(0)]),
        "e_bf16": torch.ones(0, 4, dtype=torch.bfloat16),
        "e_i8": torch.ones(0, dtype=torch.int8),
    }
    dcp.load(sd, checkpoint_id=version, storage_reader=ckptstore.StorageReader(root))
    return {
        "v6": sd["v6"].full_tensor().tolist(),
        "local": tuple(sd["v6"].to_local().shape),
        "e": (tuple(sd["e_bf16"].shape), sd["e_bf16"].dtype == torch.bfloat16, tuple(sd["e_i8"].shape)),
    }


def divergent_plain(rank, world, root, version):
    sd = {"same": torch.ones(4), "rng_like": torch.full((4,), float(rank))}
    try:
        dcp.save(sd, checkpoint_id=version, storage_writer=ckptstore.StorageWriter(root))
    except BaseException as e:  # CheckpointException is a BaseException
        return str(e)
    return None


def per_rank_save(rank, world, root, version):
    sd = {f"dataloader.dp_rank_{rank}": {"cursor": 100 + rank}, "w": torch.ones(3)}
    dcp.save(sd, checkpoint_id=version, storage_writer=ckptstore.StorageWriter(root))
    return True


def per_rank_load(rank, world, root, version, allow):
    sd = {f"dataloader.dp_rank_{rank}": {"cursor": -1}, "w": torch.zeros(3)}
    try:
        dcp.load(sd, checkpoint_id=version, storage_reader=ckptstore.StorageReader(root, allow_partial_load=allow))
    except BaseException as e:
        return ("error", str(e))
    return ("ok", sd[f"dataloader.dp_rank_{rank}"])


def killed_save(rank, world, root, version):
    """Ranks die at the fault point armed through CKPTSTORE_FAULT (see ckptstore/_faults.py)."""
    sd = {f"x.rank{rank}": torch.full((1000,), float(rank)), f"y.rank{rank}": torch.arange(10) * rank}
    dcp.save(sd, checkpoint_id=version, storage_writer=ckptstore.StorageWriter(root, frame_size=4096))
    return True


def plain_save(rank, world, root, version, value):
    sd = {f"x.rank{rank}": torch.full((1000,), float(value + rank))}
    dcp.save(sd, checkpoint_id=version, storage_writer=ckptstore.StorageWriter(root, frame_size=4096))
    return True


# ---- S3 -------------------------------------------------------------------------------------
def s3_save(rank, world, root, remote, version, seed, durability="remote", key=None):
    sd = sharded_state(world, seed)
    w = ckptstore.StorageWriter(root, remote=remote, durability=durability, key=key, step=seed, frame_size=65536, upload_timeout=60)
    try:
        dcp.save(sd, checkpoint_id=version, storage_writer=w)
        w.close()
    except BaseException as e:  # CheckpointException is a BaseException
        return ("error", str(e))
    return ("ok", None)


def s3_load(rank, world, root, remote, version, seed, key=None):
    full = full_state(seed)
    sd = sharded_state(world, seed, blank=True)
    sd["meta"] = {"epoch": 0, "args": {"lr": 0.0, "name": "", "tags": ["", ""], "note": 1}}
    dcp.load(sd, checkpoint_id=version, storage_reader=ckptstore.StorageReader(root, remote=remote, key=key))
    return (
        torch.equal(sd["dt"].full_tensor(), full["w"])
        and torch.equal(sd["dbig"].full_tensor().view(torch.int16), full["big"].view(torch.int16))
        and sd["i32"].tolist() == full["i32"].tolist()
        and sd["meta"] == full["meta"]
    )


# ---- equal values, different pickles ---------------------------------------
TAGS = {f"tag-{i:02d}" for i in range(12)}


def equal_sets_save(rank, world, root):
    """Each rank runs with its own PYTHONHASHSEED: equal sets pickle to different bytes."""
    out = {"hash": hash("ckptstore"), "equal": None, "different": None}
    sd = {"cfg": {"tags": set(TAGS), "n": 12}, "w": torch.ones(3)}
    try:
        dcp.save(sd, checkpoint_id="same", storage_writer=ckptstore.StorageWriter(root))
    except BaseException as e:  # CheckpointException is a BaseException
        out["equal"] = str(e)
    sd = {"cfg": {"tags": set(TAGS) | {f"rank-{rank}"}, "n": 12}, "w": torch.ones(3)}
    try:
        dcp.save(sd, checkpoint_id="different", storage_writer=ckptstore.StorageWriter(root))
    except BaseException as e:
        out["different"] = str(e)
    return out


def load_then_destroy(rank, world, root, version, seed, remote=None):
    """``load_sharded`` (or from ``remote`` only), then ``destroy_process_group()`` at once, as a
    training script's last lines do; returns the names of ckptstore threads still alive after it."""
    import threading

    if remote is None:
        ok = load_sharded(rank, world, root, version, seed)
        good = ok["dt"] and ok["dbig"]
    else:
        good = s3_load(rank, world, root, remote, version, seed)
    dist.destroy_process_group()
    left = sorted(t.name for t in threading.enumerate() if t.name.startswith("ckptstore-"))
    return good, left


def fsdp1_two_step_load(rank, world, root):
    """PyTorch's FSDP1 recipe (the ``load_sharded_optimizer_state_dict`` docstring): save the model's
    and the optimizer's sharded state dicts under ``model`` and ``optim``; load the model alone into a
    fresh FSDP model, then the optimizer with ``load_sharded_optimizer_state_dict`` — each through a
    default ``ckptstore.StorageReader``. Returns (parameters equal, optimizer state equal, a further
    step's parameters equal) against the saving model and optimizer."""
    import ckptstore
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    def build(seed):
        torch.manual_seed(seed)
        m = FSDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
                 device_id=torch.device("cpu"))
        return m, torch.optim.Adam(m.parameters(), lr=0.1)

    def step(m, o, seed):
        g = torch.Generator().manual_seed(seed)
        m(torch.rand(4, 8, generator=g)).sum().backward()
        o.step()
        o.zero_grad()

    model, optim = build(0)
    step(model, optim, 1)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.save(sd, checkpoint_id="v1", storage_writer=ckptstore.StorageWriter(root))
    model2, optim2 = build(1)
    with FSDP.state_dict_type(model2, StateDictType.SHARDED_STATE_DICT):
        ck = {"model": model2.state_dict()}
        dcp.load(ck, checkpoint_id="v1", storage_reader=ckptstore.StorageReader(root))
        model2.load_state_dict(ck["model"])
        osd = load_sharded_optimizer_state_dict(model_state_dict=ck["model"], optimizer_key="optim",
                                                storage_reader=ckptstore.StorageReader(root, version="v1"))
        optim2.load_state_dict(FSDP.optim_state_dict_to_load(model2, optim2, osd["optim"]))
    params = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    s1, s2 = optim.state_dict()["state"], optim2.state_dict()["state"]
    state = s1.keys() == s2.keys() and all(torch.equal(s1[k][n], s2[k][n]) for k in s1 for n in s1[k])
    step(model, optim, 2)
    step(model2, optim2, 2)
    after = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    return params, state, after
