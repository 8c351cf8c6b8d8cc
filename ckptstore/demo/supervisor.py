"""Run the demo's training jobs under ``torchrun`` and watch them.

A *job* is one training run with its own directory (``config.json``, ``events/``, ``store/``,
``torchrun.log``). The reference job runs clean. The crash job runs with a crash step: one rank
SIGKILLs itself mid-save, and ``torchrun --max-restarts=1`` restarts the worker group, which
resumes from ``Store.latest()``. To resume on a *different* world size the supervisor instead
lets that first ``torchrun`` fail and launches a second one with ``--nproc-per-node=N`` (torchrun
cannot change the group size on restart); the workers resume the same way.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console


@dataclass
class DemoConfig:
    # model (~3.3M parameters at the defaults)
    layers: int = 4
    d_model: int = 256
    heads: int = 4
    context: int = 128
    dropout: float = 0.1
    # optimisation
    global_batch: int = 12
    steps: int = 180
    lr: float = 1e-3
    warmup: int = 15
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1234
    parallel: str = "fsdp"  # or "ddp"
    # data
    corpus_dir: str | None = None
    corpus_max_bytes: int = 4 << 20
    # checkpointing and the fault
    save_every: int = 20
    crash_step: int = 120
    crash_rank: int = 1
    world_size: int = 2
    resume_world_size: int | None = None  # None: restart on world_size
    remote: str | None = None


@dataclass
class Launch:
    nproc: int
    t0: float
    t1: float = 0.0
    rc: int | None = None
    max_restarts: int = 0


@dataclass
class Job:
    label: str
    run_dir: str
    store_root: str
    remote: str | None
    crash: bool
    launches: list[Launch] = field(default_factory=list)

    @property
    def t0(self) -> float:
        return self.launches[0].t0

    @property
    def t1(self) -> float:
        return self.launches[-1].t1

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return d


def job_dir(out: str, label: str) -> str:
    return os.path.join(os.path.abspath(out), label)


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    # quiet a deprecation warning torchdata emits on every loader construction
    env.setdefault("PYTHONWARNINGS", "ignore::UserWarning")
    return env


def _torchrun_cmd(nproc: int, max_restarts: int, cfg_path: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone",  # c10d rendezvous on a free loopback port
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        "-m", "ckptstore.demo.train",
        "--config", cfg_path,
    ]


class _Follower:
    """Tails rank 0's event files to show progress and the notable events as they happen."""

    def __init__(self, run_dir: str, console: Console, label: str, total: int) -> None:
        self.run_dir = run_dir
        self.console = console
        self.label = label
        self.total = total
        self.pos: dict[str, int] = {}
        self.step = 0
        self.last_print = 0.0

    def poll(self) -> None:
        new: list[dict[str, Any]] = []
        for path in sorted(glob.glob(os.path.join(self.run_dir, "events", "rank*.a*.jsonl"))):
            with open(path, "rb") as f:
                f.seek(self.pos.get(path, 0))
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1  # only consume complete lines
            self.pos[path] = self.pos.get(path, 0) + end
            for line in chunk[:end].decode(errors="replace").splitlines():
                try:
                    new.append(json.loads(line))
                except ValueError:
                    pass
        for e in sorted(new, key=lambda e: e["t"]):
            self._event(e)

    def _say(self, msg: str) -> None:
        self.console.print(f"  [dim]{self.label}[/dim] {msg}", highlight=False)

    def _event(self, e: dict[str, Any]) -> None:
        k = e["kind"]
        if k == "crash":
            self._say(f"[bold red]rank {e['rank']} SIGKILLs itself at step {e['step']}, right after async_save({e['version']}) returned: that save is in flight[/bold red]")
        if e.get("rank") != 0:
            return
        if k == "step":
            self.step = e["step"]
            if e["step"] % 10 == 0 or e["step"] == self.total:
                self._say(f"attempt {e['attempt']} step {e['step']:>4}/{self.total}  loss {e['mean']:.4f}")
        elif k == "save":
            self._say(f"async_save {e['version']} (blocked {1000 * (e['t1'] - e['wait0']):.0f} ms)")
        elif k == "save_done" and not e["ok"]:
            self._say(f"[yellow]save {e['version']} did not complete on rank 0 (its peer died)[/yellow]")
        elif k == "resumed":
            self._say(
                f"[bold green]attempt {e['attempt']} on {e.get('world_size', '?')} rank(s) resumed from {e['version']}"
                f" (step {e['step']}, saved by {e['saved_world_size']} ranks)[/bold green]"
            )


def run_job(cfg: DemoConfig, out: str, label: str, *, crash: bool, console: Console) -> Job:
    run_dir = job_dir(out, label)
    os.makedirs(run_dir, exist_ok=True)
    remote = None if not cfg.remote else cfg.remote.rstrip("/") + "/" + label
    job = Job(label, run_dir, os.path.join(run_dir, "store"), remote, crash)
    train_cfg = asdict(cfg)
    train_cfg.update(run_dir=run_dir, store_root=job.store_root, remote=remote, label=label)
    if not crash:
        train_cfg["crash_step"] = None
    cfg_path = os.path.join(run_dir, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(train_cfg, f, indent=2)

    plan: list[tuple[int, int]]  # (nproc, max_restarts) per torchrun launch
    if crash and cfg.resume_world_size not in (None, cfg.world_size):
        plan = [(cfg.world_size, 0), (cfg.resume_world_size, 0)]
    elif crash:
        plan = [(cfg.world_size, 1)]
    else:
        plan = [(cfg.world_size, 0)]

    follower = _Follower(run_dir, console, label, cfg.steps)
    log_path = os.path.join(run_dir, "torchrun.log")
    env = _worker_env()
    for i, (nproc, restarts) in enumerate(plan):
        env_i = dict(env, CKPTSTORE_DEMO_ATTEMPT=str(i))
        launch = Launch(nproc=nproc, t0=time.time(), max_restarts=restarts)
        job.launches.append(launch)
        if i:
            console.print(f"  [dim]{label}[/dim] supervisor: relaunching torchrun on {nproc} rank(s)", highlight=False)
        with open(log_path, "a") as logf:
            logf.write(f"\n===== launch {i}: {' '.join(_torchrun_cmd(nproc, restarts, cfg_path))}\n")
            logf.flush()
            p = subprocess.Popen(_torchrun_cmd(nproc, restarts, cfg_path), stdout=logf, stderr=subprocess.STDOUT, env=env_i)
            while p.poll() is None:
                follower.poll()
                time.sleep(0.2)
        launch.t1 = time.time()
        launch.rc = p.returncode
        follower.poll()
        last = i == len(plan) - 1
        if last and p.returncode != 0:
            tail = open(log_path, errors="replace").read()[-4000:]
            console.print(f"[red]torchrun failed (exit {p.returncode}); tail of {log_path}:[/red]\n{tail}", highlight=False)
            raise SystemExit(f"{label} run failed")
        if not last and p.returncode == 0:
            raise SystemExit(f"{label}: the first launch finished without crashing; is crash_step <= steps?")
    with open(os.path.join(run_dir, "job.json"), "w") as f:
        json.dump(job.to_json(), f, indent=2)
    return job


def load_job(run_dir: str) -> Job:
    with open(os.path.join(run_dir, "job.json")) as f:
        d = json.load(f)
    d["launches"] = [Launch(**x) for x in d["launches"]]
    return Job(**d)
