"""Where a run's wall time went, from its event log (:mod:`ckptstore.events`): a pure function.

A run is every *attempt* in the log (one ``CheckpointManager`` from ``open`` to ``close`` — or to
its last line, when the process died), in the order they opened. Each attempt starts training at
the end of its restore (``restore`` line; the ``open`` line when it made none) from the restored
step (0 without one), and its ``progress`` lines say when ``save(step)`` returned for the steps it
reached (always for a step it saved, otherwise at most every ``progress_s``), with the seconds that
call blocked. A later attempt that restored step ``r`` redid everything the earlier attempts did
after ``r``: that is *lost* work. A ``rollback()`` (a ``restore`` line with ``rollback``) cuts its
attempt in two: the part after it trains from the step it restored, in the same process (no restart,
nothing until the next process), so what the part before it did after that step is lost too, and the
rollback's restore is recovery (``rollback_s``). So, with ``keep(a)`` = the smallest step a later attempt restored:

- ``useful``: from an attempt's training start to its ``save(keep(a))`` returning (to its end when
  nothing later restored an earlier step), less ``blocked``;
- ``blocked``: seconds the loop spent inside ``save()`` (staging, back-pressure, the preemption
  save's wait for its commit) in that kept part;
- ``lost``: the rest of the attempt's training, up to its end (the ``close()`` call, or — for a
  process that died, a loop that failed, a preemption that could not save — its last progress line
  or committed save);
- ``restart`` (recovery): from an attempt's end to the next one's training start, split into
  *restart* (until the next process started: detection, scheduling, process start), *init* (until
  the restore began: imports, process group, model) and *load* (the restore itself);
- ``startup``: from a launcher's ``launch`` marker (else the first process's start) to the first
  training start; ``other``: the rest of the wall time (``close()`` flushing the last save,
  shutdown, until a launcher's ``exit`` marker or the last line).

``goodput = useful / wall``. Figures are as exact as the log's time points: a process that died
between two progress lines is counted as dead at the earlier one (at most ``progress_s`` plus a step
early), and each line's time is one host's wall clock (rank 0's).

The advice (:func:`ckptstore.advise.advise`, Young/Daly) uses the measured save cost (mean
``blocked`` per save), the measured restart cost (mean recovery per restart), the step time and the
MTBF observed in the log (running time / crashes) when there are at least ``min_failures`` crashes,
else a given ``mtbf_s``. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Iterable

from .advise import Advice, advise


@dataclasses.dataclass
class Attempt:
    """One manager's part of the run (see the module docstring)."""

    id: str
    opened: float
    proc_start: float
    train_start: float
    end: float  # training ended: close() called, or the last sign of life of a process that died
    end_wall: float  # the attempt is over: close() returned, or ``end``
    ended: str  # "closed", "preempted" or "crashed"
    start_step: int
    last_step: int
    restored: str | None = None
    restore_t0: float | None = None
    restore_s: float = 0.0
    interval_steps: int | None = None
    keep_step: int | None = None  # steps after it were redone by a later attempt (None: all kept)
    useful: float = 0.0
    blocked: float = 0.0
    lost: float = 0.0
    lost_steps: int = 0
    saves: int = 0
    rollback: bool = False  # this part of a manager's run began with a rollback() (no new process)
    points: dict = dataclasses.field(default_factory=dict, repr=False)  # step -> (t, blocked_s, version)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("points")
        return d


