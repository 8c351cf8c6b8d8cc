"""Per-rank bodies for tests/test_async.py and tests/test_manager.py (module-level: spawned ranks import them)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import ckptstore

NUMEL = 1 << 20  # 4 MiB of float32 per save: big enough that saves overlap


def _load_values(root, version, rank, remote=None):
    tgt = {"x": torch.zeros(NUMEL), f"r{rank}": torch.zeros(1000)}
    dcp.load(tgt, checkpoint_id=version, storage_reader=ckptstore.StorageReader(root, remote=remote))
    return tgt


def overlapping_saves(rank, world, root, n, per_save_group=True):
    """n async saves through ONE writer, each started before the previous resolved; the training
    loop changes the tensors in place right after each call returns."""
    w = ckptstore.StorageWriter(root, threads=1)
    src = {"x": torch.zeros(NUMEL), f"r{rank}": torch.zeros(1000)}
    futs = []
    for i in range(n):
        pg = dist.new_group(backend="gloo") if per_save_group else None
        src["x"].fill_(float(i))
        src[f"r{rank}"].fill_(float(100 * i + rank))
        futs.append(dcp.async_save(src, checkpoint_id=f"s{i}", storage_writer=w, process_group=pg))
    errors = []
    for i, f in enumerate(futs):
        try:
            f.result()
        except BaseException as e:  # CheckpointException is a BaseException
            errors.append((i, str(e)[:300]))
    w.close()
    dist.barrier()
    got = {}
    for i in range(n):
        t = _load_values(root, f"s{i}", rank)
        got[i] = (
            torch.equal(t["x"], torch.full((NUMEL,), float(i))),
            torch.equal(t[f"r{rank}"], torch.full((1000,), float(100 * i + rank))),
        )
    return errors, got


def process_save_s3(rank, world, root, remote, version, kind, close=True):
    """async_save with durability='local' and a remote tier, then close(); returns the outcome."""
    w = ckptstore.StorageWriter(root, remote=remote, durability="local", upload_timeout=60)
    t = AsyncCheckpointerType.PROCESS if kind == "process" else AsyncCheckpointerType.THREAD
    sd = {"x": torch.arange(4096, dtype=torch.float32), f"r{rank}": torch.full((100,), float(rank))}
    out = {}
    try:
        dcp.async_save(sd, checkpoint_id=version, storage_writer=w, async_checkpointer_type=t).result()
        out["future"] = "ok"
    except BaseException as e:
        out["future"] = f"error: {type(e).__name__}: {str(e)[:400]}"
    t0 = time.monotonic()
    try:
        w.close()
        out["close"] = "ok"
    except BaseException as e:
        out["close"] = f"error: {type(e).__name__}: {str(e)[:600]}"
    out["close_s"] = time.monotonic() - t0
    return out


# ---- CheckpointManager ---------------------------------------------------------------------------
class Cursor:
    """A data-loader-like Stateful with per-rank state."""

    def __init__(self, rank):
        self.pos = 0
        self.rank = rank

    def state_dict(self):
        return {"pos": self.pos, "rank": self.rank}

    def load_state_dict(self, sd):
        self.pos, self.rank = sd["pos"], sd["rank"]


def make_state(rank, hidden=64):
    torch.manual_seed(0)  # the same model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)
    torch.manual_seed(1000 + rank)  # per-rank data order
    return {"model": model, "optim": optim, "sched": sched, "data": Cursor(rank)}


def train_step(state, world, hidden=64):
    model, optim = state["model"], state["optim"]
    x = torch.randn(16, hidden)
    loss = model(x).square().mean()
    optim.zero_grad()
    loss.backward()
    for p in model.parameters():  # data parallel by hand, on the DEFAULT group
        dist.all_reduce(p.grad)
        p.grad /= world
    optim.step()
    state["sched"].step()
    state["data"].pos += 16


def snapshot(state):
    return {
        "model": {k: v.clone() for k, v in state["model"].state_dict().items()},
        "optim": torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(state["model"], state["optim"]),
        "sched": dict(state["sched"].state_dict()),
        "data": state["data"].state_dict(),
        "rng": torch.get_rng_state().clone(),
    }


def same(a, b):
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape):
            return False
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))  # bit-exact
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def manager_loop(rank, world, root, steps, executor="thread", remote=None):
    """Save every step without waiting while the loop runs its own collectives on the default
    group; then every committed version must load."""
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    from ckptstore import CheckpointManager

    state = make_state(rank)
    infos = []
    mgr = CheckpointManager(root, remote=remote, interval_steps=1, executor=executor, per_rank_keys=("data",), on_save=infos.append, mtbf=6 * 3600, restart_s=60)
    blocked = []
    for step in range(1, steps + 1):
        train_step(state, world)
        dist.barrier()
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == world
        t0 = time.monotonic()
        mgr.save(step, state)
        blocked.append(time.monotonic() - t0)
    mgr.close()
    stats = mgr.stats()
    dist.barrier()
    from ckptstore import Store

    versions = [v.version for v in Store(root).versions()]
    steps_loaded = []
    for v in versions:
        tgt = make_state(rank)
        steps_loaded.append(mgr.restore(tgt, version=v))
    final = make_state(rank)
    got = CheckpointManager(root, per_rank_keys=("data",), save_rng=True).restore(final)
    return {
        "versions": versions, "loaded": steps_loaded, "latest_step": got, "data_pos": final["data"].pos,
        "data_rank": final["data"].rank, "stats_saves": stats["saves"], "advice": str(stats.get("advice")),
        "blocked": blocked, "infos": len(infos), "model_same": same(final["model"].state_dict(), state["model"].state_dict()),
    }


def killed_training(rank, world, root, kill_at):
    """Train with saves every step; record the exact state at every save; SIGKILL while the save of
    step ``kill_at`` is in flight."""
    import signal

    import torch.distributed.checkpoint.state_dict  # noqa: F401

    from ckptstore import CheckpointManager

    state = make_state(rank)
    mgr = CheckpointManager(root, interval_steps=1, per_rank_keys=("data",))
    os.makedirs(os.path.join(root, "ref"), exist_ok=True)
    for step in range(1, kill_at + 1):
        train_step(state, world)
        torch.save(snapshot(state), os.path.join(root, "ref", f"{step}.r{rank}.pt"))
        mgr.save(step, state)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    return True


def resumed_training(rank, world, root):
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    from ckptstore import CheckpointManager

    state = make_state(rank)
    torch.manual_seed(12345)  # restore must bring back the saved RNG state
    mgr = CheckpointManager(root, interval_steps=1, per_rank_keys=("data",))
    step = mgr.restore(state)
    ref = torch.load(os.path.join(root, "ref", f"{step}.r{rank}.pt"), weights_only=False)
    got = snapshot(state)
    mgr.close()
    return step, {k: same(got[k], ref[k]) for k in ref}


def node_local_roots(rank, world, base, phase):
    """Each rank its own root ``base/node<rank>`` (a node-local disk). ``phase="save"``: save step 1;
    ``phase="restore"``: restore, returning the error text when it raises."""
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    from ckptstore import CheckpointManager
    from ckptstore.errors import VersionNotFoundError

    state = make_state(rank)
    mgr = CheckpointManager(os.path.join(base, f"node{rank}"), state, per_rank_keys=("data",))
    try:
        if phase == "save":
            train_step(state, world)
            return mgr.save(1)
        try:
            return mgr.restore()
        except VersionNotFoundError as e:
            return f"VersionNotFoundError: {e}"
    finally:
        mgr.close()
