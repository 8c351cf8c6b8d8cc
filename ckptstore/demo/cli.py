"""``ckptstore demo``: the click command (wired into the ``ckptstore`` group by ``ckptstore/cli/``).

This module imports without the ``demo`` extra (so ``ckptstore --help`` always lists ``demo``); the
command checks the extra itself before any work: :func:`check_extra`.
"""

from __future__ import annotations

import importlib
import sys

import click

from .supervisor import DemoConfig


class _Duration(click.ParamType):
    """``30m``, ``90s``, ``1h30m`` or plain seconds (:func:`ckptstore.retention.parse_duration`); defined here,
    not taken from ``ckptstore.cli``, whose package imports this module."""

    name = "duration"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)):
            return float(value)
        from ..retention import parse_duration

        try:
            return parse_duration(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


DURATION = _Duration()

_D = DemoConfig()
#: ``--chaos``: the LR schedule's length and the checkpoint interval (a fault every 2 minutes: Young/Daly
#: with a save that blocks ~0.05 s gives seconds; every 5 steps keeps the work a fault loses small)
CHAOS_STEPS, CHAOS_SAVE_EVERY = 3000, 5

INSTALL_HINT = "pip install 'ckptstore[demo]'"


class MissingExtraError(click.ClickException):
    """The ``demo`` extra is not installed (exit 2: the demo cannot run as set up)."""

    exit_code = 2


def check_extra(plot: bool) -> bool:
    """Import what the demo's training workers need (torchdata) before any work; raise
    :class:`MissingExtraError` naming the install command when it is missing. Returns whether the
    plot can be drawn: a missing matplotlib only skips the plot, with a one-line note."""
    try:
        importlib.import_module("torchdata.stateful_dataloader")
    except ImportError as e:
        raise MissingExtraError(f"the demo needs the 'demo' extra: cannot import torchdata ({e}); "
                                f"install it with: {INSTALL_HINT}") from None
    if not plot:
        return False
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        click.echo(f"note: matplotlib is not installed, so the plot is skipped ({INSTALL_HINT} adds it)", err=True)
        return False
    return True


@click.command("demo", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--out", default="demo-out", show_default=True, type=click.Path(file_okay=False),
              help="Directory for the runs, stores, plot and summary (previous demo results in it are replaced).")
@click.option("--remote", default=None, metavar="s3://BUCKET/PREFIX",
              help="Also stage every checkpoint to this S3 prefix (endpoint/credentials from the boto3 chain).")
@click.option("--seaweedfs", is_flag=True, help="Start a SeaweedFS S3 server on loopback for this run (stopped after) and use it as --remote.")
@click.option("--steps", default=None, type=int,
              help=f"Training steps of each run [default: {_D.steps}]; with --chaos the LR schedule's length "
                   f"[default: {CHAOS_STEPS}] (the run itself stops when its time is up).")
@click.option("--save-every", default=None, type=int,
              help=f"Checkpoint interval in steps [default: {_D.save_every}; with --chaos {CHAOS_SAVE_EVERY}].")
@click.option("--crash-step", default=_D.crash_step, show_default=True, type=int, help="A save step: the crash rank dies right after that save (mgr.save) returned.")
@click.option("--crash-rank", default=_D.crash_rank, show_default=True, type=int, help="The rank that SIGKILLs itself at --crash-step.")
@click.option("--world-size", default=_D.world_size, show_default=True, type=int, help="Ranks of the reference run and of the crash run before the crash.")
@click.option("--resume-world-size", default=None, type=int,
              help="Restart the crashed run on this many ranks (e.g. 1 or 3): reshards through DCP; losses continue, not bit-exact.")
@click.option("--nodes", default=_D.nodes, show_default=True, type=int,
              help="Run each job as this many simulated nodes (one torchrun agent each, c10d rendezvous on 127.0.0.1), "
                   "each with its own local root; the crash kills the crash rank's whole node mid-save.")
@click.option("--replicas", default=_D.replicas, show_default=True, type=click.IntRange(min=0),
              help="CheckpointManager(replicas=F): copy each node's part of every checkpoint to F other nodes' local "
                   "roots (needs --nodes 2 or more); the crashed node then comes back as a new machine with an empty "
                   "root and the job resumes from its peers' replicas.")
@click.option("--replace-node/--same-node", "replace_node", default=None,
              help="Wipe the crashed node's local root before the relaunch (a replaced machine), or give it its disk "
                   "back. Default: replace it exactly when --replicas is given. Without --replicas it needs "
                   "--seaweedfs or --remote (the part is then read from S3).")
@click.option("--parallel", type=click.Choice(["fsdp", "ddp"]), default=_D.parallel, show_default=True,
              help="Data parallelism: FSDP2 fully_shard (sharded state) or DDP (replicated).")
@click.option("--layers", default=_D.layers, show_default=True, type=int, help="Transformer blocks.")
@click.option("--d-model", default=_D.d_model, show_default=True, type=int, help="Model width.")
@click.option("--heads", default=_D.heads, show_default=True, type=int, help="Attention heads (must divide --d-model).")
@click.option("--context", default=_D.context, show_default=True, type=int, help="Context length in bytes.")
@click.option("--global-batch", default=_D.global_batch, show_default=True, type=int, help="Samples per step over all ranks.")
@click.option("--lr", default=_D.lr, show_default=True, type=float, help="Peak learning rate (AdamW, warmup then cosine).")
@click.option("--seed", default=_D.seed, show_default=True, type=int, help="Seed of the model, data order and dropout.")
@click.option("--corpus", "corpus_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="Train on the *.py files of this directory instead of the Python standard library.")
@click.option("--chaos", "chaos", default=None, type=DURATION, metavar="DURATION",
              help="Instead of the crash demo: train unattended for DURATION (e.g. 30m) under a seeded schedule of "
                   "real faults (docs/DEMO.md, \"Chaos\"), then a fault-free reference of the same steps and the "
                   "same schedule with stock DCP; goodput, every fault's recovery, bit-exactness.")
@click.option("--fault-every", default=120.0, show_default=True, type=DURATION, metavar="SECONDS",
              help="With --chaos: one fault every this many seconds (jittered by up to a quarter).")
@click.option("--faults", "fault_kinds", default=None, metavar="KIND,...",
              help="With --chaos: only these fault kinds (default: every kind the set-up can run).")
@click.option("--peer", "peer_mode", default="alongside", show_default=True,
              type=click.Choice(["alongside", "after", "none"]),
              help="With --chaos: the stock-DCP run under the same schedule: started alongside the ckptstore run "
                   "(the same machine load for both), alone after the reference, or none.")
@click.option("--no-peer", is_flag=True, help="With --chaos: the same as --peer none.")
@click.option("--summary", default=None, type=click.Path(dir_okay=False), help="Write the results as JSON here.")
@click.option("--no-cli", is_flag=True, help="Skip the ckptstore list/gc/scrub views at the end.")
@click.option("--no-plot", is_flag=True, help="Skip the PNG.")
def demo(out, remote, seaweedfs, steps, save_every, crash_step, crash_rank, world_size, resume_world_size, nodes,
         replicas, replace_node, parallel, layers, d_model, heads, context, global_batch, lr, seed, corpus_dir, chaos,
         fault_every, fault_kinds, peer_mode, no_peer, summary, no_cli, no_plot):
    """Train a small transformer on 2 CPU ranks, SIGKILL one mid-save, resume, and prove it.

    Runs a reference job and a crash job (torchrun, gloo, FSDP2, AdamW, LR schedule,
    StatefulDataLoader, ckptstore.CheckpointManager async saves every --save-every steps), checks that the
    resumed job's per-step losses and sample ids equal the reference bit for bit, reports goodput,
    plots both, and shows `ckptstore list / gc --dry-run / scrub` of the store. Needs the demo
    extra (pip install 'ckptstore[demo]'); without matplotlib the plot is skipped. Exit 0 when every
    check passes, 1 when one fails, 2 on bad options or a missing extra.
    """
    if remote and seaweedfs:
        raise click.UsageError("--remote and --seaweedfs are alternatives")
    if chaos is not None:
        check_extra(plot=False)
        from .chaos.run import ChaosOptions, run_chaos_demo
        from .orchestrate import DemoError

        steps = CHAOS_STEPS if steps is None else steps
        cfg = DemoConfig(
            steps=steps, save_every=CHAOS_SAVE_EVERY if save_every is None else save_every, world_size=world_size,
            nodes=nodes, replicas=replicas, parallel=parallel, layers=layers, d_model=d_model, heads=heads,
            context=context, global_batch=global_batch, lr=lr, seed=seed, corpus_dir=corpus_dir, remote=remote,
            warmup=max(1, min(_D.warmup, steps // 10)), crash_step=0,
        )
        opts = ChaosOptions(duration_s=chaos, fault_every_s=fault_every, peer=not no_peer and peer_mode != "none",
                            peer_mode="after" if peer_mode == "after" else "alongside",
                            kinds=tuple(k.strip() for k in fault_kinds.split(",") if k.strip()) if fault_kinds else None)
        try:
            rc = run_chaos_demo(cfg, opts, out, summary=summary, seaweed=seaweedfs, show_cli=not no_cli)
        except DemoError as e:
            raise click.UsageError(str(e)) from e
        sys.exit(rc)
    steps = _D.steps if steps is None else steps
    save_every = _D.save_every if save_every is None else save_every
    plot = check_extra(plot=not no_plot)
    from .orchestrate import DemoError, run_demo

    cfg = DemoConfig(
        steps=steps, save_every=save_every, crash_step=crash_step, crash_rank=crash_rank, world_size=world_size,
        resume_world_size=resume_world_size, nodes=nodes, replicas=replicas, replace_node=replace_node, parallel=parallel, layers=layers, d_model=d_model, heads=heads,
        context=context, global_batch=global_batch, lr=lr, seed=seed, corpus_dir=corpus_dir, remote=remote,
        warmup=max(1, min(_D.warmup, steps // 10)),
    )
    try:
        rc = run_demo(cfg, out, summary=summary, seaweed=seaweedfs, show_cli=not no_cli, plot=plot)
    except DemoError as e:
        raise click.UsageError(str(e)) from e
    sys.exit(rc)


if __name__ == "__main__":
    demo()
