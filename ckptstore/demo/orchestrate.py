"""The whole demo: reference run, crash run, verification, goodput, plot, CLI views, summary."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from .. import events
from . import backend
from .events import History
from .goodput import Goodput, account, disagreement, from_report
from .supervisor import DemoConfig, Job, run_job
from .verify import Verdict, verify

MARKER = ".ckptstore-demo"


class DemoError(Exception):
    pass


def validate(cfg: DemoConfig, *, seaweed: bool = False) -> None:
    """Refuse option combinations the demo cannot run (:class:`DemoError`, before any work);
    ``seaweed``: a remote tier is coming (``--seaweedfs``) although ``cfg.remote`` is not set yet."""
    if cfg.save_every < 1 or cfg.steps < 1:
        raise DemoError("--steps and --save-every must be positive")
    if cfg.crash_step % cfg.save_every or not cfg.save_every <= cfg.crash_step < cfg.steps:
        raise DemoError(
            f"--crash-step ({cfg.crash_step}) must be a save step (a multiple of --save-every {cfg.save_every}) "
            f"before the last step ({cfg.steps}): the crash happens while that save is in flight"
        )
    if not 0 <= cfg.crash_rank < cfg.world_size:
        raise DemoError(f"--crash-rank must be in 0..{cfg.world_size - 1}")
    for w in (cfg.world_size, cfg.resume_world_size or cfg.world_size):
        if not 1 <= w <= cfg.global_batch:
            raise DemoError(f"world size {w} must be between 1 and the global batch ({cfg.global_batch})")
    if cfg.d_model % cfg.heads:
        raise DemoError("--d-model must be a multiple of --heads")
    if cfg.parallel not in ("fsdp", "ddp"):
        raise DemoError("--parallel is fsdp or ddp")
    if cfg.nodes < 1 or cfg.world_size % cfg.nodes:
        raise DemoError(f"--world-size ({cfg.world_size}) must be a positive multiple of --nodes ({cfg.nodes})")
    if cfg.nodes > 1 and cfg.resume_world_size not in (None, cfg.world_size):
        raise DemoError("--resume-world-size is for the single-node demo; --nodes restarts the same nodes")
    if cfg.replicas < 0:
        raise DemoError("--replicas must be 0 or more")
    if cfg.replicas and cfg.nodes < 2:
        raise DemoError("--replicas copies each node's part of a checkpoint to other nodes' local roots: "
                        "it needs --nodes 2 or more")
    if cfg.replace_node and cfg.nodes < 2:
        raise DemoError("--replace-node replaces the crashed node of a multi-node run: it needs --nodes 2 or more")
    if cfg.replaces_node() and not cfg.replicas and not (cfg.remote or seaweed):
        raise DemoError("--replace-node without --replicas and without a remote tier would lose the checkpoint: the "
                        "wiped node's part of every version exists nowhere else. Add --replicas 1 (copies on the "
                        "other nodes) or --seaweedfs / --remote s3://... (a copy in S3)")


def prepare_out(out: str) -> None:
    """Make ``out`` ours and empty of previous demo results (refuse to clobber anything else)."""
    out = os.path.abspath(out)
    if os.path.isdir(out) and os.listdir(out) and not os.path.exists(os.path.join(out, MARKER)):
        raise DemoError(f"{out} exists and is not a ckptstore demo directory; pass another --out")
    if os.path.isdir(out):
        for name in os.listdir(out):
            p = os.path.join(out, name)
            if name == MARKER:
                continue
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, MARKER), "w").close()


def make_console() -> Console:
    """The demo's console. To a pipe or file (no TTY, no COLUMNS): rules and tables 120 columns
    wide, but text lines are never wrapped (``soft_wrap``), so each result stays on one line."""
    if not sys.stdout.isatty() and "COLUMNS" not in os.environ:
        return Console(width=120, soft_wrap=True)
    return Console()


def ckptstore_cli(args: list[str], console: Console) -> int:
    """Run ``ckptstore ARGS`` and show its output."""
    cmd = [sys.executable, "-m", "ckptstore.cli", *args]
    console.print(f"[bold]$ ckptstore {' '.join(args)}[/bold]", highlight=False)
    p = subprocess.run(cmd, capture_output=True, text=True)
    text = (p.stdout + p.stderr).rstrip()
    for line in text.splitlines():
        console.print("  " + line, highlight=False, markup=False, soft_wrap=True)
    if not text.endswith(f"(exit {p.returncode})"):  # scrub's summary already ends with its exit code
        console.print(f"  [dim](exit {p.returncode})[/dim]", highlight=False)
    return p.returncode


def _fmt_s(x: float) -> str:
    return f"{x:6.1f} s"


def log_report(job):
    """``ckptstore goodput`` (its library) on ``job``'s event log (rank 0's root)."""
    from ..goodput import account as account_log

    path = os.path.join(job.store_root, events.LOG_NAME)
    with open(path, "rb") as f:
        evs, bad = events.parse(f)
    return account_log(evs, mtbf_s=6 * 3600.0, skipped_lines=bad)


def goodput_table(gp: Goodput, ref: Goodput) -> Table:
    t = Table(title="Goodput (ckptstore goodput on each run's event log; rank 0's clock)", title_justify="left")
    t.add_column("")
    t.add_column("crash run", justify="right")
    t.add_column("share", justify="right")
    t.add_column("reference", justify="right")
    rows = [
        ("useful training (steps kept, counted once)", gp.useful, ref.useful),
        ("blocked in mgr.save (staging + back-pressure)", gp.blocked, ref.blocked),
        ("work lost to the crash (redone)", gp.lost, ref.lost),
        ("restart / recovery (crash → first resumed step)", gp.recovery, ref.recovery),
        ("   of which: detect the crash, restart the workers", gp.restart, ref.restart),
        ("   of which: worker start-up (imports, rendezvous, group, data, model)", gp.init, ref.init),
        ("   of which: load checkpoint", gp.load, ref.load),
        ("start-up (launch → first step)", gp.startup, ref.startup),
        ("other (shutdown, final save flush, logging)", gp.other, ref.other),
    ]
    for name, a, b in rows:
        t.add_row(name, _fmt_s(a), f"{a / gp.wall:6.1%}" if gp.wall else "-", _fmt_s(b))
    t.add_row("[bold]wall[/bold]", _fmt_s(gp.wall), "", _fmt_s(ref.wall))
    t.add_row("[bold]goodput = useful / wall[/bold]", f"[bold]{gp.goodput:.1%}[/bold]", "", f"{ref.goodput:.1%}")
    return t


def restore_reads(run: History) -> dict[str, int] | None:
    """The read counters of the first resume after the crash (``last_restore.reads`` of every rank's
    "resumed" event), summed over the ranks, plus ``ranks``; None when no rank resumed."""
    later = [a for a in run.attempts if a > 0]
    events = run.of_kind("resumed", attempt=later[0], rank=None) if later else []
    if not events:
        return None
    out = {k: 0 for k in ("remote_reads", "peer_bytes", "fallback_reads")}
    for e in events:
        for k in out:
            out[k] += int(e.get("reads", {}).get(k, 0))
    out["ranks"] = len(events)
    return out


def run_demo(cfg: DemoConfig, out: str, *, summary: str | None = None, seaweed: bool = False,
             show_cli: bool = True, plot: bool = True, console: Console | None = None) -> int:
    if console is None:
        console = make_console()
    t_start = time.time()
    validate(cfg, seaweed=seaweed)
    prepare_out(out)
    out = os.path.abspath(out)

    with contextlib.ExitStack() as stack:
        if seaweed:
            from .seaweed import seaweedfs

            console.print("[bold]Starting SeaweedFS on loopback for this run…[/bold]")
            sw = stack.enter_context(seaweedfs(log_path=os.path.join(out, "seaweedfs.log")))
            cfg.remote = sw["url"]
            console.print(f"  S3 endpoint {sw['endpoint']}, remote tier {cfg.remote} (stopped when the demo ends)", highlight=False)
        return _run(cfg, out, summary, show_cli, plot, console, t_start)


@dataclass
class DemoRun:
    """One demo run as its phases see it: the settings, and what each phase leaves for the next.

    :func:`_run` calls the phases of :data:`CRASH_DEMO` in order; each reads what earlier phases
    set and adds its own results (a job, a verdict, a figure, exit codes), so a new scenario is a
    new phase (or a new sequence), not an edit of one long function."""

    cfg: DemoConfig
    out: str
    console: Console
    t_start: float
    summary: str | None = None
    show_cli: bool = True
    plot: bool = True
    # the two runs (run_jobs)
    ref_job: Job | None = None
    crash_job: Job | None = None
    ref_h: History | None = None
    run_h: History | None = None
    # the checks (verification)
    verdict: Verdict | None = None
    reads: dict[str, int] | None = None
    reports: dict[str, Any] = field(default_factory=dict)  # job label -> ckptstore goodput's report
    gp: Goodput | None = None
    ref_gp: Goodput | None = None
    own: dict[str, Goodput] = field(default_factory=dict)  # job label -> the demo's own accounting
    # what the rest shows (figure, CLI views) and the summary
    committed: list[tuple[str, int | None, float | None]] = field(default_factory=list)
    png: str | None = None
    scrub_rcs: list[int] = field(default_factory=list)
    runtime: float = 0.0


def _describe_fault(cfg: DemoConfig) -> tuple[str, str]:
    """How the crash run is launched, and the fault it suffers, in words."""
    if cfg.nodes > 1:
        per = cfg.world_size // cfg.nodes
        crash_node = cfg.crash_rank // per
        launch = f"{cfg.nodes} simulated nodes x {per}: a torchrun agent and a local root each, c10d rendezvous on 127.0.0.1"
        fault = (f"node {crash_node} (rank {cfg.crash_rank}'s) dies at step {cfg.crash_step} while that save is in flight: "
                 f"its ranks SIGKILL their agent and themselves; the supervisor relaunches all {cfg.nodes} nodes"
                 + (f", node {crash_node} as a new machine (its local root wiped)" if cfg.replaces_node() else ""))
        return launch, fault
    rw = cfg.resume_world_size or cfg.world_size
    return "torchrun", (f"rank {cfg.crash_rank} SIGKILLs itself at step {cfg.crash_step} while that save is in flight; "
                        f"restart on {rw} rank(s)")


def describe(run: DemoRun) -> None:
    """The banner: model, data, training, checkpointing, the fault, the output directory."""
    from .data import load_corpus
    from .model import ByteGPT, count_params

    cfg = run.cfg
    _, corpus = load_corpus(cfg.corpus_dir, cfg.corpus_max_bytes)
    nparams = count_params(ByteGPT(cfg.layers, cfg.d_model, cfg.heads, cfg.context, cfg.dropout))
    launch, fault = _describe_fault(cfg)
    replicas = f", replicas={cfg.replicas}: each node's part also on {cfg.replicas} other node(s)" if cfg.replicas else ""
    run.console.rule("[bold]ckptstore demo")
    run.console.print(
        f"model     byte-level decoder-only transformer: {cfg.layers} layers, d={cfg.d_model}, {cfg.heads} heads, "
        f"context {cfg.context}, {nparams / 1e6:.2f} M parameters\n"
        f"data      {corpus['bytes'] / 2**20:.1f} MiB of Python stdlib source ({corpus['files']} files in {corpus['directory']}), "
        f"{cfg.global_batch} samples/step globally\n"
        f"training  {cfg.steps} steps, {cfg.world_size} ranks ({launch}, gloo, {'FSDP2 fully_shard' if cfg.parallel == 'fsdp' else 'DDP'}, CPU), "
        f"AdamW + warmup/cosine LR, StatefulDataLoader\n"
        f"checkpoint ckptstore.CheckpointManager: async save every {cfg.save_every} steps"
        f"{' (local + ' + cfg.remote + ')' if cfg.remote else ' (local tier)'}"
        f"{replicas}\n"
        f"fault     {fault}\n"
        f"output    {run.out}",
        highlight=False,
    )


def run_jobs(run: DemoRun) -> None:
    """The reference run (no crash), then the crash run (SIGKILL mid-save, restart, ``mgr.resume()``)."""
    cfg, console = run.cfg, run.console
    console.rule("1/3 reference run (no crash)")
    run.ref_job = run_job(cfg, run.out, "reference", crash=False, console=console)
    console.rule("2/3 crash run (SIGKILL mid-save, " + ("a node dies, all nodes relaunched" if cfg.nodes > 1 else "torchrun restarts")
                 + ", mgr.resume())")
    run.crash_job = run_job(cfg, run.out, "crash", crash=True, console=console)


def verification(run: DemoRun) -> None:
    """Compare the crash run with the reference (:func:`.verify.verify`), check a replaced node's
    restore and the goodput accounting, and print every check."""
    run.console.rule("3/3 verification")
    run.ref_h, run.run_h = History.of(run.ref_job.run_dir), History.of(run.crash_job.run_dir)
    run.verdict = verify(run.ref_h, run.run_h, asdict(run.cfg))
    run.reads = restore_reads(run.run_h)
    if run.crash_job.wiped_root and run.cfg.replicas:  # the replaced node's part came from its peers, not from S3
        _check_replaced_node(run)
    _check_goodput(run)
    t = Table(show_header=False, box=None)
    for c in run.verdict.checks:
        t.add_row("[green]PASS[/green]" if c.ok else "[bold red]FAIL[/bold red]", c.name, f"[dim]{c.detail}[/dim]")
    run.console.print(t)


def _check_replaced_node(run: DemoRun) -> None:
    """A replaced node (its root wiped) read its part from its peers' replicas and holds it again."""
    v, job, reads = run.verdict, run.crash_job, run.reads
    got = reads or {}
    v.add("the replaced node's part was read from its peers' replicas"
          + (", with 0 S3 GETs" if job.remote else ""),
          got.get("peer_bytes", 0) > 0 and got.get("remote_reads", 0) == 0,
          "no resume" if reads is None else
          f"{got['peer_bytes']} bytes from peers, {got['remote_reads']} S3 GET(s) over {got['ranks']} ranks")
    held = [r.version for r in backend.versions(job.wiped_root)] if os.path.isdir(job.wiped_root) else []
    v.add("the replaced node holds its part of the restored version again (re-replicated)",
          v.resumed_from in held, f"{job.wiped_root} lists {', '.join(held) or 'nothing'}")


