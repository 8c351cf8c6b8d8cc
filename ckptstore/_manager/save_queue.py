"""The saves of a :class:`ckptstore.CheckpointManager` after staging: run in order, errors kept.

- **One save at a time, bounded queue.** ``save()`` blocks training only to copy the state into
  host buffers (staging), then queues the save. With the THREAD executor (default) saves run in
  order on one worker thread; at most ``max_pending`` staged saves wait behind the running one.
  **Policy when the queue is full: ``save()`` waits for the oldest save to start** (it never skips
  a due save); the wait counts as blocked time. With the PROCESS executor at most one save is in
  flight (torch's checkpoint subprocess is shared and can hang with two): ``save()`` first waits
  for the previous save.
- **Errors are never lost.** A save that fails raises from the next ``save()``, ``wait()`` or
  ``close()`` — the ckptstore error type a rank raised (``StorageFullError``, ``VersionExistsError``,
  ``KeyServiceError``, ...), naming the step and version; ``close()`` also raises ``UploadError`` for
  versions not uploaded. A save that fails
  in a collective breaks the job (:mod:`.job`): queued saves then fail without running.

The policy when the queue is full is the queue's: ``on_busy="wait"`` (above) or ``"skip"`` — a
caller that must never block a training step (under torchft, docs/FORMAT.md Save rule 9) skips a due
save while the queue is full (:meth:`SaveQueue.busy`; the save line says ``outcome: "skipped"``).
With ``raise_errors=False`` a failed save is only reported (its save line, ``on_save``), never raised
from a later call; a job that lost ranks still raises :class:`JobBrokenError`.

**Background priority.** The worker thread lowers its own CPU priority by ``nice`` (Linux: the
thread's nice value, ``setpriority(PRIO_PROCESS, tid, ...)``; elsewhere nothing is lowered). The
threads it starts inherit it: the frame encoders, and the upload, replica and tier-client threads
that it starts first — those pools persist and serve later uploads and reads at that priority too.
On a machine whose cores the training keeps busy a save then takes more of its CPU from the time
the training leaves idle (19 is what RocksDB's ``Env::LowerThreadPoolCPUPriority(...,
CpuPriority::kLow)`` gives its background threads). Unlike RocksDB's, these threads share the GIL
(and a few locks) with the training thread: while a lowered thread holds it and waits for a core,
the training thread waits too. Measured on 6 training processes sharing 2 cores (docs/DEMO.md,
"torchft: the seed rate"), 19 spread a due step's cost over two steps instead of one (+30 and +22
ms instead of +50) for the same total, and p99 read × 1.12 against × 1.24 over 11,000 steps (not
beyond the noise over 3,000). A lowered save also takes longer, and
:class:`ckptstore.CheckpointManager` (whose due save waits for the previous one) leaves it off by
default (0); the torchft tier, whose due save is skipped instead, lowers its saves (19). The last
save after a preemption signal (``urgent``) runs on a new worker at the process's own priority, once
the saves queued before it are done: an unprivileged thread cannot raise its priority back
(``RLIMIT_NICE``), so the lowered worker is ended instead.

**Background pacing.** With ``duty`` (``background_duty``) the worker thread pauses between the
pieces of a save's bookkeeping so that its own CPU stays at most that share of its wall time
(:mod:`ckptstore._pace`): the CPU is spread over more training steps rather than taken from the next
one or two, which priority alone does not do (measured there). ``SaveInfo.paused_s`` says how long a
save paused. The last save after a preemption signal runs on a new, unpaced worker, as above.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import queue
import sys
import threading
import time
from typing import Callable

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from .. import _pace
from .. import errors as _errors
from ..errors import CkptStoreError, JobBrokenError
from .job import group_failure, short_cause

log = logging.getLogger("ckptstore")


class SaveQueue:
    """The saves of one manager through ``writer`` (with a ``remote`` tier or not) on ``job``'s
    group: ``executor`` ``"thread"`` (a worker thread behind a queue of ``max_pending``) or
    ``"process"`` (DCP's checkpoint subprocess, one save in flight). ``report(info)`` is called once
    per save when it has committed (locally, and remotely when the writer has a remote commit for
    it) or failed (``info.error``).

    :attr:`infos` lists every save's :class:`~.info.SaveInfo`, oldest first (guarded by ``lock``)."""

    def __init__(self, *, writer, job, remote: bool, executor: str, max_pending: int, report: Callable,
                 on_busy: str = "wait", raise_errors: bool = True, nice: int = 0, duty: float | None = None) -> None:
        self.executor = executor
        #: how much the worker thread lowers its priority (the nice increment; 0: not at all; Linux only)
        self.nice = nice if sys.platform.startswith("linux") else 0
        #: the worker thread's CPU at most this share of its wall time (:mod:`ckptstore._pace`; None: unpaced)
        self.duty = duty
        self._last_submit: float | None = None  # when the previous save was queued (monotonic)
        self._last_busy_s = 0.0  # the CPU the previous save took on this thread (seconds)
        #: set: the running save pauses no more (hurry(), a save queued behind it, or someone waiting
        #: for the saves; cleared when the next starts unless one of the last two still holds)
        self._hurry = threading.Event()
        self._waiters = 0  # callers waiting for the saves (wait, drain, stop, an urgent save)
        self._waiters_lock = threading.Lock()
        self.on_busy = on_busy
        self.raise_errors_later = raise_errors
        self._writer, self._job, self._remote, self._report = writer, job, remote, report
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._worker: threading.Thread | None = None
        self._proc_future = None  # PROCESS: the one save in flight
        self._errors: list[str] = []
        self._causes: list = []  # per failed save: its ckptstore error (``_typed_cause``) or None
        self._raw: list = []  # per failed save: what DCP raised (the typed error's ``__cause__``)
        self.lock = threading.Lock()
        self.infos: list = []

    # -- starting saves ----------------------------------------------------------------------------
    def busy(self) -> bool:
        """With ``on_busy="skip"``: a new save would wait (the queue is full, or a PROCESS save is in
        flight); always False with ``"wait"``."""
        if self.on_busy != "skip":
            return False
        if self.executor == "process":
            f = self._proc_future
            return f is not None and not f.done()
        return self._queue.full()

    def submit(self, info, sd: dict, t0: float, extra: dict, deadline: float | None = None,
               urgent: bool = False) -> None:
        """Stage ``sd`` and queue (THREAD) or hand to DCP's checkpoint subprocess (PROCESS) the save
        ``info`` (``save()`` called at monotonic ``t0``); with ``deadline`` (monotonic), waits for
        earlier saves only until then (:class:`CkptStoreError` past it). ``urgent``: the save runs at
        the process's priority (the last save after a preemption signal; "Background priority"
        above). Sets ``info.blocked_s`` and ``extra["stage_s"]``."""
        if self.executor == "process":
            if not self.wait_process(None if deadline is None else max(0.0, deadline - time.monotonic())):
                raise CkptStoreError("the save in flight did not finish within the grace period")
            self.raise_errors()
            t_stage = time.monotonic()
            fut = dcp.async_save(
                sd, checkpoint_id=info.version, storage_writer=self._writer, process_group=self._job.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            )
            extra["stage_s"] = time.monotonic() - t_stage
            info.blocked_s = time.monotonic() - t0
            self._proc_future = fut
            fut.add_done_callback(lambda f, info=info, t0=t0: self._process_done(f, info, t0))
        else:
            t_stage = time.monotonic()
            staged = self._writer.stage(sd)
            extra["stage_s"] = time.monotonic() - t_stage
            if urgent and (self.nice or self.duty is not None):
                self._full_priority(deadline)
            self._ensure_worker()
            # a paced save pauses at most a quarter of the time since the previous save was queued, less
            # the CPU the previous one took, so pacing never carries it into the next one's turn; the
            # first (no cadence yet) is not paced
            now = time.monotonic()
            budget = 0.0 if self._last_submit is None else max(0.0, (now - self._last_submit) / 4 - self._last_busy_s)
            self._last_submit = now
            if self._queue.unfinished_tasks:
                self._hurry.set()  # a save in flight ahead of this one pauses no more (set before the put:
                # an idle worker that takes this save at once clears it for its own start)
            try:  # blocks while max_pending saves wait (policy: wait)
                self._queue.put((info, staged, t0, budget),
                                timeout=None if deadline is None else max(0.001, deadline - time.monotonic()))
            except queue.Full:
                raise CkptStoreError("the saves in flight did not start within the grace period") from None
            info.blocked_s = time.monotonic() - t0
        with self.lock:
            self.infos.append(info)

    def run_here(self, info, sd: dict, t0: float) -> None:
        """Save ``sd`` as ``info`` in this thread (``dcp.save``), after the saves in flight; a failure
        is recorded in ``info`` and kept to be raised, as for a queued save."""
        with self.lock:
            self.infos.append(info)
        try:
            dcp.save(sd, checkpoint_id=info.version, storage_writer=self._writer, process_group=self._job.pg)
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            info.blocked_s = time.monotonic() - t0
            self._failed(info, e)
            return
        info.blocked_s = info.local_commit_s = time.monotonic() - t0
        self._track_remote(info, t0)

    def hurry(self) -> None:
        """The save running now (a paced one) pauses no more: its owner expects the next one soon (a
        call before the worker takes the save is cleared when it starts)."""
        self._hurry.set()

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._run, name="ckptstore-manager", daemon=True)
            self._worker.start()

    def _full_priority(self, deadline: float | None) -> None:
        """Before an urgent save: once the saves queued before it are done (until ``deadline``,
        monotonic, :class:`CkptStoreError` past it; None: no bound), end the lowered (or paced) worker;
        the next one starts at the priority of the thread calling this (the training thread's), unpaced."""
        with self._hurrying():  # the saves ahead of it pause no more
            self._wait_worker(deadline)
        self._worker = None
        self.nice = 0
        self.duty = None

    @contextlib.contextmanager
    def _hurrying(self):
        """While in it: the saves in flight and those that start pause no more (someone waits for them)."""
        with self._waiters_lock:
            self._waiters += 1
        self._hurry.set()
        try:
            yield
        finally:
            with self._waiters_lock:
                self._waiters -= 1

    def _wait_worker(self, deadline: float | None) -> None:
        q, w = self._queue, self._worker
        with q.all_tasks_done:
            while q.unfinished_tasks and w is not None and w.is_alive():  # a dead worker runs nothing
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CkptStoreError("the saves in flight did not finish within the grace period")
                q.all_tasks_done.wait(1.0 if left is None else min(1.0, left))
        if w is not None and w.is_alive():
            q.put(None)  # the worker is idle in get(): it takes this and returns
            w.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        if self.nice:
            lower_priority(self.nice)
        pacer = None
        if self.duty is not None:
            timeout = None if self._job.timeout is None else self._job.timeout.total_seconds()
            # a save waiting behind this one: no more pauses (the next due save is never skipped for them)
            pacer = _pace.Pacer(self.duty, _pace.budget_for(timeout), hurry=self._hurry)
            _pace.install(pacer)
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                info, staged, t0, budget = job
                try:
                    self._job.check()  # the group may have broken since save() queued it: never run it
                    c_run = time.thread_time()
                    self._hurry.clear()
                    if self._queue.qsize() or self._waiters:
                        self._hurry.set()  # another save waits behind this one, or someone waits for it
                    if pacer is not None:
                        pacer.start(budget)
                    try:
                        dcp.save(staged, checkpoint_id=info.version, storage_writer=self._writer,
                                 process_group=self._job.pg)
                    finally:
                        if pacer is not None:
                            info.paused_s = pacer.slept
                        self._last_busy_s = time.thread_time() - c_run  # its own CPU, not peers' pauses
                    del staged
                    info.local_commit_s = time.monotonic() - t0
                    self._track_remote(info, t0)
                except BaseException as e:  # CheckpointException is a BaseException
                    staged = job = None  # noqa: F841 - the host copy goes back to the stager now
                    self._failed(info, e)
            finally:
                self._queue.task_done()

    # -- finished saves ----------------------------------------------------------------------------
    def _track_remote(self, info, t0: float) -> None:
        """Report ``info`` once its remote commit (the coordinator's, when there is one) and its replica
        exchange (with ``replicas``) are done: the save's line says whether it reached the remote tier
        and whether every replica was made (``info.replicas``: ``"made"`` / ``"gap"``)."""
        rf = self._writer.remote_commit_future(info.version)
        pf = self._writer.replica_future(info.version)
        waiting = [f for f in (rf, pf) if f is not None]
        if not waiting:
            self._report(info)
            return
        left = [len(waiting)]
        lock = threading.Lock()

        def remote_done(f):
            from ..dcp.upload import Superseded

            if f.exception() is None:
                info.remote_commit_s = time.monotonic() - t0
            elif isinstance(f.exception(), Superseded):
                pass  # newer versions were staged in its place: committed locally only, not a failure
            else:
                info.error = f"remote commit failed: {f.exception()}"  # close() raises UploadError for it

        def replicas_done(f):
            from ..dcp.replicas import outcome

            gaps = outcome(f)
            info.replicas = "gap" if gaps else "made"
            if gaps:  # close() raises ReplicaError for it (a redundancy gap, the version stands)
                info.replica_error = "replicas not made: " + "; ".join(gaps)

        def done(f, what):
            what(f)
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._report(info)

        if rf is not None:
            rf.add_done_callback(lambda f: done(f, remote_done))
        if pf is not None:
            pf.add_done_callback(lambda f: done(f, replicas_done))

    def _process_done(self, f, info, t0: float) -> None:
        self._writer._options_for.pop(info.version, None)  # the subprocess used its pickled copy
        e = f.exception()
        if e is not None:
            self._failed(info, e)
            return
        info.local_commit_s = time.monotonic() - t0
        if self._remote and self._job.rank == 0:
            info.remote_commit_s = info.local_commit_s  # the subprocess commits remotely before answering
        self._report(info)

    def _failed(self, info, e: BaseException) -> None:
        # one short line per failed rank, never DCP's traceback per rank (CheckpointException.__str__)
        info.error = _errors.summary(_errors.short_cause(e)).replace("\n", "; ")
        if group_failure(e):
            # the job lost ranks: the JobBrokenError that the next call raises says so, with this cause,
            # once (a queued save that did not run because of it adds nothing)
            self._job.lose(f"the save of step {info.step} ({info.version}) failed in a collective: {short_cause(e)}")
            self._report(info)
            return
        try:  # the coordinator reclaims what the failed attempt left (docs/FORMAT.md, Delete rule 14)
            self._writer.save_failed(info.version)
        except Exception:  # noqa: BLE001 - best effort: gc removes it after its grace period
            log.exception("ckptstore: could not reclaim the failed save of %s", info.version)
        if self.raise_errors_later:
            with self.lock:
                self._errors.append(f"save of step {info.step} ({info.version}) failed: {info.error}")
                self._causes.append(_typed_cause(e))
                self._raw.append(e)
        log.error("ckptstore: save of %s failed: %s", info.version, info.error)
        self._report(info)

    def take_errors(self) -> list[str]:
        """The failed saves not raised yet (and forget them)."""
        with self.lock:
            errors, self._errors = self._errors, []
            self._causes = []
            self._raw = []
        return errors

    def raise_errors(self) -> None:
        """Raise what failed since the last call: :class:`JobBrokenError` once the job is broken, else
        an error naming every failed save — of the type the first failed save raised on a rank when it
        was a ckptstore error (``StorageFullError``, ``KeyServiceError``, ``VersionExistsError``, ...,
        also from inside DCP's ``CheckpointException``), with that error's attributes; otherwise
        :class:`CkptStoreError`."""
        with self.lock:
            causes = [c for c in self._causes if c is not None]
            raw = list(self._raw)
        errors = self.take_errors()
        broken = self._job.broken
        if broken is not None:
            raise JobBrokenError(self._job.broken_message(broken) + "".join(f"; {e}" for e in errors))
        if errors:
            message = "; ".join(errors)
            if causes:
                err = copy.copy(causes[0])  # its type and attributes (code, object, ...), this message
                err.args = (message,)
                raise err.with_traceback(None) from _errors.short_cause(raw[0]) if raw else None
            raise CkptStoreError(message) from (_errors.short_cause(raw[0]) if raw else None)

    # -- waiting -----------------------------------------------------------------------------------
    def wait_process(self, timeout: float | None = None) -> bool:
        """Wait for the PROCESS save in flight (at most ``timeout`` seconds); False if still running."""
        f = self._proc_future
        if f is not None:
            try:
                f.result(timeout=timeout)
            except BaseException:  # noqa: BLE001 - recorded by _process_done
                if not f.done():
                    return False
            self._proc_future = None
        return True

    def wait(self) -> None:
        """Block until every queued save has committed (locally); raise the error of a failed one
        (:class:`JobBrokenError`, at once, once the job is broken)."""
        if self._job.broken is not None:
            self.raise_errors()
        if self.executor == "process":
            self.wait_process()
        else:
            if self._worker is not None:
                with self._hurrying():  # a paced save someone waits for pauses no more
                    self._queue.join()
            self._writer.wait_copies()  # committed "locally" includes this rank's root (node-local roots)
        self.raise_errors()

    def in_flight(self) -> bool:
        """A save queued or running, or an upload / remote commit not finished."""
        f = self._proc_future
        if f is not None and not f.done():
            return True
        if self._queue.unfinished_tasks:
            return True
        up = self._writer._uploader
        return up is not None and bool(up.in_flight())

    def stop(self) -> None:
        """End the worker thread once the saves queued before have run (unpaused from now)."""
        if self._worker is not None:
            with self._hurrying():
                self._queue.put(None)
                self._worker.join()

    def drain(self, left: Callable[[], float | None]) -> list[str]:
        """Wait for the saves in flight at most ``left()`` seconds (None: no bound), end the worker;
        return what did not finish and the errors not raised yet (close after a preemption signal)."""
        with self._hurrying():  # the saves in flight pause no more
            return self._drain(left)

    def _drain(self, left: Callable[[], float | None]) -> list[str]:
        problems = []
        if self.executor == "process":
            if not self.wait_process(left()):
                problems.append("the save in flight did not finish")
        elif self._worker is not None:
            t = left()
            end = None if t is None else time.monotonic() + t
            with self._queue.all_tasks_done:
                while self._queue.unfinished_tasks and (end is None or time.monotonic() < end):
                    self._queue.all_tasks_done.wait(None if end is None else max(0.01, end - time.monotonic()))
            if self._queue.unfinished_tasks:
                problems.append("a save in flight did not finish (it never commits: nothing is half-visible)")
            else:
                self._queue.put(None)
                self._worker.join(left())
        problems.extend(self.take_errors())
        return problems


