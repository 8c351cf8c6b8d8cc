"""Run one job of ``ckptstore demo --chaos`` for a fixed time under a fault schedule, as a scheduler would.

:class:`ChaosJob` launches one ``torchrun`` agent per simulated node (``--nnodes=N``, c10d rendezvous on
127.0.0.1 hosted by node 0's agent, ``--max-restarts`` so a dead rank is restarted in place, every
rendezvous round with a fresh store: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, see README
"Troubleshooting"), fires the faults of its schedule at their times (:mod:`.inject`), and does what a
scheduler does, never more:

* an agent that exits (its node was lost or preempted) is replaced: launched again into the running
  rendezvous while node 0's agent (which hosts it) lives; when node 0's agent is gone, every agent is
  stopped (SIGTERM, SIGKILL after 5 s) and the whole job launched again on a fresh rendezvous;
* when the time is up it asks the job to stop (a stop file every rank sees at its next step: the job saves
  that step and exits 0) and waits for it;
* it never touches the job's data: no file is repaired, no version removed, nothing decided for it.

A job that makes no progress — no step past the furthest step reached for ``stuck_s`` seconds, or
``crash_loop`` worker generations in a row that ended without training past it (a job that dies at the
same corrupt sample after every restart) — needs a person: that is recorded as a
*manual step* and ends the job there (what the stock-DCP peer meets at a fault it cannot survive).

Everything the supervisor does goes to ``<run_dir>/supervisor.jsonl`` (``t``: its wall clock, ``up``: the
host's boot clock), and the launcher's ``launch``/``exit`` markers to the job's ckptstore event log.
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
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from rich.console import Console

from ... import events as ck_events
from ..train import uptime
from . import worker
from .schedule import Fault

#: after a node agent was replaced: how long the job gets to start a new worker generation before the
#: supervisor relaunches every node
REJOIN_S = 90.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@dataclass
class Agent:
    node: int
    proc: subprocess.Popen
    launch: int
    t0: float
    exited: float | None = None


@dataclass
class JobResult:
    label: str
    run_dir: str
    t0: float
    t1: float
    off: float  # supervisor wall time = boot clock + off
    faults: list[dict[str, Any]] = field(default_factory=list)
    manual_steps: list[dict[str, Any]] = field(default_factory=list)
    stopped_clean: bool = False
    launches: int = 0
    relaunches: list[dict[str, Any]] = field(default_factory=list)


class Index:
    """What the workers' event files say so far (read incrementally): live processes, steps, saves."""

    def __init__(self, run_dir: str, off: float) -> None:
        self.run_dir, self.off = run_dir, off
        self.pos: dict[str, int] = {}
        self.procs: dict[int, dict[str, Any]] = {}  # rank -> its newest proc_start event
        self.gens: dict[int, dict[str, Any]] = {}  # gen -> {"first": t, "steps": n, "fatal": [...]}
        self.gen_order: list[int] = []
        self.last_step_t: float | None = None
        self.max_step = 0  # the furthest step any generation has trained: progress is passing it
        self.max_step_t: float | None = None  # when it was last passed
        self.last_step: dict[int, dict[str, Any]] = {}  # rank -> newest step event
        self.saves: list[dict[str, Any]] = []  # rank 0's "save" events (mgr.save returned, the save in flight)
        self.new: list[dict[str, Any]] = []  # events since the last poll

    def when(self, e: dict[str, Any]) -> float:
        """An event's time on the supervisor's clock (from the host's boot clock: no skew)."""
        up = e.get("up")
        return up + self.off if isinstance(up, (int, float)) else e["t"]

    def poll(self) -> list[dict[str, Any]]:
        new: list[dict[str, Any]] = []
        for path in glob.glob(os.path.join(self.run_dir, "events", "rank*.a*.jsonl")):
            try:
                with open(path, "rb") as f:
                    f.seek(self.pos.get(path, 0))
                    chunk = f.read()
            except OSError:
                continue
            end = chunk.rfind(b"\n") + 1
            self.pos[path] = self.pos.get(path, 0) + end
            for line in chunk[:end].decode(errors="replace").splitlines():
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if isinstance(e, dict) and "kind" in e:
                    e["T"] = self.when(e)
                    new.append(e)
        new.sort(key=lambda e: e["T"])
        for e in new:
            k, r = e["kind"], e.get("rank")
            if k == "proc_start":
                self.procs[r] = e
            g = e.get("gen")
            if g is not None and g not in self.gens:
                self.gens[g] = {"first": e["T"], "steps": 0, "fatal": [], "last": e["T"], "advanced": False}
                self.gen_order.append(g)
            if g is not None:
                self.gens[g]["last"] = e["T"]
            if k == "step":
                self.last_step_t = e["T"]
                self.last_step[r] = e
                if g is not None:
                    self.gens[g]["steps"] += 1
                if r == 0 and e["step"] > self.max_step:
                    self.max_step, self.max_step_t = e["step"], e["T"]
                    if g is not None:
                        self.gens[g]["advanced"] = True
            elif k == "save" and r == 0:
                self.saves.append(e)
            elif k == "fatal" and g is not None:
                self.gens[g]["fatal"].append(e.get("error"))
        self.new = new
        return new

    def pid(self, rank: int) -> int | None:
        p = self.procs.get(rank)
        return p["pid"] if p and _alive(p["pid"]) else None

    def training_since(self, t: float) -> bool:
        """Every live rank has trained a step after ``t`` (the job is in its loop)."""
        steps = [e for e in self.last_step.values() if e["T"] > t]
        return bool(steps) and len(steps) >= len([r for r in self.procs if self.pid(r)])


