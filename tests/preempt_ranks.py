"""The training job of tests/test_preempt.py: per-rank bodies for ``run_ranks`` and, run as a script,
a ``torchrun`` worker (``python -m torch.distributed.run ... tests/preempt_ranks.py CONFIG.json``).

A small replicated model (DDP-like: every rank holds all of it, gradients are all-reduced on the
default group — the training loop's own collective), Adam, per-rank data drawn from the global
torch RNG (restored per rank by the manager) and a per-rank data position (``per_rank_keys``).
Every step's loss is recorded exactly (``float.hex``). :func:`reference` computes the same steps in
one process (both ranks' batches, the gradients summed as gloo sums two ranks), so a resumed run
can be compared bit for bit without running a third job.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import ckptstore

DIM = 16


class Position:
    """A data loader's position (a stateful object the manager saves per rank)."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = int(sd["pos"])


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh(), torch.nn.Linear(DIM, DIM))


def seed_rank(rank: int) -> None:
    torch.manual_seed(1000 + rank)


def _loss(model, rank: int, pos: int) -> torch.Tensor:
    x = torch.randn(8, DIM)  # the global RNG: comes back with the checkpoint
    y = torch.randn(8, DIM) + 0.01 * pos
    return torch.nn.functional.mse_loss(model(x), y)


def train(rank: int, world: int, root: str, cfg: dict) -> dict:
    """The loop of the README (5 lines) with a few test hooks; returns what happened on this rank."""
    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = Position()
    state = {"model": model, "optim": opt, "data": data}
    if cfg.get("big"):  # makes every save take a while: a signal lands while one is in flight
        state["big"] = torch.arange(cfg["big"], dtype=torch.float32) + rank * 0  # replicated: equal on every rank
    seed_rank(rank)
    losses: dict[int, str] = {}
    out: dict = {"rank": rank, "pid": os.getpid(), "losses": losses, "preempted": None}
    kill_at = {int(k): v for k, v in (cfg.get("kill_at") or {}).items()}
    sleep_at = {int(k): v for k, v in (cfg.get("sleep_at") or {}).items()}
    marks = cfg.get("marks")
    opts = dict(interval_steps=cfg.get("interval", 5), per_rank_keys=("data",), executor=cfg.get("executor", "thread"),
                progress_s=cfg.get("progress_s", 0.0), remote=cfg.get("remote"), durability=cfg.get("durability", "local"))
    if not cfg.get("collectives", True):  # the ranks' models diverge: save rank 0's copy
        opts["allow_divergent_replicas"] = True
    for k in ("grace_s", "save_on_signal"):
        if k in cfg:
            opts[k] = cfg[k]
    try:
        with ckptstore.CheckpointManager(root, state, **opts) as mgr:
            start = out["start"] = mgr.resume()
            if cfg.get("ignore_signal_rank") == rank:  # this rank never hears the signal
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            for step in range(start, cfg["steps"] + 1):
                if rank in sleep_at and sleep_at[rank][0] == step:  # a rank stuck in its step (a hung loader)
                    _mark(marks, rank, f"sleeping {step}")
                    time.sleep(sleep_at[rank][1])
                loss = _loss(model, rank, data.pos)
                opt.zero_grad()
                loss.backward()
                for p in model.parameters():
                    if world > 1 and cfg.get("collectives", True):
                        dist.all_reduce(p.grad)
                    p.grad /= world
                opt.step()
                data.pos += 1
                losses[step] = float(loss.item()).hex()
                if cfg.get("step_s"):
                    time.sleep(cfg["step_s"])
                if kill_at.get(rank) == step:
                    os.kill(os.getpid(), signal.SIGTERM)
                if cfg.get("crash_at") == step and rank == 1:  # a rank dies (a crash, not a preemption)
                    os.kill(os.getpid(), signal.SIGKILL)
                _mark(marks, rank, f"step {step}")
                mgr.save(step)
            out["finished"] = True
    except ckptstore.Preempted as e:
        out["preempted"] = {"step": e.step, "saved": e.saved, "version": e.version, "durability": e.durability,
                            "seconds": e.seconds, "code": e.code, "reason": e.reason, "message": str(e)}
        out["t_raised"] = time.time()
        if cfg.get("reraise"):
            _write(cfg, rank, out)
            raise
    _write(cfg, rank, out)
    return out


def _mark(path, rank: int, what: str) -> None:
    if path:
        with open(os.path.join(path, f"rank{rank}.marks"), "a") as f:
            f.write(f"{time.time()} {what}\n")


def _write(cfg: dict, rank: int, out: dict) -> None:
    if cfg.get("out"):
        with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
            json.dump(out, f)


