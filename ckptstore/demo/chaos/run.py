"""``ckptstore demo --chaos``: the whole run, phase by phase (:data:`CHAOS_DEMO`).

1. the ckptstore job trains for ``duration`` seconds under the fault schedule (:mod:`.supervisor`,
   :mod:`.inject`), then stops at step S;
2. the reference: the same job without faults, for exactly S steps, skipping the batches the chaos run
   skipped (the only fault that changes the math, ``nan``, skips a corrupt batch);
3. the peer: the same schedule, same seed, with stock DCP; by default it runs alongside step 1 (started
   together on the same machine: the same load for both), ``--peer after`` runs it alone after step 2,
   ``--peer none`` skips it;
4. what happened (:mod:`.timeline`), the tables and the summary (:mod:`.report`), ``ckptstore list``/
   ``scrub``/``goodput`` of the chaos run's roots.

Each job has its own directory under ``OUT/chaos``, ``OUT/reference``, ``OUT/peer``; its nodes' disks are
``<job>/node<k>/disk`` — a tmpfs of ``disk_mb`` MiB each when running as root (what fault ``disk-full``
fills; the peer's shared folder is one too), plain directories otherwise (``disk-full`` is then skipped).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console

from ..orchestrate import MARKER, DemoError, ckptstore_cli, make_console, prepare_out
from ..supervisor import DemoConfig
from . import inject, report, schedule, timeline
from .clockexec import libfaketime
from .supervisor import ChaosJob, JobResult


@dataclass
class ChaosOptions:
    duration_s: float
    fault_every_s: float
    kinds: tuple[str, ...] | None = None  # only these kinds (default: every kind the set-up can run)
    peer: bool = True
    #: the stock-DCP peer runs ``"alongside"`` the ckptstore job (started together, the same schedule, the
    #: same machine load: a fair comparison, and the whole demo takes the duration once plus the reference)
    #: or ``"after"`` it (each job alone on the machine; the demo takes about three durations)
    peer_mode: str = "alongside"
    keep_last: int = 3  # retention of both checkpointers (KeepLast / torchtitan's keep_latest_k)
    incremental: bool = True
    stuck_s: float = 240.0
    disk_mb: int = 768
    grace_s: float = 30.0
    upload_timeout_s: float = 45.0


@dataclass
class ChaosRun:
    cfg: DemoConfig
    opts: ChaosOptions
    out: str
    console: Console
    t_start: float
    summary: str | None = None
    show_cli: bool = True
    seaweed: dict | None = None
    kinds: list[str] = field(default_factory=list)
    skipped_kinds: dict[str, str] = field(default_factory=dict)
    faults: list[schedule.Fault] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    jobs: dict[str, JobResult] = field(default_factory=dict)
    configs: dict[str, dict] = field(default_factory=dict)
    load: dict[str, list[float]] = field(default_factory=dict)  # job -> load averages at its start and end
    result: dict[str, Any] = field(default_factory=dict)  # what the analysis found (the summary)
    scrub_rcs: list[int] = field(default_factory=list)
    live: list = field(default_factory=list)  # the ChaosJobs running now


def validate(cfg: DemoConfig, opts: ChaosOptions) -> None:
    if opts.duration_s <= 0 or opts.fault_every_s <= 0:
        raise DemoError("--chaos and --fault-every must be positive durations")
    if cfg.nodes < 1 or cfg.world_size % cfg.nodes:
        raise DemoError(f"--world-size ({cfg.world_size}) must be a positive multiple of --nodes ({cfg.nodes})")
    if cfg.replicas and cfg.nodes < 2:
        raise DemoError("--replicas needs --nodes 2 or more")
    if cfg.d_model % cfg.heads:
        raise DemoError("--d-model must be a multiple of --heads")
    if opts.peer_mode not in ("alongside", "after"):
        raise DemoError(f"--peer must be alongside, after or none, not {opts.peer_mode!r}")
    if opts.kinds:
        bad = [k for k in opts.kinds if k not in schedule.KINDS]
        if bad:
            raise DemoError(f"unknown fault kind(s) {', '.join(bad)}; known: {', '.join(schedule.KINDS)}")


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _mount_tmpfs(run: ChaosRun, path: str) -> bool:
    os.makedirs(path, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={run.opts.disk_mb}m", "tmpfs", path],
                       capture_output=True, text=True)
    if p.returncode == 0:
        run.mounts.append(path)
        return True
    return False


def _unmount_all(run: ChaosRun) -> None:
    for path in reversed(run.mounts):
        if subprocess.run(["umount", path], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", path], capture_output=True)
    run.mounts.clear()


def describe(run: ChaosRun) -> None:
    from ..data import load_corpus
    from ..model import ByteGPT, count_params

    cfg, o = run.cfg, run.opts
    _, corpus = load_corpus(cfg.corpus_dir, cfg.corpus_max_bytes)
    nparams = count_params(ByteGPT(cfg.layers, cfg.d_model, cfg.heads, cfg.context, cfg.dropout))
    run.console.rule("[bold]ckptstore demo --chaos")
    run.console.print(
        f"model      byte-level decoder-only transformer, {cfg.layers} layers, d={cfg.d_model}, {nparams / 1e6:.2f} M "
        f"parameters; {corpus['bytes'] / 2**20:.1f} MiB of Python source, {cfg.global_batch} samples/step\n"
        f"job        {cfg.world_size} ranks on {cfg.nodes} simulated node(s) (a torchrun agent and a local disk each, "
        f"--max-restarts), FSDP2 on CPU, trained unattended for {o.duration_s:.0f} s\n"
        f"checkpoint CheckpointManager: async save every {cfg.save_every} steps, KeepLast({o.keep_last})"
        f"{', replicas=' + str(cfg.replicas) if cfg.replicas else ''}{', incremental' if o.incremental else ''}"
        f"{' + ' + cfg.remote if cfg.remote else ''}\n"
        f"faults     one every {o.fault_every_s:.0f} s (seed {cfg.seed}); "
        + ("the stock-DCP peer alongside (the same schedule), " if o.peer and o.peer_mode == "alongside" else "")
        + "then the reference (no faults, the same steps)"
        + (", then the stock-DCP peer (the same schedule)" if o.peer and o.peer_mode == "after" else "") + "\n"
        f"output     {run.out}",
        highlight=False)


def plan_faults(run: ChaosRun) -> None:
    cfg, o = run.cfg, run.opts
    root = _is_root()
    run.kinds, run.skipped_kinds = schedule.available(
        remote=bool(cfg.remote), nodes=cfg.nodes, replicas=cfg.replicas, root=root,
        faketime=libfaketime() is not None, only=o.kinds)
    run.faults = schedule.plan(o.duration_s, o.fault_every_s, cfg.seed, run.kinds, world_size=cfg.world_size,
                               nodes=cfg.nodes)
    t = report.schedule_table(run.faults)
    run.console.print(t)
    for k, why in run.skipped_kinds.items():
        run.console.print(f"  [dim]not in this run: {k}: {why}[/dim]", highlight=False)


def _node_dirs(run: ChaosRun, label: str) -> list[str]:
    return [os.path.join(run.out, label, f"node{n}") for n in range(run.cfg.nodes)]


def job_config(run: ChaosRun, label: str, *, checkpointer: str, max_steps: int | None = None,
               skip: list[int] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The workers' config of one job, and its nodes' directories (disks mounted here)."""
    cfg, o = run.cfg, run.opts
    run_dir = os.path.join(run.out, label)
    node_dirs = _node_dirs(run, label)
    os.makedirs(run_dir, exist_ok=True)
    root = _is_root()
    for d in node_dirs:
        disk = os.path.join(d, "disk")
        os.makedirs(disk, exist_ok=True)
        if root and checkpointer == "ckptstore":
            _mount_tmpfs(run, disk)
    d = asdict(cfg)
    d.update(chaos=True, label=label, run_dir=run_dir, checkpointer=checkpointer, keep_last=o.keep_last,
             max_steps=max_steps, skip_batches=sorted(skip or []), crash_step=None)
    if checkpointer == "ckptstore":
        roots = [os.path.join(nd, "disk", "store") for nd in node_dirs]
        remote = None if not cfg.remote else cfg.remote.rstrip("/") + "/" + label
        d.update(node_roots=roots, store_root=roots[0], remote=remote,
                 manager={"event_log": os.path.join(run_dir, "events.jsonl"), "incremental": o.incremental,
                          "progress_s": 1.0, "grace_s": o.grace_s,
                          # close() and a remote commit wait this long for the ranks' uploads (default 1 h): a
                          # rank whose uploads S3 refused (a clock 2 h ahead) leaves no marker to wait for
                          "upload_timeout": o.upload_timeout_s})
    else:
        shared = os.path.join(run_dir, "shared")
        os.makedirs(shared, exist_ok=True)
        if root:
            _mount_tmpfs(run, shared)
        d.update(node_roots=[], store_root=None, remote=None, dcp_folder=os.path.join(shared, "checkpoint"), manager={})
    run.configs[label] = d
    return d, node_dirs


