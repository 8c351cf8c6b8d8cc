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
- **Timings.** Per save: ``blocked_s`` (time ``save()`` held the training loop), ``local_commit_s``
  and ``remote_commit_s`` (from the ``save()`` call to the commit; ``remote_commit_s`` only on the
  coordinator, which makes the remote commit). Passed to ``on_save`` and kept by :meth:`stats`,
  which adds the interval advice of :mod:`ckptstore.advise` when ``mtbf`` is given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import random
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ._groups import destroy_group, new_gloo_group
from .dcp import StorageReader, StorageWriter
from .errors import CkptStoreError, JobBrokenError, VersionNotFoundError

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
        self._proc_info: SaveInfo | None = None
        self._errors: list[str] = []
        self._lock = threading.Lock()
        self._infos: list[SaveInfo] = []
        self._last_call: tuple[int, float] | None = None
        self._step_time: float | None = None
        self._closed = False
        self._broken: str | None = None  # why the job is broken (a peer died, the group is gone)
        with _open_lock:
            _open.setdefault(self._names, weakref.WeakSet()).add(self)

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
        destroyed): then every later call raises it at once (see "Only the whole job commits")."""
        t0 = time.monotonic()
        self._note_step(step, t0)
        self._raise_errors()
        if self._closed:
            raise CkptStoreError("CheckpointManager is closed")
        if not (force or self.due(step)):
            return False
        self._check_job()
        version = self.version_name(step)
        sd = self._state_dict(self._state(state))
        # a name left by a damaged, unloadable or abandoned version is superseded, not refused
        # (docs/FORMAT.md, "Superseding")
        self._writer.save_options(version, step=int(step), user_metadata=metadata,
                                  supersede=self._supersede.get(version))
        if self.executor == "process":
            self._wait_process()
            self._raise_errors()
            info = SaveInfo(int(step), version, 0.0)
            fut = dcp.async_save(
                sd, checkpoint_id=version, storage_writer=self._writer, process_group=self._pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            )
            info.blocked_s = time.monotonic() - t0
            self._proc_future, self._proc_info = fut, info
            fut.add_done_callback(lambda f, info=info, t0=t0: self._process_done(f, info, t0))
        else:
            staged = self._writer.stage(sd)
            info = SaveInfo(int(step), version, 0.0)
            self._ensure_worker()
            self._queue.put((info, staged, t0))  # blocks while max_pending saves wait (policy: wait)
            info.blocked_s = time.monotonic() - t0
        with self._lock:
            self._infos.append(info)
        return True

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

    def _wait_process(self) -> None:
        f = self._proc_future
        if f is not None:
            try:
                f.result()
            except BaseException:  # noqa: BLE001 - recorded by _process_done
                pass
            self._proc_future = None

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

    def _choose(self, version: str | None, failed: dict):
        """The restore choice (:func:`ckptstore.choice.decide`) for ``version`` (None: the newest
        loadable in scope), passing over ``failed`` versions; a collective on the manager's group."""
        from .store import Store

        st = Store(self.root, remote=self.remote, key=self._key, endpoint_url=self._reader_options.get("endpoint_url"))
        world = dist.get_world_size(self._pg) if self._dist else 1
        try:
            return st.choose(version, self._pg if self._dist else None, exclude=failed, scope=self.scope,
                             world_size=world, reshard=self.reshard, fall_back_after=self.fall_back_after)
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
        with self._group():
            return self._restore(state, version, allow_partial_load)

    def _restore(self, state: dict[str, Any] | None, version: str | None, partial: bool | tuple = False) -> int | None:
        state = self._state(state)
        t0 = time.monotonic()
        self.wait()
        self._check_job()
        world = dist.get_world_size(self._pg) if self._dist else 1
        failed: dict[tuple, str] = {}
        unverified: list = []
        while True:
            view = self._guarded(self._choose, version, failed)
            if view is None:
                return None
            same_world = view.world_size in (None, 0, world)
            sd = self._state_dict(state, for_load=True, per_rank=same_world)
            # resharded: the saving ranks' own values (RNG, per_rank_keys) have no rank here to go to
            unread = () if same_world else tuple(f"{k}/rank" for k in self.per_rank_keys) + ("rng/rank",)
            unread = True if partial is True else unread + tuple(partial or ())
            reader = StorageReader(self.root, remote=self.remote, key=self._key, process_group=self._pg,
                                   allow_partial_load=unread or False, **self._reader_options)
            try:
                self._guarded(lambda: dcp.load(sd, checkpoint_id=view.version, storage_reader=reader,
                                               process_group=self._pg, planner=_SpellingLoadPlanner(sd)))
                break
            except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
                why = _unverifiable(e)
                if why is None or version is not None:
                    raise
                # the same exception reached every rank (DCP gathers every rank's failure), so every
                # rank passes over the same version and agrees on the next one
                failed[(view.version, view.attempt)] = why
                unverified.append(view.version)
                if self.rank == 0:
                    log.warning("ckptstore: version %r failed verification while loading (%s); restoring the next "
                                "older loadable version instead", view.version, why[0])
        self._apply(state, sd, per_rank=same_world)
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
        process group (local, no collective). No save after this; :meth:`restore` and :meth:`latest`
        still work, each on a group made for the call (a collective on the default group)."""
        if self._closed:
            return
        self._closed = True
        with _open_lock:
            _open.get(self._names, set()).discard(self)
        try:
            self.wait()
        finally:
            if self._worker is not None:
                self._queue.put(None)
                self._worker.join()
            try:
                self._writer.close()
            finally:
                pg, self._pg = self._pg, None
                destroy_group(pg)

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
            self.close()
        except BaseException as e:  # noqa: BLE001
            log.error("ckptstore: CheckpointManager.close() after %s: %s", exc_type.__name__, e)


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


def _supersede_reason(name: str, skipped: list) -> str:
    for sk in skipped:
        if sk.version == name:
            return f"skipped at restore ({sk.kind})" + (f": {sk.object}" if sk.object else "")
    return "newer than the restored version (an abandoned timeline)"


def _nth(n: int) -> str:
    return "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


# (module, class, attribute): a wrapper module and the attribute holding the module it wraps. Only
# classes of modules already imported are looked up (nothing here imports torch._dynamo).
_WRAPPERS = (
    ("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper", "_checkpoint_wrapped_module"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "module"),
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel", "_fsdp_wrapped_module"),
)
# components only wrappers use: how a stored key of another spelling is recognised (textually)
_WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def _wrapped_attr(m: Any) -> str | None:
    for modname, clsname, attr in _WRAPPERS:
        cls = getattr(sys.modules.get(modname), clsname, None)
        if cls is not None and isinstance(m, cls):
            return attr
    return None


def canonical_fqn(model: torch.nn.Module, fqn: str) -> str:
    """``fqn`` (a name ``get_model_state_dict(model)`` gives) without the components of wrapper
    modules: ``checkpoint_wrapper(torch.compile(m))``'s ``_orig_mod.0.weight`` → ``0.weight``. Walks
    the modules, so a user's own submodule called ``module`` keeps its name."""
    out = []
    m: Any = model
    for part in fqn.split("."):
        hop = False
        while isinstance(m, torch.nn.Module):
            attr = _wrapped_attr(m)
            if attr is None:
                break
            m = m._modules.get(attr)
            if part == attr:
                hop = True
                break
        if not hop:
            out.append(part)
            m = m._modules.get(part) if isinstance(m, torch.nn.Module) else None
    return ".".join(out)