def _check_goodput(run: DemoRun) -> None:
    """The table comes from ``ckptstore goodput`` (its library) on each run's own event log; the
    demo's own accounting from the workers' step events must agree with it."""
    ref_job, crash_job = run.ref_job, run.crash_job
    run.reports = {j.label: log_report(j) for j in (ref_job, crash_job)}
    run.gp, run.ref_gp = from_report(run.reports[crash_job.label]), from_report(run.reports[ref_job.label])
    run.own = {crash_job.label: account(crash_job, run.run_h), ref_job.label: account(ref_job, run.ref_h)}
    for label, mine in ((crash_job.label, run.gp), (ref_job.label, run.ref_gp)):
        off = disagreement(mine, run.own[label])
        run.verdict.add(f"ckptstore goodput on the {label} run's event log agrees with its step events", not off,
                        "within rounding (every row ±0.2-0.3 s + 1 %, goodput ±1 point)" if not off else
                        "; ".join(f"{k} differs by {d:.2f}" for k, d in off.items()))


def show_restore_and_goodput(run: DemoRun) -> None:
    """Where the resume read from, the goodput table, and the interval ``ckptstore advise`` suggests."""
    console, reads, gp = run.console, run.reads, run.gp
    if reads is not None:
        where = "the replaced node's part from its peers' replicas, " if run.crash_job.wiped_root and run.cfg.replicas else ""
        console.print(
            f"restore reads ({reads['ranks']} ranks, CheckpointManager.last_restore.reads): {where}"
            f"{reads['peer_bytes'] / 2**20:.2f} MiB from peers, "
            + (f"[bold]{reads['remote_reads']} S3 GET(s)[/bold]" if run.crash_job.remote else "no remote tier")
            + f", {reads['fallback_reads']} fallback read(s)", highlight=False)

    console.print(goodput_table(gp, run.ref_gp))
    rep = run.reports.get(run.crash_job.label)
    if rep is not None and rep.advice is not None:  # ckptstore goodput's own advice: the figure the command prints below
        restart = rep.recovery / rep.restarts if rep.restarts else 0.0
        console.print(f"interval advice for an MTBF of 6 h (ckptstore goodput: measured "
                      f"{rep.saves['mean_blocked_s']:.2f} s blocked/save, {restart:.1f} s restart): {rep.advice}",
                      highlight=False)