@dataclasses.dataclass
class Report:
    """The accounting of one run (seconds unless named otherwise)."""

    wall: float
    useful: float
    blocked: float
    lost: float
    recovery: float
    startup: float
    other: float
    restart: float = 0.0  # recovery: until the next process started
    init: float = 0.0  # recovery: process start -> restore began
    load: float = 0.0  # recovery: the restores
    rollback_s: float = 0.0  # recovery spent in rollback() (its restores), not in restarts
    attempts: list[Attempt] = dataclasses.field(default_factory=list)
    steps: int = 0  # steps whose results are in the final state
    saves: dict[str, Any] = dataclasses.field(default_factory=dict)
    mtbf_s: float | None = None
    mtbf_source: str | None = None  # "observed", "given" or None
    advice: Advice | None = None
    advice_note: str | None = None
    skipped_lines: int = 0

    @property
    def goodput(self) -> float:
        return self.useful / self.wall if self.wall > 0 else 0.0

    @property
    def restarts(self) -> int:
        """Attempts after the first that a new process made (a rollback is not a restart)."""
        return sum(1 for a in self.attempts[1:] if not a.rollback)

    @property
    def rollbacks(self) -> int:
        return sum(1 for a in self.attempts if a.rollback)

    @property
    def restart_cost(self) -> float:
        """Mean recovery per restart (rollbacks apart), seconds; 0 without a restart."""
        return (self.recovery - self.rollback_s) / self.restarts if self.restarts else 0.0

    @property
    def failures(self) -> int:
        """Attempts that died (no ``close()``), whose loop failed (``close`` with ``loop_error``: a peer
        died) or whose preemption could not save."""
        return sum(1 for a in self.attempts if a.ended == "crashed")

    @property
    def preemptions(self) -> int:
        return sum(1 for a in self.attempts if a.ended == "preempted")

    @property
    def step_time(self) -> float | None:
        return self.useful / self.steps if self.steps else None

    def lost_work(self) -> list[dict[str, Any]]:
        """Per attempt whose work a later one redid: seconds and steps lost, how it ended."""
        return [{"attempt": a.id, "ended": a.ended, "lost_s": a.lost, "lost_steps": a.lost_steps,
                 "kept_to_step": a.keep_step} for a in self.attempts if a.keep_step is not None]

    def lost_distribution(self) -> dict[str, float] | None:
        xs = [w["lost_s"] for w in self.lost_work()]
        if not xs:
            return None
        return {"count": len(xs), "min": min(xs), "median": statistics.median(xs), "mean": statistics.fmean(xs),
                "max": max(xs), "total": sum(xs)}

    def rows(self) -> list[tuple[str, float]]:
        """The table's rows (label, seconds), in the order the command prints them."""
        return [
            ("useful training (steps kept, counted once)", self.useful),
            ("blocked in save (staging, back-pressure, preemption save)", self.blocked),
            ("work lost (redone after a restart)", self.lost),
            ("restart (end of an attempt -> training again)", self.recovery),
            ("   of which: until the next process started", self.restart),
            ("   of which: start-up of the process (imports, group, model)", self.init),
            ("   of which: restore (load the checkpoint)", self.load),
            ("start-up (launch -> first step)", self.startup),
            ("other (close/final flush, shutdown)", self.other),
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall, "useful_s": self.useful, "blocked_s": self.blocked, "lost_s": self.lost,
            "restart_s": self.recovery, "startup_s": self.startup, "other_s": self.other,
            "recovery": {"restart_s": self.restart, "init_s": self.init, "load_s": self.load, "rollback_s": self.rollback_s},
            "goodput": self.goodput, "attempts": self.restarts + 1, "restarts": self.restarts, "rollbacks": self.rollbacks,
            "failures": self.failures, "preemptions": self.preemptions, "steps": self.steps,
            "step_time_s": self.step_time, "saves": self.saves, "lost_work": self.lost_work(),
            "lost_distribution": self.lost_distribution(), "mtbf_s": self.mtbf_s, "mtbf_source": self.mtbf_source,
            "advice": None if self.advice is None else self.advice.to_json(), "advice_note": self.advice_note,
            "per_attempt": [a.to_json() for a in self.attempts], "skipped_lines": self.skipped_lines,
        }


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _is_rollback(e: dict[str, Any]) -> bool:
    return e["kind"] == "restore" and bool(e.get("rollback")) and e.get("outcome") == "restored"


