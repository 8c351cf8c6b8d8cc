"""The per-rank training worker of the demo; ``torchrun`` launches it (``python -m ckptstore.demo.train``).

One process per rank: gloo, FSDP2 (``fully_shard``) or DDP on CPU, AdamW, a warmup+cosine
``LambdaLR``, ``torchdata``'s ``StatefulDataLoader`` over :class:`~.data.GlobalBatchSampler`.
Checkpoints go through :class:`ckptstore.CheckpointManager`: every ``save_every`` steps (and at the
last step) ``mgr.save(step)`` stages model, optimizer, scheduler, data loader, per-rank RNG states
and the run's settings and saves them asynchronously (on the manager's own gloo group). At start
``mgr.resume()`` loads the newest version every rank can load, if there is one. At the configured
crash step (first attempt only) the crash rank SIGKILLs itself right after ``mgr.save`` returned,
i.e. while that save is in flight; in a multi-node run (``nodes`` > 1) every rank of the crash
rank's node does, after SIGKILLing its node agent (the whole simulated node dies).

The local root is the config's ``store_root``; in a multi-node run each simulated node has its own
directory, ``node_roots[GROUP_RANK]`` (a node-local disk: the ranks of node k share it, no other
rank sees it). With ``replicas`` F > 0 the manager also copies each node's part of every version to
F other nodes' roots (``durability="replicated"``: a save commits once they are in place), so a
node whose root was wiped resumes from the peers' replicas.

Everything the verifier and the goodput report need is appended, one JSON object a line, to
``<run_dir>/events/rank<R>.a<ATTEMPT>.jsonl`` and flushed at once (it survives SIGKILL): per step
the loss (exact, as ``float.hex``), the sample ids, and wall-clock time stamps.
"""

from __future__ import annotations

import time

T_PROC_START = time.time()  # before the heavy imports: they are part of restart cost

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ckptstore  # noqa: E402

from .data import ByteWindows, GlobalBatchSampler, collate, load_corpus  # noqa: E402
from .model import ByteGPT, count_params  # noqa: E402


def uptime() -> float | None:
    """Seconds since boot from ``/proc/uptime`` (10 ms resolution), None where there is none: the
    kernel's clock, which neither a host clock that jumps nor libfaketime (``ckptstore demo --chaos``,
    fault ``clock-jump``) moves, and which every process of one host shares."""
    try:
        with open("/proc/uptime", "rb") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class EventLog:
    """Append-only JSONL, one line per event, flushed immediately; thread-safe. Every line carries
    ``t`` (this process's wall clock) and ``up`` (:func:`uptime`, the host's boot clock)."""

    def __init__(self, path: str, **common: Any) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()
        self.common = common

    def __call__(self, kind: str, **kw: Any) -> None:
        kw.setdefault("t", time.time())
        kw.setdefault("up", uptime())
        line = json.dumps({"kind": kind, **self.common, **kw}, separators=(",", ":"))
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()

    def close(self) -> None:
        self._f.close()


def lr_lambda(warmup: int, total: int, min_ratio: float):
    def f(step: int) -> float:  # step = number of scheduler.step() calls so far
        if step < warmup:
            return (step + 1) / warmup
        p = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))

    return f


def seed_rng(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % (2**32))


def init_process_group(rank: int, world: int, attempt: int) -> None:
    """gloo on the torchrun store, under a per-attempt key prefix.

    After ``torchrun --max-restarts`` restarts the workers, they reconnect to the *same* agent
    TCPStore, which still holds the gloo addresses the dead workers published; without a fresh
    prefix the new workers may read those and fail with "connectFullMesh ... Connection refused".
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
            timeout=datetime.timedelta(seconds=120),
        )
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(f"ckptstore-demo/attempt-{attempt}", store), rank=rank, world_size=world
        )
    else:
        dist.init_process_group("gloo")


def _node() -> int:
    """This rank's (simulated) node: ``CKPTSTORE_DEMO_NODE`` (``demo --chaos`` names each node agent's
    machine: a node that rejoins a rendezvous may get another GROUP_RANK, never another disk), else
    torchrun's GROUP_RANK, 0 on a single node."""
    return int(os.environ.get("CKPTSTORE_DEMO_NODE") or os.environ.get("GROUP_RANK", "0"))


