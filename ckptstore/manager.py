"""``ckptstore.CheckpointManager``: the training-loop API over the DCP writer and reader.

::

    with CheckpointManager(root, {"model": model, "optim": optimizer}, interval_steps=100) as mgr:
        for step in range(mgr.resume(), steps + 1):   # restores the newest checkpoint; next step
            train_step()
            mgr.save(step)                            # async; a no-op unless step % 100 == 0

The state given to the constructor is the default of :meth:`save`, :meth:`restore` and
:meth:`resume`; each also takes a ``state`` of its own (the explicit form, kept for callers of the
first version: ``step = mgr.restore(state) or 0``; ``mgr.save(step, state)``; ``mgr.close()``).

Design (anchors: Orbax ``CheckpointManager``, torchtitan's checkpointer, NVRx async checkpointing).
The manager is the loop's API; each concern is one object of :mod:`ckptstore._manager`, whose
module says how it behaves:

- its own process group, and a job that lost ranks refusing every save and restore
  (:mod:`~ckptstore._manager.job`, docs/FORMAT.md, Save rules 6-7);
- one save at a time behind a bounded queue, errors never lost (:mod:`~ckptstore._manager.save_queue`);
- the state dict of modules, optimizers, stateful objects and RNG (:mod:`~ckptstore._manager.state`);
- the restore choice, its fallback past unverifiable copies and versions, re-replication
  (:mod:`~ckptstore._manager.restore`, docs/FORMAT.md "Restore choice");
- preemption: a signal becomes one last committed save at the same step on every rank and a clean
  exit within the grace period (:mod:`~ckptstore._manager.preempt`, :mod:`~ckptstore._manager.signals`);
- the event log, metrics and ``on_event`` (:mod:`~ckptstore._manager.sink`, docs/FORMAT.md "Event log");
- one manager per root and version names in a process (:mod:`~ckptstore._manager.registry`);
- per-save timings (:class:`SaveInfo`) and what a restore loaded (:class:`RestoreInfo`)
  (:mod:`~ckptstore._manager.info`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal as _signal
import time
from typing import Any, Callable

from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ._manager import registry
from ._manager.info import RestoreInfo, SaveInfo  # noqa: F401 - public here
from ._manager.job import Job, world_size
from ._manager.preempt import Preemption
from ._manager.restore import Restorer, Source
from ._manager.save_queue import SaveQueue, resolve_nice
from ._manager.sink import EventSink
from ._manager.state import StateDicts
from ._state_keys import canonical_fqn  # noqa: F401 - public here
from .dcp import StorageWriter
from .errors import CkptStoreError, JobBrokenError
from .events import process_start_time
from .tiers import make_remote, remote_options_of

log = logging.getLogger("ckptstore")


class _Kept:
    """An attribute of the manager that one of its rooms keeps: ``room`` names the manager's
    attribute holding that object, ``name`` the room's attribute (default: the same name)."""

    def __init__(self, room: str, name: str | None = None) -> None:
        self.room, self.name = room, name

    def __set_name__(self, owner, name: str) -> None:
        self.name = self.name or name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(getattr(obj, self.room), self.name)

    def __set__(self, obj, value) -> None:
        setattr(getattr(obj, self.room), self.name, value)


