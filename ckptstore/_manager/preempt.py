"""Preemption of a :class:`ckptstore.CheckpointManager`: the agreement on the step, the last save, the
watchdog.

- **Preemption** (``save_on_signal=``, ``grace_s=``). A scheduler's SIGTERM (Slurm ``--signal``,
  Kubernetes, spot VMs, ``torchrun`` forwarding it) only *records* the request in the handler. Every
  ``save()`` call runs one asynchronous all-reduce of two numbers (the signal, its time) on a second
  small gloo group of the manager, issued at one call and read at the next, so all ranks learn of a
  signal that reached any of them at the same ``save(step)`` call: that call becomes a forced save of
  ``step`` on every rank, waits (within the grace period) for its commit — the remote one when there
  is a remote tier, whatever ``durability`` says, at least the local one (saying so) when the upload
  does not fit — and raises
  :class:`~ckptstore.errors.Preempted` (a ``SystemExit``: exit status 128 + signal, 143 for SIGTERM).
  Waits are bounded by the grace period: a rank that never reaches ``save()`` makes the others give
  up (``Preempted`` with ``saved=False``) instead of hanging, and a watchdog thread ends the process
  (``os._exit``, the same status) at the grace period's end minus a reserve when it is still alive
  (e.g. blocked in the training loop's own collective with that rank). In-flight saves finish first
  (queue order) or die with the process: a manifest commits a version whole or not at all.

The handlers and the wakeup fd are the process's (:mod:`.signals`: every manager registers with its
:data:`~.signals.HUB`); what one manager learns, agrees and saves is its :class:`Preemption`'s. The
save itself is the manager's: :meth:`Preemption.save_last` gets it as a callable.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal as _signal
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from .._groups import destroy_group, new_gloo_group
from ..errors import Preempted
from .signals import HUB, Wakeup

log = logging.getLogger("ckptstore")


def wanted_signals(save_on_signal: Any) -> tuple[tuple[int, ...], bool]:
    """``(signals, explicit)`` for a manager's ``save_on_signal`` (``"auto"``: SIGTERM, not explicit)."""
    if isinstance(save_on_signal, str) and save_on_signal == "auto":
        return (int(_signal.SIGTERM),), False
    if save_on_signal in (None, False):
        return (), True
    xs = save_on_signal if isinstance(save_on_signal, (tuple, list)) else (save_on_signal,)
    return tuple(int(x) for x in xs), True


@dataclasses.dataclass
class LastSave:
    """How the save after a signal went (wall times of its local and remote commits)."""

    saved: bool = False
    durability: str | None = None
    reason: str | None = None
    local_at: float | None = None
    remote_at: float | None = None
    info: Any = None  # the SaveInfo, once the save was started

    def await_commit(self, deadline: float | None, remote_here: bool) -> None:
        """Wait for the commit of :attr:`info` until ``deadline`` (monotonic): the remote one when
        this rank makes it (``remote_here``: a remote tier, and the coordinator), else the local one."""
        info = self.info
        while True:
            if info.local_commit_s is not None and self.local_at is None:
                self.local_at = time.time()
            if info.remote_commit_s is not None and self.remote_at is None:
                self.remote_at = time.time()
            if info.error is not None or info.remote_commit_s is not None:
                break
            if info.local_commit_s is not None and not remote_here:
                break  # only the coordinator makes (and sees) the remote commit
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(0.02)

    def judge(self, grace_s: float | None, remote_here: bool) -> None:
        """Set :attr:`saved`, :attr:`durability` and :attr:`reason` from what the wait saw."""
        info = self.info
        self.saved = self.local_at is not None
        self.durability = "remote" if info.remote_commit_s is not None else ("local" if self.saved else None)
        if not self.saved:
            self.reason = info.error or f"the save did not commit within the grace period ({grace_s:g} s)"
        elif remote_here and self.durability == "local":
            self.reason = ("committed locally only: the upload did not finish within the grace period; the next "
                           "run's first save uploads it" if info.error is None else f"committed locally only: {info.error}")


