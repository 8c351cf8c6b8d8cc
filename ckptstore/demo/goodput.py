"""Where the wall time of a job went.

The demo's table comes from ``ckptstore goodput`` (:mod:`ckptstore.goodput`) on the run's own
event log — the lines rank 0's ``CheckpointManager`` appended to ``<store>/events.jsonl`` and the
supervisor's ``launch``/``exit`` markers — through :func:`from_report`. :func:`account` is the
demo's own, independent accounting from the workers' per-step events (below); the verification
checks that the two agree.

Time stamps come from rank 0's step events (ranks step in lock-step; the crash time is the dying
rank's ``crash`` event) and from the supervisor (torchrun launch and exit):

- ``useful``: compute of the steps whose results are in the final model (data, forward,
  backward, optimizer), counted once;
- ``blocked``: time the training loop spent inside ``CheckpointManager.save`` (staging the state to host
  memory) plus any wait for the previous save (back-pressure), for saves that were not lost;
- ``lost``: compute and save blocking of steps whose results died with the crash and were redone;
- ``recovery``: from the crash to the first step of the restarted workers (detection, teardown,
  restart, process start-up, rendezvous, loading the checkpoint);
- ``startup``: launch to the first step; ``other``: the rest (shutdown, the final save's flush).

``goodput = useful / wall``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .events import History
from .supervisor import Job


@dataclass
class Goodput:
    wall: float
    useful: float
    blocked: float
    lost: float
    recovery: float
    startup: float
    other: float
    # recovery broken down
    restart: float = 0.0  # crash -> restarted processes started
    init: float = 0.0  # process start -> ready to load (imports, process group, model)
    load: float = 0.0  # loading the checkpoint
    saves: int = 0
    steps: int = 0  # steps whose results are in the final model
    restarts: int = 0
    #: the interval advice of ``ckptstore goodput`` (:attr:`ckptstore.goodput.Report.advice`) for this
    #: run: one computation, so the demo prints the figure the command prints (None: not from a report)
    advice: Any = None

    @property
    def goodput(self) -> float:
        return self.useful / self.wall if self.wall > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("advice")
        d["goodput"] = self.goodput
        d["advice_mtbf_6h"] = None if self.advice is None else self.advice.to_json()
        return d


def from_report(rep) -> Goodput:
    """The table's figures from a :class:`ckptstore.goodput.Report` (``ckptstore goodput`` on the run's log)."""
    kept_saves = sum(a.saves for a in rep.attempts)
    return Goodput(rep.wall, rep.useful, rep.blocked, rep.lost, rep.recovery, rep.startup, rep.other, rep.restart,
                   rep.init, rep.load, kept_saves, rep.steps, rep.restarts, rep.advice)


#: rows of the table the two accountings must agree on, and the tolerance (seconds): each is a
#: difference of time points a line or two apart (a step's own logging, rank 0's vs the dying rank's
#: clock reading). The recovery's split differs more: the log takes a worker's start from the kernel
#: (its exec, /proc), the step events from train.py's first line, after interpreter start-up and the
#: ``ckptstore`` package import (0.3-0.4 s on two busy cores); their sum agrees like the other rows.
AGREE = {"wall": 0.2, "useful": 0.3, "blocked": 0.2, "lost": 0.3, "recovery": 0.3, "startup": 0.3,
         "restart": 1.5, "init": 1.5, "load": 0.2}
#: plus this share of the row: a row that sums many steps (useful, lost) sums their gaps too, which
#: grow with the load of the machine (0.31-0.33 s of 170 s of useful time at a load average of 13 on
#: 2 cores); the same relative bound as the goodput's ±1 point
AGREE_SHARE = 0.01


def disagreement(a: Goodput, b: Goodput) -> dict[str, float]:
    """Rows where ``a`` and ``b`` differ by more than :data:`AGREE` (seconds) plus :data:`AGREE_SHARE`
    of the row, and the goodput (points)."""
    out = {}
    for k, tol in AGREE.items():
        x, y = getattr(a, k), getattr(b, k)
        if abs(x - y) > tol + AGREE_SHARE * max(abs(x), abs(y)):
            out[k] = abs(x - y)
    if abs(a.goodput - b.goodput) > 0.01:
        out["goodput"] = abs(a.goodput - b.goodput)
    if a.restarts != b.restarts:
        out["restarts"] = abs(a.restarts - b.restarts)
    return out


def account(job: Job, h: History) -> Goodput:
    wall = job.t1 - job.t0
    useful = blocked = lost = recovery = 0.0
    restart = init = load = 0.0
    steps = restarts = 0
    for (a, r, s), e in h.steps.items():
        if r != 0:
            continue
        if h.effective.get(s) == a:
            useful += e["t1"] - e["t0"]
            steps += 1
        else:
            lost += e["t1"] - e["t0"]
    saves = 0
    for e in h.of_kind("save"):
        dt = e["t1"] - e["wait0"]
        if h.effective.get(e["step"]) == e["attempt"]:
            blocked += dt
            saves += 1
        else:
            lost += dt
    first0 = h.first_step_event(0)
    startup = (first0["t0"] - job.t0) if first0 else 0.0
    for a in h.attempts:
        if a == 0:
            continue
        first = h.first_step_event(a)
        if first is None:
            continue
        prev_end = h.crash["t"] if (h.crash and h.crash["attempt"] == a - 1) else max(
            (e["t"] for e in h.events if e["attempt"] == a - 1), default=first["t0"]
        )
        recovery += first["t0"] - prev_end
        restarts += 1
        starts = [e["t"] for e in h.of_kind("proc_start", a, rank=None)]
        if starts:
            restart += min(starts) - prev_end
        res = h.resumed.get(a)
        if res:
            init += res["t0"] - (min(starts) if starts else prev_end)
            load += res["t1"] - res["t0"]
    other = wall - useful - blocked - lost - recovery - startup
    return Goodput(wall, useful, blocked, lost, recovery, startup, other, restart, init, load, saves, steps, restarts)