class ChaosJob:
    """One job (the ckptstore run, its reference, or the stock-DCP peer) on ``nodes`` simulated nodes."""

    def __init__(self, cfg: dict[str, Any], label: str, run_dir: str, *, faults: list[Fault], duration_s: float | None,
                 console: Console, nodes: int, world_size: int, node_dirs: list[str], s3=None, stuck_s: float = 240.0,
                 crash_loop: int = 5, stop_timeout_s: float = 300.0, grace_s: float = 30.0,
                 on_event: Callable[[dict], None] | None = None) -> None:
        self.cfg, self.label, self.run_dir = cfg, label, run_dir
        self.faults, self.duration_s = faults, duration_s
        self.console, self.nodes, self.world = console, nodes, world_size
        self.node_dirs = node_dirs  # node k's disk: its root (or the peer's scratch) lives below it
        self.s3 = s3
        self.stuck_s, self.crash_loop, self.stop_timeout_s, self.grace_s = stuck_s, crash_loop, stop_timeout_s, grace_s
        self.on_event = on_event
        self.cfg_path = os.path.join(run_dir, "config.json")
        self.slog_path = os.path.join(run_dir, "supervisor.jsonl")
        self.elog = cfg.get("manager", {}).get("event_log")
        self.agents: list[Agent | None] = [None] * nodes
        self.launch_no = 0
        self.port = 0
        self.rdzv = ""
        self.rejoin_since: float | None = None
        self.teardown: dict[str, Any] | None = None
        self.stop_t: float | None = None
        self.done = False
        self.result: JobResult | None = None
        self.extra_pids: set[int] = set()
        self.hold: set[int] = set()  # nodes a fault is still working on (a lost node's disk being wiped)
        self.lock = threading.Lock()

    # -- logging ------------------------------------------------------------------------------------
    def slog(self, kind: str, /, **kw: Any) -> dict[str, Any]:
        e = {"kind": kind, "t": time.time(), "up": uptime(), "s": round(time.time() - self.t0, 3), **kw}
        with self.lock, open(self.slog_path, "a") as f:
            f.write(json.dumps(e, default=str) + "\n")
        return e

    def say(self, msg: str) -> None:
        self.console.print(f"  [dim]{self.label} {time.time() - self.t0:7.1f}s[/dim] {msg}", highlight=False)

    # -- processes ----------------------------------------------------------------------------------
    def clock_file(self, node: int) -> str:
        return os.path.join(self.node_dirs[node], "clock")

    def node_env(self, node: int) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("PYTHONWARNINGS", "ignore::UserWarning")
        env["CKPTSTORE_DEMO_NODE"] = str(node)
        env["CKPTSTORE_DEMO_ATTEMPT"] = str(self.launch_no)
        env["CKPTSTORE_CHAOS_CLOCK"] = self.clock_file(node)
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        return env

    def agent_cmd(self, node: int) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.nodes}", f"--nproc-per-node={self.world // self.nodes}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.rdzv}",
            f"--rdzv-conf=is_host={int(node == 0)},join_timeout={int(REJOIN_S * 2)}",
            "--local-addr=127.0.0.1", "--max-restarts=1000", "--monitor-interval=0.1",
            "-m", "ckptstore.demo.chaos.clockexec", "--config", self.cfg_path,
        ]

    def start_agent(self, node: int) -> None:
        log = os.path.join(self.node_dirs[node], "torchrun.log")
        cmd = self.agent_cmd(node)
        with open(log, "a") as f:
            f.write(f"\n===== launch {self.launch_no}, node {node}, {time.strftime('%H:%M:%S')}: {' '.join(cmd)}\n")
            f.flush()
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.node_env(node), start_new_session=True)
        self.agents[node] = Agent(node, p, self.launch_no, time.time())
        self.slog("agent_start", node=node, pid=p.pid, launch=self.launch_no, port=self.port)

    def launch_all(self, why: str) -> None:
        self.launch_no += 1
        self.port = _free_port()
        self.rdzv = f"{self.label}-{self.launch_no}"
        self.slog("launch", launch=self.launch_no, why=why)
        if self.result is not None:
            self.result.launches = self.launch_no
        for n in range(self.nodes):
            self.start_agent(n)

    def node_pids(self, node: int) -> list[int]:
        """This job's worker processes on ``node`` (from ``/proc``: its config in the command line, the
        node in the environment), also those that have not logged yet."""
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read()
                if self.cfg_path.encode() not in cmd or b"torch.distributed.run" in cmd:
                    continue
                with open(f"/proc/{d}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if f"CKPTSTORE_DEMO_NODE={node}".encode() in env and _alive(int(d)):
                out.append(int(d))
        return out

    def kill_pids(self, pids, sig=signal.SIGKILL) -> list[int]:
        done = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                done.append(pid)
            except OSError:
                pass
        return done

    def kill_node(self, node: int, sig=signal.SIGKILL) -> list[int]:
        """The node's agent and its workers (they run in sessions of their own)."""
        a = self.agents[node]
        pids = ([a.proc.pid] if a and a.proc.poll() is None else []) + self.node_pids(node)
        return self.kill_pids(pids, sig)

    # -- the loop -----------------------------------------------------------------------------------
    def run(self, injector_factory: Callable[["ChaosJob", Fault], Any] | None = None) -> JobResult:
        os.makedirs(self.run_dir, exist_ok=True)
        os.makedirs(worker.control_dir(self.run_dir), exist_ok=True)
        for n in range(self.nodes):
            os.makedirs(self.node_dirs[n], exist_ok=True)
            with open(self.clock_file(n), "w") as f:
                f.write("+0\n")
        with open(self.cfg_path, "w") as f:
            json.dump(self.cfg, f, indent=2)
        self.t0 = time.time()
        up = uptime()
        self.off = self.t0 - up if up is not None else 0.0
        self.index = Index(self.run_dir, self.off)
        self.result = JobResult(self.label, self.run_dir, self.t0, 0.0, self.off)
        if self.elog:
            ck_events.append(self.elog, "launch", label=self.label, nodes=self.nodes)
        pending = sorted(self.faults, key=lambda f: f.at_s)
        active: list[Any] = []
        self.launch_all("start")
        try:
            while not self.done:
                now = time.time()
                el = now - self.t0
                for e in self.index.poll():
                    if self.on_event:
                        self.on_event(e)
                if self.stop_t is None:
                    while pending and pending[0].at_s <= el and injector_factory is not None:
                        f = pending.pop(0)
                        active.append(injector_factory(self, f))
                    for inj in list(active):
                        if inj.tick(now):
                            active.remove(inj)
                    if self.duration_s is not None and el >= self.duration_s:
                        self.begin_stop(active, pending)
                        active, pending = [], []
                    else:
                        self.check_stuck(now)
                self.tick_agents(now)
                time.sleep(0.05)
        finally:
            for inj in active:
                inj.abort()
            self.kill_everything()
            self.result.t1 = time.time()
            if self.elog:
                ck_events.append(self.elog, "exit", label=self.label, clean=self.result.stopped_clean)
            self.slog("end", stopped_clean=self.result.stopped_clean, manual_steps=len(self.result.manual_steps))
            with open(os.path.join(self.run_dir, "job.json"), "w") as f:
                json.dump(asdict(self.result), f, indent=1, default=str)
        return self.result

    def begin_stop(self, active, pending) -> None:
        """The run's time is up: end the open fault windows, then ask the job to stop."""
        for inj in active:
            inj.abort()
        for f in pending:
            self.result.faults.append({**f.to_json(), "ran": False, "note": "not injected: the run's time was up"})
        self.stop_t = time.time()
        open(os.path.join(worker.control_dir(self.run_dir), worker.STOP), "w").close()
        self.slog("stop_requested")
        self.say("time is up: stop file written (every rank stops at the same step, saves it, exits 0)")

    def tick_agents(self, now: float) -> None:
        for a in self.agents:
            if a is not None and a.exited is None and a.proc.poll() is not None:
                a.exited = now
                self.slog("agent_exit", node=a.node, rc=a.proc.returncode, launch=a.launch)
                if self.stop_t is None:
                    self.say(f"node {a.node}'s torchrun agent exited ({a.proc.returncode})")
        if self.teardown is not None:
            self._tick_teardown(now)
            return
        gone = [a for a in self.agents if a is not None and a.exited is not None]
        if any(a.proc.returncode == 0 for a in gone) and self.stop_t is None:
            # a node finished its run (the reference reached its last step): the job is ending, never relaunch
            self.stop_t = now
            self.slog("finishing")
        if self.stop_t is not None:
            if len(gone) == self.nodes:
                if all(a is not None and a.proc.returncode == 0 for a in self.agents):
                    self.result.stopped_clean = True
                    self.done = True
                else:  # a fault's restart was under way: bring the job up once more, it stops at once
                    self.launch_all("stop: relaunch to let the job stop cleanly")
            elif now - self.stop_t > self.stop_timeout_s:
                self.slog("stop_timeout")
                self.say("[red]the job did not stop in time; killing it[/red]")
                self.done = True
            return
        if not gone:
            if self.rejoin_since is not None and self.index.gen_order and self.index.gens[self.index.gen_order[-1]]["first"] > self.rejoin_since:
                self.rejoin_since = None
            elif self.rejoin_since is not None and now - self.rejoin_since > REJOIN_S:
                self.say(f"no new worker generation {REJOIN_S:.0f} s after a node rejoined: relaunching every node")
                self.begin_teardown("rejoin timed out")
            return
        host = self.agents[0]
        if host is not None and host.exited is None:
            for a in gone:
                if a.node in self.hold:
                    continue
                self.say(f"scheduler: node {a.node} replaced; its agent rejoins the rendezvous")
                self.result.relaunches.append({"t": now - self.t0, "what": f"node {a.node}", "launch": self.launch_no})
                self.start_agent(a.node)
                self.rejoin_since = now
        else:
            self.begin_teardown("node 0's agent (the rendezvous host) is gone")

    def begin_teardown(self, why: str) -> None:
        self.slog("teardown", why=why)
        self.teardown = {"t": time.time(), "why": why, "killed": False}
        for a in self.agents:
            if a is not None and a.proc.poll() is None:
                try:
                    a.proc.send_signal(signal.SIGTERM)
                except OSError:
                    pass

    def _tick_teardown(self, now: float) -> None:
        td = self.teardown
        alive = [a for a in self.agents if a is not None and a.proc.poll() is None]
        if alive and now - td["t"] > 5 and not td["killed"]:
            for a in alive:
                self.kill_node(a.node)
            td["killed"] = True
        if not alive and not self.hold:
            for n in range(self.nodes):
                self.kill_pids(self.node_pids(n))
            self.teardown = None
            self.rejoin_since = None
            self.result.relaunches.append({"t": now - self.t0, "what": "all nodes", "why": td["why"]})
            self.say(f"scheduler: relaunching all {self.nodes} nodes ({td['why']})")
            self.launch_all(td["why"])

    def check_stuck(self, now: float) -> None:
        # progress is training past the furthest step reached: a job that restarts, redoes a few steps
        # and dies at the same place again (a corrupt sample it cannot get past) is making none
        idx = self.index
        last = idx.max_step_t if idx.max_step_t is not None else self.t0
        reason = None
        if now - last > self.stuck_s:
            reason = f"no step past step {idx.max_step} for {now - last:.0f} s"
        tail = 0
        for g in reversed(idx.gen_order[:-1]):
            if idx.gens[g]["advanced"]:
                break
            tail += 1
        if tail >= self.crash_loop:
            errs = [e for g in idx.gen_order[-self.crash_loop - 1:] for e in idx.gens[g]["fatal"]]
            reason = (f"{tail} restarts in a row ended without training past step {idx.max_step}"
                      + (f" (last error: {errs[-1]})" if errs else ""))
        if reason:
            step = max((e["step"] for e in idx.last_step.values()), default=None)
            m = {"at_s": round(now - self.t0, 1), "reason": reason, "last_step": step}
            self.result.manual_steps.append(m)
            self.slog("manual_step", **m)
            self.say(f"[bold red]needs a person: {reason}; the run ends here[/bold red]")
            self.done = True

    def kill_everything(self) -> None:
        for a in self.agents:
            if a is not None and a.proc.poll() is None:
                self.kill_node(a.node)
        for n in range(self.nodes):
            self.kill_pids(self.node_pids(n))
        self.kill_pids([p for p in self.extra_pids if _alive(p)])
        for a in self.agents:
            if a is not None:
                try:
                    a.proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass

    # -- helpers for the injectors ----------------------------------------------------------------
    def elapsed(self) -> float:
        return time.time() - self.t0

    def set_clock(self, node: int, offset: str) -> None:
        tmp = self.clock_file(node) + ".tmp"
        with open(tmp, "w") as f:
            f.write(offset + "\n")
        os.replace(tmp, self.clock_file(node))

    def wipe(self, path: str) -> None:
        """Remove everything below ``path`` (a node's disk; a tmpfs mount point itself stays)."""
        if not os.path.isdir(path):
            return
        for name in os.listdir(path):
            p = os.path.join(path, name)
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