def _run_job(run: ChaosRun, label: str, d: dict, node_dirs: list[str], *, faults, duration, targets,
             s3: bool = True) -> JobResult:
    """One job, start to end. ``s3``: this job's ``s3-down`` faults stop and start the run's SeaweedFS (the
    stock-DCP peer running alongside the ckptstore job, which owns the server, gets False: it has no S3
    tier, its ``s3-down`` is the restart alone)."""
    server = run.seaweed["server"] if run.seaweed and s3 else None
    run.load[label] = [os.getloadavg()[0]]
    job = ChaosJob(d, label, d["run_dir"], faults=faults, duration_s=duration, console=run.console,
                   nodes=run.cfg.nodes, world_size=run.cfg.world_size, node_dirs=node_dirs, s3=server,
                   stuck_s=run.opts.stuck_s, grace_s=run.opts.grace_s, on_event=report.Follower(run.console, label))
    run.live.append(job)
    try:
        res = job.run(inject.factory(targets) if faults else None)
    finally:
        run.live.remove(job)
    run.load[label].append(os.getloadavg()[0])
    run.jobs[label] = res
    return res


def run_chaos(run: ChaosRun) -> None:
    alongside = run.opts.peer and run.opts.peer_mode == "alongside"
    run.console.rule(f"1/3 the ckptstore job under faults ({run.opts.duration_s:.0f} s)"
                     + (", the stock-DCP peer alongside it (the same schedule)" if alongside else ""))
    d, nd = job_config(run, "chaos", checkpointer="ckptstore")
    if not alongside:
        _run_job(run, "chaos", d, nd, faults=run.faults, duration=run.opts.duration_s, targets=inject.Targets)
        return
    pd, pnd = job_config(run, "peer", checkpointer="dcp")
    errs: list[BaseException] = []

    def peer() -> None:
        try:
            _run_job(run, "peer", pd, pnd, faults=run.faults, duration=run.opts.duration_s, targets=inject.DcpTargets,
                     s3=False)
        except BaseException as e:  # noqa: BLE001 - raised below, in the main thread
            errs.append(e)

    th = threading.Thread(target=peer, name="chaos-peer", daemon=True)
    th.start()
    try:
        _run_job(run, "chaos", d, nd, faults=run.faults, duration=run.opts.duration_s, targets=inject.Targets)
    except BaseException:
        for job in list(run.live):  # interrupted: end the peer too (its loop kills its processes)
            job.done = True
        raise
    finally:
        th.join()
    if errs:
        raise errs[0]


