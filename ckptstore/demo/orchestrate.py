"""The whole demo: reference run, crash run, verification, goodput, plot, CLI views, summary."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table

from .. import events
from . import backend
from .events import History
from .goodput import Goodput, account, disagreement, from_report
from .supervisor import DemoConfig, run_job
from .verify import verify

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


def _run(cfg: DemoConfig, out: str, summary: str | None, show_cli: bool, plot: bool, console: Console, t_start: float) -> int:
    from .data import load_corpus
    from .model import ByteGPT, count_params

    _, corpus = load_corpus(cfg.corpus_dir, cfg.corpus_max_bytes)
    nparams = count_params(ByteGPT(cfg.layers, cfg.d_model, cfg.heads, cfg.context, cfg.dropout))
    rw = cfg.resume_world_size or cfg.world_size
    if cfg.nodes > 1:
        per = cfg.world_size // cfg.nodes
        crash_node = cfg.crash_rank // per
        launch = f"{cfg.nodes} simulated nodes x {per}: a torchrun agent and a local root each, c10d rendezvous on 127.0.0.1"
        fault = (f"node {crash_node} (rank {cfg.crash_rank}'s) dies at step {cfg.crash_step} while that save is in flight: "
                 f"its ranks SIGKILL their agent and themselves; the supervisor relaunches all {cfg.nodes} nodes"
                 + (f", node {crash_node} as a new machine (its local root wiped)" if cfg.replaces_node() else ""))
    else:
        launch = "torchrun"
        fault = (f"rank {cfg.crash_rank} SIGKILLs itself at step {cfg.crash_step} while that save is in flight; "
                 f"restart on {rw} rank(s)")
    replicas = f", replicas={cfg.replicas}: each node's part also on {cfg.replicas} other node(s)" if cfg.replicas else ""
    console.rule("[bold]ckptstore demo")
    console.print(
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
        f"output    {out}",
        highlight=False,
    )

    console.rule("1/3 reference run (no crash)")
    ref_job = run_job(cfg, out, "reference", crash=False, console=console)
    console.rule("2/3 crash run (SIGKILL mid-save, " + ("a node dies, all nodes relaunched" if cfg.nodes > 1 else "torchrun restarts")
                 + ", mgr.resume())")
    run_job_ = run_job(cfg, out, "crash", crash=True, console=console)

    console.rule("3/3 verification")
    ref_h, run_h = History.of(ref_job.run_dir), History.of(run_job_.run_dir)
    v = verify(ref_h, run_h, asdict(cfg))
    reads = restore_reads(run_h)
    if run_job_.wiped_root and cfg.replicas:  # the replaced node's part came from its peers, not from S3
        got = reads or {}
        v.add("the replaced node's part was read from its peers' replicas"
              + (", with 0 S3 GETs" if run_job_.remote else ""),
              got.get("peer_bytes", 0) > 0 and got.get("remote_reads", 0) == 0,
              "no resume" if reads is None else
              f"{got['peer_bytes']} bytes from peers, {got['remote_reads']} S3 GET(s) over {got['ranks']} ranks")
        held = [r.version for r in backend.versions(run_job_.wiped_root)] if os.path.isdir(run_job_.wiped_root) else []
        v.add("the replaced node holds its part of the restored version again (re-replicated)",
              v.resumed_from in held, f"{run_job_.wiped_root} lists {', '.join(held) or 'nothing'}")

    # the table comes from `ckptstore goodput` (its library) on each run's own event log; the demo's
    # own accounting from the workers' step events must agree with it
    reports = {j.label: log_report(j) for j in (ref_job, run_job_)}
    gp, ref_gp = from_report(reports[run_job_.label]), from_report(reports[ref_job.label])
    own = {run_job_.label: account(run_job_, run_h), ref_job.label: account(ref_job, ref_h)}
    for label, mine in ((run_job_.label, gp), (ref_job.label, ref_gp)):
        off = disagreement(mine, own[label])
        v.add(f"ckptstore goodput on the {label} run's event log agrees with its step events", not off,
              "within rounding (every row ±0.2-0.3 s, goodput ±1 point)" if not off else
              "; ".join(f"{k} differs by {d:.2f}" for k, d in off.items()))
    t = Table(show_header=False, box=None)
    for c in v.checks:
        t.add_row("[green]PASS[/green]" if c.ok else "[bold red]FAIL[/bold red]", c.name, f"[dim]{c.detail}[/dim]")
    console.print(t)

    if reads is not None:
        where = "the replaced node's part from its peers' replicas, " if run_job_.wiped_root and cfg.replicas else ""
        console.print(
            f"restore reads ({reads['ranks']} ranks, CheckpointManager.last_restore.reads): {where}"
            f"{reads['peer_bytes'] / 2**20:.2f} MiB from peers, "
            + (f"[bold]{reads['remote_reads']} S3 GET(s)[/bold]" if run_job_.remote else "no remote tier")
            + f", {reads['fallback_reads']} fallback read(s)", highlight=False)

    console.print(goodput_table(gp, ref_gp))
    if (adv := gp.advice()) is not None:  # ckptstore advise, from this run's measured costs
        console.print(f"interval advice for an MTBF of 6 h (measured {gp.blocked / gp.saves:.2f} s blocked/save, "
                      f"{gp.recovery / max(gp.restarts, 1):.1f} s restart): {adv}", highlight=False)

    committed = [(r.version, r.step, r.created.timestamp() if r.created else None)
                 for r in backend.versions(run_job_.store_root, run_job_.remote)]
    png = None
    if plot:
        from .plot import plot as make_plot

        png = make_plot(
            os.path.join(out, "demo.png"), ref_h, run_h, ref_job, run_job_, gp, ref_gp, committed,
            f"ckptstore demo: {cfg.world_size} ranks, crash at step {cfg.crash_step}, resumed from {v.resumed_from}"
            f" on {v.resume_world_size} rank(s); bit-exact: {v.bit_exact}",
        )
        console.print(f"plot: {png}", highlight=False)

    scrub_rcs: list[int] = []
    if show_cli:
        console.rule("the crash run's store, through the ckptstore CLI" + (" (on each node)" if run_job_.node_roots else ""))
        extra = ["--remote", run_job_.remote] if run_job_.remote else []
        roots = run_job_.node_roots or [run_job_.store_root]
        for root in roots:
            ckptstore_cli(["list", root, *extra], console)
        # what a retention policy would prune: keep the 3 newest and the one with the lowest loss
        ckptstore_cli(["gc", roots[0], *extra, "--dry-run", "--keep-last", "3",
                       "--keep-best", "1", "--metric", "loss", "--mode", "min"], console)
        for root in roots:
            scrub_rcs.append(ckptstore_cli(["scrub", root, *extra], console))
        ckptstore_cli(["goodput", run_job_.store_root, "--mtbf", "6h"], console)  # the table above, from the command

    runtime = time.time() - t_start
    result: dict[str, Any] = {
        "passed": v.passed,
        "bit_exact": v.bit_exact,
        "goodput": gp.goodput,
        "steps": cfg.steps,
        "crash_step": v.crash_step,
        "resumed_from": v.resumed_from,
        "resumed_step": v.resumed_step,
        "world_size": cfg.world_size,
        "nodes": cfg.nodes,
        "node_roots": run_job_.node_roots,
        "replicas": cfg.replicas,
        "wiped_root": run_job_.wiped_root,
        "restore_reads": reads,
        "scrub_exit_codes": scrub_rcs,
        "resume_world_size": v.resume_world_size,
        "redone_steps": v.redone_steps,
        "max_rel_loss_diff": v.max_rel_loss_diff,
        "goodput_breakdown": gp.to_json(),
        "reference_goodput": ref_gp.to_json(),
        "goodput_from_step_events": own[run_job_.label].to_json(),
        "goodput_log": os.path.join(run_job_.store_root, events.LOG_NAME),
        "goodput_report": reports[run_job_.label].to_json(),
        "checks": [asdict(c) for c in v.checks],
        "final_loss": {"reference": ref_h.mean_loss(cfg.steps) if cfg.steps in ref_h.effective else None,
                       "crash_run": run_h.mean_loss(cfg.steps) if cfg.steps in run_h.effective else None},
        "store": run_job_.store_root,
        "remote": run_job_.remote,
        "versions": [c[0] for c in committed],
        "plot": png,
        "out": out,
        "runtime_s": runtime,
        "config": asdict(cfg),
    }
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(result, f, indent=2)
    if summary:
        with open(summary, "w") as f:
            json.dump(result, f, indent=2)

    console.rule()
    if v.passed:
        how = "bit for bit" if v.bit_exact else f"within {v.max_rel_loss_diff:.2%} (resharded: not bit-exact by design)"
        src = ""
        if run_job_.wiped_root and reads is not None:
            src = (" (the replaced node's part from its peers' replicas" if cfg.replicas else " (the replaced node's part from S3")
            src += f", {reads['remote_reads']} S3 GETs)" if run_job_.remote else ")"
        console.print(
            f"[bold green]PASS[/bold green]: the crashed run resumed from {v.resumed_from}{src} and matched the reference "
            f"{how}; goodput {gp.goodput:.1%} (reference {ref_gp.goodput:.1%}); demo took {runtime:.0f} s",
            highlight=False,
        )
        return 0
    failed = [c.name for c in v.checks if not c.ok]
    console.print(f"[bold red]FAIL[/bold red]: {'; '.join(failed)}  (events under {out})", highlight=False)
    return 1