def _textual(fqn: str) -> str:
    return ".".join(p for p in fqn.split(".") if p not in _WRAPPER_PARTS)


class _Respelled(dict):
    """A module's or optimizer's state dict under canonical keys; ``back`` maps each canonical name to
    the module's own (what ``set_model_state_dict``/``set_optimizer_state_dict`` want)."""

    back: dict

    @classmethod
    def _of(cls, items, back: dict) -> "_Respelled":
        out = cls(items)
        out.back = back
        return out

    @classmethod
    def model(cls, model: torch.nn.Module, msd: dict) -> "_Respelled":
        names = {k: canonical_fqn(model, k) for k in msd}
        if len(set(names.values())) < len(names):  # two names would collapse into one: keep the module's own
            names = {k: k for k in msd}
        return cls._of({names[k]: v for k, v in msd.items()}, {c: k for k, c in names.items() if c != k})

    @classmethod
    def optimizer(cls, model: torch.nn.Module, osd: dict) -> "_Respelled":
        fqns = set(osd.get("state", {})) | {p for g in osd.get("param_groups", []) for p in g.get("params", [])}
        names = {k: canonical_fqn(model, k) for k in fqns if isinstance(k, str)}
        if len(set(names.values())) < len(names):
            names = {k: k for k in names}
        return cls._of(_respell_optim(osd, names), {c: k for k, c in names.items() if c != k})

    @staticmethod
    def back_of(sd: dict) -> dict:
        """``sd`` (after the load) under the module's own names."""
        back = getattr(sd, "back", None)
        if not back:
            return sd
        if "state" in sd or "param_groups" in sd:
            return _respell_optim(sd, back)
        return {back.get(k, k): v for k, v in sd.items()}