def _attempts(events: list[dict[str, Any]]) -> list[Attempt]:
    """One :class:`Attempt` per manager (``a``), cut at each ``rollback()``: the part after a rollback
    trains from the step it restored, in the same process, so the steps the part before it ran after that
    step were redone (lost), and the rollback's restore is recovery."""
    by: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        a = e.get("a")
        if isinstance(a, str):
            by.setdefault(a, []).append(e)
    out = []
    for aid, es in by.items():
        opened = next((e for e in es if e["kind"] == "open"), None)
        t_open = opened["t"] if opened else min(e["t"] for e in es)
        proc_start = _num(opened.get("proc_start")) if opened else None
        interval = opened.get("interval_steps") if opened else None
        cuts = [e for e in es if _is_rollback(e)]
        parts: list[tuple[list[dict[str, Any]], dict[str, Any] | None]] = []
        rest = [e for e in es if not _is_rollback(e)]
        before: dict[str, Any] | None = None
        for rb in cuts:  # lines before the rollback began belong to the part it ended
            t0 = _num(rb.get("t0")) or rb["t"]
            parts.append(([e for e in rest if e["t"] < t0], before))
            rest = [e for e in rest if e["t"] >= t0]
            before = rb
        parts.append((rest, before))
        for i, (part, rb) in enumerate(parts):
            last = i == len(parts) - 1
            if rb is None:
                a = _attempt(aid, part, t_open, proc_start, interval, None if last else cuts[i])
            else:
                t0 = _num(rb.get("t0")) or rb["t"]
                a = _attempt(f"{aid}/rollback{i}", [rb, *part], t0, t0, interval, None if last else cuts[i])
                a.rollback = True
            out.append(a)
    out.sort(key=lambda a: (a.opened, a.train_start))
    return out


def _attempt(aid: str, es: list[dict[str, Any]], t_open: float, proc_start: float | None, interval: int | None,
             rolled_back: dict[str, Any] | None) -> Attempt:
    """The attempt (or the part of one) whose lines are ``es``; ``rolled_back``: the rollback that ended it."""
    restore = next((e for e in es if e["kind"] == "restore"), None)
    start_step, restored, r_t0, r_s = 0, None, None, 0.0
    train_start = t_open
    if restore is not None:
        train_start = restore["t"]
        r_s = _num(restore.get("seconds")) or 0.0
        r_t0 = _num(restore.get("t0")) or train_start - r_s
        if restore.get("outcome") == "restored" and isinstance(restore.get("step"), int):
            start_step, restored = restore["step"], restore.get("version")
    points: dict[int, tuple[float, float, str | None]] = {}
    alive = [train_start]
    for e in es:
        if e["kind"] == "progress" and isinstance(e.get("step"), int):
            points[e["step"]] = (e["t"], _num(e.get("blocked_s")) or 0.0, e.get("save"))
            alive.append(e["t"])
        elif e["kind"] == "save" and e.get("outcome") in ("committed", "committed-local"):
            alive.append(e["t"])
    close = next((e for e in es if e["kind"] == "close"), None)
    preempt = next((e for e in es if e["kind"] == "preempt" and e.get("saved")), None)
    if rolled_back is not None:  # the loop went back: this part ended when the rollback began
        end = end_wall = _num(rolled_back.get("t0")) or rolled_back["t"]
        ended = "rolled back"
    elif preempt is not None:  # saved the step reached, then exited
        end = (_num(close.get("t0")) or close["t"]) if close is not None else preempt["t"]
        end_wall = close["t"] if close is not None else preempt["t"]
        ended = "preempted"
    elif close is not None and not close.get("loop_error") and not any(e["kind"] == "preempt" for e in es):
        end = _num(close.get("t0")) or close["t"]
        end_wall = close["t"]
        ended = "closed"
    else:  # the process died, the loop failed (a peer died), or a preemption that could not save:
        end = end_wall = max(alive)  # counted from the last sign of progress
        ended = "crashed"
    return Attempt(
        id=aid, opened=t_open, proc_start=proc_start if proc_start is not None else t_open,
        train_start=train_start, end=max(end, train_start), end_wall=max(end_wall, train_start), ended=ended,
        start_step=start_step, last_step=max([start_step, *points]), restored=restored, restore_t0=r_t0,
        restore_s=r_s, interval_steps=interval, points=points,
    )


