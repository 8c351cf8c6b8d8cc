"""The per-rank training worker of the demo; ``torchrun`` launches it (``python -m ckptstore.demo.train``).

One process per rank: gloo, FSDP2 (``fully_shard``) or DDP on CPU, AdamW, a warmup+cosine
``LambdaLR``, ``torchdata``'s ``StatefulDataLoader`` over :class:`~.data.GlobalBatchSampler`.
Every ``save_every`` steps it checkpoints model, optimizer, scheduler, data loader, RNG states
and step with ``dcp.async_save(..., storage_writer=ckptstore.StorageWriter(...))``. At start it
resumes from ``Store(root).latest()`` if there is one. At the configured crash step (first
attempt only) the crash rank SIGKILLs itself right after ``async_save`` returned, i.e. while that
save is in flight.

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
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

from . import backend  # noqa: E402
from .data import ByteWindows, GlobalBatchSampler, collate, load_corpus  # noqa: E402
from .model import ByteGPT, count_params  # noqa: E402


class EventLog:
    """Append-only JSONL, one line per event, flushed immediately; thread-safe."""

    def __init__(self, path: str, **common: Any) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()
        self.common = common

    def __call__(self, kind: str, **kw: Any) -> None:
        kw.setdefault("t", time.time())
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


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    py = s["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(tuple(s["numpy"]))


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
    # async_save coordinates ranks from its background thread: give it its own group, so those
    # collectives never interleave with the training collectives on the default group.
    ckpt_pg = dist.new_group(backend="gloo")

    # ---- data --------------------------------------------------------------------------------
    from torchdata.stateful_dataloader import StatefulDataLoader

    corpus, corpus_info = load_corpus(cfg.get("corpus_dir"), cfg["corpus_max_bytes"])
    ds = ByteWindows(corpus, cfg["context"])
    G = cfg["global_batch"]
    sampler = GlobalBatchSampler(len(ds), G, rank, world, cfg["seed"])
    loader = StatefulDataLoader(
        ds,
        batch_sampler=sampler,
        num_workers=0,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(cfg["seed"]),  # keep the loader off the global RNG
    )

    # ---- model, optimizer, scheduler ----------------------------------------------------------
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
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg["warmup"], cfg["steps"], cfg["min_lr_ratio"]))

    root, remote = cfg["store_root"], cfg.get("remote")

    def full_state(step: int, with_rng: bool = True) -> dict[str, Any]:
        msd, osd = get_state_dict(model, opt)
        st = {
            "model": msd,
            "optim": osd,
            "sched": sched.state_dict(),
            "data": loader.state_dict(),
            "meta": {"step": step, "world_size": world, "seed": cfg["seed"], "global_batch": G},
        }
        if with_rng:  # per-rank: distinct keys, so DCP keeps every rank's copy
            st["rng"] = {f"rank{rank}": rng_state()}
        return st

    # ---- resume ------------------------------------------------------------------------------
    log("init_done", params=nparams, corpus=corpus_info, samples=len(ds))
    t_load0 = time.time()
    pick: list[Any] = [None]
    if rank == 0:
        rec = backend.latest(root, remote)
        pick = [None if rec is None else rec.version]
    dist.broadcast_object_list(pick, src=0)
    version = pick[0]
    start_step = 0
    rng_loaded = False
    if version is not None:
        cid, rd = backend.reader(root, remote, version, partial=True)
        meta = {"meta": {"step": 0, "world_size": 0, "seed": 0, "global_batch": 0}}
        dcp.load(meta, checkpoint_id=cid, storage_reader=rd)  # a partial load: just the metadata
        m = meta["meta"]
        if m["seed"] != cfg["seed"] or m["global_batch"] != G:
            raise SystemExit(f"checkpoint {version} was written with seed/global batch {m['seed']}/{m['global_batch']}")
        same_world = m["world_size"] == world
        st = full_state(0, with_rng=same_world)
        # on another world size the per-rank RNG states are left behind (reseeded instead)
        cid, rd = backend.reader(root, remote, version, partial=not same_world)
        dcp.load(st, checkpoint_id=cid, storage_reader=rd)
        set_state_dict(model, opt, model_state_dict=st["model"], optim_state_dict=st["optim"])
        sched.load_state_dict(st["sched"])
        loader.load_state_dict(st["data"])
        start_step = int(st["meta"]["step"])
        if same_world:
            rng_state_loaded = st["rng"][f"rank{rank}"]
            rng_loaded = True
        log("resumed", version=version, step=start_step, world_size=world, saved_world_size=m["world_size"], rng_restored=same_world,
            t0=t_load0, t1=time.time())
    it = iter(loader)
    # RNG last, after everything that might draw from it
    if rng_loaded:
        set_rng_state(rng_state_loaded)
    else:
        seed_rng(cfg["seed"] * 1000 + 7919 * (start_step + 1) + rank)

    # ---- train -------------------------------------------------------------------------------
    T = cfg["context"]
    pending = None
    crash_step = cfg.get("crash_step")
    for step in range(start_step + 1, cfg["steps"] + 1):
        t0 = time.time()
        c0 = time.thread_time()
        ids, x = next(it)
        logits = model(x[:, :-1])
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
        )
        if step % cfg["save_every"] == 0 or step == cfg["steps"]:
            tw0 = time.time()
            if pending is not None:  # back-pressure: one save in flight at a time
                pending.result()
            tw1 = time.time()
            state = full_state(step)
            # user metadata travels in the manifest: `ckptstore gc --keep-best N --metric loss` can use it
            cid, wr = backend.writer(root, remote, step, {"loss": gsum.item() / (G * T), "run": cfg.get("label", "")})
            pending = dcp.async_save(state, checkpoint_id=cid, storage_writer=wr, process_group=ckpt_pg)
            del state
            ts1 = time.time()
            log("save", step=step, version=backend.version_name(step), wait0=tw0, wait1=tw1, t0=tw1, t1=ts1)

            def _done(f, step=step):
                err = f.exception()
                log("save_done", step=step, version=backend.version_name(step), ok=err is None, error=None if err is None else repr(err))

            pending.add_done_callback(_done)
            if attempt == 0 and crash_step == step and rank == cfg["crash_rank"]:
                log("crash", step=step, version=backend.version_name(step))
                os.kill(os.getpid(), signal.SIGKILL)
    t_fin0 = time.time()
    if pending is not None:
        pending.result()
    dist.barrier()
    log("done", t0=t_fin0, t1=time.time())
    dist.destroy_process_group()
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