def make_figure(run: DemoRun) -> None:
    """The crash run's committed versions, and (unless ``--no-plot``) the figure ``demo.png``."""
    cfg, v, job = run.cfg, run.verdict, run.crash_job
    run.committed = [(r.version, r.step, r.created.timestamp() if r.created else None)
                     for r in backend.versions(job.store_root, job.remote)]
    if not run.plot:
        return
    from .plot import plot as make_plot

    run.png = make_plot(
        os.path.join(run.out, "demo.png"), run.ref_h, run.run_h, run.ref_job, job, run.gp, run.ref_gp, run.committed,
        f"ckptstore demo: {cfg.world_size} ranks, crash at step {cfg.crash_step}, resumed from {v.resumed_from}"
        f" on {v.resume_world_size} rank(s); bit-exact: {v.bit_exact}",
    )
    run.console.print(f"plot: {run.png}", highlight=False)


def cli_views(run: DemoRun) -> None:
    """The crash run's store through the ``ckptstore`` CLI (unless ``--no-cli``): list (each node),
    what gc would prune, scrub (each node; exit codes kept), goodput."""
    if not run.show_cli:
        return
    job, console = run.crash_job, run.console
    console.rule("the crash run's store, through the ckptstore CLI" + (" (on each node)" if job.node_roots else ""))
    extra = ["--remote", job.remote] if job.remote else []
    roots = job.node_roots or [job.store_root]
    for root in roots:
        ckptstore_cli(["list", root, *extra], console)
    # what a retention policy would prune: keep the 3 newest and the one with the lowest loss
    ckptstore_cli(["gc", roots[0], *extra, "--dry-run", "--keep-last", "3",
                   "--keep-best", "1", "--metric", "loss", "--mode", "min"], console)
    for root in roots:
        run.scrub_rcs.append(ckptstore_cli(["scrub", root, *extra], console))
    ckptstore_cli(["goodput", job.store_root, "--mtbf", "6h"], console)  # the table above, from the command


