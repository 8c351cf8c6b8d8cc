"""``ckptstore demo``: the click command (attached to the ``ckptstore`` group by ``ckptstore/cli.py``)."""

from __future__ import annotations

import sys

import click

from .supervisor import DemoConfig

_D = DemoConfig()


@click.command("demo", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--out", default="demo-out", show_default=True, type=click.Path(file_okay=False),
              help="Directory for the runs, stores, plot and summary (previous demo results in it are replaced).")
@click.option("--remote", default=None, metavar="s3://BUCKET/PREFIX",
              help="Also stage every checkpoint to this S3 prefix (endpoint/credentials from the boto3 chain).")
@click.option("--seaweedfs", is_flag=True, help="Start a SeaweedFS S3 server on loopback for this run (stopped after) and use it as --remote.")
@click.option("--steps", default=_D.steps, show_default=True, type=int)
@click.option("--save-every", default=_D.save_every, show_default=True, type=int, help="Checkpoint interval in steps.")
@click.option("--crash-step", default=_D.crash_step, show_default=True, type=int, help="A save step: the crash rank dies right after that async_save.")
@click.option("--crash-rank", default=_D.crash_rank, show_default=True, type=int)
@click.option("--world-size", default=_D.world_size, show_default=True, type=int, help="Ranks of the reference run and of the crash run before the crash.")
@click.option("--resume-world-size", default=None, type=int,
              help="Restart the crashed run on this many ranks (e.g. 1 or 3): reshards through DCP; losses continue, not bit-exact.")
@click.option("--parallel", type=click.Choice(["fsdp", "ddp"]), default=_D.parallel, show_default=True)
@click.option("--layers", default=_D.layers, show_default=True, type=int)
@click.option("--d-model", default=_D.d_model, show_default=True, type=int)
@click.option("--heads", default=_D.heads, show_default=True, type=int)
@click.option("--context", default=_D.context, show_default=True, type=int)
@click.option("--global-batch", default=_D.global_batch, show_default=True, type=int, help="Samples per step over all ranks.")
@click.option("--lr", default=_D.lr, show_default=True, type=float)
@click.option("--seed", default=_D.seed, show_default=True, type=int)
@click.option("--corpus", "corpus_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="Train on the *.py files of this directory instead of the Python standard library.")
@click.option("--summary", default=None, type=click.Path(dir_okay=False), help="Write the results as JSON here.")
@click.option("--no-cli", is_flag=True, help="Skip the ckptstore list/gc/scrub views at the end.")
@click.option("--no-plot", is_flag=True, help="Skip the PNG.")
def demo(out, remote, seaweedfs, steps, save_every, crash_step, crash_rank, world_size, resume_world_size,
         parallel, layers, d_model, heads, context, global_batch, lr, seed, corpus_dir, summary, no_cli, no_plot):
    """Train a small transformer on 2 CPU ranks, SIGKILL one mid-save, resume, and prove it.

    Runs a reference job and a crash job (torchrun, gloo, FSDP2, AdamW, LR schedule,
    StatefulDataLoader, dcp.async_save to ckptstore every --save-every steps), checks that the
    resumed job's per-step losses and sample ids equal the reference bit for bit, reports goodput,
    plots both, and shows `ckptstore list / gc --dry-run / scrub` of the store. Exit 0 when every
    check passes, 1 when one fails, 2 on bad options.
    """
    from .orchestrate import DemoError, run_demo

    if remote and seaweedfs:
        raise click.UsageError("--remote and --seaweedfs are alternatives")
    cfg = DemoConfig(
        steps=steps, save_every=save_every, crash_step=crash_step, crash_rank=crash_rank, world_size=world_size,
        resume_world_size=resume_world_size, parallel=parallel, layers=layers, d_model=d_model, heads=heads,
        context=context, global_batch=global_batch, lr=lr, seed=seed, corpus_dir=corpus_dir, remote=remote,
        warmup=max(1, min(_D.warmup, steps // 10)),
    )
    try:
        rc = run_demo(cfg, out, summary=summary, seaweed=seaweedfs, show_cli=not no_cli, plot=not no_plot)
    except DemoError as e:
        raise click.UsageError(str(e)) from e
    sys.exit(rc)


if __name__ == "__main__":
    demo()
