"""Run the demo's training jobs under ``torchrun`` and watch them.

A *job* is one training run with its own directory (``config.json``, ``events/``, ``store/``,
``torchrun.log``). The reference job runs clean. The crash job runs with a crash step: one rank
SIGKILLs itself mid-save, and ``torchrun --max-restarts=1`` restarts the worker group, which
resume with ``CheckpointManager.resume()`` (the newest version every rank can load). To resume on a *different* world size the supervisor instead
lets that first ``torchrun`` fail and launches a second one with ``--nproc-per-node=N`` (torchrun
cannot change the group size on restart); the workers resume the same way.

**Multi-node** (``nodes`` > 1, ``ckptstore demo --nodes 2``): the job runs as that many simulated
nodes on this host, one ``torchrun`` node agent each (``--nnodes=N``, c10d rendezvous on
127.0.0.1, the first agent hosts the store), and node k's ranks (``GROUP_RANK`` k) use their own
local root ``<run_dir>/node<k>/store``: a node-local disk no other node sees; the remote tier, if
any, is shared. At the crash step every rank of the crash rank's node SIGKILLs its agent and
itself (the node is gone mid-save); the other nodes' ranks then fail on their next collective and
their agents exit. The supervisor waits for that (terminating agents still up after
``NODE_GRACE_S``) and relaunches all node agents on a fresh rendezvous, as a scheduler would with
a replacement node that gets the same disk back; the workers resume with
``CheckpointManager.resume()``.

**A replaced node** (``replicas`` > 0, ``ckptstore demo --nodes 2 --replicas 1``; or
``replace_node``): before the relaunch the supervisor removes the dead node's local root, as a new
machine with an empty disk would come up. The workers' managers copy each node's part of every
version to ``replicas`` other nodes' roots (``CheckpointManager(replicas=F)``), so the job resumes
from the peers' replicas (no S3 read) and re-replicates the restored version to the new node.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .. import events

if TYPE_CHECKING:  # annotations only: the ``ckptstore`` command line imports this module without rich
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
    nodes: int = 1  # simulated nodes, each with its own local root (world_size // nodes ranks each)
    replicas: int = 0  # CheckpointManager(replicas=F): each node's part also on F other nodes' roots
    # multi-node crash run: the dead node comes back as a new machine, its local root empty (wiped
    # before the relaunch); None: exactly when replicas > 0
    replace_node: bool | None = None

    def replaces_node(self) -> bool:
        return self.nodes > 1 and (self.replicas > 0 if self.replace_node is None else self.replace_node)


@dataclass
class Launch:
    nproc: int
    t0: float
    t1: float = 0.0
    rc: int | None = None
    max_restarts: int = 0
    node_rcs: list[int] = field(default_factory=list)  # exit code of each node agent (multi-node)


@dataclass
class Job:
    label: str
    run_dir: str
    store_root: str
    remote: str | None
    crash: bool
    launches: list[Launch] = field(default_factory=list)
    node_roots: list[str] = field(default_factory=list)  # multi-node: node k's local root
    wiped_root: str | None = None  # replaced node: the local root removed before the relaunch

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


NODE_GRACE_S = 60.0  # after a node died: how long the other agents get to notice and exit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_agent_cmd(node: int, nodes: int, nproc: int, port: int, rdzv_id: str, cfg_path: str) -> list[str]:
    """One simulated node's ``torchrun`` agent: c10d rendezvous on loopback; node 0 hosts its store."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf=is_host={int(node == 0)},join_timeout=120",
        "--local-addr=127.0.0.1",
        "--max-restarts=0",
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
        self.crashed = False

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
        if k == "crash" and "node" in e and not self.crashed:
            self.crashed = True
            self._say(f"[bold red]node {e['node']} dies at step {e['step']}: its ranks SIGKILL their torchrun agent and "
                      f"themselves right after mgr.save({e['version']}) returned: that save is in flight[/bold red]")
        elif k == "crash" and "node" not in e:
            self._say(f"[bold red]rank {e['rank']} SIGKILLs itself at step {e['step']}, right after mgr.save({e['version']}) returned: that save is in flight[/bold red]")
        if e.get("rank") != 0:
            return
        if k == "step":
            self.step = e["step"]
            if e["step"] % 10 == 0 or e["step"] == self.total:
                self._say(f"attempt {e['attempt']} step {e['step']:>4}/{self.total}  loss {e['mean']:.4f}")
        elif k == "save":
            self._say(f"mgr.save {e['version']} (blocked {1000 * (e['t1'] - e['wait0']):.0f} ms)")
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
    node_roots = [os.path.join(run_dir, f"node{n}", "store") for n in range(cfg.nodes)] if cfg.nodes > 1 else []
    job = Job(label, run_dir, node_roots[0] if node_roots else os.path.join(run_dir, "store"), remote, crash,
              node_roots=node_roots)
    train_cfg = asdict(cfg)
    train_cfg.update(run_dir=run_dir, store_root=job.store_root, remote=remote, label=label, node_roots=node_roots)
    if not crash:
        train_cfg["crash_step"] = None
    cfg_path = os.path.join(run_dir, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(train_cfg, f, indent=2)

    plan: list[tuple[int, int]]  # (nproc, max_restarts) per torchrun launch
    if crash and cfg.resume_world_size not in (None, cfg.world_size):
        plan = [(cfg.world_size, 0), (cfg.resume_world_size, 0)]
    elif crash and cfg.nodes > 1:
        plan = [(cfg.world_size, 0), (cfg.world_size, 0)]  # the supervisor relaunches all nodes
    elif crash:
        plan = [(cfg.world_size, 1)]
    else:
        plan = [(cfg.world_size, 0)]

    follower = _Follower(run_dir, console, label, cfg.steps)
    env = _worker_env()
    # the launcher's markers in the event log rank 0's manager appends to: `ckptstore goodput`
    # counts start-up (launch -> first step) and shutdown (-> exit) as a scheduler sees them
    elog = os.path.join(job.store_root, events.LOG_NAME)
    for i, (nproc, restarts) in enumerate(plan):
        env_i = dict(env, CKPTSTORE_DEMO_ATTEMPT=str(i))
        if i == 0:
            events.append(elog, "launch", label=label, nproc=nproc)
        launch = Launch(nproc=nproc, t0=time.time(), max_restarts=restarts)
        job.launches.append(launch)
        if i and crash and cfg.replaces_node() and job.wiped_root is None:
            job.wiped_root = replace_node(cfg, node_roots, label, console)
        if i:
            what = f"all {cfg.nodes} nodes" if cfg.nodes > 1 else f"torchrun on {nproc} rank(s)"
            console.print(f"  [dim]{label}[/dim] supervisor: relaunching {what}", highlight=False)
        if cfg.nodes > 1:
            log_path = _run_nodes(cfg, run_dir, label, i, cfg_path, env_i, launch, follower, console)
        else:
            log_path = os.path.join(run_dir, "torchrun.log")
            with open(log_path, "a") as logf:
                logf.write(f"\n===== launch {i}: {' '.join(_torchrun_cmd(nproc, restarts, cfg_path))}\n")
                logf.flush()
                p = subprocess.Popen(_torchrun_cmd(nproc, restarts, cfg_path), stdout=logf, stderr=subprocess.STDOUT, env=env_i)
                while p.poll() is None:
                    follower.poll()
                    time.sleep(0.2)
            launch.rc = p.returncode
        launch.t1 = time.time()
        follower.poll()
        last = i == len(plan) - 1
        if last:
            events.append(elog, "exit", label=label, rc=launch.rc)
        if last and launch.rc != 0:
            tail = open(log_path, errors="replace").read()[-4000:]
            console.print(f"[red]torchrun failed (exit {launch.rc}); tail of {log_path}:[/red]\n{tail}", highlight=False)
            raise SystemExit(f"{label} run failed")
        if not last and launch.rc == 0:
            raise SystemExit(f"{label}: the first launch finished without crashing; is crash_step <= steps?")
    with open(os.path.join(run_dir, "job.json"), "w") as f:
        json.dump(job.to_json(), f, indent=2)
    return job


def replace_node(cfg: DemoConfig, node_roots: list[str], label: str, console: Console) -> str:
    """The crashed node comes back as a new machine: remove its local root (its checkpoint parts and
    the replicas it held for others). Returns the removed path."""
    crash_node = cfg.crash_rank // (cfg.world_size // cfg.nodes)
    root = node_roots[crash_node]
    shutil.rmtree(root, ignore_errors=True)
    console.print(f"  [dim]{label}[/dim] supervisor: [bold]node {crash_node} is replaced by a new machine: its local root "
                  f"{root} is wiped[/bold]; its part of every checkpoint is now only in "
                  + ("the other nodes' replicas" if cfg.replicas else "the remote tier"), highlight=False)
    return root


def _run_nodes(cfg: DemoConfig, run_dir: str, label: str, attempt: int, cfg_path: str, env: dict[str, str],
               launch: Launch, follower: _Follower, console: Console) -> str:
    """Launch one ``torchrun`` agent per simulated node and wait for all; returns the log path of
    the first node whose agent failed (else node 0's). When one agent is gone the others get
    ``NODE_GRACE_S`` to exit on their own, then SIGTERM (torchrun stops its workers), then SIGKILL."""
    port = _free_port()
    nproc = cfg.world_size // cfg.nodes
    logs = [os.path.join(run_dir, f"node{n}", "torchrun.log") for n in range(cfg.nodes)]
    procs = []
    for n in range(cfg.nodes):
        os.makedirs(os.path.dirname(logs[n]), exist_ok=True)
        cmd = _node_agent_cmd(n, cfg.nodes, nproc, port, f"{label}-{attempt}", cfg_path)
        with open(logs[n], "a") as logf:
            logf.write(f"\n===== launch {attempt}, node {n}: {' '.join(cmd)}\n")
            logf.flush()
            procs.append(subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    first_exit: float | None = None
    stage = 0  # 0: running, 1: SIGTERM sent, 2: SIGKILL sent
    while any(p.poll() is None for p in procs):
        follower.poll()
        now = time.time()
        if first_exit is None and any(p.poll() is not None and p.returncode != 0 for p in procs):
            first_exit = now
            gone = [n for n, p in enumerate(procs) if p.returncode is not None and p.returncode != 0]
            how = ", ".join(f"node {n} exit {procs[n].returncode}" for n in gone)
            console.print(f"  [dim]{label}[/dim] supervisor: {how}; waiting for the other node(s) to stop", highlight=False)
        if first_exit is not None and stage < 2 and now - first_exit > NODE_GRACE_S * (1 + stage / 6):
            sig = signal.SIGTERM if stage == 0 else signal.SIGKILL
            for p in procs:
                if p.poll() is None:
                    p.send_signal(sig)
            stage += 1
        time.sleep(0.2)
    launch.node_rcs = [p.returncode for p in procs]
    bad = [n for n, p in enumerate(procs) if p.returncode != 0]
    launch.rc = 0 if not bad else procs[bad[0]].returncode
    return logs[bad[0] if bad else 0]


def load_job(run_dir: str) -> Job:
    with open(os.path.join(run_dir, "job.json")) as f:
        d = json.load(f)
    d["launches"] = [Launch(**x) for x in d["launches"]]
    return Job(**d)