def summary_json(run: DemoRun) -> dict[str, Any]:
    """The run's summary (``summary.json``; ``--summary``): its keys are part of the demo's interface."""
    cfg, v, job, gp = run.cfg, run.verdict, run.crash_job, run.gp
    return {
        "passed": v.passed,
        "bit_exact": v.bit_exact,
        "goodput": gp.goodput,
        "steps": cfg.steps,
        "crash_step": v.crash_step,
        "resumed_from": v.resumed_from,
        "resumed_step": v.resumed_step,
        "world_size": cfg.world_size,
        "nodes": cfg.nodes,
        "node_roots": job.node_roots,
        "replicas": cfg.replicas,
        "wiped_root": job.wiped_root,
        "restore_reads": run.reads,
        "scrub_exit_codes": run.scrub_rcs,
        "resume_world_size": v.resume_world_size,
        "redone_steps": v.redone_steps,
        "max_rel_loss_diff": v.max_rel_loss_diff,
        "goodput_breakdown": gp.to_json(),
        "reference_goodput": run.ref_gp.to_json(),
        "goodput_from_step_events": run.own[job.label].to_json(),
        "goodput_log": os.path.join(job.store_root, events.LOG_NAME),
        "goodput_report": run.reports[job.label].to_json(),
        "checks": [asdict(c) for c in v.checks],
        "final_loss": {"reference": run.ref_h.mean_loss(cfg.steps) if cfg.steps in run.ref_h.effective else None,
                       "crash_run": run.run_h.mean_loss(cfg.steps) if cfg.steps in run.run_h.effective else None},
        "store": job.store_root,
        "remote": job.remote,
        "versions": [c[0] for c in run.committed],
        "plot": run.png,
        "out": run.out,
        "runtime_s": run.runtime,
        "config": asdict(cfg),
    }