def run_reference(run: ChaosRun) -> None:
    tl = timeline.Timeline.of(run.configs["chaos"]["run_dir"], run.jobs["chaos"].off)
    steps = tl.final_step()
    skip = tl.skipped_batches()
    run.console.rule(f"2/3 the reference: the same job without faults, {steps} steps"
                     + (f", skipping batch(es) {skip}" if skip else ""))
    if not steps:
        raise DemoError("the chaos run trained no step; nothing to compare")
    d, nd = job_config(run, "reference", checkpointer="ckptstore", max_steps=steps, skip=skip)
    _run_job(run, "reference", d, nd, faults=[], duration=None, targets=None)


def run_peer(run: ChaosRun) -> None:
    if not run.opts.peer or run.opts.peer_mode != "after":
        return
    run.console.rule(f"3/3 the peer: stock DCP (FileSystemWriter, async_save, torchtitan's resume) under the same "
                     f"schedule ({run.opts.duration_s:.0f} s)")
    d, nd = job_config(run, "peer", checkpointer="dcp")
    _run_job(run, "peer", d, nd, faults=run.faults, duration=run.opts.duration_s, targets=inject.DcpTargets)


def analyse(run: ChaosRun) -> None:
    run.result = report.analyse(run)


def show(run: ChaosRun) -> None:
    report.show(run)