def _crashes(rank: int, cfg: dict[str, Any]) -> bool:
    """Whether this rank dies at the crash step: the crash rank, or in a multi-node run every rank
    on the crash rank's node (ranks are numbered node by node: ``world // nodes`` per node)."""
    nodes = cfg.get("nodes", 1)
    if nodes <= 1:
        return rank == cfg["crash_rank"]
    per_node = cfg["world_size"] // nodes
    return _node() == cfg["crash_rank"] // per_node


def _data(cfg: dict[str, Any], rank: int, world: int):
    """This rank's ``StatefulDataLoader`` over the corpus (its own generator, off the global RNG),
    the dataset, and the corpus' description."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    corpus, corpus_info = load_corpus(cfg.get("corpus_dir"), cfg["corpus_max_bytes"])
    ds = ByteWindows(corpus, cfg["context"])
    sampler = GlobalBatchSampler(len(ds), cfg["global_batch"], rank, world, cfg["seed"])
    loader = StatefulDataLoader(
        ds,
        batch_sampler=sampler,
        num_workers=0,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(cfg["seed"]),  # keep the loader off the global RNG
    )
    return loader, ds, corpus_info


def _model(cfg: dict[str, Any], world: int):
    """The model, identically initialised on every rank, wrapped in FSDP2 or DDP; its parameter count."""
    torch.manual_seed(cfg["seed"])  # identical init on every rank
    model = ByteGPT(cfg["layers"], cfg["d_model"], cfg["heads"], cfg["context"], cfg["dropout"])
    nparams = count_params(model)
    if cfg["parallel"] == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    model.train()
    return model, nparams


def _manager(cfg: dict[str, Any], state: dict[str, Any], log: EventLog) -> ckptstore.CheckpointManager:
    """The checkpoint manager of this rank: it owns a gloo group for DCP's collectives, so its saves
    never interleave with the training loop's all_reduce on the default group."""
    root = cfg["node_roots"][_node()] if cfg.get("node_roots") else cfg["store_root"]

    def saved(info: ckptstore.SaveInfo) -> None:  # on the manager's thread, at commit (or failure)
        log("save_done", step=info.step, version=info.version, ok=info.error is None, error=info.error,
            local_commit_s=info.local_commit_s, remote_commit_s=info.remote_commit_s)

    extra: dict[str, Any] = dict(cfg.get("manager") or {})  # ckptstore demo --chaos: event_log, incremental, ...
    if cfg.get("keep_last"):
        from ckptstore.retention import KeepLast, RetentionPolicy

        extra["retention"] = RetentionPolicy([KeepLast(int(cfg["keep_last"]))])
    return ckptstore.CheckpointManager(
        root, state, remote=cfg.get("remote"), interval_steps=cfg["save_every"],
        on_save=saved,
        # --resume-world-size: the restarted job loads the crashed job's versions resharded, on purpose
        reshard=cfg.get("resume_world_size") not in (None, cfg["world_size"]),
        # --replicas F: each node's part is also copied to F other nodes' roots; a save commits once
        # its replicas are in place, so a node lost later costs no committed version
        **({"replicas": cfg["replicas"], "durability": "replicated"} if cfg.get("replicas") else {}),
        **extra,
    )


def _resume(mgr: ckptstore.CheckpointManager, state: dict[str, Any], cfg: dict[str, Any], log: EventLog,
            world: int):
    """``mgr.resume()``: model, optimizer, scheduler, loader, this rank's RNG (same world size).
    Returns the last step already trained and the restore (None: a fresh start)."""
    t_load0 = time.time()
    start = mgr.resume()
    r = mgr.last_restore
    if r is not None:
        m = state["meta"]
        if m["seed"] != cfg["seed"] or m["global_batch"] != cfg["global_batch"]:
            raise SystemExit(f"checkpoint {r.version} was written with seed/global batch {m['seed']}/{m['global_batch']}")
        log("resumed", version=r.version, step=r.step, world_size=world, saved_world_size=r.world_size,
            rng_restored=r.rng_restored, reads=r.reads, t0=t_load0, t1=time.time())
    return start - 1, r


