"""``ckptstore goodput LOG``: where a run's wall time went, from its event log (:mod:`ckptstore.goodput`)."""

from __future__ import annotations

import os

import click

from ..errors import StoreNotFoundError
from ._common import DURATION, emit_json


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:8.1f} s"


@click.command("goodput")
@click.argument("log", metavar="LOG")
@click.option("--mtbf", type=DURATION, default=None, metavar="DURATION",
              help="MTBF for the interval advice when the log has fewer than --min-failures crashes (e.g. 6h).")
@click.option("--min-failures", type=int, default=3, show_default=True,
              help="Crashes needed to take the MTBF from the log.")
@click.option("--buckets", type=click.Choice(["ckptstore", "google", "both"]), default="ckptstore", show_default=True,
              help="The table's rows: ckptstore's, the buckets of Google's ml-goodput-measurement (productive, "
                   "checkpoint save, checkpoint restore, wasted progress, infrastructure recovery, other), or both.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def goodput(log, mtbf, min_failures, buckets, as_json):
    """Useful, blocked, lost and restart time of a run, its goodput, the work each crash lost, the
    measured save cost and the Young/Daly interval, from the event log LOG (a CheckpointManager's
    ROOT/events.jsonl, or ROOT itself). Every restart of a run that crashed counts."""
    from .. import events as _events
    from ..advise import format_seconds
    from ..goodput import GOOGLE_BUCKETS, account, google_buckets

    path = _events.default_path(log) if os.path.isdir(log) else log
    try:
        with open(path, "rb") as f:
            evs, bad = _events.parse(f)
    except FileNotFoundError:
        raise StoreNotFoundError(f"no event log at {path} (CheckpointManager writes ROOT/{_events.LOG_NAME})") from None
    try:
        rep = account(evs, mtbf_s=mtbf, min_failures=min_failures, skipped_lines=bad)
    except ValueError as e:
        raise click.ClickException(f"{path}: {e}") from None
    if bad:
        click.echo(f"warning: {bad} torn or unreadable line(s) skipped", err=True)
    if as_json:
        out = rep.to_json()
        out["google"] = google_buckets(rep)
        emit_json(out)
        return
    click.echo(f"run in {path}: {rep.restarts + 1} attempt(s), {rep.restarts} restart(s) "
               f"({rep.failures} crash(es), {rep.preemptions} preemption(s))"
               + (f", {rep.rollbacks} rollback(s)" if rep.rollbacks else "") + f", {rep.steps} steps kept")
    rows = []
    if buckets in ("ckptstore", "both"):
        rows += rep.rows()
    if buckets in ("google", "both"):
        g = google_buckets(rep)
        if buckets == "both":
            click.echo("  ckptstore's rows:")
            for label, x in rows:
                click.echo(f"  {label:<62} {_s(x)}  {x / rep.wall if rep.wall else 0:6.1%}")
            click.echo("  in the buckets of Google's ml-goodput-measurement:")
            rows = []
        rows += [(label, g[key]) for key, label in GOOGLE_BUCKETS]
    for label, x in rows:
        share = f"{x / rep.wall:6.1%}" if rep.wall else "     -"
        click.echo(f"  {label:<62} {_s(x)}  {share}")
    click.echo(f"  {'wall':<62} {_s(rep.wall)}")
    click.echo(f"  {'goodput = useful / wall':<62} {rep.goodput:8.1%}")
    lw = rep.lost_work()
    if lw:
        d = rep.lost_distribution()
        each = ", ".join(f"{w['lost_s']:.1f} s ({w['lost_steps']} steps, {w['ended']})" for w in lw)
        click.echo(f"lost work per restart: {each}; median {d['median']:.1f} s, max {d['max']:.1f} s")
    sv = rep.saves
    if sv.get("started"):
        click.echo(f"saves: {sv['started']} started, {sv['committed']} committed, {sv['failed']} failed; blocked "
                   f"{sv['mean_blocked_s']:.3f} s per save (max {sv['max_blocked_s']:.3f} s)"
                   + (f"; local commit {sv['mean_local_commit_s']:.2f} s" if sv.get("mean_local_commit_s") is not None else "")
                   + (f"; durable lag {sv['mean_durable_lag_s']:.2f} s (max {sv['max_durable_lag_s']:.2f} s)"
                      if sv.get("mean_durable_lag_s") is not None else ""))
    if rep.step_time:
        click.echo(f"step time {rep.step_time:.3f} s; restart cost {rep.restart_cost:.1f} s per restart")
    if rep.advice is not None:
        src = "observed" if rep.mtbf_source == "observed" else "given"
        click.echo(f"advice (MTBF {format_seconds(rep.mtbf_s)}, {src}): {rep.advice}")
    elif rep.advice_note:
        click.echo(rep.advice_note)