class CheckpointManager:
    """Periodic async checkpoints for a training loop, restore from the newest loadable version.

    Args:
        root: local checkpoint directory (the fast tier), shared by the ranks of one node.
        state: the default training state of :meth:`save`, :meth:`restore` and :meth:`resume`:
            a dict of modules, optimizers, objects with ``state_dict()``/``load_state_dict()``
            and plain values (see :mod:`ckptstore._manager.state`); None: pass ``state`` to each call.
        remote: a remote tier's URL (``"s3://bucket/prefix"``, ``"gs://…"``, ``"az://…"``;
            docs/tiers.md) or a :class:`~ckptstore.tiers.Tier`, to also stage every version there;
            its options go in ``remote_options`` (a ``writer_options`` entry, as for
            :class:`ckptstore.StorageWriter`).
        key: master key (see :class:`ckptstore.StorageWriter`).
        key_file: instead of ``key``, a key file (32 bytes or their base64, what ``ckptstore keygen``
            writes; the CLI's ``--key-file``, torchtitan's ``key_file``). Not with ``key``.
        interval_steps: ``save(step, ...)`` saves when ``step % interval_steps == 0`` (or ``force``);
            None: only with ``force`` (a framework that decides when to save, as torchtitan's
            checkpointer does, calls ``save(step)`` at every step so that a preemption signal is
            noticed at the next step boundary, and ``save(step, force=True)`` to save).
        retention: a :class:`ckptstore.retention.RetentionPolicy` applied after each commit.
        durability: ``"local"``, ``"replicated"`` or ``"remote"`` (see :class:`ckptstore.StorageWriter`).
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
        allow_nonfinite: let :meth:`restore` and :meth:`resume` pick a version whose manifest records
            NaN/Inf values (default False: such a version is skipped, ``last_restore.skipped`` kind
            ``nonfinite``; docs/FORMAT.md "Restore choice"). :meth:`rollback` never picks one.
        fall_back_after: when the version :meth:`restore` would pick has been restored this many
            times in a row with nothing newer committed in between (the job dies after every resume),
            skip it and restore the one before (default None: never; the count is always in
            ``last_restore.restore_count`` and warned about from 2 on).
        save_on_signal: signals that ask for a last save and a clean exit
            (:mod:`ckptstore._manager.preempt`). Default ``"auto"``: SIGTERM, when the manager is
            created in the main thread and SIGTERM has its default disposition (a handler of the
            program's own is left alone); a tuple of signals: those, replacing their handlers; ``()``
            or None: off. The previous handlers come back at :meth:`close`. Every rank must pass the
            same setting.
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
        on_busy: ``"wait"`` (default): a due save waits while ``max_pending`` saves are queued;
            ``"skip"``: it is skipped instead (``save()`` returns False, a save line with outcome
            ``skipped``) — for loops that must never block on a save (under torchft).
        group_timeout_s: the timeout of the manager's gloo group (its DCP collectives; default
            torch's 30 minutes).
        raise_errors: True (default): a failed save raises from the next ``save()``/``wait()``/
            ``close()``; False: it is only reported (its save line, ``on_save``, the metrics).
        background_nice: how far the thread that runs the saves (THREAD executor) lowers its CPU
            priority, as a nice increment 0-19 (Linux; elsewhere ignored). Default (None): the
            environment variable ``CKPTSTORE_BACKGROUND_NICE`` when set, else 0 (not lowered). Where
            the training keeps every core busy, a lowered save takes more of its CPU from the time
            the training leaves idle and takes longer; the threads it starts (frame encoders, and
            the upload, replica and tier-client pools it starts first, which persist) inherit it;
            the last save after a preemption signal runs at the process's own priority. The GIL is
            not prioritised: a lowered thread holding it delays the training thread until it gets a
            core; a due save waits for a lowered one still running (``on_busy="wait"``), hence off by
            default (measured: :mod:`ckptstore._manager.save_queue`, "Background priority").
        background_duty: the share of its wall time (0 < d <= 1) the thread that runs the saves
            (THREAD executor) may spend on CPU in a save's bookkeeping — DCP's planning, the commit,
            retention's listing: it first pauses a random 0-0.1 s, then between the pieces pauses in
            proportion to the CPU each used (at most 0.2 s at a time; per save at most 2 s, a quarter
            of ``group_timeout_s``, and a quarter of the time since the previous save was queued less
            the CPU that one took — the first save is not paced — and no pause once another save is
            queued behind it or someone waits for the saves), so their CPU is spread over more
            training steps instead of lengthening the next one or two (:mod:`ckptstore._pace`). The bytes (frame encoders,
            uploads) are never paced. Default None (1): unpaced; the last save after a preemption
            signal is never paced. For loops whose cores the training keeps busy and whose saves are
            small or skipped when busy (the torchft tier sets 0.02). ``SaveInfo.paused_s``: how long
            a save paused.
        **writer_options: passed to :class:`ckptstore.StorageWriter` (``threads``, ``frame_size``,
            ``upload_timeout``, ``remote_options``, ...); ``world_size`` defaults to the job's.
            Among them ``replicas``: replication factor F — every node's objects are also copied to
            the roots of F other nodes (docs/FORMAT.md, "Replicas"); after a restore, a replaced node
            gets its part back from the replicas in the background. THREAD executor only.
            ``replica_domain``: this rank's failure domain (a rack, a switch), default the
            environment variable ``CKPTSTORE_REPLICA_DOMAIN``, else the host name: a node's replicas
            never go to a node of its own domain while another domain exists (docs/FORMAT.md,
            "Replicas"; :class:`ckptstore.StorageWriter`).

    Creating a manager on the same ``root`` and version names as another manager of this process
    that still has saves or uploads in flight closes that one first (waits for them, warns with
    ``RuntimeWarning``). Once a save failed because the job lost ranks, every ``save``, ``wait``,
    ``latest`` and ``restore`` raises :class:`~ckptstore.errors.JobBrokenError`
    (:mod:`ckptstore._manager.job`, "Only the whole job commits").
    """

    # attributes kept by the rooms (set on the manager, they change the room's)
    executor = _Kept("_saves")
    save_rng = _Kept("_states")
    per_rank_keys = _Kept("_states")
    attempt_id = _Kept("_events")
    on_event = _Kept("_events")
    progress_s = _Kept("_events")
    event_log = _Kept("_events")
    metrics_file = _Kept("_events")
    grace_s = _Kept("_preempt")
    #: the last sentence of the preemption message: how to resume (``{step}``, ``{version}`` filled in)
    resume_hint = _Kept("_preempt")
    _sig = _Kept("_preempt", "sig")
    _sig_mono = _Kept("_preempt", "sig_mono")
    _healing = _Kept("_restorer", "healing")

    def __init__(
        self,
        root: str | os.PathLike,
        state: dict[str, Any] | None = None,
        *,
        remote: str | None = None,
        key: Any = None,
        key_file: str | os.PathLike | None = None,
        interval_steps: int | None = 1,
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
        allow_nonfinite: bool = False,
        save_on_signal: Any = "auto",
        grace_s: float | None = 30.0,
        event_log: Any = True,
        on_event: Callable[[dict], None] | None = None,
        metrics_file: str | os.PathLike | None = None,
        progress_s: float = 5.0,
        on_busy: str = "wait",
        raise_errors: bool = True,
        group_timeout_s: float | None = None,
        background_nice: int | None = None,
        background_duty: float | None = None,
        **writer_options: Any,
    ) -> None:
        if on_busy not in ("wait", "skip"):
            raise ValueError("on_busy must be 'wait' or 'skip'")
        background_nice = resolve_nice(background_nice, 0)
        background_duty = _check_duty(background_duty)
        kind = _executor_kind(executor, interval_steps, max_pending, writer_options)
        if key_file is not None:
            from .codec.crypto import key_or_file

            key = key_or_file(key, key_file)
        self._names = registry.names_of(root, prefix, version_format)
        registry.close_previous(self._names)
        _check_bounds(fall_back_after, grace_s, progress_s)
        self.root = os.fspath(root)
        self.remote = remote
        self.interval_steps = interval_steps
        self.on_save = on_save
        self.mtbf = mtbf
        self.restart_s = restart_s
        self.prefix = prefix
        self.version_format = version_format
        self.reshard = reshard
        self.fall_back_after = fall_back_after
        self.allow_nonfinite = bool(allow_nonfinite)
        self.state = state
        self.last_restore: RestoreInfo | None = None
        self._open_rooms(key=key, retention=retention, durability=durability, kind=kind, max_pending=max_pending,
                         save_rng=save_rng, per_rank_keys=per_rank_keys, writer_options=writer_options,
                         on_busy=on_busy, raise_errors=raise_errors, group_timeout_s=group_timeout_s,
                         background_nice=background_nice, background_duty=background_duty)
        self._events = EventSink(rank=self.rank, world=self._job.world, root=self.root, remote=remote,
                                 writer=self._writer, event_log=event_log, on_event=on_event,
                                 metrics_file=metrics_file, progress_s=progress_s)
        self._preempt = Preemption(save_on_signal=save_on_signal, grace_s=grace_s, rank=self.rank,
                                   multi_rank=self._job.dist and self._job.world > 1, emit=self._events.emit)
        if self._preempt.wanted:
            self._writer._subprocess_own_group = True  # torchrun signals the worker's process group
        registry.add(self, self._names)
        self._events.emit("open", pid=os.getpid(), proc_start=process_start_time(), ranks=self._job.world,
                          names=self._names[2], interval_steps=interval_steps, executor=kind, durability=durability,
                          remote=remote is not None, restart_count=_env_int("TORCHELASTIC_RESTART_COUNT"),
                          save_on_signal=[_signal.Signals(x).name for x in self._preempt.signals], grace_s=grace_s)

    def _open_rooms(self, *, key, retention, durability: str, kind: str, max_pending: int, save_rng: bool,
                    per_rank_keys, writer_options: dict, on_busy: str = "wait", raise_errors: bool = True,
                    group_timeout_s: float | None = None, background_nice: int = 0,
                    background_duty: float | None = None) -> None:
        """The writer, then the manager's group (after any group the writer makes: every rank makes
        them in the same order), the save queue, the state dicts and the restorer."""
        from .choice import version_pattern

        #: the regular expression of the names this manager saves (its scope)
        self.scope = version_pattern(self.prefix, self.version_format)
        if retention is not None and getattr(retention, "match", None) is None and dataclasses.is_dataclass(retention):
            retention = dataclasses.replace(retention, match=self.scope)
        #: ``{name: {attempt: reason}}``: versions the next save of that name supersedes (set by restore)
        self._supersede: dict[str, dict[str, str]] = {}
        self._key = key
        # the remote tier is made once, from its URL and options (docs/tiers.md), for the writer and every restore
        remote_options = remote_options_of(writer_options.pop("remote_options", None), writer_options,
                                           where="CheckpointManager")
        self._remote_tier = make_remote(self.remote, **remote_options)
        self._reader_options = {k: writer_options[k] for k in ("threads",) if k in writer_options}
        # the writer refuses any save by another number of ranks (docs/FORMAT.md, Save rule 6)
        writer_options.setdefault("world_size", world_size())
        # an incremental save without a baseline in memory takes the newest version of this scope
        writer_options.setdefault("scope", self.scope)
        self._writer = StorageWriter(self.root, remote=self._remote_tier, key=key, durability=durability, retention=retention,
                                     max_staged=max_pending + 1, **writer_options)
        self._job = Job(group_timeout_s)
        self.rank = self._job.rank
        self._states = StateDicts(self.rank, per_rank_keys, save_rng)
        self._saves = SaveQueue(writer=self._writer, job=self._job, remote=self.remote is not None, executor=kind,
                                max_pending=max_pending, report=self._report, on_busy=on_busy,
                                raise_errors=raise_errors, nice=background_nice, duty=background_duty)
        self._restorer = Restorer(writer=self._writer, job=self._job, states=self._states)
        self._last_call: tuple[int, float] | None = None
        self._step_time: float | None = None
        self._closed = False

    # -- events and metrics (ckptstore._manager.sink) ----------------------------------------------
    def metrics_text(self, openmetrics: bool = False) -> str:
        """This rank's figures (saves, bytes, phases of the last save, durable lag, restores,
        retention, preemptions) in the Prometheus text format 0.0.4, or with ``openmetrics`` in the
        OpenMetrics format (:mod:`ckptstore.metrics`)."""
        return self._events.metrics_text(openmetrics)

    def _report(self, info: SaveInfo) -> None:
        """A save committed or failed (from the save queue): its event, then ``on_save``."""
        try:
            self._events.save_event(info)
        except Exception:  # noqa: BLE001 - the event log never breaks saving
            log.exception("ckptstore: could not record the save event of %s", info.version)
        if self.on_save is not None:
            try:
                self.on_save(info)
            except Exception:  # noqa: BLE001 - a callback must not break saving
                log.exception("ckptstore: on_save callback failed")

    # -- saving ------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.interval_steps is not None and step % self.interval_steps == 0

    def version_name(self, step: int) -> str:
        if self.version_format is not None:
            return self.version_format.format(step=int(step))
        return f"{self.prefix}{int(step)}"

    def _state(self, state: dict[str, Any] | Callable[[], dict[str, Any]] | None) -> dict[str, Any]:
        state = self.state if state is None else state
        if state is None:
            raise TypeError("no state: pass CheckpointManager(root, state) or state= to this call")
        if callable(state) and not isinstance(state, dict) and not hasattr(state, "state_dict"):
            state = state()  # built only when a save starts (save(step, lambda: ...))
        return state

    def save(self, step: int, state: dict[str, Any] | Callable[[], dict[str, Any]] | None = None, *,
             force: bool = False, metadata: dict[str, Any] | None = None) -> bool:
        """Stage ``state`` (default: the constructor's; a callable returning it is called only when a
        save starts, so a loop may pass one at every step for nothing) and queue its save as version
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
        rank, for the signal to be noticed within a step. With several managers in the process (a
        model manager and a ``prefix="loader-"`` one) every one of them hears the signal and saves the
        same step; the last one called at that step raises, the others return True (their next
        ``save()`` raises) — see :mod:`ckptstore._manager.signals`."""
        t0 = time.monotonic()
        self._note_step(step, t0)
        if self._preempt.preempted is not None:
            raise self._preempt.preempted  # the loop caught it and went on: stop again
        self._saves.raise_errors()
        if self._closed:
            raise CkptStoreError("CheckpointManager is closed")
        if self._preempt.due():
            pre = self._preempt.check(step)
            if pre is not None:
                self._preempt_save(step, state, metadata, pre, t0)  # raises Preempted (the process's last manager)
                return True
        if not (force or self.due(step)):
            self._events.progress(step, t0, None)
            return False
        self._job.check()
        if self._saves.busy():  # on_busy="skip": never wait for the save in flight
            self._events.emit("save", step=int(step), version=self.version_name(step), ranks=self._job.world,
                              outcome="skipped", error="the previous save is still running")
            self._events.progress(step, t0, None)
            return False
        info = self._start_save(step, state, metadata, t0)
        self._events.progress(step, t0, info.version)
        return True

    def _prepare(self, step: int, state, metadata, t0: float, forced: bool) -> tuple[SaveInfo, dict, dict]:
        """The save of ``step``: its record, its state dict, and its line's fields so far."""
        version = self.version_name(step)
        sd = self._states.build(self._state(state))
        # a name left by a damaged, unloadable or abandoned version is superseded, not refused
        # (docs/FORMAT.md, "Superseding")
        self._writer.save_options(version, step=int(step), user_metadata=metadata,
                                  supersede=self._supersede.get(version))
        extra = self._events.save_called(version, t0, forced)
        return SaveInfo(int(step), version, 0.0), sd, extra

    def _start_save(self, step: int, state, metadata, t0: float, *, forced: bool = False,
                    deadline: float | None = None, urgent: bool = False) -> SaveInfo:
        """Stage and queue (THREAD) or hand to DCP's checkpoint subprocess (PROCESS) the save of
        ``step``; with ``deadline`` (monotonic), waits for earlier saves only until then; ``urgent``:
        at the process's priority (the last save after a preemption signal)."""
        info, sd, extra = self._prepare(step, state, metadata, t0, forced)
        self._saves.submit(info, sd, t0, extra, deadline, urgent=urgent)
        return info

    def _note_step(self, step: int, now: float) -> None:
        if self._last_call is not None and step > self._last_call[0]:
            dt = (now - self._last_call[1]) / (step - self._last_call[0])
            self._step_time = dt if self._step_time is None else 0.8 * self._step_time + 0.2 * dt
        self._last_call = (step, now)

    def wait(self) -> None:
        """Block until every queued save has committed (locally; see ``durability``) and, on
        node-local roots, its manifest copy is in this rank's root (docs/FORMAT.md, "Placement"); raise
        the error of a failed one (:class:`JobBrokenError`, at once, once the job lost ranks)."""
        self._saves.wait()

    def _in_flight(self) -> bool:
        """A save queued or running, or an upload / remote commit not finished."""
        return self._saves.in_flight()

    # -- preemption (ckptstore._manager.preempt) ---------------------------------------------------
    def _preempt_save(self, step: int, state, metadata, pre: tuple, t0: float) -> None:
        """The forced save of ``step`` after a preemption signal; raises :class:`Preempted` when this is
        the last manager of the process to save that step (``signals.SignalHub``: every manager saves
        the same step), else returns (the next ``save()`` call raises it)."""
        self._preempt.adopt(pre)
        version = self.version_name(step)
        in_flight = self._in_flight()

        def start(deadline: float | None) -> SaveInfo:
            self._job.check()
            if self.executor == "process":
                return self._save_here(step, state, metadata, t0, deadline)
            return self._start_save(step, state, metadata, t0, forced=True, deadline=deadline, urgent=True)

        last = self._preempt.save_last(step, version, pre, start, lambda: self._committed_locally(version),
                                       self.remote is not None)
        self._events.progress(step, t0, version if last.info is not None else None)
        exc = self._preempt.stop_loop(step, version, pre, last, in_flight)
        if self._preempt.last_of_process():
            raise exc
        log.warning("ckptstore: %s saved step %d; the process stops once its other managers saved it too",
                    self.version_name(step), step)

    def _save_here(self, step: int, state, metadata, t0: float, deadline: float | None) -> SaveInfo:
        """PROCESS executor, the last save before exiting: once the save in flight has finished (its
        subprocess is out of the trainer's process group, so torchrun's signal does not end it), save
        in this process (``dcp.save``): nothing is gained by handing a save we wait for to the
        subprocess, and its uploads are this process's to bound (``close()``)."""
        if not self._saves.wait_process(None if deadline is None else max(0.0, deadline - time.monotonic())):
            raise CkptStoreError("the save in flight did not finish within the grace period")
        info, sd, _extra = self._prepare(step, state, metadata, t0, True)
        self._saves.run_here(info, sd, t0)
        return info

    def _committed_locally(self, version: str) -> bool:
        from .manifest import layout

        try:
            return self._writer._tier.exists(layout.manifest_key(version))
        except Exception:  # noqa: BLE001
            return False

    def _stop_watchdog(self) -> None:
        self._preempt.stop_watchdog()

    # -- restoring (ckptstore._manager.restore) ----------------------------------------------------
    def _source(self, allow_nonfinite: bool | None = None) -> Source:
        return Source(self.root, self._remote_tier, self._key, self._reader_options, self.scope, self.reshard,
                      self.fall_back_after, self.allow_nonfinite if allow_nonfinite is None else bool(allow_nonfinite))

    def latest(self) -> str | None:
        """The newest version in this manager's scope that every rank can load (a collective on the
        manager's group: the choice :meth:`restore` makes), or None."""
        self._job.check()
        with self._job.group():
            view = self._job.guarded(self._restorer.choose, self._source(), None, {})
        return None if view is None else view.version

    def restore(self, state: dict[str, Any] | None = None, version: str | None = None, *,
                allow_partial_load: bool | tuple = False, allow_nonfinite: bool | None = None) -> int | None:
        """Load the newest version in scope that every rank can load and verify (or ``version``) into
        ``state`` (default: the constructor's) in place; return its step, or None when there is no
        checkpoint (``state`` is left unchanged). :attr:`last_restore` then says what was loaded and
        what was passed over.

        Never needs a person (docs/FORMAT.md, "Restore choice"): a version marked damaged anywhere,
        missing an object on every root and tier, saved by another number of ranks (unless
        ``reshard``), recorded as holding NaN/Inf values (unless ``allow_nonfinite``: this call's,
        else the manager's), or that fails verification while it is loaded is skipped on every rank — with
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
        return self._restore_call(state, version, allow_partial_load, allow_nonfinite, rollback=False)

    def _restore_call(self, state, version, partial, allow_nonfinite, rollback: bool) -> int | None:
        """:meth:`restore` with its ``restore`` line in the event log."""
        t_wall = time.time()
        try:
            with self._job.group():
                step = self._restore(state, version, partial, allow_nonfinite)
        except BaseException as e:
            self._events.restore_event(t_wall, None, e, rollback)
            raise
        self._events.restore_event(t_wall, self.last_restore if step is not None else None, None, rollback)
        return step

    def _restore(self, state: dict[str, Any] | None, version: str | None, partial: bool | tuple = False,
                 allow_nonfinite: bool | None = None) -> int | None:
        state = self._state(state)
        t0 = time.monotonic()
        self.wait()
        self._job.check()
        got = self._restorer.restore(self._source(allow_nonfinite), state, version, partial, t0)
        if got is None:
            return None
        self._supersede = got.supersede
        self.last_restore = got.info
        return got.info.step

    def resume(self, state: dict[str, Any] | None = None, *, first_step: int = 1) -> int:
        """:meth:`restore` and return the step to run next: the restored step + 1, or
        ``first_step`` when there is no checkpoint. ``for step in range(mgr.resume(), steps + 1)``."""
        step = self.restore(state)
        return first_step if step is None else int(step) + 1

    def rollback(self, state: dict[str, Any] | None = None) -> int:
        """Go back to the newest version whose tensors hold no NaN/Inf and return the step to run next
        (its step + 1), for a loop that saw a non-finite loss and wants to continue unattended::

            if not torch.isfinite(loss):          # the same decision on every rank (an all-reduced loss)
                step = mgr.rollback()             # state restored in place; skip the batches you choose
                continue

        A collective on the manager's group: every rank calls it at the same point. It waits for the
        saves in flight (a save of the poisoned state commits, recorded with its NaN/Inf count), then
        restores as :meth:`restore` does (model, optimizer, scheduler, data loader and RNG from one
        version, ``last_restore`` saying what was passed over) with every version that records
        NaN/Inf values skipped (kind ``nonfinite``), whatever ``allow_nonfinite`` says. Which data to
        skip is the loop's: the restored data loader is at the restored step. The next saves of the
        skipped names, and of every name newer than the restored version, supersede them (an
        abandoned timeline, docs/FORMAT.md "Superseding"). Versions whose values were not counted
        (older releases, ``count_nonfinite=False``) count as finite.

        Raises :class:`~ckptstore.errors.VersionNotFoundError` when there is nothing to go back to
        (no committed version; every version holds NaN/Inf) — the state is then left as it is."""
        step = self._restore_call(state, None, False, False, rollback=True)
        if step is None:
            from .errors import VersionNotFoundError

            raise VersionNotFoundError(f"nothing to roll back to: no version in this manager's scope ({self.scope}) is "
                                       f"committed under {self.root}" + (f" or {self.remote}" if self.remote else "")
                                       + "; save one before the loop can go back (mgr.save(step, force=True))")
        return int(step) + 1

    # -- reporting and shutdown --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per-save timings and their means; ``advice`` (see :mod:`ckptstore.advise`) when ``mtbf``
        was given and a save has been measured."""
        with self._saves.lock:
            infos = [dataclasses.asdict(i) for i in self._saves.infos]

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

            cur = self.interval_steps * self._step_time if self._step_time and self.interval_steps else None
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
        registry.discard(self, self._names)
        t_wall = time.time()
        err: BaseException | None = None
        try:
            if self._sig is not None:
                self._close_preempted()
            else:
                try:
                    self.wait()
                finally:
                    self._saves.stop()
                    self._writer.close()
        except BaseException as e:
            err = e
            raise
        finally:
            self._preempt.finish_round()
            self._job.close()
            self._preempt.close()
            self._events.close(t_wall, err, loop_error)

    def _close_preempted(self) -> None:
        """close() after a preemption signal: every wait ends before the watchdog's deadline; what is
        not uploaded by then is named in a warning (not raised: the next run's first save uploads it)."""
        left = self._preempt.close_budget()
        problems = self._saves.drain(left)
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

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the loop already failed: finish what can be finished, never hide its error
            self._close(exc)
        except BaseException as e:  # noqa: BLE001
            if isinstance(exc, JobBrokenError) and isinstance(e, JobBrokenError):
                return  # the loop's own error says it (once)
            log.error("ckptstore: CheckpointManager.close() after %s: %s", exc_type.__name__, e)


