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
  ``load_state_dict()`` (scheduler, data loader), or plain tensors/values. The RNG states of this
  rank (torch, CUDA when present, ``random``, numpy when imported) are saved under ``rng/rank{r}``
  for the caller (``save_rng=False`` to turn off) and restored per rank.
- **Errors are never lost.** A save that fails raises from the next ``save()``, ``wait()`` or
  ``close()``; ``close()`` also raises ``UploadError`` for versions not uploaded.
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
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ._groups import destroy_group, new_gloo_group
from .dcp import StorageReader, StorageWriter
from .errors import CkptStoreError, VersionNotFoundError

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
    ``seconds`` spent (agreeing on the version and loading it)."""

    version: str
    step: int | None
    world_size: int | None
    rng_restored: bool
    per_rank_restored: bool
    seconds: float


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
        durability: ``"local"`` or ``"remote"`` (see :class:`ckptstore.StorageWriter`).
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
            (e.g. ``"step-{step:06d}"``).
        **writer_options: passed to :class:`ckptstore.StorageWriter` (``threads``, ``frame_size``,
            ``upload_timeout``, ``endpoint_url``, ...).
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
        **writer_options: Any,
    ) -> None:
        if interval_steps < 1:
            raise ValueError("interval_steps must be >= 1")
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        kind = executor.value if isinstance(executor, AsyncCheckpointerType) else str(executor)
        if kind not in ("thread", "process"):
            raise ValueError("executor must be 'thread' or 'process'")
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
        self.state = state
        self.last_restore: RestoreInfo | None = None
        self.per_rank_keys = tuple(per_rank_keys)
        self._key = key
        self._reader_options = {k: writer_options[k] for k in ("endpoint_url", "threads") if k in writer_options}
        self._writer = StorageWriter(
            root, remote=remote, key=key, durability=durability, retention=retention, max_staged=max_pending + 1, **writer_options
        )
        self._dist = dist.is_available() and dist.is_initialized()
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
        Raises the error of an earlier failed save."""
        t0 = time.monotonic()
        self._note_step(step, t0)
        self._raise_errors()
        if self._closed:
            raise CkptStoreError("CheckpointManager is closed")
        if not (force or self.due(step)):
            return False
        version = self.version_name(step)
        sd = self._state_dict(self._state(state))
        self._writer.save_options(version, step=int(step), user_metadata=metadata)
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
                    dcp.save(staged, checkpoint_id=info.version, storage_writer=self._writer, process_group=self._pg)
                    del staged
                    info.local_commit_s = time.monotonic() - t0
                    self._track_remote(info, t0)
                except BaseException as e:  # CheckpointException is a BaseException
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
        if errors:
            raise CkptStoreError("; ".join(errors))

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
        error of a failed one."""
        if self.executor == "process":
            self._wait_process()
        elif self._worker is not None:
            self._queue.join()
        self._raise_errors()

    # -- restoring ---------------------------------------------------------------------------------
    def latest(self) -> str | None:
        """The newest version every rank can load (a collective on the manager's group:
        :meth:`ckptstore.Store.latest_in_job`, the version ``StorageReader`` picks), or None."""
        with self._group():
            rec = self._agree(None)
        return None if rec is None else rec.version

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

    def _agree(self, version: str | None):
        """The record of ``version`` (None: the newest every rank can load) as the job sees it."""
        from .store import Store

        st = Store(self.root, remote=self.remote, key=self._key, endpoint_url=self._reader_options.get("endpoint_url"))
        try:
            return st.agree(version, self._pg if self._dist else None)
        finally:
            st.close()

    def restore(self, state: dict[str, Any] | None = None, version: str | None = None) -> int | None:
        """Load the newest version every rank can load (or ``version``) into ``state`` (default:
        the constructor's) in place; return its step, or None when there is no checkpoint
        (``state`` is left unchanged). :attr:`last_restore` then says what was loaded.
        Raises :class:`~ckptstore.errors.VersionNotFoundError` (naming the missing objects) when
        versions are committed but none can be loaded by every rank (e.g. a node lost its local root
        and there is no remote tier): starting from scratch there would silently drop the run's
        progress. Roots may be node-local (docs/FORMAT.md, "Placement").

        When the version was saved by another world size (a resharded load), this rank's RNG
        states and ``per_rank_keys`` values are not restored (there is no copy for this rank);
        ``last_restore.rng_restored`` is False, so the caller can reseed.
        Raises what ``dcp.load`` raises (``ckptstore.errors`` types) when the version cannot be read."""
        with self._group():
            return self._restore(state, version)

    def _restore(self, state: dict[str, Any] | None, version: str | None) -> int | None:
        from .store import Store

        state = self._state(state)
        t0 = time.monotonic()
        self.wait()
        rec = self._agree(version)
        if rec is None:
            return None
        version = rec.version
        world = dist.get_world_size(self._pg) if self._dist else 1
        same_world = rec.world_size is None or rec.world_size == world
        sd = self._state_dict(state, for_load=True, per_rank=same_world)
        reader = StorageReader(self.root, remote=self.remote, key=self._key, process_group=self._pg, **self._reader_options)
        dcp.load(sd, checkpoint_id=version, storage_reader=reader, process_group=self._pg)
        self._apply(state, sd, per_rank=same_world)
        if not same_world and (self.save_rng or self.per_rank_keys):
            log.warning("ckptstore: %s was saved by %s ranks, this job has %s: per-rank values (RNG, %s) not restored",
                        version, rec.world_size, world, ", ".join(self.per_rank_keys) or "-")
        self.last_restore = RestoreInfo(version, rec.step, rec.world_size, same_world and self.save_rng,
                                        same_world and bool(self.per_rank_keys), time.monotonic() - t0)
        return rec.step

    def resume(self, state: dict[str, Any] | None = None, *, first_step: int = 1) -> int:
        """:meth:`restore` and return the step to run next: the restored step + 1, or
        ``first_step`` when there is no checkpoint. ``for step in range(mgr.resume(), steps + 1)``."""
        step = self.restore(state)
        return first_step if step is None else int(step) + 1

    # -- state dict helpers ------------------------------------------------------------------------
    def _state_dict(self, state: dict[str, Any], for_load: bool = False, per_rank: bool = True) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        module = _the_module(state)
        sd: dict[str, Any] = {}
        for k, v in state.items():
            if k in self.per_rank_keys:
                if not per_rank:
                    continue
                k = f"{k}/rank{self.rank}"
            if isinstance(v, torch.nn.Module):
                sd[k] = get_model_state_dict(v)
            elif isinstance(v, torch.optim.Optimizer):
                if module is None:
                    raise CkptStoreError(f"state[{k!r}] is an optimizer; the state needs exactly one nn.Module for it")
                sd[k] = get_optimizer_state_dict(module, v)
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
                set_model_state_dict(v, sd[sk])
            elif isinstance(v, torch.optim.Optimizer):
                set_optimizer_state_dict(module, v, sd[sk])
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
