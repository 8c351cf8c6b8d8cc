"""Checkpoint interval advice: the interval that maximises goodput.

With a checkpoint cost ``C`` (seconds training is blocked per save), a mean time between failures
``M`` and a restart cost ``R`` (seconds from a failure until training runs again, loading included),
the first-order optimum interval is Young's

    t_opt = sqrt(2 C M)                                   (Young 1974, "A first order
                                                           approximation to the optimum checkpoint
                                                           interval", CACM 17(9))

and Daly's higher-order refinement, valid for C < 2M (Daly 2006, "A higher order estimate of the
optimum checkpoint interval for restart dumps", FGCS 22(3)):

    t_opt = sqrt(2 C M) * (1 + sqrt(C/(2M))/3 + (C/(2M))/9) - C

The expected goodput (useful fraction of wall time) of checkpointing every ``t`` seconds of work,
with exponentially distributed failures (Daly's model), is

    goodput(t) = t / (M * exp(R/M) * (exp((t + C)/M) - 1))

No torch import: the CLI uses this module.
"""

from __future__ import annotations

import dataclasses
import math
import re

import click


@dataclasses.dataclass(frozen=True)
class Advice:
    """``interval_s``: seconds of training between checkpoints; ``interval_steps`` when a step time
    is known; ``goodput``: expected useful fraction at that interval; ``goodput_at`` the same for
    the interval in use (when given); ``young_s``: the first-order interval for reference."""

    interval_s: float
    young_s: float
    goodput: float
    interval_steps: int | None = None
    current_interval_s: float | None = None
    goodput_at_current: float | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        s = f"checkpoint every {_fmt_s(self.interval_s)}"
        if self.interval_steps is not None:
            s += f" (every {self.interval_steps} steps)"
        s += f": expected goodput {self.goodput:.1%}"
        if self.goodput_at_current is not None:
            s += f"; now every {_fmt_s(self.current_interval_s)}: {self.goodput_at_current:.1%}"
        return s


def goodput(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Expected useful fraction of wall time when checkpointing every ``interval_s`` seconds of work."""
    if interval_s <= 0:
        return 0.0
    m = mtbf_s
    return interval_s / (m * math.exp(restart_s / m) * math.expm1((interval_s + cost_s) / m))


def optimal_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (Young's sqrt(2CM) to first order); ``mtbf_s`` when C ≥ 2M."""
    if cost_s <= 0:
        return 0.0
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    x = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - cost_s


def advise(
    *, cost_s: float, mtbf_s: float, restart_s: float = 0.0, step_time_s: float | None = None,
    current_interval_s: float | None = None,
) -> Advice:
    """The goodput-maximising checkpoint interval for the measured costs (see module docstring)."""
    if mtbf_s <= 0:
        raise ValueError("mtbf must be positive")
    if cost_s < 0 or restart_s < 0:
        raise ValueError("cost and restart must be >= 0")
    t = optimal_interval(cost_s, mtbf_s)
    steps = None
    if step_time_s:
        steps = max(1, round(t / step_time_s))
        t = steps * step_time_s
    cur = None if current_interval_s is None else goodput(current_interval_s, cost_s, mtbf_s, restart_s)
    return Advice(t, math.sqrt(2 * cost_s * mtbf_s), goodput(t, cost_s, mtbf_s, restart_s), steps, current_interval_s, cur)


_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``"6h"``, ``"90m"``, ``"45s"``, ``"2d"`` or plain seconds → seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|m|min|h|d)?\s*", str(text))
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 45s, 90m, 6h, 2d)")
    return float(m.group(1)) * _UNITS[m.group(2) or ""]


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "?"
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"


class _Duration(click.ParamType):
    name = "duration"

    def convert(self, value, param, ctx):
        try:
            return parse_duration(value) if not isinstance(value, (int, float)) else float(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


@click.command("advise")
@click.option("--mtbf", type=_Duration(), required=True, help="mean time between failures of the job (e.g. 6h)")
@click.option("--cost", type=_Duration(), required=True, help="seconds training is blocked per checkpoint")
@click.option("--restart", type=_Duration(), default="0", show_default=True, help="seconds from a failure until training runs again")
@click.option("--step-time", type=_Duration(), default=None, help="seconds per training step (advice in steps)")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def advise_cmd(mtbf, cost, restart, step_time, as_json):
    """Checkpoint interval that maximises goodput (Young/Daly: sqrt(2 * cost * MTBF))."""
    a = advise(cost_s=cost, mtbf_s=mtbf, restart_s=restart, step_time_s=step_time)
    if as_json:
        import json

        click.echo(json.dumps(a.to_json(), indent=2))
    else:
        click.echo(str(a))
        click.echo(f"  (Young's first-order interval: {_fmt_s(a.young_s)}; MTBF {_fmt_s(mtbf)}, cost {cost:g} s, restart {restart:g} s)")


if __name__ == "__main__":  # pragma: no cover
    advise_cmd()