def _executor_kind(executor, interval_steps: int | None, max_pending: int, writer_options: dict) -> str:
    """Check the options of the save queue; the executor's name (``"thread"`` or ``"process"``)."""
    if interval_steps is not None and interval_steps < 1:
        raise ValueError("interval_steps must be >= 1 (or None: save only with force=True)")
    if max_pending < 1:
        raise ValueError("max_pending must be >= 1")
    kind = executor.value if isinstance(executor, AsyncCheckpointerType) else str(executor)
    if kind not in ("thread", "process"):
        raise ValueError("executor must be 'thread' or 'process'")
    if kind == "process" and writer_options.get("replicas"):
        raise ValueError("replicas= needs executor='thread': the copies travel between the trainers' processes, "
                         "which DCP's checkpoint subprocess is not")
    return kind


def _check_duty(duty: float | None) -> float | None:
    """``background_duty`` checked: None (unpaced) for None or 1; ``ValueError`` outside (0, 1]."""
    if duty is None:
        return None
    if isinstance(duty, bool) or not isinstance(duty, (int, float)) or not 0 < duty <= 1:
        raise ValueError(f"background_duty must be a share of one core's time in (0, 1] (or None), not {duty!r}")
    return None if duty == 1 else float(duty)


def _check_bounds(fall_back_after: int | None, grace_s: float | None, progress_s: float) -> None:
    if fall_back_after is not None and fall_back_after < 1:
        raise ValueError("fall_back_after must be >= 1 (or None)")
    if grace_s is not None and grace_s <= 0:
        raise ValueError("grace_s must be positive (or None)")
    if progress_s < 0:
        raise ValueError("progress_s must be >= 0")


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None