def _typed_cause(e: BaseException | None) -> CkptStoreError | None:
    """The ckptstore error behind a failed save: ``e`` itself, the first one a rank raised inside DCP's
    ``CheckpointException`` (``failures``: rank -> the exception, or (exception, traceback)), or one
    in its chain of causes."""
    seen: set = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, CkptStoreError):
            return e
        for failure in (getattr(e, "failures", None) or {}).values():
            exc = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(exc, CkptStoreError):
                return exc
        e = e.__cause__ or e.__context__
    return None


def lower_priority(nice: int) -> int | None:
    """Lower the calling thread's CPU priority by ``nice`` (its nice value, capped at 19); returns the
    new value, or None where it could not (not Linux — ``setpriority`` there acts on the whole process —
    or the call refused: logged). Threads this thread starts afterwards inherit it (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    try:
        value = min(19, os.getpriority(os.PRIO_PROCESS, tid) + int(nice))
        os.setpriority(os.PRIO_PROCESS, tid, value)
    except OSError as e:
        log.debug("ckptstore: the save thread keeps its priority (%s)", e)
        return None
    return value


def resolve_nice(value: int | None, default: int) -> int:
    """The nice increment of a manager's saves: ``value``, else ``CKPTSTORE_BACKGROUND_NICE`` when
    set, else ``default``. Raises ``ValueError`` for anything but an int from 0 to 19."""
    where = "background_nice"
    if value is None:
        env = os.environ.get("CKPTSTORE_BACKGROUND_NICE", "").strip()
        where, value = "CKPTSTORE_BACKGROUND_NICE", env if env else default
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"{where} must be an int from 0 to 19 (a nice increment), not {env!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 19:
        raise ValueError(f"{where} must be an int from 0 to 19 (a nice increment), not {value!r}")
    return value