def cli_views(run: ChaosRun) -> None:
    if not run.show_cli:
        return
    c = run.configs["chaos"]
    run.console.rule("the chaos run's store, through the ckptstore CLI")
    extra = ["--remote", c["remote"]] if c.get("remote") else []
    for root in c["node_roots"]:
        ckptstore_cli(["list", root, *extra], run.console)
    for root in c["node_roots"]:
        run.scrub_rcs.append(ckptstore_cli(["scrub", root, *extra], run.console))
    ckptstore_cli(["goodput", c["manager"]["event_log"], "--buckets", "google"], run.console)


def write_summary(run: ChaosRun) -> None:
    run.result["runtime_s"] = time.time() - run.t_start
    run.result["scrub_exit_codes"] = run.scrub_rcs
    with open(os.path.join(run.out, "summary.json"), "w") as f:
        json.dump(run.result, f, indent=2, default=str)
    if run.summary:
        with open(run.summary, "w") as f:
            json.dump(run.result, f, indent=2, default=str)


#: the chaos demo, phase by phase
CHAOS_DEMO = (describe, plan_faults, run_chaos, run_reference, run_peer, analyse, show, cli_views, write_summary)


def run_chaos_demo(cfg: DemoConfig, opts: ChaosOptions, out: str, *, summary: str | None = None, seaweed: bool = False,
                   show_cli: bool = True, console: Console | None = None) -> int:
    console = console or make_console()
    validate(cfg, opts)
    prepare_out(out)
    out = os.path.abspath(out)
    run = ChaosRun(cfg, opts, out, console, time.time(), summary=summary, show_cli=show_cli)

    def terminated(signum, frame):  # SIGTERM (a timeout, a scheduler): stop the jobs, unmount, exit 143
        raise SystemExit(128 + signum)

    old_term = signal.signal(signal.SIGTERM, terminated) if threading.current_thread() is threading.main_thread() else None
    with contextlib.ExitStack() as stack:
        if old_term is not None:
            stack.callback(signal.signal, signal.SIGTERM, old_term)
        stack.callback(_unmount_all, run)
        if seaweed:
            from ..seaweed import seaweedfs

            console.print("[bold]Starting SeaweedFS on loopback for this run…[/bold]")
            run.seaweed = stack.enter_context(seaweedfs(log_path=os.path.join(out, "seaweedfs.log")))
            cfg.remote = run.seaweed["url"]
        for phase in CHAOS_DEMO:
            phase(run)
        return report.conclude(run)


def reanalyse(out: str, *, console: Console | None = None, duration_s: float | None = None) -> int:
    """Analyse and print a finished run's directory again (its jobs' ``job.json`` and ``config.json``),
    without running anything: ``python -c "from ckptstore.demo.chaos.run import reanalyse; reanalyse('OUT')"``."""
    out = os.path.abspath(out)
    console = console or make_console()
    with open(os.path.join(out, "chaos", "config.json")) as f:
        c = json.load(f)
    cfg = DemoConfig(**{k: v for k, v in c.items() if k in DemoConfig.__dataclass_fields__})
    old = {}
    if os.path.exists(os.path.join(out, "summary.json")):
        with open(os.path.join(out, "summary.json")) as f:
            old = json.load(f)
    opts = ChaosOptions(duration_s=duration_s or old.get("duration_s") or 0.0, fault_every_s=old.get("fault_every_s") or 0.0)
    run = ChaosRun(cfg, opts, out, console, time.time(), show_cli=False)
    run.faults = [schedule.Fault(**f) for f in old.get("schedule", [])]
    run.kinds, run.skipped_kinds = old.get("kinds", []), old.get("kinds_not_run", {})
    run.load = old.get("load_average", {})
    for label in ("chaos", "reference", "peer"):
        d = os.path.join(out, label)
        if not os.path.exists(os.path.join(d, "job.json")):
            continue
        with open(os.path.join(d, "config.json")) as f:
            run.configs[label] = json.load(f)
        with open(os.path.join(d, "job.json")) as f:
            run.jobs[label] = JobResult(**json.load(f))
    analyse(run)
    show(run)
    write_summary(run)
    return report.conclude(run)
