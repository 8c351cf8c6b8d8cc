"""``ckptstore advise``: the checkpoint interval that maximises goodput (Young/Daly, :mod:`ckptstore.advise`)."""

from __future__ import annotations

import click

from ._common import DURATION, emit_json


@click.command("advise")
@click.option("--mtbf", type=DURATION, required=True, metavar="DURATION", help="Mean time between failures of the job (e.g. 6h).")
@click.option("--cost", type=DURATION, required=True, metavar="DURATION",
              help="Seconds training is blocked per checkpoint (CheckpointManager.stats()['mean_blocked_s']).")
@click.option("--restart", type=DURATION, default="0", show_default=True, metavar="DURATION",
              help="Seconds from a failure until training runs again (restart and load).")
@click.option("--step-time", type=DURATION, default=None, metavar="DURATION", help="Seconds per training step (advice in steps too).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def advise(mtbf, cost, restart, step_time, as_json):
    """Checkpoint interval that maximises goodput: Daly's refinement of Young's sqrt(2 * cost * MTBF)."""
    from ..advise import advise as _advise, format_seconds

    try:
        a = _advise(cost_s=cost, mtbf_s=mtbf, restart_s=restart, step_time_s=step_time)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        emit_json(a.to_json())
    else:
        click.echo(str(a))
        young = "" if cost == 0 else f"Young's first-order interval: {format_seconds(a.young_s)}; "
        click.echo(f"  ({young}MTBF {format_seconds(mtbf)}, cost {cost:g} s, restart {restart:g} s)")