def _train_step(step: int, it, model, opt, sched, cfg: dict[str, Any], world: int, log: EventLog,
                poison=None, digest=None, **fields: Any):
    """One optimizer step on the next batch of ``it``; logs the step (losses exact, as ``float.hex``, and
    ``fields``). Returns the all-reduced summed token loss. ``demo --chaos`` adds ``poison(ids)`` (fault
    ``nan``: the rows of this batch whose logits get a NaN, as a corrupt sample's forward pass would) and
    ``digest()`` (logged as ``wd``: the weights after the step, taken after ``t1``)."""
    G, T = cfg["global_batch"], cfg["context"]
    t0 = time.time()
    c0 = time.thread_time()
    ids, x = next(it)
    logits = model(x[:, :-1])
    rows = poison(ids) if poison is not None else ()
    if rows:  # NaN in one logit of each corrupt sample: the loss, every gradient, then the weights
        bad = torch.zeros_like(logits)
        bad[list(rows), 0, 0] = float("nan")
        logits = logits + bad
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
    # gradients are averaged over ranks: scale so the result is d(global mean loss) for any W
    (loss_sum * (world / (G * T))).backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
    if hasattr(gnorm, "full_tensor"):
        gnorm = gnorm.full_tensor()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    gsum = loss_sum.detach().clone()
    dist.all_reduce(gsum)
    t1 = time.time()
    if digest is not None:
        fields["wd"] = digest()
    log(
        "step",
        cpu=time.thread_time() - c0,  # this thread's CPU time: the step's cost on an idle machine
        step=step,
        loss=float(loss_sum.item()).hex(),  # this rank's summed token loss, exact
        gloss=float(gsum.item()).hex(),  # all ranks' sum, exact
        mean=gsum.item() / (G * T),
        lr=sched.get_last_lr()[0],
        gnorm=float(gnorm),
        ids=ids,
        t0=t0,
        t1=t1,
        **fields,
    )
    return gsum


def _crash(mgr: ckptstore.CheckpointManager, step: int, cfg: dict[str, Any], log: EventLog) -> None:
    """Die while the save of ``step`` is in flight: SIGKILL this rank (in a multi-node run, its node
    agent first: the whole node dies)."""
    if cfg.get("nodes", 1) > 1:
        log("crash", step=step, version=mgr.version_name(step), node=_node())
        os.kill(os.getppid(), signal.SIGKILL)
    else:
        log("crash", step=step, version=mgr.version_name(step))
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args(argv)
    with open(args.config) as f:
        cfg = json.load(f)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("CKPTSTORE_DEMO_ATTEMPT", "0")) + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = EventLog(os.path.join(cfg["run_dir"], "events", f"rank{rank}.a{attempt}.jsonl"), rank=rank, attempt=attempt)
    log("proc_start", t=T_PROC_START, pid=os.getpid(), world_size=world)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    init_process_group(rank, world, attempt)

    loader, ds, corpus_info = _data(cfg, rank, world)
    model, nparams = _model(cfg, world)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg["warmup"], cfg["steps"], cfg["min_lr_ratio"]))
    state = {
        "model": model, "optim": opt, "sched": sched, "data": loader,
        "meta": {"seed": cfg["seed"], "global_batch": cfg["global_batch"]},  # checked on resume
    }
    mgr = _manager(cfg, state, log)

    log("init_done", params=nparams, corpus=corpus_info, samples=len(ds))
    start_step, restored = _resume(mgr, state, cfg, log, world)
    it = iter(loader)
    if restored is None or not restored.rng_restored:  # on another world size the per-rank RNG states stay behind
        seed_rng(cfg["seed"] * 1000 + 7919 * (start_step + 1) + rank)
    norm = cfg["global_batch"] * cfg["context"]
    for step in range(start_step + 1, cfg["steps"] + 1):
        gsum = _train_step(step, it, model, opt, sched, cfg, world, log)
        tw0 = time.time()
        # async: returns once the state is staged in host memory (waits only when the previous
        # save has not started yet); a no-op on steps that are not due
        if mgr.save(step, force=step == cfg["steps"], metadata={"loss": gsum.item() / norm, "run": cfg.get("label", "")}):
            ts1 = time.time()
            log("save", step=step, version=mgr.version_name(step), wait0=tw0, wait1=tw0, t0=tw0, t1=ts1)
            if attempt == 0 and cfg.get("crash_step") == step and _crashes(rank, cfg):
                _crash(mgr, step, cfg, log)
    t_fin0 = time.time()
    mgr.close()  # waits for the last save (and its upload); raises if one failed
    dist.barrier()
    log("done", t0=t_fin0, t1=time.time())
    dist.destroy_process_group()
    log.close()
    return 0


if __name__ == "__main__":
    from .._groups import exit_process

    # not sys.exit: a gloo thread can abort the finalising interpreter of a rank that did its work
    # (pytorch/pytorch #190489); an exception from main() still exits non-zero with its traceback
    exit_process(main())