def _account_attempt(a: Attempt, keep: int | None) -> None:
    """Split ``a``'s training time into useful / blocked / lost given that steps after ``keep`` were redone."""
    a.keep_step = keep if keep is not None and keep < a.last_step else None
    if a.keep_step is None:
        kept_end, kept_steps = a.end, a.last_step
    else:
        at = [s for s in a.points if s <= a.keep_step]
        if a.keep_step <= a.start_step or not at:
            kept_end, kept_steps = a.train_start, a.start_step
        else:
            kept_steps = max(at)
            kept_end = a.points[kept_steps][0]
        a.lost_steps = a.last_step - max(kept_steps, a.start_step)
    kept_end = min(max(kept_end, a.train_start), a.end)
    a.blocked = sum(b for s, (t, b, _v) in a.points.items() if s <= kept_steps and t <= kept_end)
    a.saves = sum(1 for s, (t, _b, v) in a.points.items() if v and s <= kept_steps and t <= kept_end)
    a.useful = max(0.0, kept_end - a.train_start - a.blocked)
    a.lost = a.end - kept_end


def _save_stats(events: list[dict[str, Any]]) -> dict[str, Any]:
    saves = [e for e in events if e["kind"] == "save"]
    blocked = [b for e in events if e["kind"] == "progress" and e.get("save") for b in [_num(e.get("blocked_s"))] if b is not None]

    def mean(key):
        xs = [x for e in saves for x in [_num(e.get(key))] if x is not None]
        return statistics.fmean(xs) if xs else None

    lags = [x for e in saves for x in [_num(e.get("durable_lag_s"))] if x is not None]
    out: dict[str, Any] = {
        "started": len(blocked),
        "committed": sum(1 for e in saves if e.get("outcome") in ("committed", "committed-local")),
        "failed": sum(1 for e in saves if e.get("outcome") == "failed"),
        "mean_blocked_s": statistics.fmean(blocked) if blocked else None,
        "max_blocked_s": max(blocked) if blocked else None,
    }
    for k in ("stage_s", "write_s", "commit_s", "local_commit_s", "upload_s", "replicate_s", "remote_commit_s"):
        out[f"mean_{k}"] = mean(k)
    out["mean_durable_lag_s"] = statistics.fmean(lags) if lags else None
    out["max_durable_lag_s"] = max(lags) if lags else None
    for k in ("logical_bytes", "stored_bytes", "uploaded_bytes"):
        out[k] = sum(int(x) for e in saves for x in [_num(e.get(k))] if x is not None)
    last = saves[-1] if saves else None
    out["last"] = None if last is None else {k: last.get(k) for k in ("version", "step", "outcome", "durable_lag_s", "t")}
    return out


def account(events: Iterable[dict[str, Any]], *, mtbf_s: float | None = None, min_failures: int = 3,
            skipped_lines: int = 0) -> Report:
    """The :class:`Report` of the run whose event log holds ``events`` (see the module docstring).

    ``mtbf_s``: the MTBF (seconds) for the advice when the log has fewer than ``min_failures``
    crashes to measure it from. Raises ``ValueError`` when the log holds no attempt."""
    events = sorted((e for e in events if isinstance(e, dict) and "t" in e), key=lambda e: e["t"])
    ranks = [e["rank"] for e in events if isinstance(e.get("rank"), int)]
    if ranks:  # a log that several ranks wrote: the lowest rank's lines (rank 0 writes by default)
        events = [e for e in events if e.get("rank", min(ranks)) == min(ranks)]
    attempts = _attempts(events)
    if not attempts:
        raise ValueError("the event log holds no CheckpointManager lines (no 'open', 'progress' or 'save')")
    for i, a in enumerate(attempts):
        later = [b.start_step for b in attempts[i + 1:]]
        _account_attempt(a, min(later) if later else None)
    recovery = restart = init = load = rolled = 0.0
    for prev, a in zip(attempts, attempts[1:]):
        rec = max(0.0, a.train_start - prev.end_wall)
        recovery += rec
        if a.rollback:
            rolled += rec
        r = min(rec, max(0.0, a.proc_start - prev.end_wall))
        began = max(a.proc_start, prev.end_wall)
        ld = min(a.restore_s, max(0.0, rec - r)) if a.restore_t0 is not None else 0.0
        restart += r
        load += ld
        init += max(0.0, rec - r - ld) if a.restore_t0 is not None else max(0.0, a.train_start - began)
    launches = [e["t"] for e in events if e["kind"] == "launch" and e["t"] <= attempts[0].proc_start]
    exits = [e["t"] for e in events if e["kind"] == "exit" and e["t"] >= attempts[-1].end_wall]
    t0 = min(launches) if launches else min(attempts[0].proc_start, attempts[0].opened)
    t1 = max(exits) if exits else attempts[-1].end_wall
    wall = max(0.0, t1 - t0)
    useful = sum(a.useful for a in attempts)
    blocked = sum(a.blocked for a in attempts)
    lost = sum(a.lost for a in attempts)
    startup = max(0.0, attempts[0].train_start - t0)
    other = wall - useful - blocked - lost - recovery - startup
    rep = Report(wall, useful, blocked, lost, recovery, startup, other, restart, init, load, rolled, attempts,
                 steps=sum(max(0, (a.keep_step if a.keep_step is not None else a.last_step) - a.start_step)
                           for a in attempts),
                 saves=_save_stats(events), skipped_lines=skipped_lines)
    _advise(rep, mtbf_s, min_failures)
    return rep


