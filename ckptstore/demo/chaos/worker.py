"""The training worker of ``ckptstore demo --chaos``: the demo's model, trained unattended.

``python -m ckptstore.demo.chaos.worker --config CFG`` runs :func:`main` (through ``clockexec``). The
model, data, optimizer and schedule are the demo's (:mod:`ckptstore.demo.train`); the loop is the one a
user writes to run without a person (README, "NaN and Inf: recorded, skipped, rolled back from"):

* ``resume()`` at start; ``save(step)`` at every step (async; due every ``save_every`` steps);
* a save that failed (a full disk, say) is logged and training goes on: ckptstore raises the error
  from the next ``save()`` (:class:`~ckptstore.errors.CkptStoreError`, never for a lost rank, which is
  :class:`~ckptstore.errors.JobBrokenError` and ends the process), so the loop catches it and calls
  ``save(step)`` again — every rank raises at the same call, since each learns of the failure from
  DCP's collective result;
* a non-finite all-reduced loss: the batch is added to the batches never trained on (kept in the
  checkpointed state, ``state["chaos"]["skip"]``), ``mgr.rollback()``, and the loop continues from the
  step it returns;
* a preemption (:class:`~ckptstore.errors.Preempted` out of ``save()``) ends the process with its code;
* the supervisor's stop file (the run's time is up), seen by any rank, stops every rank at the same
  step (one all-reduce per step), which is saved (forced) before ``close()``.

``checkpointer: "dcp"`` runs the same loop over stock DCP instead (:class:`StockDCP`: ``FileSystemWriter``
through ``dcp.async_save``, resume from the newest ``step-N`` folder that has ``.metadata``, as
torchtitan does); it has no rollback (a non-finite loss raises) and no preemption handler.

Every step event carries ``gen`` (a number rank 0 draws at start and broadcasts: the same on every rank of
one worker generation, whatever torchrun's per-node restart counts say), ``seg`` (rollbacks so far in this
process), ``b`` (the global batch index trained) and ``wd`` (an XXH3 digest of this rank's parameter shards
after the step), so :mod:`.timeline` can rebuild which steps survived and compare them with the reference.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import re
import shutil
import time
import traceback
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ... import errors

#: the supervisor's files in ``<run_dir>/chaos/``: the stop file, the inbox of requests to ranks, the corrupt samples
STOP, INBOX, CORRUPT = "stop", "inbox", "corrupt.json"


def control_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "chaos")


def next_batch_index(sampler) -> int:
    """The global index of the batch the sampler yields next (``GlobalBatchSampler``: epoch and cursor;
    a ragged tail moves to the next epoch)."""
    per = sampler.num_samples // sampler.global_batch
    if sampler.cursor + sampler.global_batch > sampler.num_samples:
        return (sampler.epoch + 1) * per
    return sampler.epoch * per + sampler.cursor // sampler.global_batch


def tensors_digest(tensors) -> str:
    """XXH3-64 (hex) over the bytes of ``tensors`` (their local shards for DTensors), in order."""
    import xxhash

    h = xxhash.xxh3_64()
    for t in tensors:
        if hasattr(t, "to_local"):
            t = t.to_local()
        t = t.detach().contiguous()
        if t.numel():
            h.update(t.view(torch.uint8).numpy() if t.dim() else t.reshape(1).view(torch.uint8).numpy())
    return h.hexdigest()


def model_digest(model) -> str:
    return tensors_digest(p for _n, p in sorted(model.named_parameters(), key=lambda x: x[0]))


def optim_digest(model, opt) -> str:
    out = []
    for _n, p in sorted(model.named_parameters(), key=lambda x: x[0]):
        st = opt.state.get(p, {})
        out.extend(st[k] for k in sorted(st) if torch.is_tensor(st[k]))
    return tensors_digest(out)


class Control:
    """The supervisor's side channel: the stop file and this rank's requests (a corrupt sample)."""

    def __init__(self, run_dir: str, rank: int, log) -> None:
        self.dir = control_dir(run_dir)
        self.rank = rank
        self.log = log
        os.makedirs(os.path.join(self.dir, INBOX), exist_ok=True)
        self.corrupt = set(self._read_corrupt())

    def _read_corrupt(self) -> list[int]:
        try:
            with open(os.path.join(self.dir, CORRUPT)) as f:
                return [int(x) for x in json.load(f)]
        except (OSError, ValueError):
            return []

    def stop_agreed(self) -> bool:
        """Whether any rank sees the stop file (a MAX all-reduce: every rank stops at the same step)."""
        flag = torch.tensor([1.0 if os.path.exists(os.path.join(self.dir, STOP)) else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _request(self, what: str) -> bool:
        p = os.path.join(self.dir, INBOX, f"{what}.r{self.rank}")
        try:
            os.rename(p, p + ".done")
            return True
        except OSError:
            return False

    def poison(self, ids: list[int]) -> list[int]:
        """Rows of this batch that are corrupt samples. On a ``nan`` request the first sample of this
        batch becomes corrupt for the rest of the run (recorded in ``corrupt.json``: a bad record in the
        data set, met again by any later attempt that reads it)."""
        if self._request("nan") and ids:
            self.corrupt = set(self._read_corrupt()) | {int(ids[0])}
            tmp = os.path.join(self.dir, f".{CORRUPT}.{os.getpid()}")
            with open(tmp, "w") as f:
                json.dump(sorted(self.corrupt), f)
            os.replace(tmp, os.path.join(self.dir, CORRUPT))
            self.log("corrupt_sample", sample=int(ids[0]))
        return [i for i, x in enumerate(ids) if int(x) in self.corrupt]


class ManagerCheckpointer:
    """``ckptstore.CheckpointManager`` (the demo's settings plus the run's: event log, retention, ...)."""

    name = "ckptstore"

    def __init__(self, cfg, state, log) -> None:
        from ..train import _manager

        self.log = log
        self.mgr = _manager(cfg, state, log)

    def version_name(self, step: int) -> str:
        return self.mgr.version_name(step)

    def resume(self) -> tuple[int, Any]:
        t0 = time.time()
        start = self.mgr.resume()
        r = self.mgr.last_restore
        if r is not None:
            self.log("resumed", version=r.version, step=r.step, saved_world_size=r.world_size,
                     rng_restored=r.rng_restored, reads=r.reads, skipped=_skipped(r), t0=t0, t1=time.time())
        return start, r

    def save(self, step: int, metadata: dict, force: bool = False) -> bool:
        """``mgr.save(step)``; an earlier save's failure (raised here) is logged and the call repeated."""
        for _ in range(4):
            try:
                return self.mgr.save(step, force=force, metadata=metadata)
            except errors.JobBrokenError:
                raise
            except errors.CkptStoreError as e:
                self.log("save_error", step=step, error=f"{type(e).__name__}: {e}"[:600])
        return False

    def rollback(self) -> tuple[int, Any]:
        t0 = time.time()
        for _ in range(4):
            try:
                nxt = self.mgr.rollback()
                break
            except (errors.JobBrokenError, errors.VersionNotFoundError):
                raise
            except errors.CkptStoreError as e:  # a failed save's error, raised by the wait for saves in flight
                self.log("save_error", step=None, error=f"{type(e).__name__}: {e}"[:600])
        else:
            raise errors.CkptStoreError("rollback failed four times")
        r = self.mgr.last_restore
        self.log("rollback", version=r.version, step=r.step, skipped=_skipped(r), t0=t0, t1=time.time())
        return nxt, r

    def close(self) -> None:
        try:
            self.mgr.close()
        except errors.CkptStoreError as e:  # e.g. uploads that could not finish: logged, the run is over
            self.log("close_error", error=str(e)[:600])