def write_summary(run: DemoRun) -> None:
    """``OUT/summary.json`` and (``--summary``) a copy where asked."""
    run.runtime = time.time() - run.t_start
    result = summary_json(run)
    with open(os.path.join(run.out, "summary.json"), "w") as f:
        json.dump(result, f, indent=2)
    if run.summary:
        with open(run.summary, "w") as f:
            json.dump(result, f, indent=2)


def conclude(run: DemoRun) -> int:
    """The last line, PASS (how exactly the crash run matched, where the replaced node's part came
    from) or FAIL (the failed checks); the demo's exit code."""
    v, job, reads, console = run.verdict, run.crash_job, run.reads, run.console
    console.rule()
    if not v.passed:
        failed = [c.name for c in v.checks if not c.ok]
        console.print(f"[bold red]FAIL[/bold red]: {'; '.join(failed)}  (events under {run.out})", highlight=False)
        return 1
    how = "bit for bit" if v.bit_exact else f"within {v.max_rel_loss_diff:.2%} (resharded: not bit-exact by design)"
    src = ""
    if job.wiped_root and reads is not None:
        src = (" (the replaced node's part from its peers' replicas" if run.cfg.replicas else " (the replaced node's part from S3")
        src += f", {reads['remote_reads']} S3 GETs)" if job.remote else ")"
    console.print(
        f"[bold green]PASS[/bold green]: the crashed run resumed from {v.resumed_from}{src} and matched the reference "
        f"{how}; goodput {run.gp.goodput:.1%} (reference {run.ref_gp.goodput:.1%}); demo took {run.runtime:.0f} s",
        highlight=False,
    )
    return 0


#: the crash demo, phase by phase (each a function of the :class:`DemoRun`); :func:`conclude` ends it
CRASH_DEMO = (describe, run_jobs, verification, show_restore_and_goodput, make_figure, cli_views, write_summary)


def _run(cfg: DemoConfig, out: str, summary: str | None, show_cli: bool, plot: bool, console: Console, t_start: float) -> int:
    run = DemoRun(cfg, out, console, t_start, summary=summary, show_cli=show_cli, plot=plot)
    for phase in CRASH_DEMO:
        phase(run)
    return conclude(run)
