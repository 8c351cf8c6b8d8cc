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

No torch or click import: ``ckptstore advise`` (ckptstore/cli/cmd_advise.py) and the manager use it.
"""

from __future__ import annotations

import dataclasses
import math


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
        """Seconds rounded to the millisecond, goodputs to 6 decimals (no ``327.20000000000005``)."""
        out = dataclasses.asdict(self)
        for k, v in out.items():
            if isinstance(v, float):
                out[k] = round(v, 6 if k.startswith("goodput") else 3)
        return out

    def __str__(self) -> str:
        if self.interval_s == 0:  # a free checkpoint: only the restart costs time
            return (f"checkpoint at every step (a checkpoint that costs 0 s loses no work): expected goodput "
                    f"{self.goodput:.1%}")
        s = f"checkpoint every {format_seconds(self.interval_s)}"
        if self.interval_steps is not None:
            s += f" (every {self.interval_steps} step{'' if self.interval_steps == 1 else 's'})"
        s += f": expected goodput {self.goodput:.1%}"
        if self.goodput_at_current is not None:
            s += f"; now every {format_seconds(self.current_interval_s)}: {self.goodput_at_current:.1%}"
        return s


def goodput(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Expected useful fraction of wall time when checkpointing every ``interval_s`` seconds of work;
    for ``cost_s == 0`` and ``interval_s == 0`` the limit ``exp(-R/M)`` (continuous free checkpoints)."""
    if interval_s <= 0:
        return math.exp(-restart_s / mtbf_s) if cost_s == 0 else 0.0
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
    elif cost_s == 0:
        t = 0.0  # as often as possible: at every step (goodput: the limit, see goodput())
    cur = None if current_interval_s is None else goodput(current_interval_s, cost_s, mtbf_s, restart_s)
    return Advice(t, math.sqrt(2 * cost_s * mtbf_s), goodput(t, cost_s, mtbf_s, restart_s), steps, current_interval_s, cur)


def format_seconds(s: float | None) -> str:
    if s is None:
        return "?"
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"