def _respell_optim(osd: dict, names: dict) -> dict:
    """An optimizer state dict (``get_optimizer_state_dict``: ``state`` keyed by parameter names,
    ``param_groups[i]["params"]`` lists of them) with the names mapped through ``names``."""
    out = dict(osd)
    if isinstance(osd.get("state"), dict):
        out["state"] = {names.get(k, k): v for k, v in osd["state"].items()}
    if isinstance(osd.get("param_groups"), list):
        out["param_groups"] = [
            {**g, "params": [names.get(p, p) for p in g["params"]]} if isinstance(g, dict) and isinstance(g.get("params"), list) else g
            for g in osd["param_groups"]
        ]
    return out


def _flat_aliases(sd: dict) -> dict[str, str]:
    """DCP's flattened key of every canonical module/optimizer entry in ``sd`` → the flattened key of the
    module's own spelling (what earlier releases stored)."""
    aliases: dict[str, str] = {}
    for k, v in sd.items():
        back = getattr(v, "back", None)
        if not back:
            continue
        if "state" in v and isinstance(v["state"], dict):
            for c, o in back.items():
                for sub in v["state"].get(c, {}) if isinstance(v["state"].get(c), dict) else ():
                    aliases[f"{k}.state.{c}.{sub}"] = f"{k}.state.{o}.{sub}"
        else:
            aliases.update({f"{k}.{c}": f"{k}.{o}" for c, o in back.items()})
    return aliases


class _SpellingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that also loads a version whose module keys are spelled another way:
    saved by an earlier release that kept a wrapper's component (``model._orig_mod.0.weight``,
    checkpoint_wrapper around torch.compile) where this one saves ``model.0.weight``. A respelled key
    the version holds under neither spelling raises :class:`StateDictKeysError` showing both (other
    missing keys are DCP's to report)."""

    def __init__(self, sd: dict) -> None:
        super().__init__()
        self._aliases = _flat_aliases(sd)

    def create_local_plan(self):
        stored = self.metadata.state_dict_metadata
        by_text: dict[str, list[str]] | None = None
        missing = []
        for key in [k for k in self.state_dict if k not in stored]:
            alias = self._aliases.get(key)
            if alias is not None and alias in stored:
                found = [alias]
            else:
                if by_text is None:
                    by_text = {}
                    for s in stored:
                        if any(p in _WRAPPER_PARTS for p in s.split(".")):
                            by_text.setdefault(_textual(s), []).append(s)
                found = by_text.get(_textual(key), [])
            if len(found) == 1:
                self.state_dict[found[0]] = self.state_dict.pop(key)
                if key in self.mappings:
                    self.mappings[found[0]] = self.mappings.pop(key)
            elif alias is not None or found:
                missing.append((key, alias, found))
        if missing:
            from .errors import StateDictKeysError

            shown = "; ".join(
                f"{k!r}" + (f" (the module's own spelling {a!r})" if a else "") + (f", stored as {f}" if f else "")
                for k, a, f in missing[:10]
            )
            raise StateDictKeysError(
                f"the checkpoint has no entry for {len(missing)} key(s) of the state: {shown}"
                + (" ..." if len(missing) > 10 else "")
                + ". Modules are saved under canonical keys (wrapper components such as _orig_mod, "
                "_checkpoint_wrapped_module or DDP's module dropped); was it saved from another model?"
            )
        return super().create_local_plan()


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