def reference(world: int, steps: int) -> dict[int, list[str]]:
    """Per rank, the losses of an uninterrupted run of :func:`train` (computed in this process)."""
    threads = torch.get_num_threads()
    rng = torch.get_rng_state()
    torch.set_num_threads(1)
    try:
        model = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        rngs = []
        for r in range(world):
            seed_rank(r)
            rngs.append(torch.get_rng_state())
        out: dict[int, list[str]] = {r: [] for r in range(world)}
        for step in range(1, steps + 1):
            grads = []
            for r in range(world):
                torch.set_rng_state(rngs[r])
                opt.zero_grad()
                loss = _loss(model, r, step - 1)
                loss.backward()
                rngs[r] = torch.get_rng_state()
                grads.append([p.grad.clone() for p in model.parameters()])
                out[r].append(float(loss.item()).hex())
            for i, p in enumerate(model.parameters()):
                g = grads[0][i]
                for r in range(1, world):
                    g = g + grads[r][i]  # what gloo's all_reduce(SUM) gives for two ranks
                p.grad = g / world
            opt.step()
        return out
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)


def rank_train(rank: int, world: int, root: str, cfg: dict) -> dict:
    """``run_ranks`` entry."""
    return train(rank, world, root, cfg)


def _wrap(cfg_path: str) -> int:
    """Run the worker as a child and record its exit status and time (``rc.<RANK>.json``): torchrun
    does not report its workers' statuses after it forwarded a signal. The wrapper outlives the
    signal torchrun sends to the process group (a handler, not SIG_IGN: the child starts with the
    default disposition, as a worker would)."""
    import subprocess

    signal.signal(signal.SIGTERM, lambda *a: None)
    with open(cfg_path) as f:
        config = json.load(f)
    rc = subprocess.call([sys.executable, os.path.abspath(__file__), cfg_path])
    with open(os.path.join(config["out"], f"rc.{os.environ['RANK']}.json"), "w") as f:
        json.dump({"rc": rc, "t": time.time()}, f)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":  # a torchrun worker: python tests/preempt_ranks.py [--wrap] CONFIG.json
    if sys.argv[1] == "--wrap":
        sys.exit(_wrap(sys.argv[2]))
    with open(sys.argv[1]) as f:
        config = json.load(f)
    if "crash_at" in config:  # SIGKILL at this step in this torchrun restart (attempt)
        config["crash_at"] = config["crash_at"].get(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # a fresh key prefix per torchrun restart:
        import datetime  # the agent's store still holds the dead workers' gloo addresses (see ckptstore/demo/train.py)

        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                              is_master=False, timeout=datetime.timedelta(seconds=120))
        dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    try:
        train(r, w, config["root"], dict(config, reraise=True))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def two_managers(rank: int, world: int, root: str, cfg: dict) -> dict:
    """The README's two managers in one process: the model's (``step-``, every ``model_interval``
    steps) and the data loader's (``prefix="loader-"``, every step). Rank 0 sends itself SIGTERM after
    the training of step ``kill_at`` (None: no signal). Returns where each manager resumed and what
    the preemption saved."""
    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = Position()
    seed_rank(rank)
    out: dict = {"rank": rank, "preempted": None, "saved_by": []}
    common = dict(grace_s=cfg.get("grace_s", 30), save_on_signal=cfg.get("save_on_signal", "auto"), progress_s=0.0)
    try:
        with ckptstore.CheckpointManager(root, {"model": model, "optim": opt}, interval_steps=cfg.get("model_interval", 5),
                                         **common) as mm, \
                ckptstore.CheckpointManager(root, {"data": data}, prefix="loader-", per_rank_keys=("data",),
                                            save_rng=False, interval_steps=1, **common) as lm:
            out["model_start"], out["loader_start"] = mm.resume(), lm.resume()
            out["pos_start"] = data.pos
            for step in range(min(out["model_start"], out["loader_start"]), cfg["steps"] + 1):
                loss = _loss(model, rank, data.pos)
                opt.zero_grad()
                loss.backward()
                for p in model.parameters():
                    if world > 1:
                        dist.all_reduce(p.grad)
                    p.grad /= world
                opt.step()
                data.pos += 1
                if cfg.get("kill_at") == step and rank == 0:
                    os.kill(os.getpid(), signal.SIGTERM)
                for name, m in (("model", mm), ("loader", lm)):
                    if m.save(step) and m._preempt.preempted is not None:
                        out["saved_by"].append((name, step))
            out["finished"] = True
    except ckptstore.Preempted as e:
        out["preempted"] = {"step": e.step, "saved": e.saved, "version": e.version}
    return out