#: Google's buckets (ml-goodput-measurement's ``BadputType``, README "Badput Breakdown Details",
#: github.com/AI-Hypercomputer/ml-goodput-measurement), in the order :func:`google_buckets` gives them
GOOGLE_BUCKETS = (
    ("productive", "productive (goodput)"),
    ("checkpoint_save", "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME"),
    ("checkpoint_restore", "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME"),
    ("wasted_progress", "WASTED_PROGRESS_FROM_DISRUPTION"),
    ("infrastructure_recovery", "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION"),
    ("other", "OTHER (start-up, training preparation, shutdown)"),
)


def google_buckets(rep: Report) -> dict[str, Any]:
    """``rep``'s wall time in the buckets of Google's ml-goodput-measurement (seconds), which sum to the wall:

    - ``productive``: ``useful`` (their goodput: productive step time);
    - ``checkpoint_save``: ``blocked`` — UNPRODUCTIVE_CHECKPOINT_SAVE_TIME, "the first blocking operation"
      of an asynchronous save (the copy to host memory) plus a preemption's synchronous save;
    - ``checkpoint_restore``: the restores (``restart``'s *restore* part) — UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME;
    - ``wasted_progress``: ``lost`` — WASTED_PROGRESS_FROM_DISRUPTION, "time that was spent on productive
      training but lost after restart";
    - ``infrastructure_recovery``: ``restart``'s part until the next process started —
      INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION, which their calculator takes as the next job start minus
      the last disruption;
    - ``other``: process start-up after a restart (imports, process group, model: their
      TPU_INITIALIZATION, TRAINING_PREP and PROGRAM_STARTUP, which ckptstore does not tell apart), the first
      start-up, close and shutdown.

    Also ``wall``, ``goodput`` and ``steps``."""
    out = {
        "productive": rep.useful,
        "checkpoint_save": rep.blocked,
        "checkpoint_restore": rep.load,
        "wasted_progress": rep.lost,
        "infrastructure_recovery": rep.restart,
        "other": rep.init + rep.startup + rep.other,
    }
    out.update(wall=rep.wall, goodput=rep.goodput, steps=rep.steps)
    return out


def _advise(rep: Report, mtbf_s: float | None, min_failures: int) -> None:
    running = sum(a.end_wall - a.proc_start for a in rep.attempts)
    if rep.failures >= max(1, min_failures):
        rep.mtbf_s, rep.mtbf_source = running / rep.failures, "observed"
    elif mtbf_s:
        rep.mtbf_s, rep.mtbf_source = float(mtbf_s), "given"
    cost = rep.saves.get("mean_blocked_s")
    if rep.mtbf_s is None:
        rep.advice_note = (f"no interval advice: {rep.failures} crash(es) in the log (at least {min_failures} "
                           "give an observed MTBF); pass --mtbf")
        return
    if cost is None or not rep.steps:
        rep.advice_note = "no interval advice: no save measured"
        return
    restart = rep.restart_cost
    iv = rep.attempts[-1].interval_steps
    cur = iv * rep.step_time if iv and rep.step_time else None
    rep.advice = advise(cost_s=cost, mtbf_s=rep.mtbf_s, restart_s=restart, step_time_s=rep.step_time,
                        current_interval_s=cur)
