"""Pacing: a background save's bookkeeping spread over time (``background_duty``).

A save's fixed CPU cost is Python on the thread that runs it: DCP's planning, the commit (the DCP
metadata object, the manifest), retention's listing of the root after the commit. For a small state
that is the whole save: 10-16 ms of CPU per rank on this project's 2-core machine, wherever its bytes
go. Where the training keeps every core busy that CPU comes out of training steps, and lowering the
save's priority does not hide it (``benchmarks/pace_bench.py``: 6 gloo ranks sharing 2 cores, a
synchronised step of ~16 ms, a 15 ms burst of Python per rank every 100 steps): in a nice-19 thread
the burst added 37-40 ms to the 6 steps after it and put p99 ÷ p50 at 2.40-2.51 against 1.95-2.00
with no burst; in a nice-19 process of its own (no GIL shared) 35-41 ms and 2.41-2.44; at nice 0 or
under ``SCHED_IDLE``, thread or process, no better. Paced at a duty of 0.02 the same burst left p99 ÷
p50 at 1.95-2.01 (docs/DEMO.md, "The tier in the step-time tail").

A paced thread (:func:`install`, one :class:`Pacer` per thread) passes :func:`point` at places
between the pieces of that work; where it used more than :data:`QUANTUM_S` of its own CPU
(``time.thread_time``) since its last pause, it sleeps so that its CPU time stays at most ``duty``
of its wall time — at most :data:`MAX_SLEEP_S` at a time and at most ``budget_s`` per save (each
:meth:`Pacer.start`, whose first pause is a random one of up to :data:`START_JITTER_S`: saves that
several processes start at one step begin at different steps), so a save is never held past its
group's collective timeout; the save queue also gives each save at most a quarter of the time since
the previous one was queued, less the CPU the previous one took (the first save, with no cadence
known, is not paced), and a save stops pausing once another is waiting behind it (``hurry``; also
once its owner waits for it, closes, or must save after a preemption signal; the torchft tier hurries
its saves a quarter of an interval after their step). Points sit outside locks, never between a
commit's fence check and its commit point, and never between retention's listing of the root and its
deletions (that pass is one piece: a pause there would widen the time in which a version committed
by another writer after the listing could reference objects about to be deleted). The encoder and upload threads are never paced (a small save's few frames are
encoded on the save thread, within a piece). Where no pacer is installed (every other thread)
:func:`point` is one thread-local lookup.
"""

from __future__ import annotations

import os
import random
import threading
import time

#: CPU seconds a paced thread may use between two pauses (one piece)
QUANTUM_S = 0.001
#: the longest single pause (seconds)
MAX_SLEEP_S = 0.2
#: a save's first piece waits a random pause of up to this long (seconds): the saves that several
#: processes start at one step (a due step) do not all take their first piece in the same step
START_JITTER_S = 0.1
#: the most a save is paused in all (seconds; a quarter of its group's timeout when that is less)
MAX_BUDGET_S = 2.0

_local = threading.local()
#: the random first pauses draw from a generator of their own, seeded from the OS: never from the
#: ``random`` module's, whose state a training loop may seed, save and restore (a paced save must not
#: change what a resumed run draws), and never the same on ranks seeded alike
_rng = random.Random(os.urandom(16))


class Pacer:
    """Keeps the CPU time of the thread it is installed on at most ``duty`` (0 < duty < 1) of its wall
    time across :func:`point` calls, pausing at most ``budget_s`` seconds per :meth:`start`."""

    __slots__ = ("duty", "budget_s", "save_budget_s", "mark", "slept", "hurry")

    def __init__(self, duty: float, budget_s: float = MAX_BUDGET_S, hurry: threading.Event | None = None) -> None:
        if not 0.0 < duty < 1.0:
            raise ValueError(f"duty must be in (0, 1), not {duty!r}")
        #: set (another save is waiting behind this one, or the owner expects the next soon): the pause
        #: in progress ends and no other is taken
        self.hurry = hurry if hurry is not None else threading.Event()
        self.duty = float(duty)
        self.budget_s = self.save_budget_s = float(budget_s)
        self.mark = time.thread_time()
        self.slept = 0.0

    def start(self, budget_s: float | None = None) -> None:
        """A new save: its pauses count from zero, at most ``budget_s`` of them (default: the
        pacer's budget; never more), and the first is a random one (up to :data:`START_JITTER_S`)."""
        self.slept = 0.0
        self.save_budget_s = self.budget_s if budget_s is None else min(self.budget_s, max(0.0, budget_s))
        self._pause(min(_rng.uniform(0.0, START_JITTER_S), self.save_budget_s))
        self.mark = time.thread_time()

    def point(self) -> None:
        now = time.thread_time()
        used = now - self.mark
        if used < QUANTUM_S:
            return
        self._pause(min(used * (1.0 / self.duty - 1.0), MAX_SLEEP_S, self.save_budget_s - self.slept))
        self.mark = time.thread_time()

    def _pause(self, seconds: float) -> None:
        """Sleep ``seconds`` (none when not positive, or hurried: a ``hurry`` set meanwhile ends it),
        counted in :attr:`slept`."""
        if seconds > 0 and not self.hurry.is_set():
            t0 = time.monotonic()
            self.hurry.wait(seconds)
            self.slept += min(seconds, time.monotonic() - t0)


def install(pacer: Pacer | None) -> None:
    """Pace the calling thread with ``pacer`` (None: no longer)."""
    _local.pacer = pacer


def current() -> Pacer | None:
    return getattr(_local, "pacer", None)


def point() -> None:
    """A place where the calling thread may pause (see the module docstring)."""
    p = getattr(_local, "pacer", None)
    if p is not None:
        p.point()


def budget_for(timeout_s: float | None) -> float:
    """The pauses one save may take: :data:`MAX_BUDGET_S`, or a quarter of its group's collective
    timeout (seconds) when that is less."""
    return MAX_BUDGET_S if timeout_s is None else min(MAX_BUDGET_S, timeout_s / 4)