def _skipped(r) -> list[dict]:
    return [{"version": s.version, "kind": s.kind, "reason": str(s.reason)[:300]} for s in (r.skipped or [])]


class StockDCP:
    """The peer: stock DCP as torchtitan uses it (``components/checkpoint.py``). ``dcp.async_save`` with
    DCP's ``FileSystemWriter`` into ``FOLDER/step-N`` on a gloo group of its own; before the next save it
    waits for the previous one (an error there is raised: the job dies); rank 0 then removes the oldest
    ``step-N`` folders beyond ``keep_last`` (torchtitan's ``keep_latest_k``: every folder counts, complete
    or not); at start it loads the newest ``step-N`` folder that holds ``.metadata``. Model and optimizer
    through ``get_state_dict``/``set_state_dict``; scheduler, data loader, this rank's RNG states (pickled,
    under ``rng/rank{r}``) and the skipped batches as plain values. A non-finite loss raises: there is
    nothing to roll back with."""

    name = "dcp"
    _STEP = re.compile(r"step-(\d+)$")

    def __init__(self, cfg, state, log, rank: int, model, opt, sched, loader) -> None:
        self.cfg, self.state, self.log, self.rank = cfg, state, log, rank
        self.model, self.opt, self.sched, self.loader = model, opt, sched, loader
        self.folder = cfg["dcp_folder"]
        self.every = int(cfg["save_every"])
        self.keep = int(cfg.get("keep_last") or 0)
        self.pg = dist.new_group(backend="gloo")
        self.fut = None
        os.makedirs(self.folder, exist_ok=True)

    def version_name(self, step: int) -> str:
        return f"step-{step}"

    def _sd(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        rng = pickle.dumps((torch.get_rng_state(), random.getstate(), np.random.get_state()))
        return {"model": model_sd, "optim": optim_sd, "sched": self.sched.state_dict(), "data": self.loader.state_dict(),
                "chaos": {"skip": list(self.state["chaos"]["skip"])}, f"rng/rank{self.rank}": rng}

    def _steps(self, complete: bool) -> list[int]:
        out = []
        for name in os.listdir(self.folder):
            m = self._STEP.match(name)
            if m and (not complete or os.path.isfile(os.path.join(self.folder, name, ".metadata"))):
                out.append(int(m.group(1)))
        return sorted(out)

    def resume(self) -> tuple[int, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        steps = self._steps(complete=True)
        if not steps:
            return 1, None
        t0 = time.time()
        step = steps[-1]
        sd = self._sd()
        dcp.load(sd, checkpoint_id=os.path.join(self.folder, f"step-{step}"), process_group=self.pg)
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.sched.load_state_dict(sd["sched"])
        self.loader.load_state_dict(sd["data"])
        self.state["chaos"] = {"skip": list(sd["chaos"]["skip"])}
        rng = sd[f"rng/rank{self.rank}"]
        t_rng, py, npy = pickle.loads(rng.getvalue() if hasattr(rng, "getvalue") else rng)
        torch.set_rng_state(t_rng)
        random.setstate(py)
        np.random.set_state(npy)
        self.log("resumed", version=f"step-{step}", step=step, saved_world_size=None, rng_restored=True, reads={},
                 skipped=[], t0=t0, t1=time.time())
        return step + 1, _Restored(step)

    def save(self, step: int, metadata: dict, force: bool = False) -> bool:
        import torch.distributed.checkpoint as dcp

        if not (force or step % self.every == 0):
            return False
        self._wait()
        self.fut = dcp.async_save(self._sd(), checkpoint_id=os.path.join(self.folder, f"step-{step}"),
                                  process_group=self.pg)
        self.fut_step = step
        if self.keep and self.rank == 0:  # torchtitan's purge of the oldest step-N folders
            for old in self._steps(complete=False)[:-self.keep]:
                shutil.rmtree(os.path.join(self.folder, f"step-{old}"), ignore_errors=True)
        return True

    def _wait(self) -> None:
        """The previous save's future (torchtitan waits here before the next save; its error ends the job)."""
        if self.fut is not None:
            fut, self.fut = self.fut, None
            try:
                fut.result()
            except BaseException as e:
                self.log("save_done", step=self.fut_step, version=f"step-{self.fut_step}", ok=False,
                         error=f"{type(e).__name__}: {e}"[:600])
                raise
            self.log("save_done", step=self.fut_step, version=f"step-{self.fut_step}", ok=True, error=None)

    def rollback(self):
        raise FloatingPointError("non-finite loss; stock DCP has no rollback: the job stops here")

    def close(self) -> None:
        self._wait()


class _Restored:
    def __init__(self, step: int) -> None:
        self.step, self.rng_restored = step, True


def _started_up() -> float | None:
    """This process's start on the boot clock (``/proc/self/stat`` field 22, in clock ticks)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _broadcast_gen() -> int:
    """A number rank 0 draws and every rank receives: this worker generation's id."""
    g = torch.tensor([float(random.SystemRandom().getrandbits(50))], dtype=torch.float64)
    dist.broadcast(g, 0)
    return int(g.item())


def main(cfg: dict[str, Any]) -> int:
    from .. import train as T
    from ..._groups import exit_process

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    attempt = int(os.environ.get("CKPTSTORE_DEMO_ATTEMPT", "0")) * 1000 + restarts
    log = T.EventLog(os.path.join(cfg["run_dir"], "events", f"rank{rank}.a{attempt}.jsonl"), rank=rank, attempt=attempt,
                     pid=os.getpid())
    log("proc_start", t=T.T_PROC_START, up=_started_up(), pid=os.getpid(),
        world_size=world, node=T._node(), restart_count=restarts, faketime=os.environ.get("FAKETIME"))
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    T.init_process_group(rank, world, attempt)
    log.common["gen"] = _broadcast_gen()
    loader, ds, corpus_info = T._data(cfg, rank, world)
    model, nparams = T._model(cfg, world)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, T.lr_lambda(cfg["warmup"], cfg["steps"], cfg["min_lr_ratio"]))
    state = {"model": model, "optim": opt, "sched": sched, "data": loader,
             "meta": {"seed": cfg["seed"], "global_batch": cfg["global_batch"]},
             "chaos": {"skip": sorted(int(b) for b in cfg.get("skip_batches") or ())}}
    ckpt: Any
    if cfg.get("checkpointer") == "dcp":
        ckpt = StockDCP(cfg, state, log, rank, model, opt, sched, loader)
    else:
        ckpt = ManagerCheckpointer(cfg, state, log)
    log("init_done", params=nparams, corpus=corpus_info, samples=len(ds), checkpointer=ckpt.name)
    try:
        _loop(cfg, rank, world, model, opt, sched, loader, state, ckpt, Control(cfg["run_dir"], rank, log), log)
    except errors.Preempted as p:
        log("preempted", step=p.step, version=p.version, saved=p.saved, seconds=p.seconds, reason=p.reason)
        exit_process(int(p.code) if isinstance(p.code, int) else 143)
    except BaseException as e:  # noqa: BLE001 - the supervisor reads why a rank ended
        log("fatal", error=f"{type(e).__name__}: {e}"[:600])
        traceback.print_exc()
        exit_process(1)
    return 0


def _loop(cfg, rank, world, model, opt, sched, loader, state, ckpt, ctl: Control, log) -> None:
    from .. import train as T

    norm = cfg["global_batch"] * cfg["context"]
    sampler = loader.batch_sampler
    step, restored = ckpt.resume()
    skip = set(state["chaos"]["skip"]) | {int(b) for b in cfg.get("skip_batches") or ()}
    it = iter(loader)
    if restored is None or not restored.rng_restored:
        T.seed_rng(cfg["seed"] * 1000 + 7919 * step + rank)
    limit = cfg.get("max_steps")  # the reference run: exactly the chaos run's steps
    last_saved = restored.step if restored is not None else None
    seg = 0
    while limit is None or step <= limit:
        if limit is None and ctl.stop_agreed():
            log("stop", step=step - 1)
            break
        b = next_batch_index(sampler)
        while b in skip:  # batches the loop never trains on again (a corrupt sample)
            next(it)
            log("skip_batch", step=step, b=b)
            b = next_batch_index(sampler)
        gsum = T._train_step(step, it, model, opt, sched, cfg, world, log, poison=ctl.poison,
                             digest=lambda: model_digest(model), seg=seg, b=b)
        loss = gsum.item()
        tw0 = time.time()
        if ckpt.save(step, metadata={"loss": loss / norm if math.isfinite(loss) else None, "run": cfg.get("label", "")}):
            last_saved = step
            log("save", step=step, version=ckpt.version_name(step), wait0=tw0, wait1=tw0, t0=tw0, t1=time.time())
        if not math.isfinite(loss):
            skip.add(b)
            state["chaos"] = {"skip": sorted(skip)}
            log("nonfinite", step=step, b=b)
            step, r = ckpt.rollback()
            skip |= set(state["chaos"]["skip"])  # the restored state predates the decision: keep it
            state["chaos"] = {"skip": sorted(skip)}
            last_saved = r.step
            seg += 1
            it = iter(loader)
            continue
        step += 1
    last = step - 1
    if last >= 1 and last != last_saved:  # the step the run stopped at is its final state
        tw0 = time.time()
        if ckpt.save(last, metadata={"run": cfg.get("label", ""), "final": True}, force=True):
            log("save", step=last, version=ckpt.version_name(last), wait0=tw0, wait1=tw0, t0=tw0, t1=time.time())
    t0 = time.time()
    ckpt.close()
    log("done", step=last, t0=t0, t1=time.time(), od=optim_digest(model, opt), wd=model_digest(model))
    dist.barrier()


if __name__ == "__main__":
    import argparse

    from ..._groups import exit_process

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    with open(ap.parse_args().config) as f:
        _cfg = json.load(f)
    # not sys.exit: a gloo thread can abort the finalising interpreter (pytorch/pytorch #190489)
    exit_process(main(_cfg) or 0)