class Preemption:
    """One manager's preemption on rank ``rank``: the signals it listens for (``save_on_signal``),
    the signal learnt (:attr:`sig`, its wall and monotonic times), the agreement rounds (with
    ``multi_rank``, on a gloo group of its own, :attr:`ctl`), the watchdog, and :attr:`preempted`
    once the last save raised. ``emit(kind, **fields)`` records events.

    Construct it on every rank at the same point (it creates the group and agrees once whether any
    rank listens)."""

    def __init__(self, *, save_on_signal: Any, grace_s: float | None, rank: int, multi_rank: bool, emit) -> None:
        self.grace_s = grace_s
        self.rank = rank
        self._emit = emit
        #: how to resume, in the words of the loop's framework (``{step}``, ``{version}`` filled in)
        self.resume_hint = "Resume with mgr.resume()"
        wanted, explicit = wanted_signals(save_on_signal)
        #: a signal was asked for (whether or not this rank could install a handler for it)
        self.wanted = bool(wanted)
        self.signals: tuple[int, ...] = ()  # the signals this rank handles
        self.sig: int | None = None  # the signal received (by this rank, or by a peer: learnt at save())
        self.sig_wall: float | None = None
        self.sig_mono: float | None = None
        self._sig_event = threading.Event()
        self.preempted: Preempted | None = None
        self._watch_stop = False
        self._watchdog_thread: threading.Thread | None = None
        self._wake: Wakeup | None = None
        self._round = None  # (work, tensor): the all-reduce issued at the last save() call
        self.ctl = None
        if wanted:
            self._listen(wanted, explicit)
        self.rounds = False
        if wanted and multi_rank:
            # every rank creates it here, in the same order; the ranks agree once whether any listens
            self.ctl = new_gloo_group()  # keyed per creation, like the manager's group
            flag = torch.tensor([1.0 if self.signals else 0.0], dtype=torch.float64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctl)
            self.rounds = bool(flag.item())

    # -- signals (the process's: .signals) ---------------------------------------------------------
    def _listen(self, wanted: tuple[int, ...], explicit: bool) -> None:
        self.signals = HUB.listen(self, wanted, explicit)
        if self.signals and self.grace_s is not None:
            # the watchdog hears the signal through Python's wakeup fd, written by the C-level handler
            # at once: the Python handler runs only once the main thread is back in the interpreter,
            # which a loop blocked in a collective with a stuck rank never is
            self._wake = Wakeup.install()
            self._watchdog_thread = threading.Thread(target=self._watchdog, name="ckptstore-preempt-watchdog", daemon=True)
            self._watchdog_thread.start()

    def on_signal(self, signum: int) -> None:
        """From the signal handler: record only."""
        if self.sig is None:
            self.sig = int(signum)
            if self.sig_mono is None:  # (the watchdog may have heard it first, through the wakeup fd)
                self.sig_wall, self.sig_mono = time.time(), time.monotonic()
        self._sig_event.set()

    def forked(self) -> None:
        """In a forked child: no signals, no wakeup fd, no rounds."""
        if self._wake is not None:
            self._wake.uninstall()
            self._wake = None
        self.signals, self.rounds = (), False

    def _leave(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        HUB.unlisten(self)
        if self._wake is not None:
            self._wake.uninstall()

    # -- deadlines and the watchdog ----------------------------------------------------------------
    def reserve(self) -> float:
        return min(5.0, max(1.0, (self.grace_s or 0.0) / 10))

    def hard_deadline(self) -> float | None:
        """Monotonic time the watchdog ends the process (None: no signal, or no grace period)."""
        if self.sig_mono is None or self.grace_s is None:
            return None
        return self.sig_mono + self.grace_s - self.reserve()

    def work_deadline(self) -> float | None:
        """Monotonic time the last save and its waits give up."""
        d = self.hard_deadline()
        return None if d is None else d - self.reserve()

    def close_budget(self) -> Callable[[], float | None]:
        """``left()``: seconds a close after the signal may still wait (None: no bound)."""
        d = self.hard_deadline()
        return (lambda: None) if d is None else (lambda: max(0.0, d - self.reserve() / 2 - time.monotonic()))

    def _wake_watchdog(self) -> None:
        self._sig_event.set()
        if self._wake is not None:
            self._wake.poke()

    def stop_watchdog(self) -> None:
        """End the watchdog thread unless a signal came (then it ends the process at its deadline).
        Joined: a thread left waiting at interpreter exit makes torch 2.13's teardown abort more often
        (pytorch/pytorch #190489)."""
        t = self._watchdog_thread
        if self.sig is None and self.sig_mono is None and t is not None:
            self._watch_stop = True
            self._wake_watchdog()
            t.join(1.0)
            if self._wake is not None and not t.is_alive():
                self._wake.close()

    def _watchdog(self) -> None:
        seen = None
        while True:
            if self._wake is not None:
                got = self._wake.wait()
            else:
                self._sig_event.wait()
                got = b""
            if self._watch_stop and self.sig is None and self.sig_mono is None:
                return
            seen = next((b for b in got if b in self.signals), None)
            if seen is not None and self.sig_mono is None:  # before the Python handler ran
                self.sig_wall, self.sig_mono = time.time(), time.monotonic()
            if self.sig_mono is not None:
                break
            if self._wake is None and not got:
                return
        d = self.hard_deadline()
        if d is None:
            return
        time.sleep(max(0.0, d - time.monotonic()))
        self._end_process(int(self.sig or seen or _signal.SIGTERM))

    def _end_process(self, signum: int) -> None:
        code = 128 + signum
        name = _signal.Signals(signum).name
        why = ("the process did not end after the last save" if self.preempted is not None else
               "the training loop did not reach save() (or the save did not finish)")
        msg = (f"ckptstore: {name} {time.monotonic() - self.sig_mono:.1f} s ago, grace period {self.grace_s:g} s: "
               f"{why}; ending the process now (exit {code}) before the scheduler kills it")
        try:
            self._emit("preempt", signal=name, outcome="grace period over", saved=bool(self.preempted and self.preempted.saved),
                       step=None if self.preempted is None else self.preempted.step, exit_code=code, reason=why)
            log.error(msg)
            for h in logging.getLogger().handlers + log.handlers + [logging.lastResort]:
                if h is not None:
                    h.flush()
        finally:
            os._exit(code)

    # -- the agreement round (at every save() call) ------------------------------------------------
    def due(self) -> bool:
        """:meth:`poll` has anything to do at this ``save()`` call."""
        return self.rounds or self.sig is not None

    def poll(self) -> tuple | None:
        """At a ``save()`` call: ``(signal, its wall time, why not to save or None)`` when the job is to stop here —
        learnt from the all-reduce issued at the previous call (every rank reads it at the same call)
        or, outside a multi-rank job, from this process's handler — else None (and the next
        all-reduce is issued)."""
        if not self.rounds:
            return None if self.sig is None else (self.sig, self.sig_wall, None)
        agreed = None
        if self._round is not None:
            work, t = self._round
            deadline = self.work_deadline()
            try:
                if deadline is None:
                    work.wait()
                elif not work.is_completed():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    work.wait(_timedelta(left))
            except BaseException as e:  # noqa: BLE001 - gloo raises RuntimeError("... timed out") on a timeout
                return self._round_failed(e, deadline)
            self._round = None
            sig, neg_t = t.tolist()
            if sig > 0:
                agreed = (int(sig), -neg_t, None)
        if agreed is not None:
            return agreed
        t = torch.tensor([float(self.sig or 0), -self.sig_wall if self.sig_wall is not None else -1e18],
                         dtype=torch.float64)
        self._round = (dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctl, async_op=True), t)
        return None

    def _round_failed(self, e: BaseException, deadline: float | None) -> tuple | None:
        """The last round did not complete: stop here without saving when a signal came, else go on
        without rounds (signals handled per rank)."""
        self._round = None
        if self.sig is not None:
            self.rounds = False
            late = deadline is not None and time.monotonic() >= deadline - 0.05
            why = (f"a rank did not reach save() within the grace period ({self.grace_s:g} s)" if late else
                   f"the ranks could not agree on the step ({type(e).__name__}: {str(e)[:200]}; a rank is gone?)")
            return (self.sig, self.sig_wall, why + "; nothing was saved at this step")
        self.rounds = False
        log.warning("ckptstore: the preemption check across ranks failed (%s: %s); signals are handled "
                    "per rank from now on", type(e).__name__, e)
        return None

    def finish_round(self) -> None:
        """Let the last preemption all-reduce complete (every rank issued it at its last save() call)
        and drop it, so that no collective of this manager is left to gloo's threads at exit
        (pytorch/pytorch #190489: a gloo worker freeing a collective's tensors while Python finalises)."""
        r, self._round = self._round, None
        if r is None:
            return
        try:
            if not r[0].is_completed():
                r[0].wait(_timedelta(5.0 if self.sig is None else 0.5))
        except BaseException:  # noqa: BLE001 - a peer that is gone: nothing to wait for
            pass

    # -- the last save -----------------------------------------------------------------------------
    def adopt(self, pre: tuple) -> None:
        """Take the signal :meth:`poll` agreed on: a peer's signal starts this rank's grace period too."""
        signum, t_sig, _failed = pre
        if self.sig is None:  # a peer got the signal: this rank's grace period runs from that one
            self.sig, self.sig_wall = signum, t_sig
        if self.sig_wall is None or t_sig < self.sig_wall:
            self.sig_wall = t_sig
        self.sig_mono = time.monotonic() - max(0.0, time.time() - self.sig_wall)
        self._wake_watchdog()

    def save_last(self, step: int, version: str, pre: tuple, start: Callable, committed_locally: Callable[[], bool],
                  remote: bool) -> LastSave:
        """The save of ``step`` (``version``) after the signal :meth:`adopt` took: ``start(deadline)``
        starts it and returns its SaveInfo; waits for its commit (the remote one with a ``remote``
        tier on rank 0) until the work deadline. ``committed_locally()``: the version's manifest is
        in the local tier (the PROCESS executor's subprocess may have committed it unseen)."""
        signum, _t, failed = pre
        name = _signal.Signals(signum).name
        deadline = self.work_deadline()
        out = LastSave()
        if failed:
            out.reason = failed
        elif deadline is not None and time.monotonic() >= deadline:
            out.reason = f"the grace period ({self.grace_s:g} s after {name}) was over when this rank reached save()"
        else:
            if self.rank == 0:
                log.warning("ckptstore: %s received: saving step %d (%s) before exiting (grace period %s)", name, step,
                            version, "none" if self.grace_s is None else f"{self.grace_s:g} s")
            remote_here = remote and self.rank == 0
            try:
                out.info = start(deadline)
                out.await_commit(deadline, remote_here)
                if out.info.local_commit_s is None and committed_locally():
                    out.local_at = time.time()  # PROCESS: the subprocess committed it, the remote commit is pending
                out.judge(self.grace_s, remote_here)
            except Preempted:
                raise
            except BaseException as e:  # noqa: BLE001 - reported in Preempted; the process is ending anyway
                out.reason = f"{type(e).__name__}: {e}"
        return out

    def stop_loop(self, step: int, version: str, pre: tuple, last: LastSave, in_flight: bool) -> Preempted:
        """The :class:`Preempted` that ends the loop after :meth:`save_last` (recorded, logged and
        kept: a later ``save()`` raises it again)."""
        signum = pre[0]
        done_at = last.remote_at or last.local_at or time.time()
        seconds = done_at - (self.sig_wall or done_at)
        code = 128 + signum
        name = _signal.Signals(signum).name
        if last.saved:
            msg = (f"{name}: saved step {step} ({version}) {seconds:.1f} s after the signal, committed "
                   f"{'remotely' if last.durability == 'remote' else 'locally'}"
                   + (f" ({last.reason})" if last.reason else "") + f"; exiting with status {code}. "
                   + self.resume_hint.format(step=step, version=version))
        else:
            msg = f"{name}: step {step} not saved ({last.reason}); exiting with status {code}"
        exc = Preempted(msg, signal=signum, step=int(step), version=version if last.saved else None, saved=last.saved,
                        durability=last.durability, seconds=seconds, reason=last.reason, code=code)
        self.preempted = exc
        self._emit("preempt", signal=name, t_signal=self.sig_wall, step=int(step), version=version, saved=last.saved,
                   durability=last.durability, seconds=seconds,
                   local_s=None if last.local_at is None else last.local_at - self.sig_wall,
                   remote_s=None if last.remote_at is None else last.remote_at - self.sig_wall, in_flight=in_flight,
                   outcome="saved" if last.saved else "not saved", reason=last.reason, exit_code=code)
        (log.warning if last.saved else log.error)("ckptstore: %s", msg)
        return exc

    # -- closing -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the round's group (local, no collective), stop the watchdog (unless a signal came),
        give the signals back."""
        ctl, self.ctl = self.ctl, None
        destroy_group(ctl)
        self.stop_watchdog()
        self._leave()


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=max(0.001, seconds))
