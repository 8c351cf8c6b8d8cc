"""``ckptstore.CheckpointManager``: the training-loop API over the DCP writer and reader.

::

    with CheckpointManager(root, {"model": model, "optim": optimizer}, interval_steps=100) as mgr:
        for step in range(mgr.resume(), steps + 1):   # restores the newest checkpoint; next step
            train_step()
            mgr.save(step)                            # async; a no-op unless step % 100 == 0

The state given to the constructor is the default of :meth:`save`, :meth:`restore` and
:meth:`resume`; each also takes a ``state`` of its own (the explicit form, kept for callers of the
first version: ``step = mgr.restore(state) or 0``; ``mgr.save(step, state)``; ``mgr.close()``).

Design (anchors: Orbax ``CheckpointManager``, torchtitan's checkpointer, NVRx async checkpointing):

- **Its own process group.** DCP runs planning collectives (gather/scatter/all-reduce) for every
  save and load. The manager creates one gloo group (on every rank, in ``__init__``:
  :func:`ckptstore._groups.new_gloo_group`, ``dist.new_group(backend="gloo")`` keyed so that it
  survives ``torchrun --max-restarts`` in-place restarts) and passes it as ``process_group=`` to
  every save and load, so the trainer's collectives on the default group can never interleave with
  them. :meth:`close` destroys it.
- **One save at a time, bounded queue.** ``save()`` blocks training only to copy the state into
  host buffers (staging), then queues the save. With the THREAD executor (default) saves run in
  order on one worker thread; at most ``max_pending`` staged saves wait behind the running one.
  **Policy when the queue is full: ``save()`` waits for the oldest save to start** (it never skips
  a due save); the wait counts as blocked time. With the PROCESS executor at most one save is in
  flight (torch's checkpoint subprocess is shared and can hang with two): ``save()`` first waits
  for the previous save.
- **State.** Values in ``state`` may be an ``nn.Module`` (saved through
  ``torch.distributed.checkpoint.state_dict.get_model_state_dict``), an ``Optimizer`` (through
  ``get_optimizer_state_dict`` with the state's one module), any object with ``state_dict()`` /
  ``load_state_dict()`` (scheduler, data loader), or plain tensors/values. Module and optimizer keys
  are canonical (wrapper components dropped: :func:`canonical_fqn`), so any nesting of
  ``torch.compile``, ``checkpoint_wrapper`` and DDP saves and restores the same keys. The RNG states of this
  rank (torch, CUDA when present, ``random``, numpy when imported) are saved under ``rng/rank{r}``
  for the caller (``save_rng=False`` to turn off) and restored per rank.
- **Errors are never lost.** A save that fails raises from the next ``save()``, ``wait()`` or
  ``close()``; ``close()`` also raises ``UploadError`` for versions not uploaded.
- **Only the whole job commits** (docs/FORMAT.md, Save rules 6-7). The writer is set up with the
  job's world size and refuses to plan or commit a save with any other number of ranks. A save
  that fails because a collective of DCP failed — a peer died (gloo's ``RuntimeError: Connection
  closed by peer``, ``torch.distributed.DistError``), the process group was destroyed
  (``ValueError: Group ... is not registered``), or anything else DCP raises outside its per-rank
  ``CheckpointException`` — *breaks* the manager: that save and every later ``save()``, ``wait()``,
  ``latest()`` and ``restore()`` raise :class:`~ckptstore.errors.JobBrokenError` at once (queued
  saves fail without running; nothing hangs, nothing is committed by the survivors). A save that
  failed with ckptstore errors reported by the ranks (disk full, ``VersionExistsError``) does not
  break it. The manager also checks before each save that its process group still exists.
- **One manager per root and version names in a process.** A manager created on the same
  ``root`` and the same version names (``prefix`` / ``version_format``) as another manager of this
  process that still has saves or uploads in flight closes that one first: it waits for those saves
  and uploads (``close()``, bounded by ``upload_timeout``) and warns (``RuntimeWarning``); an error
  the old manager raises there is part of the warning. So a restart inside the process (a new
  manager after an exception) never races the old one for a version name, and resumes from what the
  old one committed.
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
- **Event log** (:mod:`ckptstore.events`, docs/FORMAT.md "Event log"): rank 0 appends one JSON line
  per save, restore, retention run and preemption, plus ``open``/``close``/``progress`` lines, to
  ``ROOT/events.jsonl`` (``event_log=`` another path, ``{rank}`` in it for one log per rank, False:
  none); every rank passes its events to ``on_event`` and :meth:`metrics_text`
  (:mod:`ckptstore.metrics`; ``metrics_file=`` keeps a textfile-collector file up to date).
  ``ckptstore goodput LOG`` (:mod:`ckptstore.goodput`) reads the log back.
- **Timings.** Per save: ``blocked_s`` (time ``save()`` held the training loop), ``local_commit_s``
  and ``remote_commit_s`` (from the ``save()`` call to the commit; ``remote_commit_s`` only on the
  coordinator, which makes the remote commit). Passed to ``on_save`` and kept by :meth:`stats`,
  which adds the interval advice of :mod:`ckptstore.advise` when ``mtbf`` is given.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import queue
import random
import signal as _signal
import sys
import threading
import time
import uuid
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ._groups import destroy_group, new_gloo_group
from ._state_keys import _Respelled, _SpellingLoadPlanner, canonical_fqn  # noqa: F401 - canonical_fqn: public here
from .dcp import StorageReader, StorageWriter
from . import events as _events
from .errors import CkptStoreError, JobBrokenError, Preempted, VersionNotFoundError
from .metrics import Metrics, write_textfile

log = logging.getLogger("ckptstore")


@dataclasses.dataclass
class SaveInfo:
    """Timings of one save (seconds, measured on this rank from the ``save()`` call)."""

    step: int
    version: str
    blocked_s: float
    local_commit_s: float | None = None
    remote_commit_s: float | None = None
    error: str | None = None


@dataclasses.dataclass
class RestoreInfo:
    """What the last :meth:`CheckpointManager.restore` loaded: ``version``, its ``step``, the
    ``world_size`` that saved it, whether this rank's RNG states and ``per_rank_keys`` values were
    restored (only when the world size is unchanged; otherwise they are left as they are), and
    ``seconds`` spent (agreeing on the version and loading it).

    What the choice passed over (docs/FORMAT.md, "Restore choice"): ``skipped`` — newer versions
    not loaded, newest first, each a :class:`ckptstore.choice.Skipped` with its ``kind``
    (``damaged``, ``missing``, ``unverified``: failed verification while loading, ``shape``,
    ``restarts``) and ``reason``; ``remote_error`` — why the remote tier was not consulted (None: it
    was, or there is none); ``restore_count`` — restores in a row before this one that loaded the
    same version with nothing newer committed in between (the job died after each: a restart loop);
    ``attempt`` — the attempt loaded; ``stale`` — ``(where, attempt)`` copies of the name that are
    not the version (reported, not loaded)."""

    version: str
    step: int | None
    world_size: int | None
    rng_restored: bool
    per_rank_restored: bool
    seconds: float
    attempt: str | None = None
    skipped: list = dataclasses.field(default_factory=list)
    remote_error: str | None = None
    restore_count: int = 0
    stale: list = dataclasses.field(default_factory=list)
    #: this rank's read counters of the load (``StorageReader.stats``: ``fallback_reads``,
    #: ``remote_reads``, ``peer_bytes``, ``repaired``)
    reads: dict = dataclasses.field(default_factory=dict)

    @property
    def fell_back(self) -> bool:
        """A newer version was skipped."""
        return bool(self.skipped)


class CheckpointManager:
    """Periodic async checkpoints for a training loop, restore from the newest loadable version.

    Args:
        root: local checkpoint directory (the fast tier), shared by the ranks of one node.
        state: the default training state of :meth:`save`, :meth:`restore` and :meth:`resume`:
            a dict of modules, optimizers, objects with ``state_dict()``/``load_state_dict()``
            and plain values (see the module docstring); None: pass ``state`` to each call.
        remote: ``"s3://bucket/prefix"`` to also stage every version there.
        key: master key (see :class:`ckptstore.StorageWriter`).
        interval_steps: ``save(step, ...)`` saves when ``step % interval_steps == 0`` (or ``force``).
        retention: a :class:`ckptstore.retention.RetentionPolicy` applied after each commit.
        durability: ``"local"``, ``"replicated"`` or ``"remote"`` (see :class:`ckptstore.StorageWriter`).
        replicas (a writer option): replication factor F — every node's objects are also copied to
            the roots of F other nodes (docs/FORMAT.md, "Replicas"); after a restore, a replaced node
            gets its part back from the replicas in the background. THREAD executor only.
        executor: ``"thread"`` (default) or ``"process"`` (``AsyncCheckpointerType`` accepted).
        max_pending: staged saves that may wait behind the running one (THREAD; default 1).
        on_save: ``callback(SaveInfo)`` called (on the worker thread) when a save has committed,
            or has failed (``info.error`` set; the error is also raised from the next call).
        mtbf: mean time between failures (seconds) for the interval advice in :meth:`stats`.
        restart_s: seconds from a failure until training runs again (for the advice).
        save_rng: save and restore this rank's RNG states under ``rng/rank{r}`` (default True).
        per_rank_keys: keys of ``state`` whose value differs per rank (a data loader's position):
            saved under ``f"{key}/rank{r}"`` and restored per rank. Other non-sharded values must be
            equal on every rank (DCP saves one copy; ckptstore refuses diverging copies).
        prefix: version names are ``f"{prefix}{step}"`` ...
        version_format: ... or ``version_format.format(step=step)`` when given
            (e.g. ``"step-{step:06d}"``). The names scope the manager: :meth:`restore`,
            :meth:`latest` and ``retention`` consider only versions named this way, so managers with
            different prefixes share a root without seeing each other's versions.
        reshard: let :meth:`restore` load a version saved by another number of ranks (default
            False: such a version is skipped, with its reason in ``last_restore.skipped``).
        fall_back_after: when the version :meth:`restore` would pick has been restored this many
            times in a row with nothing newer committed in between (the job dies after every resume),
            skip it and restore the one before (default None: never; the count is always in
            ``last_restore.restore_count`` and warned about from 2 on).
        save_on_signal: signals that ask for a last save and a clean exit (module docstring,
            "Preemption"). Default ``"auto"``: SIGTERM, when the manager is created in the main
            thread and SIGTERM has its default disposition (a handler of the program's own is left
            alone); a tuple of signals: those, replacing their handlers; ``()`` or None: off. The
            previous handlers come back at :meth:`close`. Every rank must pass the same setting.
        grace_s: seconds from the signal until the process must be gone (Kubernetes'
            ``terminationGracePeriodSeconds``, 30 by default, and ``torchrun``'s shutdown timeout).
            The last save and its waits end ``2 * r`` before that and the watchdog ends the process
            ``r`` before it, with ``r = min(5, max(1, grace_s / 10))``; None: no bound.
        event_log: where rank 0 appends its events: True (default) ``ROOT/events.jsonl``, a path
            (with ``{rank}`` in it: every rank writes its own), False/None: no log.
        on_event: ``callback(event: dict)`` for every event of this rank (the log's lines; on the
            calling or the manager's thread); an exception in it is logged, never raised.
        metrics_file: a file this rank keeps up to date with :meth:`metrics_text` (atomically
            replaced after every save, restore, gc and preemption event): point it into a node
            exporter's textfile-collector directory (``.prom``); ``{rank}`` in it for one per rank,
            else rank 0 writes it.
        progress_s: seconds between two ``progress`` lines of a loop that calls :meth:`save` every
            step (a save always writes one); 0: every call. A crash is placed at the last one.
        **writer_options: passed to :class:`ckptstore.StorageWriter` (``threads``, ``frame_size``,
            ``upload_timeout``, ``endpoint_url``, ...); ``world_size`` defaults to the job's.

    Creating a manager on the same ``root`` and version names as another manager of this process
    that still has saves or uploads in flight closes that one first (waits for them, warns with
    ``RuntimeWarning``). Once a save failed because the job lost ranks, every ``save``, ``wait``,
    ``latest`` and ``restore`` raises :class:`~ckptstore.errors.JobBrokenError` (module docstring,
    "Only the whole job commits").
    """

    def __init__(
        self,
        root: str | os.PathLike,
        state: dict[str, Any] | None = None,
        *,
        remote: str | None = None,
        key: Any = None,
        interval_steps: int = 1,
        retention: Any = None,
        durability: str = "local",
        executor: str | AsyncCheckpointerType = "thread",
        max_pending: int = 1,
        on_save: Callable[[SaveInfo], None] | None = None,
        mtbf: float | None = None,
        restart_s: float = 0.0,
        save_rng: bool = True,
        per_rank_keys: tuple[str, ...] = (),
        prefix: str = "step-",
        version_format: str | None = None,
        reshard: bool = False,
        fall_back_after: int | None = None,
        save_on_signal: Any = "auto",
        grace_s: float | None = 30.0,
        event_log: Any = True,
        on_event: Callable[[dict], None] | None = None,
        metrics_file: str | os.PathLike | None = None,
        progress_s: float = 5.0,
        **writer_options: Any,
    ) -> None:
        if interval_steps < 1:
            raise ValueError("interval_steps must be >= 1")
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        kind = executor.value if isinstance(executor, AsyncCheckpointerType) else str(executor)
        if kind not in ("thread", "process"):
            raise ValueError("executor must be 'thread' or 'process'")
        if kind == "process" and writer_options.get("replicas"):
            raise ValueError("replicas= needs executor='thread': the copies travel between the trainers' processes, "
                             "which DCP's checkpoint subprocess is not")
        self._names = (os.path.realpath(os.fspath(root)), "format" if version_format is not None else "prefix",
                       version_format if version_format is not None else prefix)
        _close_previous(self._names)
        self.root = os.fspath(root)
        self.remote = remote
        self.interval_steps = interval_steps
        self.executor = kind
        self.on_save = on_save
        self.mtbf = mtbf
        self.restart_s = restart_s
        self.save_rng = save_rng
        self.prefix = prefix
        self.version_format = version_format
        self.reshard = reshard
        if fall_back_after is not None and fall_back_after < 1:
            raise ValueError("fall_back_after must be >= 1 (or None)")
        if grace_s is not None and grace_s <= 0:
            raise ValueError("grace_s must be positive (or None)")
        if progress_s < 0:
            raise ValueError("progress_s must be >= 0")
        self.fall_back_after = fall_back_after
        from .choice import version_pattern

        #: the regular expression of the names this manager saves (its scope)
        self.scope = version_pattern(prefix, version_format)
        if retention is not None and getattr(retention, "match", None) is None and dataclasses.is_dataclass(retention):
            retention = dataclasses.replace(retention, match=self.scope)
        #: ``{name: {attempt: reason}}``: versions the next save of that name supersedes (set by restore)
        self._supersede: dict[str, dict[str, str]] = {}
        self.state = state
        self.last_restore: RestoreInfo | None = None
        self.per_rank_keys = tuple(per_rank_keys)
        self._key = key
        self._reader_options = {k: writer_options[k] for k in ("endpoint_url", "threads") if k in writer_options}
        self._dist = dist.is_available() and dist.is_initialized()
        # the writer refuses any save by another number of ranks (docs/FORMAT.md, Save rule 6)
        writer_options.setdefault("world_size", dist.get_world_size() if self._dist else 1)
        self._writer = StorageWriter(
            root, remote=remote, key=key, durability=durability, retention=retention, max_staged=max_pending + 1, **writer_options
        )
        self.rank = dist.get_rank() if self._dist else 0
        # every rank creates the group here, in the same order: DCP's collectives run on it only;
        # keyed per creation, so that it comes up after torchrun's in-place restarts (_groups.py)
        self._pg = new_gloo_group() if self._dist else None
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._worker: threading.Thread | None = None
        self._proc_future = None  # PROCESS: the one save in flight
        self._errors: list[str] = []
        self._lock = threading.Lock()
        self._infos: list[SaveInfo] = []
        self._last_call: tuple[int, float] | None = None
        self._step_time: float | None = None
        self._closed = False
        self._broken: str | None = None  # why the job is broken (a peer died, the group is gone)
        self._job_world = dist.get_world_size() if self._dist else 1
        self._init_events(event_log, on_event, metrics_file, progress_s)
        self._init_preemption(save_on_signal, grace_s)
        with _open_lock:
            _open.setdefault(self._names, weakref.WeakSet()).add(self)
        self._emit("open", pid=os.getpid(), proc_start=_events.process_start_time(), ranks=self._world(),
                   names=self._names[2], interval_steps=interval_steps, executor=kind, durability=durability,
                   remote=remote is not None, restart_count=_env_int("TORCHELASTIC_RESTART_COUNT"),
                   save_on_signal=[_signal.Signals(x).name for x in self._signals], grace_s=grace_s)

    # -- events and metrics (module docstring, "Event log") ----------------------------------------
    def _world(self) -> int:
        """The job's number of ranks (as at construction: asking torch.distributed fails once the
        group is destroyed)."""
        return self._job_world

    def _init_events(self, event_log: Any, on_event, metrics_file, progress_s: float) -> None:
        self.attempt_id = uuid.uuid4().hex[:12]  # this manager's part of the run (the lines' "a")
        self.on_event = on_event
        self.progress_s = float(progress_s)
        path = None
        if event_log is True:
            path = _events.default_path(self.root) if self.rank == 0 else None
        elif event_log not in (None, False):
            path = os.fspath(event_log)
            path = path.format(rank=self.rank) if "{rank}" in path else (path if self.rank == 0 else None)
        #: the event log this rank appends to (None: this rank writes none)
        self.event_log = path
        self._elog = _events.EventLog(path) if path else None
        self._elog_failed = False
        mf = None if metrics_file is None else os.fspath(metrics_file)
        self.metrics_file = None if mf is None else (mf.format(rank=self.rank) if "{rank}" in mf else (mf if self.rank == 0 else None))
        self._metrics = Metrics(self.rank)
        self._metrics_lock = threading.Lock()
        self._last_progress = float("-inf")
        self._save_extra: dict[str, dict] = {}

    def _emit(self, kind: str, **fields: Any) -> dict:
        """One event of this rank: to the log (rank 0), the metrics and ``on_event``; never raises."""
        e = {"ev": _events.FORMAT, "kind": kind, "t": time.time(), "a": self.attempt_id, "rank": self.rank, **fields}
        if self._elog is not None:
            try:
                self._elog.write(e)
            except OSError as ex:
                if not self._elog_failed:
                    self._elog_failed = True
                    log.warning("ckptstore: cannot append to the event log %s: %s (events are not logged)", self.event_log, ex)
        self._metrics.observe(e)
        if self.metrics_file and kind != "progress":
            try:
                with self._metrics_lock:
                    write_textfile(self.metrics_file, self._metrics.text())
            except OSError as ex:
                log.warning("ckptstore: cannot write the metrics file %s: %s", self.metrics_file, ex)
        if self.on_event is not None:
            try:
                self.on_event(dict(e))
            except Exception:  # noqa: BLE001 - a callback must not break saving
                log.exception("ckptstore: on_event callback failed")
        return e

    def metrics_text(self, openmetrics: bool = False) -> str:
        """This rank's figures (saves, bytes, phases of the last save, durable lag, restores,
        retention, preemptions) in the Prometheus text format 0.0.4, or with ``openmetrics`` in the
        OpenMetrics format (:mod:`ckptstore.metrics`)."""
        return self._metrics.text(openmetrics)

    def _progress(self, step: int, t_call: float, version: str | None) -> None:
        """A ``progress`` line: always for a save (``version``), else at most every ``progress_s``."""
        now = time.monotonic()
        if version is None and now - self._last_progress < self.progress_s:
            return
        self._last_progress = now
        fields: dict[str, Any] = {"step": int(step)}
        if version is not None:
            fields.update(save=version, blocked_s=now - t_call)
        self._emit("progress", **fields)

    def _save_event(self, info: "SaveInfo") -> None:
        extra = self._save_extra.pop(info.version, {})
        tm = self._writer.timings(info.version)
        m = self._writer.last_manifest
        if m is None or m.version != info.version:
            m = None
            if self.rank == 0 and info.local_commit_s is not None and self._elog is not None:
                try:  # PROCESS executor: the subprocess committed it; its manifest says the sizes
                    from .manifest import catalogue

                    m = catalogue.read_manifest(self._writer._tier, info.version).manifest
                except Exception:  # noqa: BLE001 - the figures are optional
                    m = None
        remote_ok = info.remote_commit_s is not None
        if info.local_commit_s is None:
            outcome = "failed"
        elif self.remote is not None and self.rank == 0 and not remote_ok and info.error:
            outcome = "committed-local"
        else:
            outcome = "committed"
        upload_s = info.remote_commit_s - info.local_commit_s if remote_ok and info.local_commit_s is not None else None
        self._emit(
            "save", step=info.step, version=info.version, ranks=self._world(), t_call=extra.get("t_call"),
            forced=bool(extra.get("forced")), blocked_s=info.blocked_s, stage_s=extra.get("stage_s"),
            write_s=tm.get("write_s"), commit_s=tm.get("commit_s"), local_commit_s=info.local_commit_s,
            upload_s=upload_s, replicate_s=tm.get("replicate_s"), remote_commit_s=info.remote_commit_s,
            durable_lag_s=info.remote_commit_s, logical_bytes=None if m is None else m.nbytes,
            stored_bytes=None if m is None else m.stored_bytes,
            uploaded_bytes=(None if m is None else m.stored_bytes) if remote_ok else (0 if self.remote else None),
            durability="remote" if remote_ok else ("local" if info.local_commit_s is not None else None),
            outcome=outcome, error=info.error,
        )
        for pruned in self._writer.pruned():
            self._emit("gc", source="retention", **pruned)

    # -- preemption (module docstring, "Preemption") -----------------------------------------------
    def _init_preemption(self, save_on_signal: Any, grace_s: float | None) -> None:
        self.grace_s = grace_s
        auto = isinstance(save_on_signal, str) and save_on_signal == "auto"
        if auto:
            wanted: tuple[int, ...] = (int(_signal.SIGTERM),)
        elif save_on_signal in (None, False):
            wanted = ()
        else:
            wanted = tuple(int(x) for x in (save_on_signal if isinstance(save_on_signal, (tuple, list)) else (save_on_signal,)))
        self._signals: tuple[int, ...] = ()  # the signals this rank handles
        self._prev_handlers: dict[int, Any] = {}
        self._sig: int | None = None  # the signal received (by this rank, or by a peer: learnt at save())
        self._sig_wall: float | None = None
        self._sig_mono: float | None = None
        self._sig_event = threading.Event()
        self._preempted: Preempted | None = None
        self._watch_stop = False
        self._watchdog_thread: threading.Thread | None = None
        self._wake: _Wakeup | None = None
        self._round = None  # (work, tensor): the all-reduce issued at the last save() call
        self._ctl = None
        if wanted:
            self._install_signals(wanted, explicit=not auto)
            self._writer._subprocess_own_group = True  # torchrun signals the worker's process group
        self._rounds = False
        if wanted and self._dist and self._world() > 1:
            # every rank creates it here, in the same order; the ranks agree once whether any listens
            self._ctl = new_gloo_group()  # keyed per creation, like _pg
            flag = torch.tensor([1.0 if self._signals else 0.0], dtype=torch.float64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._ctl)
            self._rounds = bool(flag.item())

    def _install_signals(self, wanted: tuple[int, ...], explicit: bool) -> None:
        if threading.current_thread() is not threading.main_thread():
            if explicit:
                log.warning("ckptstore: save_on_signal needs the manager to be created in the main thread; "
                            "signals are not handled")
            return
        for signum in wanted:
            prev = _signal.getsignal(signum)
            other = getattr(prev, "__self__", None)
            if isinstance(other, CheckpointManager):  # an earlier manager's handler: take over from it
                prev = other._prev_handlers.get(signum, _signal.SIG_DFL)
            elif not explicit and prev not in (_signal.SIG_DFL, None):
                log.info("ckptstore: %s has a handler of the program's own; CheckpointManager leaves it alone",
                         _signal.Signals(signum).name)
                continue
            _signal.signal(signum, self._on_signal)
            self._prev_handlers[signum] = prev
        self._signals = tuple(self._prev_handlers)
        if self._signals:
            _handling.add(self)
        if self._signals and self.grace_s is not None:
            # the watchdog hears the signal through Python's wakeup fd, written by the C-level handler
            # at once: the Python handler runs only once the main thread is back in the interpreter,
            # which a loop blocked in a collective with a stuck rank never is
            self._wake = _Wakeup.install()
            self._watchdog_thread = threading.Thread(target=self._watchdog, name="ckptstore-preempt-watchdog", daemon=True)
            self._watchdog_thread.start()

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002 - the signal handler: records only
        if self._sig is None:
            self._sig = int(signum)
            if self._sig_mono is None:  # (the watchdog may have heard it first, through the wakeup fd)
                self._sig_wall, self._sig_mono = time.time(), time.monotonic()
        self._sig_event.set()

    def _wake_watchdog(self) -> None:
        self._sig_event.set()
        if self._wake is not None:
            self._wake.poke()

    def _restore_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, prev in self._prev_handlers.items():
            if getattr(_signal.getsignal(signum), "__self__", None) is self:
                _signal.signal(signum, prev if prev is not None else _signal.SIG_DFL)
        self._prev_handlers.clear()
        if self._wake is not None:
            self._wake.uninstall()

    def _stop_watchdog(self) -> None:
        """End the watchdog thread unless a signal came (then it ends the process at its deadline).
        Joined: a thread left waiting at interpreter exit makes torch 2.13's teardown abort more often
        (pytorch/pytorch #190489)."""
        t = self._watchdog_thread
        if self._sig is None and self._sig_mono is None and t is not None:
            self._watch_stop = True
            self._wake_watchdog()
            t.join(1.0)
            if self._wake is not None and not t.is_alive():
                self._wake.close()

    def _reserve(self) -> float:
        return min(5.0, max(1.0, (self.grace_s or 0.0) / 10))

    def _hard_deadline(self) -> float | None:
        """Monotonic time the watchdog ends the process (None: no signal, or no grace period)."""
        if self._sig_mono is None or self.grace_s is None:
            return None
        return self._sig_mono + self.grace_s - self._reserve()

    def _work_deadline(self) -> float | None:
        """Monotonic time the last save and its waits give up."""
        d = self._hard_deadline()
        return None if d is None else d - self._reserve()

    def _watchdog(self) -> None:
        seen = None
        while True:
            if self._wake is not None:
                got = self._wake.wait()
            else:
                self._sig_event.wait()
                got = b""
            if self._watch_stop and self._sig is None and self._sig_mono is None:
                return
            seen = next((b for b in got if b in self._signals), None)
            if seen is not None and self._sig_mono is None:  # before the Python handler ran
                self._sig_wall, self._sig_mono = time.time(), time.monotonic()
            if self._sig_mono is not None:
                break
            if self._wake is None and not got:
                return
        d = self._hard_deadline()
        if d is None:
            return
        time.sleep(max(0.0, d - time.monotonic()))
        signum = int(self._sig or seen or _signal.SIGTERM)
        code = 128 + signum
        name = _signal.Signals(signum).name
        why = ("the process did not end after the last save" if self._preempted is not None else
               "the training loop did not reach save() (or the save did not finish)")
        msg = (f"ckptstore: {name} {time.monotonic() - self._sig_mono:.1f} s ago, grace period {self.grace_s:g} s: "
               f"{why}; ending the process now (exit {code}) before the scheduler kills it")
        try:
            self._emit("preempt", signal=name, outcome="grace period over", saved=bool(self._preempted and self._preempted.saved),
                       step=None if self._preempted is None else self._preempted.step, exit_code=code, reason=why)
            log.error(msg)
            for h in logging.getLogger().handlers + log.handlers + [logging.lastResort]:
                if h is not None:
                    h.flush()
        finally:
            os._exit(code)

    def _poll_preempt(self) -> tuple | None:
        """At a ``save()`` call: ``(signal, its wall time, why not to save or None)`` when the job is to stop here —
        learnt from the all-reduce issued at the previous call (every rank reads it at the same call)
        or, outside a multi-rank job, from this process's handler — else None (and the next
        all-reduce is issued)."""
        if not self._rounds:
            return None if self._sig is None else (self._sig, self._sig_wall, None)
        agreed = None
        if self._round is not None:
            work, t = self._round
            deadline = self._work_deadline()
            try:
                if deadline is None:
                    work.wait()
                elif not work.is_completed():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    work.wait(_timedelta(left))
            except BaseException as e:  # noqa: BLE001 - gloo raises RuntimeError("... timed out") on a timeout
                self._round = None
                if self._sig is not None:
                    self._rounds = False
                    late = deadline is not None and time.monotonic() >= deadline - 0.05
                    why = (f"a rank did not reach save() within the grace period ({self.grace_s:g} s)" if late else
                           f"the ranks could not agree on the step ({type(e).__name__}: {str(e)[:200]}; a rank is gone?)")
                    return (self._sig, self._sig_wall, why + "; nothing was saved at this step")
                self._rounds = False
                log.warning("ckptstore: the preemption check across ranks failed (%s: %s); signals are handled "
                            "per rank from now on", type(e).__name__, e)
                return None
            self._round = None
            sig, neg_t = t.tolist()
            if sig > 0:
                agreed = (int(sig), -neg_t, None)
        if agreed is not None:
            return agreed
        t = torch.tensor([float(self._sig or 0), -self._sig_wall if self._sig_wall is not None else -1e18],
                         dtype=torch.float64)
        self._round = (dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._ctl, async_op=True), t)
        return None

    def _preempt_save(self, step: int, state, metadata, pre: tuple, t0: float) -> None:
        """The forced save of ``step`` after a preemption signal; always raises :class:`Preempted`."""
        signum, t_sig, failed = pre
        if self._sig is None:  # a peer got the signal: this rank's grace period runs from that one
            self._sig, self._sig_wall = signum, t_sig
        if self._sig_wall is None or t_sig < self._sig_wall:
            self._sig_wall = t_sig
        self._sig_mono = time.monotonic() - max(0.0, time.time() - self._sig_wall)
        self._wake_watchdog()
        name = _signal.Signals(signum).name
        version = self.version_name(step)
        in_flight = self._in_flight()
        deadline = self._work_deadline()
        saved, durability, reason = False, None, None
        local_at = remote_at = None
        info = None
        if failed:
            reason = failed
        elif deadline is not None and time.monotonic() >= deadline:
            reason = f"the grace period ({self.grace_s:g} s after {name}) was over when this rank reached save()"
        else:
            if self.rank == 0:
                log.warning("ckptstore: %s received: saving step %d (%s) before exiting (grace period %s)", name, step,
                            version, "none" if self.grace_s is None else f"{self.grace_s:g} s")
            try:
                self._check_job()
                if self.executor == "process":
                    info = self._save_here(step, state, metadata, t0, deadline)
                else:
                    info = self._start_save(step, state, metadata, t0, forced=True, deadline=deadline)
                while True:
                    if info.local_commit_s is not None and local_at is None:
                        local_at = time.time()
                    if info.remote_commit_s is not None and remote_at is None:
                        remote_at = time.time()
                    if info.error is not None or info.remote_commit_s is not None:
                        break
                    if info.local_commit_s is not None and (self.remote is None or self.rank != 0):
                        break  # only the coordinator makes (and sees) the remote commit
                    if deadline is not None and time.monotonic() >= deadline:
                        break
                    time.sleep(0.02)
                if info.local_commit_s is None and self._committed_locally(version):
                    local_at = time.time()  # PROCESS: the subprocess committed it, the remote commit is pending
                saved = local_at is not None
                durability = "remote" if info.remote_commit_s is not None else ("local" if saved else None)
                if not saved:
                    reason = info.error or f"the save did not commit within the grace period ({self.grace_s:g} s)"
                elif self.remote is not None and self.rank == 0 and durability == "local":
                    reason = ("committed locally only: the upload did not finish within the grace period; the next "
                              "run's first save uploads it" if info.error is None else f"committed locally only: {info.error}")
            except Preempted:
                raise
            except BaseException as e:  # noqa: BLE001 - reported in Preempted; the process is ending anyway
                reason = f"{type(e).__name__}: {e}"
        done_at = remote_at or local_at or time.time()
        seconds = done_at - (self._sig_wall or done_at)
        code = 128 + signum
        if saved:
            msg = (f"{name}: saved step {step} ({version}) {seconds:.1f} s after the signal, committed "
                   f"{'remotely' if durability == 'remote' else 'locally'}"
                   + (f" ({reason})" if reason else "") + f"; exiting with status {code}. Resume with mgr.resume()")
        else:
            msg = f"{name}: step {step} not saved ({reason}); exiting with status {code}"
        exc = Preempted(msg, signal=signum, step=int(step), version=version if saved else None, saved=saved,
                        durability=durability, seconds=seconds, reason=reason, code=code)
        self._preempted = exc
        self._progress(step, t0, version if info is not None else None)
        self._emit("preempt", signal=name, t_signal=self._sig_wall, step=int(step), version=version, saved=saved,
                   durability=durability, seconds=seconds, local_s=None if local_at is None else local_at - self._sig_wall,
                   remote_s=None if remote_at is None else remote_at - self._sig_wall, in_flight=in_flight,
                   outcome="saved" if saved else "not saved", reason=reason, exit_code=code)
        (log.warning if saved else log.error)("ckptstore: %s", msg)
        raise exc

    def _save_here(self, step: int, state, metadata, t0: float, deadline: float | None) -> SaveInfo:
        """PROCESS executor, the last save before exiting: once the save in flight has finished (its
        subprocess is out of the trainer's process group, so torchrun's signal does not end it), save
        in this process (``dcp.save``): nothing is gained by handing a save we wait for to the
        subprocess, and its uploads are this process's to bound (``close()``)."""
        if not self._wait_process(None if deadline is None else max(0.0, deadline - time.monotonic())):
            raise CkptStoreError("the save in flight did not finish within the grace period")
        version = self.version_name(step)
        sd = self._state_dict(self._state(state))
        self._writer.save_options(version, step=int(step), user_metadata=metadata, supersede=self._supersede.get(version))
        self._save_extra[version] = {"t_call": time.time() - (time.monotonic() - t0), "forced": True}
        info = SaveInfo(int(step), version, 0.0)
        with self._lock:
            self._infos.append(info)
        try:
            dcp.save(sd, checkpoint_id=version, storage_writer=self._writer, process_group=self._pg)
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            info.blocked_s = time.monotonic() - t0
            self._failed(info, e)
            return info
        info.blocked_s = info.local_commit_s = time.monotonic() - t0
        self._track_remote(info, t0)
        return info

    def _committed_locally(self, version: str) -> bool:
        from .manifest import layout

        try:
            return self._writer._tier.exists(layout.manifest_key(version))
        except Exception:  # noqa: BLE001
            return False

    # -- saving ------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return step % self.interval_steps == 0

    def version_name(self, step: int) -> str:
        if self.version_format is not None:
            return self.version_format.format(step=int(step))
        return f"{self.prefix}{int(step)}"

    def _state(self, state: dict[str, Any] | None) -> dict[str, Any]:
        state = self.state if state is None else state
        if state is None:
            raise TypeError("no state: pass CheckpointManager(root, state) or state= to this call")
        return state

    def save(self, step: int, state: dict[str, Any] | None = None, *, force: bool = False,
             metadata: dict[str, Any] | None = None) -> bool:
        """Stage ``state`` (default: the constructor's) and queue its save as version
        :meth:`version_name` ``(step)``; return True if a save was started, False when ``step`` is
        not due (``step % interval_steps != 0``) and not ``force``. ``metadata``: JSON-serialisable
        user metadata recorded in the version's manifest (``ckptstore gc --keep-best`` reads it).
        Returns after staging (and, when the queue is full, after the oldest queued save started).
        Raises the error of an earlier failed save; :class:`~ckptstore.errors.JobBrokenError` once
        the job lost ranks (a save failed in a collective, or the manager's process group was
        destroyed): then every later call raises it at once (see "Only the whole job commits").

        After a preemption signal (``save_on_signal``) reached any rank, the call at which every rank
        has learnt it saves ``step`` whether due or not, waits for the commit within the grace period
        and raises :class:`~ckptstore.errors.Preempted` (exit status 143 for SIGTERM when not caught;
        ``saved=False`` when it could not save in time). Call ``save(step)`` at every step, on every
        rank, for the signal to be noticed within a step."""
        t0 = time.monotonic()
        self._note_step(step, t0)
        if self._preempted is not None:
            raise self._preempted  # the loop caught it and went on: stop again
        self._raise_errors()
        if self._closed:
            raise CkptStoreError("CheckpointManager is closed")
        if self._rounds or self._sig is not None:
            pre = self._poll_preempt()
            if pre is not None:
                self._preempt_save(step, state, metadata, pre, t0)  # raises Preempted
        if not (force or self.due(step)):
            self._progress(step, t0, None)
            return False
        self._check_job()
        info = self._start_save(step, state, metadata, t0)
        self._progress(step, t0, info.version)
        return True

    def _start_save(self, step: int, state, metadata, t0: float, *, forced: bool = False,
                    deadline: float | None = None) -> SaveInfo:
        """Stage and queue (THREAD) or hand to DCP's checkpoint subprocess (PROCESS) the save of
        ``step``; with ``deadline`` (monotonic), waits for earlier saves only until then."""
        version = self.version_name(step)
        sd = self._state_dict(self._state(state))
        # a name left by a damaged, unloadable or abandoned version is superseded, not refused
        # (docs/FORMAT.md, "Superseding")
        self._writer.save_options(version, step=int(step), user_metadata=metadata,
                                  supersede=self._supersede.get(version))
        extra = self._save_extra[version] = {"t_call": time.time() - (time.monotonic() - t0), "forced": forced}
        info = SaveInfo(int(step), version, 0.0)
        if self.executor == "process":
            if not self._wait_process(None if deadline is None else max(0.0, deadline - time.monotonic())):
                raise CkptStoreError("the save in flight did not finish within the grace period")
            self._raise_errors()
            t_stage = time.monotonic()
            fut = dcp.async_save(
                sd, checkpoint_id=version, storage_writer=self._writer, process_group=self._pg,
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
            self._ensure_worker()
            try:  # blocks while max_pending saves wait (policy: wait)
                self._queue.put((info, staged, t0), timeout=None if deadline is None else max(0.001, deadline - time.monotonic()))
            except queue.Full:
                raise CkptStoreError("the saves in flight did not start within the grace period") from None
            info.blocked_s = time.monotonic() - t0
        with self._lock:
            self._infos.append(info)
        return info

    def _note_step(self, step: int, now: float) -> None:
        if self._last_call is not None and step > self._last_call[0]:
            dt = (now - self._last_call[1]) / (step - self._last_call[0])
            self._step_time = dt if self._step_time is None else 0.8 * self._step_time + 0.2 * dt
        self._last_call = (step, now)

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._run, name="ckptstore-manager", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                info, staged, t0 = job
                try:
                    self._check_job()  # the group may have broken since save() queued it: never run it
                    dcp.save(staged, checkpoint_id=info.version, storage_writer=self._writer, process_group=self._pg)
                    del staged
                    info.local_commit_s = time.monotonic() - t0
                    self._track_remote(info, t0)
                except BaseException as e:  # CheckpointException is a BaseException
                    staged = job = None  # noqa: F841 - the host copy goes back to the stager now
                    self._failed(info, e)
            finally:
                self._queue.task_done()

    def _track_remote(self, info: SaveInfo, t0: float) -> None:
        fut = self._writer.remote_commit_future(info.version)
        if fut is None:
            self._report(info)
            return

        def done(f):
            if f.exception() is None:
                info.remote_commit_s = time.monotonic() - t0
            else:
                info.error = f"remote commit failed: {f.exception()}"  # close() raises UploadError for it
            self._report(info)

        fut.add_done_callback(done)

    def _process_done(self, f, info: SaveInfo, t0: float) -> None:
        self._writer._options_for.pop(info.version, None)  # the subprocess used its pickled copy
        e = f.exception()
        if e is not None:
            self._failed(info, e)
            return
        info.local_commit_s = time.monotonic() - t0
        if self.remote is not None and self.rank == 0:
            info.remote_commit_s = info.local_commit_s  # the subprocess commits remotely before answering
        self._report(info)

    def _failed(self, info: SaveInfo, e: BaseException) -> None:
        if _group_failure(e):
            self._break(f"the save of step {info.step} ({info.version}) failed in a collective: {type(e).__name__}: {e}")
        info.error = f"{type(e).__name__}: {e}"
        with self._lock:
            self._errors.append(f"save of step {info.step} ({info.version}) failed: {info.error}")
        log.error("ckptstore: save of %s failed: %s", info.version, e)
        self._report(info)

    def _report(self, info: SaveInfo) -> None:
        try:
            self._save_event(info)
        except Exception:  # noqa: BLE001 - the event log never breaks saving
            log.exception("ckptstore: could not record the save event of %s", info.version)
        if self.on_save is not None:
            try:
                self.on_save(info)
            except Exception:  # noqa: BLE001 - a callback must not break saving
                log.exception("ckptstore: on_save callback failed")

    def _raise_errors(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
            broken = self._broken
        if broken is not None:
            raise JobBrokenError(self._broken_message(broken) + "".join(f"; {e}" for e in errors))
        if errors:
            raise CkptStoreError("; ".join(errors))

    # -- a broken job (docs/FORMAT.md, Save rule 6) --------------------------------------------------
    @staticmethod
    def _broken_message(why: str) -> str:
        return (f"the job lost ranks ({why}); this CheckpointManager refuses every save, wait and restore so "
                "that no rank commits without its peers. Restart the whole job: it resumes from the newest "
                "version all ranks committed")

    def _break(self, why: str) -> None:
        with self._lock:
            if self._broken is not None:
                return
            self._broken = why
        log.error("ckptstore: %s", self._broken_message(why))

    def _check_job(self) -> None:
        """Raise :class:`JobBrokenError` when the job is broken, or when the manager's process group
        (or torch.distributed itself) is gone — DCP would otherwise save on this rank alone."""
        if self._broken is None and self._dist and not _group_alive(self._pg):
            self._break("the CheckpointManager's process group was destroyed (torch.distributed.destroy_process_group)")
        if self._broken is not None:
            raise JobBrokenError(self._broken_message(self._broken))

    def _wait_process(self, timeout: float | None = None) -> bool:
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
        """Block until every queued save has committed (locally; see ``durability``); raise the
        error of a failed one (:class:`JobBrokenError`, at once, once the job lost ranks)."""
        if self._broken is not None:
            self._raise_errors()
        if self.executor == "process":
            self._wait_process()
        elif self._worker is not None:
            self._queue.join()
        self._raise_errors()

    # -- restoring ---------------------------------------------------------------------------------
    def latest(self) -> str | None:
        """The newest version in this manager's scope that every rank can load (a collective on the
        manager's group: the choice :meth:`restore` makes), or None."""
        self._check_job()
        with self._group():
            view = self._guarded(self._choose, None, {})
        return None if view is None else view.version

    def _guarded(self, fn, *args):
        """``fn(*args)`` (collectives on the manager's group); a failed collective breaks the job."""
        try:
            return fn(*args)
        except Exception as e:
            if _group_failure(e):
                self._break(f"a collective of a restore failed: {type(e).__name__}: {e}")
                raise JobBrokenError(self._broken_message(self._broken)) from e
            raise

    @contextlib.contextmanager
    def _group(self):
        """Around :meth:`restore` and :meth:`latest`: the manager's group, or after :meth:`close`
        destroyed it, one made for the call (every rank makes the call) and destroyed at its end."""
        if self._pg is not None or not self._dist:
            yield
            return
        self._pg = new_gloo_group()
        try:
            yield
        finally:
            pg, self._pg = self._pg, None
            destroy_group(pg)

    def _choose(self, version: str | None, failed: dict, bad: set = frozenset(), notes: dict | None = None):
        """The restore choice (:func:`ckptstore.choice.decide`) for ``version`` (None: the newest
        loadable in scope), passing over ``failed`` versions; a collective on the manager's group."""
        from .store import Store

        st = Store(self.root, remote=self.remote, key=self._key, endpoint_url=self._reader_options.get("endpoint_url"))
        world = dist.get_world_size(self._pg) if self._dist else 1
        try:
            return st.choose(version, self._pg if self._dist else None, exclude=failed, scope=self.scope,
                             world_size=world, reshard=self.reshard, fall_back_after=self.fall_back_after,
                             bad=frozenset(bad), notes=notes)
        finally:
            st.close()

    def restore(self, state: dict[str, Any] | None = None, version: str | None = None, *,
                allow_partial_load: bool | tuple = False) -> int | None:
        """Load the newest version in scope that every rank can load and verify (or ``version``) into
        ``state`` (default: the constructor's) in place; return its step, or None when there is no
        checkpoint (``state`` is left unchanged). :attr:`last_restore` then says what was loaded and
        what was passed over.

        Never needs a person (docs/FORMAT.md, "Restore choice"): a version marked damaged anywhere,
        missing an object on every root and tier, saved by another number of ranks (unless
        ``reshard``), or that fails verification while it is loaded is skipped on every rank — with
        one warning naming version, object and place — and the next older one is loaded; whatever the
        failed load wrote into ``state`` is overwritten by that version (model, optimizer, data loader
        and RNG come from one version). The next :meth:`save` of a skipped or newer name supersedes it
        instead of raising ``VersionExistsError``. An unreachable remote tier does not stop a restore
        the roots can serve (``last_restore.remote_error``). An explicit ``version`` falls back to
        nothing: its problem is raised.

        Raises :class:`~ckptstore.errors.VersionNotFoundError` (listing why each version was skipped)
        when versions are committed but none can be loaded by every rank (e.g. a node lost its local
        root and there is no remote tier): starting from scratch there would silently drop the run's
        progress. Roots may be node-local (docs/FORMAT.md, "Placement").

        When the version was saved by another world size (``reshard=True``), this rank's RNG states
        and ``per_rank_keys`` values are not restored (there is no copy for this rank);
        ``last_restore.rng_restored`` is False, so the caller can reseed.

        ``allow_partial_load``: a ``state`` that asks for part of the version only — True, or a
        tuple of key prefixes (DCP's flattened keys, e.g. ``("dataloader.",)``) that may stay unread
        (see :class:`ckptstore.StorageReader`); default False: every stored key must be asked for.
        Raises what ``dcp.load`` raises (``ckptstore.errors`` types) when the version cannot be read."""
        t_wall = time.time()
        try:
            with self._group():
                step = self._restore(state, version, allow_partial_load)
        except BaseException as e:
            self._restore_event(t_wall, None, e)
            raise
        self._restore_event(t_wall, self.last_restore if step is not None else None, None)
        return step

    def _restore_event(self, t_wall: float, r: "RestoreInfo | None", e: BaseException | None) -> None:
        try:
            self._restore_line(t_wall, r, e)
        except Exception:  # noqa: BLE001 - the event log never changes what restore() returns or raises
            log.exception("ckptstore: could not record the restore event")

    def _restore_line(self, t_wall: float, r: "RestoreInfo | None", e: BaseException | None) -> None:
        fields: dict[str, Any] = {"t0": t_wall, "seconds": time.time() - t_wall, "ranks": self._world()}
        if r is not None:
            fields.update(
                outcome="restored", version=r.version, step=r.step, saved_ranks=r.world_size, attempt_loaded=r.attempt,
                skipped=[{"version": sk.version, "kind": sk.kind, "reason": sk.reason} for sk in r.skipped],
                remote_error=r.remote_error, restore_count=r.restore_count, rng_restored=r.rng_restored,
                reads={k: v for k, v in r.reads.items() if isinstance(v, (int, float))})
        elif e is None:
            fields.update(outcome="none")
        else:
            fields.update(outcome="failed", error=f"{type(e).__name__}: {e}")
        self._emit("restore", **fields)

    def _restore(self, state: dict[str, Any] | None, version: str | None, partial: bool | tuple = False) -> int | None:
        state = self._state(state)
        t0 = time.monotonic()
        self.wait()
        self._check_job()
        world = dist.get_world_size(self._pg) if self._dist else 1
        failed: dict[tuple, str] = {}
        unverified: list = []
        bad: set = set()
        notes: dict = {}
        tries = 0
        retry = None
        while True:
            view = self._guarded(self._choose, version, failed, bad, notes)
            if view is None:
                return None
            if retry is not None and retry[0] == view.version and self.rank == 0:
                log.warning("ckptstore: %s; loading %s again from another copy", retry[1],
                            ", ".join(f"{o} (not from rank {r}'s root)" for r, o in sorted(retry[2])))
            retry = None
            same_world = view.world_size in (None, 0, world)
            sd = self._state_dict(state, for_load=True, per_rank=same_world)
            # resharded: the saving ranks' own values (RNG, per_rank_keys) have no rank here to go to
            unread = () if same_world else tuple(f"{k}/rank" for k in self.per_rank_keys) + ("rng/rank",)
            unread = True if partial is True else unread + tuple(partial or ())
            reader = StorageReader(self.root, remote=self.remote, key=self._key, process_group=self._pg,
                                   allow_partial_load=unread or False, avoid=frozenset(bad),
                                   record_digests=self._writer.incremental and same_world, **self._reader_options)
            try:
                self._guarded(lambda: dcp.load(sd, checkpoint_id=view.version, storage_reader=reader,
                                               process_group=self._pg, planner=_SpellingLoadPlanner(sd)))
                break
            except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
                why = _unverifiable(e)
                if why is None:
                    raise
                # the same exception reached every rank (DCP gathers every rank's failure), so every
                # rank decides the same: first the load again without the copies that failed, when
                # another root holds one (a replica, the primary: the nearest verified copy); then,
                # with none left, past the version
                more = _bad_copies(e) - bad
                if more and tries < 4:
                    bad |= more
                    notes[(view.version, view.attempt)] = why
                    retry = (view.version, why[0], more)  # warned once the choice shows another copy exists
                    tries += 1
                    continue
                if version is not None:
                    raise
                failed[(view.version, view.attempt)] = why
                unverified.append(view.version)
                if self.rank == 0:
                    log.warning("ckptstore: version %r failed verification while loading (%s); restoring the next "
                                "older loadable version instead", view.version, why[0])
        self._apply(state, sd, per_rank=same_world)
        if same_world and self._writer.incremental:  # the next save references what did not change since
            self._writer._inc.seed(reader.manifest, reader.item_digests)
        if same_world:  # re-replication: a replaced node gets its part back, in the background
            j = reader._joined
            self._healing = self._writer.heal(view, j[2], j[3]) if j is not None and len(j) > 1 else None
        if not same_world and (self.save_rng or self.per_rank_keys):
            log.warning("ckptstore: %s was saved by %s ranks, this job has %s: per-rank values (RNG, %s) not restored",
                        view.version, view.world_size, world, ", ".join(self.per_rank_keys) or "-")
        skipped = list(view.skipped)
        if self.rank == 0:
            for sk in skipped:
                if sk.version not in unverified:
                    log.warning("ckptstore: skipped version %r (%s): %s", sk.version, sk.kind, sk.reason)
            if view.restore_count >= 1:
                log.warning("ckptstore: version %r is restored for the %d%s time in a row and nothing newer was committed "
                            "in between: the job ends after every resume%s", view.version, view.restore_count + 1,
                            _nth(view.restore_count + 1),
                            "" if self.fall_back_after else " (CheckpointManager(fall_back_after=K) skips it after K tries)")
            self._log_restore(view)
        self._supersede = {n: {a: _supersede_reason(n, skipped) for a in atts} for n, atts in view.newer.items()}
        self.last_restore = RestoreInfo(view.version, view.step, view.world_size, same_world and self.save_rng,
                                        same_world and bool(self.per_rank_keys), time.monotonic() - t0,
                                        attempt=view.attempt, skipped=skipped, remote_error=view.remote_error,
                                        restore_count=view.restore_count, stale=list(view.stale),
                                        reads=dict(reader.stats))
        return view.step

    def _log_restore(self, view) -> None:
        """Append this restore to the restore log of rank 0's root (docs/FORMAT.md, "Restore log")."""
        from .dcp import _job
        from .manifest.schema import utcnow

        entry = {"version": view.version, "attempt": view.attempt, "newest": list(view.newest or ()), "time": utcnow(),
                 "world_size": dist.get_world_size(self._pg) if self._dist else 1,
                 "skipped": [sk.version for sk in view.skipped]}
        try:
            _job.append_restore_log(self._writer._tier, entry)
        except OSError as e:  # the restore stands; only the restart-loop count misses it
            log.warning("ckptstore: could not append to the restore log of %s: %s", self.root, e)

    def resume(self, state: dict[str, Any] | None = None, *, first_step: int = 1) -> int:
        """:meth:`restore` and return the step to run next: the restored step + 1, or
        ``first_step`` when there is no checkpoint. ``for step in range(mgr.resume(), steps + 1)``."""
        step = self.restore(state)
        return first_step if step is None else int(step) + 1

    # -- state dict helpers ------------------------------------------------------------------------
    def _state_dict(self, state: dict[str, Any], for_load: bool = False, per_rank: bool = True) -> dict[str, Any]:
        """The state dict saved and loaded for ``state``. Module and optimizer keys are canonical: the
        components wrappers add (``torch.compile``'s ``_orig_mod``, ``checkpoint_wrapper``'s
        ``_checkpoint_wrapped_module``, DDP's ``module``, FSDP1's ``_fsdp_wrapped_module``) are dropped
        wherever ``get_model_state_dict`` leaves them, so every nesting of wrappers saves and loads the
        same keys (``model.0.weight``); :meth:`_apply` maps them back to the module's own spelling."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        module = _the_module(state)
        sd: dict[str, Any] = {}
        for k, v in state.items():
            if k in self.per_rank_keys:
                if not per_rank:
                    continue
                k = f"{k}/rank{self.rank}"
            if isinstance(v, torch.nn.Module):
                sd[k] = _Respelled.model(v, get_model_state_dict(v))
            elif isinstance(v, torch.optim.Optimizer):
                if module is None:
                    raise CkptStoreError(f"state[{k!r}] is an optimizer; the state needs exactly one nn.Module for it")
                sd[k] = _Respelled.optimizer(module, get_optimizer_state_dict(module, v))
            elif hasattr(v, "state_dict") and hasattr(v, "load_state_dict"):
                sd[k] = v.state_dict()
            else:
                sd[k] = v
        if self.save_rng and per_rank:
            sd[f"rng/rank{self.rank}"] = _rng_state()
        return sd

    def _apply(self, state: dict[str, Any], sd: dict[str, Any], per_rank: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        module = _the_module(state)
        for k, v in state.items():
            if k in self.per_rank_keys and not per_rank:
                continue
            sk = f"{k}/rank{self.rank}" if k in self.per_rank_keys else k
            if isinstance(v, torch.nn.Module):
                set_model_state_dict(v, _Respelled.back_of(sd[sk]))
            elif isinstance(v, torch.optim.Optimizer):
                set_optimizer_state_dict(module, v, _Respelled.back_of(sd[sk]))
            elif hasattr(v, "state_dict") and hasattr(v, "load_state_dict"):
                v.load_state_dict(sd[sk])
            elif isinstance(v, torch.Tensor):
                pass  # loaded in place by DCP
            else:
                state[k] = sd[sk]
        if self.save_rng and per_rank:
            _set_rng_state(sd[f"rng/rank{self.rank}"])

    # -- reporting and shutdown --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per-save timings and their means; ``advice`` (see :mod:`ckptstore.advise`) when ``mtbf``
        was given and a save has been measured."""
        with self._lock:
            infos = [dataclasses.asdict(i) for i in self._infos]

        def mean(key):
            xs = [i[key] for i in infos if i[key] is not None]
            return sum(xs) / len(xs) if xs else None

        out: dict[str, Any] = {
            "saves": len(infos),
            "failed": sum(1 for i in infos if i["error"]),
            "mean_blocked_s": mean("blocked_s"),
            "mean_local_commit_s": mean("local_commit_s"),
            "mean_remote_commit_s": mean("remote_commit_s"),
            "step_time_s": self._step_time,
            "per_save": infos,
        }
        if self.mtbf and out["mean_blocked_s"] is not None:
            from .advise import advise

            cur = self.interval_steps * self._step_time if self._step_time else None
            out["advice"] = advise(
                cost_s=out["mean_blocked_s"], mtbf_s=self.mtbf, restart_s=self.restart_s,
                step_time_s=self._step_time, current_interval_s=cur,
            )
        return out

    def close(self) -> None:
        """Wait for every save and upload (bounded by ``upload_timeout``); raise the first problem
        (a failed save, or ``UploadError`` naming versions not uploaded). Then destroy the manager's
        process groups (local, no collective). No save after this; :meth:`restore` and :meth:`latest`
        still work, each on a group made for the call (a collective on the default group)."""
        self._close(None)

    def _close(self, loop_error: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        with _open_lock:
            _open.get(self._names, set()).discard(self)
        t_wall = time.time()
        err: BaseException | None = None
        try:
            if self._sig is not None:
                self._close_preempted()
            else:
                try:
                    self.wait()
                finally:
                    if self._worker is not None:
                        self._queue.put(None)
                        self._worker.join()
                    self._writer.close()
        except BaseException as e:
            err = e
            raise
        finally:
            self._finish_round()
            for name in ("_pg", "_ctl"):  # local, no collective (_groups.py)
                pg = getattr(self, name)
                setattr(self, name, None)
                destroy_group(pg)
            self._stop_watchdog()
            self._restore_signals()
            # the loop's own exception (not a preemption): the attempt ended in a failure (ckptstore goodput)
            failed = loop_error is not None and not isinstance(loop_error, (Preempted, KeyboardInterrupt))
            self._emit("close", t0=t_wall, seconds=time.time() - t_wall, outcome="ok" if err is None else "error",
                       error=None if err is None else f"{type(err).__name__}: {err}",
                       loop_error=f"{type(loop_error).__name__}: {loop_error}"[:500] if failed else None)
            if self._elog is not None:
                self._elog.close()

    def _finish_round(self) -> None:
        """Let the last preemption all-reduce complete (every rank issued it at its last save() call)
        and drop it, so that no collective of this manager is left to gloo's threads at exit
        (pytorch/pytorch #190489: a gloo worker freeing a collective's tensors while Python finalises)."""
        r, self._round = self._round, None
        if r is None:
            return
        try:
            if not r[0].is_completed():
                r[0].wait(_timedelta(5.0 if self._sig is None else 0.5))
        except BaseException:  # noqa: BLE001 - a peer that is gone: nothing to wait for
            pass

    def _close_preempted(self) -> None:
        """close() after a preemption signal: every wait ends before the watchdog's deadline; what is
        not uploaded by then is named in a warning (not raised: the next run's first save uploads it)."""
        d = self._hard_deadline()
        left = (lambda: None) if d is None else (lambda: max(0.0, d - self._reserve() / 2 - time.monotonic()))
        problems = []
        if self.executor == "process":
            if not self._wait_process(left()):
                problems.append("the save in flight did not finish")
        elif self._worker is not None:
            end = None if d is None else time.monotonic() + (left() or 0.0)
            with self._queue.all_tasks_done:
                while self._queue.unfinished_tasks and (end is None or time.monotonic() < end):
                    self._queue.all_tasks_done.wait(None if end is None else max(0.01, end - time.monotonic()))
            if self._queue.unfinished_tasks:
                problems.append("a save in flight did not finish (it never commits: nothing is half-visible)")
            else:
                self._queue.put(None)
                self._worker.join(left())
        with self._lock:
            errors, self._errors = self._errors, []
        problems.extend(errors)
        t = left()
        self._writer.upload_timeout = 0.0 if t is None else t  # also what the exit-time checks wait
        up = self._writer._uploader
        if up is not None and t is not None:
            up.timeout = t
        try:
            self._writer.close(t)
        except CkptStoreError as e:
            problems.append(str(e))
        if problems and self.rank == 0:
            log.warning("ckptstore: closing after %s: %s", _signal.Signals(self._sig).name, "; ".join(problems))

    def _in_flight(self) -> bool:
        """A save queued or running, or an upload / remote commit not finished."""
        f = self._proc_future
        if f is not None and not f.done():
            return True
        if self._queue.unfinished_tasks:
            return True
        up = self._writer._uploader
        return up is not None and bool(up.in_flight())

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the loop already failed: finish what can be finished, never hide its error
            self._close(exc)
        except BaseException as e:  # noqa: BLE001
            log.error("ckptstore: CheckpointManager.close() after %s: %s", exc_type.__name__, e)


class _Wakeup:
    """A socket pair whose write end is Python's signal wakeup fd (``signal.set_wakeup_fd``): the
    C-level handler writes each signal's number there as it arrives, whatever the main thread is
    doing; the watchdog thread reads the other end. Not installed when the program already has a
    wakeup fd (asyncio's): the watchdog then learns of the signal from the Python handler."""

    def __init__(self) -> None:
        import socket

        self.r, self.w = socket.socketpair()
        self.w.setblocking(False)

    @classmethod
    def install(cls) -> "_Wakeup | None":
        wk = cls()
        try:
            old = _signal.set_wakeup_fd(wk.w.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):
            wk.close()
            return None
        if old != -1:
            _signal.set_wakeup_fd(old)
            wk.close()
            return None
        return wk

    def wait(self) -> bytes:
        try:
            return self.r.recv(64)
        except OSError:
            return b""

    def poke(self) -> None:
        try:
            self.w.send(b"\0")
        except OSError:
            pass

    def uninstall(self) -> None:
        try:
            cur = _signal.set_wakeup_fd(-1)
            if cur not in (-1, self.w.fileno()):
                _signal.set_wakeup_fd(cur)
        except (ValueError, OSError):
            pass

    def close(self) -> None:
        for sk in (self.r, self.w):
            try:
                sk.close()
            except OSError:
                pass


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=max(0.001, seconds))


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _unverifiable(e: BaseException) -> tuple | None:
    """Why a failed load shows that its version cannot be loaded and verified (stored bytes that fail
    their checksum or tag, an object missing everywhere, a damage mark): ``(one line naming the rank,
    version, object and place, the object)`` — or None when the failure is of another kind (a key, a
    state dict mismatch, the job itself), which falling back would not cure."""
    from torch.distributed.checkpoint.api import CheckpointException

    from .errors import DamagedVersionError, IntegrityError, KeyMismatchError, ObjectNotFoundError

    if isinstance(e, CheckpointException):
        fails = sorted((r, f[0] if isinstance(f, tuple) else f) for r, f in e.failures.items())
    else:
        fails = [(None, e)]
    for r, x in fails:
        if isinstance(x, (IntegrityError, DamagedVersionError, ObjectNotFoundError)) and not isinstance(x, KeyMismatchError):
            return ("" if r is None else f"rank {r}: ") + f"{type(x).__name__}: {x}", getattr(x, "object", None)
    return None


def _bad_copies(e: BaseException) -> set:
    """``{(global rank, object)}``: the root copies a failed load found unverifiable (from the
    ``places`` of the readers' ``IntegrityError``s, gathered to every rank by DCP)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from .errors import IntegrityError

    fails = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()] if isinstance(e, CheckpointException) else [e]
    out = set()
    for x in fails:
        if isinstance(x, IntegrityError) and x.object:
            out.update((r, x.object) for kind, r in getattr(x, "places", ()) if kind == "root" and r is not None)
    return out


def _supersede_reason(name: str, skipped: list) -> str:
    for sk in skipped:
        if sk.version == name:
            return f"skipped at restore ({sk.kind})" + (f": {sk.object}" if sk.object else "")
    return "newer than the restored version (an abandoned timeline)"


def _nth(n: int) -> str:
    return "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


def _group_failure(e: BaseException) -> bool:
    """Did a save (or restore) fail because the job lost ranks? DCP reports a rank's own failure
    (a ckptstore error, a planner error) to every rank as ``CheckpointException``; anything else it
    raises comes from a collective that failed — gloo's ``RuntimeError`` ("Connection closed by
    peer"), ``torch.distributed.DistError`` and subclasses, ``ValueError`` ("Group ... is not
    registered") — after which the ranks no longer agree on where they are."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, JobBrokenError):
        return True
    if isinstance(e, CheckpointException):
        return any(isinstance(f[0] if isinstance(f, tuple) else f, JobBrokenError) for f in e.failures.values())
    if isinstance(e, CkptStoreError):
        return False
    return isinstance(e, Exception)


def _group_alive(pg) -> bool:
    """The process group ``pg`` (and torch.distributed) still exist in this process."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        dist.get_rank(pg)  # "Group ... is not registered" once destroyed (get_world_size does not check)
    except (ValueError, RuntimeError):
        return False
    return True


# the open managers of this process by (real root path, version names): see "One manager per root"
_open: dict[tuple, "weakref.WeakSet[CheckpointManager]"] = {}
_open_lock = threading.Lock()


# managers whose signal handlers are installed (reset in forked children: below)
_handling: "weakref.WeakSet[CheckpointManager]" = weakref.WeakSet()


def _reset_signals_in_child() -> None:
    """A forked child (a data loader's worker, a forkserver) is not the training loop: the signals
    get their previous handlers back and the wakeup fd (shared with the parent's watchdog) is
    dropped, so a SIGTERM to the child ends it as before and never reaches the parent's watchdog."""
    for m in list(_handling):
        try:
            for signum, prev in m._prev_handlers.items():
                if getattr(_signal.getsignal(signum), "__self__", None) is m:
                    _signal.signal(signum, prev if prev is not None else _signal.SIG_DFL)
            if m._wake is not None:
                m._wake.uninstall()
                m._wake = None
        except (ValueError, OSError):  # forked from a thread other than the main one
            pass
        m._signals, m._rounds = (), False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_signals_in_child)


def _stop_watchdogs_at_exit() -> None:  # managers never closed: their watchdog threads end before finalisation
    with _open_lock:
        mgrs = [m for ms in _open.values() for m in ms]
    for m in mgrs:
        m._stop_watchdog()


atexit.register(_stop_watchdogs_at_exit)


def _close_previous(names: tuple) -> None:
    """Close every open manager on ``names`` that still has saves or uploads in flight (warning)."""
    with _open_lock:
        busy = [m for m in _open.get(names, ()) if not m._closed and m._in_flight()]
    for first in busy:
        msg = (f"ckptstore: a new CheckpointManager on {names[0]} (version names {names[1]} {names[2]!r}) while "
               "another one of this process still has saves in flight: waited for them and closed the old manager")
        try:
            first.close()
        except BaseException as e:  # noqa: BLE001 - reported in the warning; the new manager goes on
            msg += f"; its close() raised {type(e).__name__}: {e}"
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _the_module(state: dict[str, Any]) -> torch.nn.Module | None:
    mods = [v for v in state.values() if isinstance(v, torch.nn.Module)]
    return mods[0] if len(mods) == 1 else None


def _rng_state() -> dict[str, Any]:
    s: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["cuda"] = torch.cuda.get_rng_state()
    np = sys.modules.get("numpy")
    if np is not None:
        s["numpy"] = np.random.get_state()
    return s


def _set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in s:
        np.random.set_state(s["numpy"])
