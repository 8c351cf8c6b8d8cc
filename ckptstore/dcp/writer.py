"""``ckptstore.StorageWriter``: a DCP StorageWriter with framed, checksummed, encrypted shards and a
two-phase manifest commit.

Call sequence (as DCP drives it; see ``torch.distributed.checkpoint.storage.StorageWriter``):

0. (all ranks) ``reset(checkpoint_id)`` — only when a ``checkpoint_id`` is passed; starts a new
   per-save state (``_Save``: version, attempt, data key, plan items) for the calling thread, so
   overlapping saves through one writer never share it (see the class docstring).
   ``storage_meta()`` returns ``StorageMeta(checkpoint_id=version, save_id=...)``.
1. (all ranks) ``set_up_storage_writer(is_coordinator, rank=, use_collectives=)`` — validates the
   version name and fails fast with :class:`VersionExistsError` unless ``overwrite=True``.
2. (all ranks) ``prepare_local_plan`` — records the rank in ``plan.storage_data``.
3. (coordinator) ``prepare_global_plan`` — draws the attempt id and (with a key) a fresh data key,
   wrapped by the master key; returns one plan per rank, in order, via ``dataclasses.replace``.
4. (all ranks) ``write_data`` — **phase 1**: encodes frames in a thread pool (byte-group/zstd,
   AES-GCM, XXH3), appends them to the rank's object ``attempts/<attempt>/rNNNNN.ckd`` and fsyncs
   it and its directory; returns ``WriteResult``s carrying frame locations and the object's size
   and digest.
5. (coordinator) ``finish`` — **phase 2**: writes DCP's ``Metadata`` (compact format 2,
   docs/FORMAT.md "DCP metadata object") as a framed object, fsyncs it, then commits
   ``manifest.json`` with put-if-absent (temp file, fsync, ``os.link``, fsync dir). Only then does
   the version exist. With node-local roots the other roots then receive copies
   (docs/FORMAT.md, "Placement").

A crash anywhere before the link leaves only objects no manifest references (garbage for
``ckptstore gc`` after the grace period); the previous version stays the latest.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures as cf
import dataclasses
import io
import logging
import os
import sys
import threading
import time
import uuid
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as _DCPStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import _faults
from .._names import check_version
from ..codec import FrameCodec, FrameRef, xxh3, xxh128
from ..codec.bytegroup import PlanCell
from ..codec.frame import FIXED_LEN, xxh3_stream
from ..codec.crypto import FrameCipher, key_id, new_data_key, resolve_key, unwrap_key, wrap_key
from ..codec.stages import env_threads
from ..errors import (CkptStoreError, InvalidNameError, JobBrokenError, KeyMismatchError, ManifestError,
                      StateDictKeysError, TransientStorageError, UnsupportedFormatError, VersionExistsError,
                      VersionNotFoundError)
from ..manifest import layout
from ..manifest.commit import commit_manifest
from ..manifest.order import next_seq, order_key
from ..manifest.schema import Manifest, ObjectEntry, utcnow
from ..tiers import LocalTier, make_remote
from . import _liveness, _roots, _subclass
from ._types import ItemLocation, LocalPlanData, ObjectReport, PlanData, ReplicaDigest, RootReport
from ._checks import check_metadata_loads, quiet_single_process, reject_unknown_kwargs, value_digest
from ._metadata import ItemTable, ItemTables, pack_items
from ._metadata import pack as pack_metadata
from .staging import Stager

log = logging.getLogger("ckptstore")

#: seconds the coordinator skips the remote existence check after the remote tier did not answer
_REMOTE_DOWN_S = 60.0

DEFAULT_FRAME_SIZE = 2 << 20  # bytes; a multiple of every element size (≤ 16). 2 MiB: AES-GCM and
# zstd run fastest on buffers that stay below the allocator's mmap threshold; 48 B of header per frame.
_SENTINEL = "\x00ckptstore/"
_FLOAT_WIDTH = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4, torch.float64: 8}


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def tensor_bytes(t: torch.Tensor, key: str = "?") -> memoryview:
    """The bytes of ``t`` in C order as a flat memoryview (copies only if non-contiguous/non-CPU, or a
    tensor subclass without memory of its own: its values through its ``copy_``, docs/FORMAT.md "Index").

    Raises :class:`UnsupportedStateError` naming ``key`` when such a subclass cannot give its values."""
    t = t.detach()
    if t.numel() and not _subclass.has_memory(t):  # a wrapper subclass (quantized / Float8 weights)
        t = _subclass.values(t, key)
    t = t.resolve_conj().resolve_neg()  # lazy conjugate/negative views: materialise
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous() or t.storage_offset() < 0:
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    mv = _subclass.own_bytes(t)
    if mv is None:  # a class whose reshape/view copy: the values, as a plain tensor
        mv = _subclass.own_bytes(_subclass.values(t, key))
    return memoryview(mv)


@dataclasses.dataclass(eq=False)
class _Save:
    """Everything one DCP call sequence (reset → … → finish) needs; never shared between saves."""

    version: str | None
    step: int | None
    user_metadata: dict
    save_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    rank: int = 0
    is_coordinator: bool = True
    use_collectives: bool = True
    started: bool = False  # set_up_storage_writer ran: the next DCP sequence needs a new _Save
    local_items: list = dataclasses.field(default_factory=list)
    attempt: str | None = None
    wrapped: tuple = (None, None)  # (wrapped data key, key id) drawn by the coordinator
    #: ``{attempt: reason}`` of existing copies of this name the save may replace (docs/FORMAT.md, "Superseding")
    supersede: dict = dataclasses.field(default_factory=dict)
    existing: str | None = None  # the attempt of this name committed in this rank's root, if any
    existing_remote: str | None = None  # ... in the remote tier (coordinator)
    seq: int | None = None  # commit sequence (coordinator)
    restage: tuple = ()  # versions staged again with this save (see StorageWriter._restage)
    replaced: tuple = ()  # attempts this commit replaces, every rank's root and the remote tier (coordinator)


class StorageWriter(_DCPStorageWriter):
    """Write DCP checkpoints into a ckptstore.

    Args:
        root: local directory (the fast NVMe tier). Created if missing.
        remote: ``"s3://bucket/prefix"`` to also stage every version to S3, or None.
        key: master key, 32 bytes or a key provider (``get_key() -> bytes``); default
            ``CKPTSTORE_KEY`` (base64) / ``CKPTSTORE_KEY_FILE``. With a key everything is encrypted.
        version: version name when ``dcp.save`` is called without ``checkpoint_id``.
        overwrite: replace an existing version atomically instead of raising
            :class:`VersionExistsError`.
        step: training step recorded in the manifest (for ``list`` and retention); per save with
            :meth:`save_options`.
        user_metadata: free-form JSON-serialisable dict recorded in the manifest.
        threads: encoder threads per rank (default ``CKPTSTORE_THREADS``, else cores / ``LOCAL_WORLD_SIZE`` + 1, 2..8).
        frame_size: raw bytes per frame (default 2 MiB); big tensors are split into frames.
        compression: ``"auto"`` (zstd / byte-grouped floats, kept only when ≥ 3 % smaller) or ``"none"``.
        level: zstd level (default 1, fastest).
        durability: ``"local"`` (the save completes at the local commit; replicas and upload
            continue), ``"replicated"`` (at the local commit once every replica is in place; needs
            ``replicas``) or ``"remote"`` (at the remote commit, and with ``replicas`` once every
            replica is in place). ``"remote"`` only with ``remote``. Under
            ``AsyncCheckpointerType.PROCESS`` a save always completes at the remote commit: DCP's
            checkpoint subprocess cannot keep uploading after it has answered.
        endpoint_url: S3 endpoint, overriding the boto3 chain.
        upload_timeout: seconds ``close()``/exit and the remote commit wait for uploads (default 1 h).
        retention: a :class:`ckptstore.retention.RetentionPolicy` applied by the coordinator right
            after each commit, per tier (opt-in; default None keeps everything). It considers only
            versions committed at or before the one just committed, never deletes that one, and
            locally never deletes a version not yet committed in the remote tier.
        allow_divergent_replicas: when two ranks hold different values under one non-sharded key,
            save rank 0's copy (DCP's behaviour) instead of raising :class:`StateDictKeysError`.
        max_staged: how many ``async_save`` host copies may exist at once (default 2); ``stage()``
            waits for an earlier save to finish writing when that many are held (back-pressure).
        replicas: replication factor F (default 0: none). After each rank's object is committed
            locally it is copied, as stored, to the roots of F other root groups (other nodes; see
            docs/FORMAT.md, "Replicas") over a gloo group the writer makes at construction — so
            construct the writer on every rank, after ``init_process_group``. Not with the PROCESS
            executor (its subprocess has no group with the other ranks' trainers).
        incremental: reference, instead of writing again, every write item whose bytes (XXH3-128 of
            the raw bytes) equal those of the same item in the newest version this writer committed
            (or, through ``CheckpointManager``, restored): the new manifest names the earlier object
            (``refs``, docs/FORMAT.md "References"), nothing of the item is written or uploaded again.
            Pays when much of the state does not change between saves (a frozen base model under a
            LoRA adapter, untouched experts); costs one XXH3-128 pass over every item. Off by default.
        world_size: the number of ranks every save through this writer has (default: the default
            process group's size when one is initialised at construction, else not checked). A save
            planned or finished by any other number of ranks — a rank that outlived its peers, DCP
            falling back to a single process after the process group was destroyed — raises
            :class:`JobBrokenError` and commits nothing (docs/FORMAT.md, Save rule 6). Pass
            ``world_size=1`` for a single-rank save inside a larger job.

    Only the whole job commits (docs/FORMAT.md, Save rules 6-7): besides ``world_size``, the copy of
    the writer that runs in DCP's checkpoint subprocess (``AsyncCheckpointerType.PROCESS``) knows
    its trainer (pid and start time, recorded when the writer is pickled) and refuses — with
    :class:`JobBrokenError` — to report write results, commit the local manifest or the remote one
    once the trainer is gone; a watcher thread (checking every 0.2 s) exits the subprocess once the
    trainer is dead, stopping its uploads. A THREAD-executor save runs in the trainer and dies with it.

    Overlapping saves (any number in flight through one writer, e.g. ``dcp.async_save`` called again
    before the previous future resolved):

    - **Concurrent**: each DCP call sequence ``reset → storage_meta → set_up_storage_writer →
      prepare_local_plan → prepare_global_plan → write_data → finish`` runs on one thread and gets
      its own per-save state (version, attempt, data key, plan items) created by ``reset()`` (or by
      ``storage_meta()`` when DCP is called without ``checkpoint_id``) and found through that
      thread; encoding, writing and the local commit of different saves run in parallel.
    - **Queued**: ``stage()`` waits while ``max_staged`` host copies are held; uploads and remote
      commits share one uploader pool (``threads`` workers) in submission order.
    - **Not the writer's to order**: DCP's planning collectives. Overlapping saves on one process
      group may interleave differently on different ranks and hang; give each in-flight save its own
      ``process_group=`` (or use :class:`ckptstore.CheckpointManager`, which runs them one at a time
      on its own group).

    A future that resolves without error means the version is committed (locally; remotely with
    ``durability="remote"`` or the PROCESS executor); a failed save leaves only objects that no
    manifest references, so saving its name again works.

    Raises (through DCP's ``CheckpointException``): :class:`VersionExistsError`,
    :class:`InvalidNameError`, :class:`StorageFullError`, :class:`StorageError`,
    :class:`KeyMismatchError`, :class:`StateDictKeysError`, :class:`JobBrokenError`,
    :class:`UnsupportedStateError` (a tensor subclass without memory of its own that cannot give its
    values; from ``stage()`` directly).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        remote: str | None = None,
        key: Any = None,
        version: str | None = None,
        overwrite: bool = False,
        step: int | None = None,
        user_metadata: dict | None = None,
        threads: int | None = None,
        frame_size: int = DEFAULT_FRAME_SIZE,
        compression: str = "auto",
        level: int = 1,
        durability: str = "local",
        endpoint_url: str | None = None,
        allow_divergent_replicas: bool = False,
        upload_timeout: float = 3600.0,
        retention: Any = None,
        max_staged: int = 2,
        world_size: int | None = None,
        replicas: int = 0,
        incremental: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        reject_unknown_kwargs(type(self), kwargs)
        quiet_single_process()
        if compression not in ("auto", "none"):
            raise ValueError("compression must be 'auto' or 'none'")
        if durability not in ("local", "replicated", "remote"):
            raise ValueError("durability must be 'local', 'replicated' or 'remote'")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise ValueError(f"replicas must be a non-negative integer, got {replicas!r}")
        if durability == "replicated" and not replicas:
            raise ValueError("durability='replicated' needs replicas=F (F >= 1)")
        if frame_size < 4096 or frame_size % 16:
            raise ValueError("frame_size must be a multiple of 16 bytes and at least 4096")
        if max_staged < 1:
            raise ValueError("max_staged must be at least 1")
        if world_size is None and dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size()
        if world_size is not None and int(world_size) < 1:
            raise ValueError("world_size must be at least 1")
        self.world_size = None if world_size is None else int(world_size)
        self.root = os.path.abspath(os.fspath(root))
        self.remote_url = remote
        self.endpoint_url = endpoint_url
        self._master = resolve_key(key)
        self.overwrite = overwrite
        self.step = step
        self.user_metadata = dict(user_metadata or {})
        self.threads = threads or env_threads()
        self.frame_size = frame_size
        self.compression = compression
        self.level = level
        self.durability = durability
        self.allow_divergent_replicas = allow_divergent_replicas
        self.upload_timeout = upload_timeout
        self.retention = retention
        if durability == "remote" and not remote:
            raise ValueError("durability='remote' needs remote='s3://...'")
        self._default_version = check_version(version) if version is not None else None
        self._tier = LocalTier(self.root)
        self._remote = make_remote(remote, endpoint_url=endpoint_url) if remote else None
        self._stager = Stager(max_staged, timeout=upload_timeout)
        self._uploader = None
        self._caught_up = False
        self._remote_down_until = 0.0  # monotonic time before which set-up does not wait for the remote tier
        self._in_subprocess = False  # this copy runs in DCP's checkpoint subprocess (PROCESS)
        self._shipped = False  # a copy of this writer was sent to DCP's checkpoint subprocess
        self._ship_rank = 0  # the rank that sent it (only rank 0 re-checks the uploads at close)
        self._trainer: tuple | None = None  # (pid, start time) of the process that pickled this copy
        self._trainer_is_parent = False
        self._born = utcnow()
        self._options_for: dict[str, tuple] = {}
        self._remote_futs: dict[str, cf.Future] = {}
        self._timings: dict[str, dict] = {}
        self._pruned: list[dict] = []
        #: DCP's checkpoint subprocess leaves the trainer's process group (set by
        #: CheckpointManager(save_on_signal=...)): torchrun signals a worker's whole process group
        #: (os.killpg), and a save in flight there must be able to finish after a preemption signal; it
        #: still exits once its trainer is gone (the watcher) and when the trainer ends it
        self._subprocess_own_group = False
        self.last_manifest: Manifest | None = None
        self._probe = _roots.PROCESS_NONCE  # this process's root probe (docs/FORMAT.md, "Placement")
        self._publisher = _roots.Publisher()
        self.replicas = replicas
        self.incremental = bool(incremental)
        from ._incremental import Incremental

        self._inc = Incremental()
        self._replicator = None
        if replicas and _multi_rank():
            from .. import _groups
            from .replicas import Replicator

            # made here, on the caller's thread, on every rank: never a collective from DCP's background thread
            self._replicator = Replicator(self._tier, _groups.new_gloo_group(), replicas)
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._follower = _roots.Follower()

    # -- pickling (AsyncCheckpointerType.PROCESS): configuration only, no pools or clients ------
    def __getstate__(self):
        if self._replicator is not None:
            raise CkptStoreError(
                "StorageWriter(replicas=...) cannot run in DCP's checkpoint subprocess (AsyncCheckpointerType.PROCESS): "
                "the copies travel between the trainers' processes. Use the THREAD executor (the default) or dcp.save")
        if not self._in_subprocess and self._remote is not None and not self._shipped:
            self._shipped = True  # close()/exit here check that the subprocess's versions reached S3
            self._ship_rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
            _shipped.add(self)
        s = self.__dict__.copy()
        if not self._in_subprocess:  # the copy commits only while this process lives (Save rule 7)
            s["_trainer"] = _liveness.identity()
        for k in ("_uploader", "_lock", "_tls", "_follower"):
            s.pop(k, None)
        s["_remote_futs"] = {}
        s["_timings"] = {}
        s["_pruned"] = []
        s["_in_subprocess"] = True
        return s

    def __setstate__(self, s):
        self.__dict__.update(s)
        self._uploader = None
        self._init_runtime()
        if self._trainer is not None:
            self._trainer_is_parent = os.getppid() == self._trainer[0]
            _liveness.watch(self._trainer)  # exits this process once the trainer is gone
            try:
                if self._subprocess_own_group and os.getpgid(0) == os.getpgid(self._trainer[0]):
                    os.setpgid(0, 0)
            except OSError as e:  # a session leader cannot (the signal then reaches it too); a trainer gone
                log.debug("ckptstore: checkpoint subprocess stays in its trainer's process group: %s", e)

    def _check_trainer(self, what: str) -> None:
        """Raise :class:`JobBrokenError` when this copy runs in DCP's checkpoint subprocess and its
        trainer is gone (docs/FORMAT.md, Save rule 7); called right before ``what`` commits."""
        if self._trainer is None or _liveness.alive(self._trainer, parent_is_it=self._trainer_is_parent):
            return
        raise JobBrokenError(
            f"DCP's checkpoint subprocess (pid {os.getpid()}) outlived its trainer (pid {self._trainer[0]}): "
            f"refusing {what}; nothing is committed. Restart the job; it resumes from the newest committed version"
        )

    def _check_world(self, n: int, what: str) -> None:
        """Raise :class:`JobBrokenError` unless ``n`` ranks is the job's ``world_size`` (Save rule 6)."""
        if self.world_size is None or n == self.world_size:
            return
        raise JobBrokenError(
            f"{what} has {n} rank(s) but this writer was set up for a job of {self.world_size} "
            f"(StorageWriter(world_size={self.world_size})): only the whole job commits, a rank that outlived its "
            "peers never commits alone; nothing was committed. Restart the whole job (or pass world_size= for a "
            "save by fewer ranks on purpose)"
        )

    # -- per-save state --------------------------------------------------------------------------
    def _new_save(self, version: str | None) -> _Save:
        step, user, supersede = self.step, self.user_metadata, {}
        if version is not None:
            with self._lock:
                step, user, supersede = self._options_for.pop(version, (step, user, supersede))
        s = _Save(version, step, dict(user), supersede=dict(supersede))
        self._tls.save = s
        return s

    def _cur(self, *, starting: bool = False) -> _Save:
        """This thread's save; a new one when DCP starts a sequence without ``reset()``."""
        s = getattr(self._tls, "save", None)
        if s is None or (starting and s.started):
            s = self._new_save(self._default_version)
        return s

    def save_options(self, version: str, *, step: int | None = None, user_metadata: dict | None = None,
                     supersede: dict | None = None) -> None:
        """Record ``step``/``user_metadata`` for the next save of ``version`` (for callers that run
        overlapping saves through one writer, where setting ``writer.step`` would race).

        ``supersede``: ``{attempt: reason}`` — copies of ``version`` with one of these attempts (a
        damaged, unloadable or abandoned version, see :class:`ckptstore.CheckpointManager`) may be
        replaced by this save; it records them in its manifest (``supersedes``) and the old attempt's
        objects become garbage once the new one committed (docs/FORMAT.md, "Superseding"). A copy
        with any other attempt is still refused with :class:`VersionExistsError`."""
        with self._lock:
            self._options_for[check_version(version)] = (
                self.step if step is None else step,
                self.user_metadata if user_metadata is None else dict(user_metadata),
                dict(supersede or {}),
            )

    # The attributes below read (and, for tests, set) the calling thread's save.
    @property
    def version(self) -> str | None:
        s = getattr(self._tls, "save", None)
        return s.version if s is not None else self._default_version

    @version.setter
    def version(self, v: str | None) -> None:
        self._default_version = v

    @property
    def attempt(self) -> str | None:
        return self._cur().attempt

    @attempt.setter
    def attempt(self, a: str | None) -> None:
        self._cur().attempt = a

    @property
    def save_id(self) -> str:
        return self._cur().save_id

    @property
    def rank(self) -> int:
        return self._cur().rank

    @property
    def is_coordinator(self) -> bool:
        return self._cur().is_coordinator

    # -- DCP contract --------------------------------------------------------------------------
    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True for a valid version name, given as a string or a path-like; never raises."""
        try:
            # a path-like (``pathlib.Path("step-1")``) as ``reset`` takes it; frameworks that auto-detect
            # the storage class ask this first
            check_version(os.fspath(checkpoint_id) if isinstance(checkpoint_id, (str, os.PathLike)) else None)
            return True
        except Exception:
            return False

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        version = self._default_version
        if checkpoint_id is not None:
            version = check_version(os.fspath(checkpoint_id) if isinstance(checkpoint_id, os.PathLike) else checkpoint_id)
        self._new_save(version)

    @property
    def checkpoint_id(self) -> str | None:
        return self.version

    def storage_meta(self) -> StorageMeta | None:
        s = self._cur(starting=True)
        return StorageMeta(checkpoint_id=s.version, save_id=s.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        s = self._cur(starting=True)
        s.started = True
        s.is_coordinator = is_coordinator
        s.use_collectives = kwargs.get("use_collectives", True)
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        s.rank = int(rank)
        if s.version is None:
            raise CkptStoreError(
                "no version name: pass checkpoint_id= to dcp.save/async_save or version= to StorageWriter"
            )
        if self.world_size is not None and self.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
            # DCP saves "in a single process" when torch.distributed is not initialised (any more)
            self._check_world(1, f"the save of {s.version!r} (torch.distributed is not initialised)")
        if not s.use_collectives and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise CkptStoreError(
                "ckptstore commits one manifest per version and needs rank coordination; "
                "call dcp.save/async_save with use_collectives=True (the default)"
            )
        self._follower.wait(self.upload_timeout)  # the previous save's copy into this root, if any
        if self.incremental:
            self._inc.promote(self._tier)  # the previous save, once it is committed here, is the baseline
        if _multi_rank():
            _roots.write_probe(self._tier, s.rank, self._probe)
        self._check_existing(s)

    def _check_existing(self, s: _Save) -> None:
        """One name, one version, across tiers: every rank checks its own root (so every root of the
        job is checked) and the coordinator the remote tier, before anything is committed anywhere.
        A copy is replaced only with ``overwrite=True`` or when its attempt is one the save was told
        to supersede; otherwise :class:`VersionExistsError`. The attempts found are recorded in the
        new manifest's ``supersedes`` (docs/FORMAT.md, "Superseding")."""
        s.existing = self._existing_attempt(self._tier, s.version)
        where = None
        if s.existing is not None and not self._may_replace(s, s.existing):
            where = f"the local tier {self.root}"
        elif s.is_coordinator and self._remote is not None and (self._sync_remote or time.monotonic() >= self._remote_down_until):
            try:
                s.existing_remote = self._existing_attempt(self._remote, s.version)
            except TransientStorageError as e:
                if self._sync_remote:
                    raise
                # durability="local": commit locally now; the remote commit is put-if-absent and
                # refuses the name there if it exists (docs/FORMAT.md, Save rule 8). For a minute
                # the next saves do not wait for the remote tier's retries again.
                self._remote_down_until = time.monotonic() + _REMOTE_DOWN_S
                log.warning("ckptstore: could not check the remote tier for an existing %r (%s); saving locally, "
                            "the upload follows when the remote tier answers", s.version, e)
            if s.existing_remote is not None and not self._may_replace(s, s.existing_remote):
                where = f"the remote tier {self.remote_url}"
        if where is not None:
            raise VersionExistsError(
                f"Checkpoint already exists: version {s.version!r} in {where}; choose a new checkpoint_id "
                "or pass overwrite=True to replace it"
            )

    def _may_replace(self, s: _Save, attempt: str) -> bool:
        return self.overwrite or attempt in s.supersede

    @staticmethod
    def _existing_attempt(tier, version: str) -> str | None:
        """The attempt of ``version`` committed in ``tier`` (None: not committed there). A manifest
        that does not parse counts as a copy of an unknown attempt: never replaced unless overwrite."""
        from ..manifest import catalogue

        key = layout.manifest_key(version)
        if not tier.exists(key):
            return None
        try:
            return catalogue.read_manifest(tier, version).manifest.attempt
        except VersionNotFoundError:
            return None
        except (ManifestError, UnsupportedFormatError, InvalidNameError):
            return "(invalid manifest)"

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        s = self._cur()
        s.local_items = [i for i in plan.items if i.type in (WriteItemType.TENSOR, WriteItemType.BYTE_IO)]
        from ..manifest import catalogue

        return dataclasses.replace(plan, storage_data=LocalPlanData(
            rank=s.rank, probe=self._probe if _multi_rank() else None,
            # one rank per node reads its root's newest manifests for the commit sequence (docs/FORMAT.md, "Order")
            seq=catalogue.max_seq(self._tier) if os.environ.get("LOCAL_RANK", "0") == "0" else None,
            existing=s.existing))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        s = self._cur()
        self._check_world(len(plans), f"the plan of {s.version!r}")
        attempt = layout.new_attempt()
        wrapped = kid = None
        if self._master is not None:
            wrapped = wrap_key(self._master, new_data_key(), s.version, attempt)
            kid = key_id(self._master)
        ranks = [p.storage_data.rank if isinstance(p.storage_data, LocalPlanData) else i for i, p in enumerate(plans)]
        probes = tuple(
            (r, p.storage_data.probe) for r, p in zip(ranks, plans)
            if isinstance(p.storage_data, LocalPlanData) and p.storage_data.probe is not None
        )
        restage = self._restage(s.version, len(plans))
        out = [
            dataclasses.replace(p, storage_data=PlanData(r, attempt, wrapped, kid, probes if len(probes) > 1 else (), s.rank,
                                                         restage))
            for r, p in zip(ranks, plans)
        ]
        s.attempt = attempt
        s.wrapped = (wrapped, kid)
        local = [p.storage_data for p in plans if isinstance(p.storage_data, LocalPlanData)]
        s.seq = next_seq([d.seq for d in local])
        s.replaced = tuple(sorted({d.existing for d in local if d.existing is not None}
                                  | ({s.existing_remote} if s.existing_remote is not None else set())))
        return out

    def _restage(self, version: str, world: int) -> tuple:
        """Coordinator, first save of this writer with a remote tier: ``((version, who), ...)`` for the
        versions committed in its root but not in the remote tier that are ordered after every remote
        commit (a crash or an outage cut their remote commit off). ``who`` says who uploads their
        objects in this save: ``"coordinator"`` (its root holds every object) or ``"ranks"`` (a
        version saved by a job of this size: every rank its own, from its own root — node-local
        roots, where no single root holds every object). The coordinator then commits them remotely
        (docs/FORMAT.md, Save rule 8), so a job restarted after an S3 outage stages what it could
        not. One remote listing and one manifest read; tried again at the next save when the remote
        tier does not answer."""
        if self._remote is None or self._in_subprocess or self._caught_up:
            return ()
        from .._names import decode_version
        from ..manifest import catalogue

        try:
            entries = catalogue.scan(self._tier)
            listed = {}
            for info in self._remote.list(layout.VERSIONS + "/"):
                parts = info.key.split("/")
                if len(parts) == 3 and parts[2] == layout.MANIFEST:
                    listed[parts[1]] = info.mtime
            local = catalogue.merge({"local": entries})
            todo = [r for r in local if layout.version_dir(r.version).split("/")[1] not in listed and r.version != version]
            newest = None
            if listed and todo:
                m = catalogue.read_manifest(self._remote, decode_version(max(listed, key=lambda k: listed[k]))).manifest
                newest = order_key(m.step, m.seq, m.created, m.version)
        except CkptStoreError as e:
            log.warning("ckptstore: cannot compare the local and remote tiers to stage what an earlier run did not "
                        "upload (%s); trying again at the next save", e)
            return ()
        self._caught_up = True
        out = []
        for r in todo:
            if newest is not None and r.order <= newest:
                continue  # older than the remote tier's newest commit: its retention may have dropped it
            m = entries[r.version].manifest
            if all(self._tier.exists(layout.object_key(r.version, o.name)) for o in m.objects):
                out.append((r.version, "coordinator"))
            elif m.world_size == world:
                out.append((r.version, "ranks"))
            else:
                log.warning("ckptstore: version %r is committed locally but not in %s, and neither this root nor "
                            "this job's ranks hold all its objects; it is not staged", r.version, self.remote_url)
        if out:
            log.warning("ckptstore: versions %s are committed locally but not in %s; staging them with this save",
                        [v for v, _w in out], self.remote_url)
        return tuple(out)

    def _restage_objects(self, pd: PlanData) -> None:
        """This rank's part of ``pd.restage``: the objects it uploads of those versions, as its root
        holds them (the upload checks every frame against the manifest before it sends)."""
        from ..manifest import catalogue

        for v, who in pd.restage:
            if who == "coordinator" and pd.rank != pd.coordinator:
                continue
            try:
                m = catalogue.read_manifest(self._tier, v).manifest
            except CkptStoreError:
                continue  # this root holds no copy of it (another node's part)
            for o in m.objects:
                if (who == "coordinator" or o.rank == pd.rank) and self._tier.exists(layout.object_key(v, o.name)):
                    self.uploader.upload_object(v, o, o.rank, retry=False)

    def _codec(self, s: _Save, pd: PlanData) -> FrameCodec:
        cipher = None
        if pd.wrapped_key is not None:
            if self._master is None:
                raise KeyMismatchError(f"rank {s.rank} has no master key but the coordinator encrypts; give every rank the same key")
            cipher = FrameCipher(unwrap_key(self._master, pd.wrapped_key, s.version, pd.attempt, pd.key_id))
        return FrameCodec(s.version, pd.attempt, cipher, compress=self.compression, level=self.level)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        s = self._cur()
        staged: list[int] = []  # storage address of the first staged tensor: which host copy to free
        t0 = time.monotonic()
        try:
            results = self._write_data(s, plan, planner, staged)
        finally:
            self._stager.release(staged[0] if staged else None)
        self._timed(s.version, write_s=time.monotonic() - t0)
        if self._in_subprocess and not s.is_coordinator:
            self._drop_uploader()
        self._check_trainer(f"to report the write results of {s.version!r}")
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _write_data(self, s: _Save, plan: SavePlan, planner: SavePlanner, staged: list) -> list[WriteResult]:
        pd: PlanData = plan.storage_data
        s.attempt = pd.attempt
        s.restage = pd.restage
        if pd.restage:
            self._restage_objects(pd)
        results: list[WriteResult] = []
        held = None
        try:
            if plan.items:
                results.extend(self._write_object(s, plan, planner, pd, staged))
                rep = next(r.storage_data for r in results if isinstance(r.storage_data, ObjectReport))
                from .replicas import Held

                held = Held(rep.name, rep.size, rep.digest, rep.frames)
            group = _roots.root_group(self._tier, pd.rank, pd.probes)
        finally:
            # every rank joins the version's replica exchange, also when its write failed (docs/FORMAT.md, "Replicas")
            replicated = self._replicate(s, pd, held)
        if replicated is not None and self._sync_replicas:
            self._wait_replicated(s, replicated)
        results.append(WriteResult(MetadataIndex(_SENTINEL + f"root/{pd.rank}"), 0, RootReport(pd.rank, group)))
        if pd.probes and group[0] == pd.rank and pd.coordinator not in group:
            # this rank leads a root without the commit point: copy the manifest in once committed
            # its retention runs once the copy is in (the same rules as after the commit)
            self._follower.follow(self._tier, s.version, pd.attempt, group, self.upload_timeout, self._after_commit)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if not self.allow_divergent_replicas and world > 1:  # one rank cannot diverge from itself
            for item in s.local_items:
                data = planner.resolve_data(item)
                mv = value_digest(planner, item, data) if isinstance(data, io.BytesIO) else tensor_bytes(data, item.index.fqn)
                rd = ReplicaDigest(item.index.fqn, pd.rank, xxh3(mv))
                results.append(WriteResult(MetadataIndex(_SENTINEL + "replica/" + item.index.fqn), 0, rd))
        return results

    def _replicate(self, s: _Save, pd: PlanData, held) -> "cf.Future | None":
        """Submit this rank's part of the version's replica exchange (None without replicas)."""
        if self._replicator is None:
            return None
        try:
            group = _roots.root_group(self._tier, pd.rank, pd.probes)
        except CkptStoreError:
            group = (pd.rank,)
        return self._replicator.save(s.version, pd.attempt, pd.rank, group, held)

    @property
    def _sync_replicas(self) -> bool:
        """Wait for the replicas inside the save: ``durability="replicated"`` or ``"remote"``."""
        return self.durability in ("replicated", "remote")

    def _wait_replicated(self, s: _Save, fut) -> None:
        from .replicas import ReplicaError

        try:
            ok = fut.result(self.upload_timeout)
        except cf.TimeoutError:
            raise ReplicaError(f"version {s.version!r}: replicas not in place within {self.upload_timeout:.0f} s; "
                               "nothing was committed") from None
        except ReplicaError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed exchange
            raise ReplicaError(f"version {s.version!r}: the replica exchange failed ({type(e).__name__}: {e}); "
                               "nothing was committed") from e
        if not ok:
            raise ReplicaError(f"version {s.version!r}: a replica could not be made on some rank (see its log); "
                               f"durability={self.durability!r} commits only once every replica is in place")

    def _write_object(self, s: _Save, plan, planner, pd: PlanData, staged: list) -> list[WriteResult]:
        """Phase 1 for this rank: every plan item's frames, in order, into one object — except, with
        ``incremental``, the items identical to the baseline's, whose earlier frames are referenced."""
        from ._incremental import item_key

        name = layout.shard_name(pd.attempt, pd.rank)
        per_item: list[tuple[Any, Any, int, str | None, tuple | None]] = []  # (item, refs list or location, ...)
        used: dict = {}  # object name -> RefEntry of the earlier objects referenced
        digests: dict = {}
        present: dict = {}

        def chunks():
            for item in plan.items:
                data = planner.resolve_data(item)
                if isinstance(data, io.BytesIO):
                    mv, dtype, shape, width = data.getbuffer(), None, None, 0
                else:
                    if not staged and data.numel() and _subclass.has_memory(data):
                        staged.append(data.untyped_storage().data_ptr())
                    dtype, shape = _dtype_name(data.dtype), tuple(data.shape)
                    width = _FLOAT_WIDTH.get(data.dtype, 0)
                    mv = tensor_bytes(data, item.index.fqn)
                if self.incremental:
                    key = item_key(item.index)
                    digests[key] = h = xxh128(mv)
                    loc, ref = self._inc.lookup(self._tier, key, h, dtype, shape, len(mv), present, pd.key_id)
                    if loc is not None:  # identical to the baseline: reference its frames
                        per_item.append((item, loc, len(mv), dtype, shape))
                        used[ref.name] = ref
                        continue
                refs: list = []
                per_item.append((item, refs, len(mv), dtype, shape))
                yield from _split(mv, self.frame_size, width, refs)

        sink = _ObjectSink(self._tier, layout.object_key(s.version, name), "write.frame", stream=self._part_stream(s, name))
        with cf.ThreadPoolExecutor(self.threads, thread_name_prefix="ckptstore-enc") as pool, sink:
            _write_frames(sink, self._codec(s, pd), name, chunks(), pool, window=max(2, 2 * self.threads))
            _faults.point("write.commit")
        locs = [refs if isinstance(refs, ItemLocation) else ItemLocation(name, tuple(refs), n, dtype, shape)
                for _item, refs, n, dtype, shape in per_item]
        total_raw = sum(n for _, _, n, _, _ in per_item)
        ref_raw = sum(n for _i, refs, n, _d, _s in per_item if isinstance(refs, ItemLocation))
        results = [_items_result(pd.rank, total_raw, [item.index for item, *_ in per_item], locs)]
        rep = ObjectReport(name, sink.offset, sink.hexdigest(), sink.frames, pd.rank, total_raw - ref_raw,
                           tuple(sorted(sink.codecs)), tuple(sorted(used.values(), key=lambda r: r.name)), ref_raw)
        results.append(WriteResult(MetadataIndex(_SENTINEL + f"object/{pd.rank}"), total_raw, rep))
        if self.incremental:
            self._inc.candidate(s.version, pd.attempt,
                                {item_key(item.index): (digests[item_key(item.index)], loc)
                                 for (item, *_r), loc in zip(per_item, locs)})
        if self._remote is not None:
            failed = self._upload_rank_object(s, rep)
            if failed is not None:
                results.append(WriteResult(MetadataIndex(_SENTINEL + f"upload/{pd.rank}"), 0, failed))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        s = self._cur()
        if s.attempt is None:  # a rank-less save (empty plans everywhere)
            raise CkptStoreError("finish() called before write_data(); this is a DCP protocol error")
        t0 = time.monotonic()
        reports, replicas, tables, extras = _collect(results)
        upload_failures = [x for x in extras if isinstance(x, _UploadFailure)]
        roots = [x for x in extras if isinstance(x, RootReport)]
        split = _roots.placement([r.group for r in roots])
        try:
            self._check_world(len(results), f"the commit of {s.version!r}")
            self._check_replicas(replicas)
            m, body = self._seal_manifest(s, metadata, tables, reports, world_size=len(results), placement=split)
            self._check_trainer(f"the local commit of {s.version!r}")
            commit_manifest(
                self._tier, s.version, body, overwrite=self.overwrite or s.existing is not None, fault="commit.manifest",
                hint="another save committed it first; its data is intact. Choose a new checkpoint_id or pass overwrite=True",
            )
        except BaseException:
            if split:
                self._publisher.publish(s.attempt, b"", None)  # the other roots stop waiting
            raise
        _faults.point("commit.after_manifest")
        self._timed(s.version, commit_s=time.monotonic() - t0)
        if split:  # every other root that holds objects gets the manifest (docs/FORMAT.md, "Placement")
            t1 = time.monotonic()
            self._publisher.publish(s.attempt, body, self._tier.get(layout.object_key(s.version, m.metadata_object.name)))
            self._timed(s.version, replicate_s=time.monotonic() - t1)
        self.last_manifest = m
        if upload_failures:  # PROCESS + durability="local": the local version stands, the future fails
            from .upload import UploadError

            self._after_commit(m)
            raise UploadError(
                f"version {s.version!r} is committed locally but not uploaded to {self.remote_url}: "
                + "; ".join(f"rank {f.rank}: {f.error}" for f in sorted(upload_failures, key=lambda f: f.rank))
            )
        if self._remote is not None:
            try:
                self._commit_remote(s, m, body)
            finally:
                if self._in_subprocess:
                    self._drop_uploader()
        self._after_commit(m)

    @staticmethod
    def _check_replicas(replicas: dict[str, dict[int, int]]) -> None:
        for fqn, by_rank in replicas.items():
            if len(set(by_rank.values())) > 1:
                raise StateDictKeysError(
                    f"state dict key {fqn!r} holds different values on ranks {sorted(by_rank)} "
                    "(a plain tensor or object, not a DTensor, is saved once for all ranks, so the other "
                    f"ranks' values would be lost). Save per-rank state under per-rank keys, e.g. "
                    f"f'{fqn}.rank{{rank}}', or pass allow_divergent_replicas=True to keep only one copy"
                )

    def _seal_manifest(self, s: _Save, metadata: Metadata, tables: list, reports: list, world_size: int,
                       placement: list | None = None) -> tuple[Manifest, bytes]:
        """Phase 2 up to the commit: write the DCP metadata object (``metadata`` with the ranks' item
        ``tables``), build and seal the manifest."""
        wrapped, kid = s.wrapped
        data_key = cipher = None
        if wrapped is not None:
            data_key = unwrap_key(self._master, wrapped, s.version, s.attempt, kid)
            cipher = FrameCipher(data_key)
        codec = FrameCodec(s.version, s.attempt, cipher, compress=self.compression, level=self.level)
        metadata.storage_meta = StorageMeta(checkpoint_id=s.version, save_id=s.save_id)  # as FileSystemWriter records it
        # the item locations stay packed: dcp.save returns (and DCP broadcasts) them as ItemTables
        metadata.storage_data = ItemTables(tables)
        blob = pack_metadata(metadata, tables)  # docs/FORMAT.md, "DCP metadata object" (format 2: packed tables)
        check_metadata_loads(blob, s.version)  # never commit what the reader refuses
        meta_entry, meta_codecs = self._write_small_object(s, codec, layout.metadata_name(s.attempt), blob)
        reports.sort(key=lambda r: r.rank)
        objects = [ObjectEntry(r.name, r.size, r.digest, r.frames, r.rank, r.nbytes) for r in reports]
        codecs = sorted({c for r in reports for c in r.codecs} | set(meta_codecs))
        m = Manifest(
            version=s.version,
            attempt=s.attempt,
            created=utcnow(),
            world_size=world_size,
            objects=objects,
            metadata_object=meta_entry,
            nbytes=sum(r.nbytes + r.ref_nbytes for r in reports),
            stored_bytes=sum(o.size for o in objects) + meta_entry.size,
            step=s.step,
            user=s.user_metadata,
            encryption=None if wrapped is None else {"alg": "AES-256-GCM", "key_id": kid, "wrapped_key": wrapped},
            codecs=[c for c in codecs if c],
            writer=f"ckptstore {_version()} torch {torch.__version__}",
            placement=placement,
            seq=s.seq,
            replicas=self.replicas or None,
            refs=sorted({ref.name: ref for r in reports for ref in r.refs}.values(), key=lambda r: r.name),
            supersedes=[{"attempt": a, "reason": s.supersede.get(a, "overwritten (overwrite=True)")} for a in s.replaced] or None,
        )
        return m, m.to_bytes(data_key)

    def _write_small_object(self, s: _Save, codec: FrameCodec, name: str, blob: bytes) -> tuple[ObjectEntry, tuple]:
        refs: list = []
        with _ObjectSink(self._tier, layout.object_key(s.version, name), "write.metadata") as sink:
            _write_frames(sink, codec, name, _split(memoryview(blob), self.frame_size, 0, refs))
        return ObjectEntry(name, sink.offset, sink.hexdigest(), sink.frames, None, len(blob)), tuple(sink.codecs)

    # -- remote tier ---------------------------------------------------------------------------
    @property
    def uploader(self):
        with self._lock:
            if self._uploader is None and self._remote is not None:
                from .upload import Uploader

                self._uploader = Uploader(
                    self._tier, self._remote, threads=max(2, self.threads), timeout=self.upload_timeout, retention=self.retention,
                    guard=self._check_trainer if self._trainer is not None else None,
                )
            return self._uploader

    @property
    def _sync_remote(self) -> bool:
        """Wait for uploads inside the save: ``durability="remote"``, or in DCP's checkpoint
        subprocess, which cannot keep uploading after it has answered."""
        return self.durability == "remote" or self._in_subprocess

    def _drop_uploader(self) -> None:
        with self._lock:
            up, self._uploader = self._uploader, None
        if up is not None:
            up.shutdown()
            self._remote.close()  # its pool and client (re-created on the next use)

    def _part_stream(self, s: _Save, name: str):
        """The streamed upload of the rank object ``name`` (None without a remote tier)."""
        if self._remote is None:
            return None
        return self.uploader.open_stream(layout.object_key(s.version, name))

    def _upload_rank_object(self, s: _Save, rep: ObjectReport) -> _UploadFailure | None:
        entry = ObjectEntry(rep.name, rep.size, rep.digest, rep.frames, rep.rank, rep.nbytes)
        fut = self.uploader.upload_object(s.version, entry, rep.rank, refs=rep.refs)
        if self.durability == "remote":
            fut.result()
        elif self._in_subprocess:  # PROCESS, durability="local": commit locally, then report it
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001 - travels to the coordinator in the write results
                return _UploadFailure(rep.rank, f"{type(e).__name__}: {e}")
        return None

    def _commit_remote(self, s: _Save, m: Manifest, body: bytes) -> None:
        from ..manifest import catalogue

        for v, _who in s.restage:  # what an earlier run could not commit remotely (see _restage)
            try:
                p = catalogue.read_manifest(self._tier, v)
                self.uploader.commit(p.manifest, self._tier.get(layout.manifest_key(v)), False, retry=False)
            except CkptStoreError as e:
                log.warning("ckptstore: cannot stage version %r again: %s", v, e)
        fut = self.uploader.commit(m, body, self.overwrite)
        with self._lock:
            self._remote_futs[m.version] = fut
        if self._sync_remote:
            fut.result()

    def _timed(self, version: str | None, **seconds: float) -> None:
        with self._lock:
            self._timings.setdefault(version, {}).update(seconds)
            while len(self._timings) > 64:  # nobody asked for them: keep the newest
                self._timings.pop(next(iter(self._timings)))

    def timings(self, version: str) -> dict:
        """Seconds of this rank's phases of the committed save ``version`` — ``write_s`` (encode and
        write its shard, ``write_data``), and on the coordinator ``commit_s`` (metadata object,
        manifest, local commit) and ``replicate_s`` (handing the manifest to the other roots) — or
        ``{}`` (PROCESS executor: measured in DCP's checkpoint subprocess); handed out once."""
        with self._lock:
            return self._timings.pop(version, {})

    def remote_commit_future(self, version: str):
        """The ``concurrent.futures.Future`` of ``version``'s remote commit made by this writer (the
        coordinator), or None; handed out once."""
        with self._lock:
            return self._remote_futs.pop(version, None)

    def wait_uploads(self, timeout: float | None = None) -> None:
        """Block until this writer's pending uploads and remote commits finish.

        Raises :class:`ckptstore.dcp.upload.UploadError` (a :class:`StorageError`) listing what
        did not complete within ``timeout`` seconds or failed.
        """
        from .upload import check_uploads

        check_uploads(self._uploader, timeout)

    def _after_commit(self, m: Manifest) -> None:
        from ..gc import apply_after_commit

        up = self._uploader
        t0 = time.monotonic()
        decisions = apply_after_commit(self._tier, self.retention, m, tier_name="local", others={"remote": self._remote},
                                       in_flight=up.in_flight() if up is not None else ())
        deleted = [d.version for d in decisions if not d.keep]
        if deleted:
            with self._lock:
                self._pruned.append({"tier": "local", "after": m.version, "deleted": deleted,
                                     "seconds": time.monotonic() - t0, "outcome": "ok"})
                del self._pruned[:-16]

    def pruned(self) -> list[dict]:
        """What automatic retention deleted after this writer's commits since the last call (one
        dict per run: ``tier``, ``after`` (the version just committed), ``deleted`` versions,
        ``seconds``)."""
        with self._lock:
            out, self._pruned = self._pruned, []
        return out
    # -- AsyncStager protocol (dcp.async_save uses the writer as its stager) --------------------
    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into host buffers (what ``async_save`` blocks on); waits while
        ``max_staged`` earlier copies are still being written."""
        return self._stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        pass

    def close(self, timeout: float | None = None) -> None:
        """Wait for pending uploads (bounded by ``timeout`` or ``upload_timeout`` seconds) and
        release resources; raises ``UploadError`` naming what was not uploaded — including versions
        that DCP's checkpoint subprocess (PROCESS executor) committed locally but not remotely.
        With ``replicas``, also waits for the copies and destroys the writer's replica group (each
        holds a connection to every rank); a later save through this writer raises
        :class:`~ckptstore.dcp.replicas.ReplicaError` (make a new writer)."""
        timeout = self.upload_timeout if timeout is None else timeout
        try:
            self._follower.wait(timeout)
            if self._replicator is not None:  # the copies a durability="local" save left running
                try:
                    self._replicator.wait(timeout)
                except cf.TimeoutError:
                    from .replicas import ReplicaError

                    raise ReplicaError(f"replica copies did not finish within {timeout:.0f} s (a peer gone?); the "
                                       "committed versions stand, their missing replicas are made at the next restore") from None
                finally:
                    self._replicator.close(timeout)
            if self._shipped:
                self._check_shipped(timeout)
            if self._uploader is not None:
                self.wait_uploads(timeout)
        finally:
            _shipped.discard(self)
            self._drop_uploader()

    def heal(self, view, manifest: bytes | None, metadata: bytes | None):
        """After a restore of ``view``'s version (a collective call, on every rank): copy, in the
        background, the objects each rank's root should hold of it — its own shard and the replicas the
        saved placement assigns to it — but lacks, from the ranks whose roots hold them
        (docs/FORMAT.md, "Replicas": re-replication). Returns the future (True: all copied), or None
        when there is nothing to do."""
        from ..manifest.schema import parse
        from .replicas import heal_plan

        if self._replicator is None or self._replicator.closed or manifest is None:
            return None
        m = parse(manifest, expect_version=view.version).manifest
        copies = heal_plan(view, m, m.replicas or self.replicas)
        if not copies:
            return None
        return self._replicator.heal(view.version, view.attempt, copies, manifest, metadata)

    def _check_shipped(self, timeout: float) -> None:
        """PROCESS executor: the subprocess commits remotely before its future resolves; a version it
        committed locally in this writer's lifetime but not remotely failed to upload. The
        coordinator (rank 0) stages those again from here and raises for what still fails."""
        from ..manifest import catalogue
        from .upload import UploadError

        if self._ship_rank != 0:
            return
        local = {v: e for v, e in catalogue.scan(self._tier).items() if e.manifest.created >= self._born}
        missing = sorted(set(local) - set(catalogue.scan(self._remote)))
        if not missing:
            return
        up = self.uploader
        up.catch_up(only=missing)
        left = up.wait(timeout)
        still = sorted(set(missing) - set(catalogue.scan(self._remote)))
        if still:
            raise UploadError(
                f"versions {still} were committed locally by DCP's checkpoint subprocess but not in "
                f"{self.remote_url}; they are intact locally (the next save with this remote stages them, "
                "or run the save again with working credentials):\n  " + "\n  ".join(left)
            )


_shipped: "weakref.WeakSet[StorageWriter]" = weakref.WeakSet()


def _multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@atexit.register
def _check_shipped_at_exit() -> None:  # pragma: no cover - exercised by subprocess tests
    for w in list(_shipped):
        try:
            w.close()
        except Exception as e:  # noqa: BLE001 - report every writer
            print(f"ckptstore: NOT uploaded before exit: {e}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class _UploadFailure:
    """A rank's failed upload (PROCESS executor, durability="local"), reported to the coordinator."""

    rank: int
    error: str


def _items_result(rank: int, nbytes: int, idx: list, locs: list) -> WriteResult:
    """The one WriteResult that carries all of a rank's item locations (``MetadataIndex`` ``idx`` →
    ``ItemLocation`` ``locs``), packed as an ``ItemTable`` (docs/FORMAT.md, "DCP metadata object"):
    DCP gathers a few byte strings per rank instead of one object per item, and the coordinator's
    ``finish`` concatenates them without touching single items."""
    return WriteResult(MetadataIndex(_SENTINEL + f"items/{rank}"), nbytes, pack_items(idx, locs))


def _collect(results: list[list[WriteResult]]) -> tuple[list[ObjectReport], dict[str, dict[int, int]], list, list]:
    """Split the ranks' write results into object reports, replica digests, the ranks' item tables
    (in rank order) and the other sentinels (root reports, upload failures)."""
    reports: list[ObjectReport] = []
    replicas: dict[str, dict[int, int]] = {}
    tables: list[ItemTable] = []
    extras: list = []
    for per_rank in results:
        for r in per_rank:  # a few sentinels per rank (and a digest per replicated item)
            sd = r.storage_data
            if isinstance(sd, ItemTable):
                tables.append(sd)
            elif isinstance(sd, ObjectReport):
                reports.append(sd)
            elif isinstance(sd, ReplicaDigest):
                replicas.setdefault(sd.fqn, {})[sd.rank] = sd.digest
            elif isinstance(sd, (RootReport, _UploadFailure)):
                extras.append(sd)
            else:
                raise CkptStoreError(
                    f"write result {r.index.fqn!r} carries {type(sd).__name__}, not a ckptstore record: every "
                    "rank of a save must use ckptstore.StorageWriter of the same release")
    return reports, replicas, tables, extras


def _split(mv: memoryview, frame_size: int, width: int, refs: list):
    """(chunk, element width, refs list, plan cell) for each frame of ``mv``; one empty frame when
    empty. The frames of one item share a ``bytegroup.PlanCell``: its encoding is decided once."""
    n = len(mv)
    cell = PlanCell() if width and n > frame_size else None
    for start in range(0, n, frame_size) if n else [0]:
        yield mv[start : start + frame_size], width, refs, cell


class _ObjectSink:
    """One object being written: appends encoded frames, tracks size, digest and codec chains;
    commits on a clean exit from ``with``, aborts on any exception.

    With ``stream`` (an ``upload.PartStream``), every part's worth of appended bytes is handed to
    the remote upload as soon as it is in the local file; a failed or aborted write aborts it."""

    def __init__(self, tier, key: str, fault: str, stream=None) -> None:
        try:
            self._w = tier.open_writer(key)
        except BaseException:
            if stream is not None:
                stream.abort()
            raise
        self._fault = fault
        self._stream = stream
        self._digest = xxh3_stream()
        self.offset = 0
        self.frames = 0
        self.codecs: set[str] = set()

    def append(self, head: bytes, payload, h: int, raw_len: int, index: int) -> FrameRef:
        _faults.point(self._fault)
        self._w.write(head)
        self._w.write(payload)
        self._digest.update(head)
        ref = FrameRef(self.offset, len(head) + len(payload), raw_len, h, index)
        self.codecs.add(_chain_of(head))
        self.offset += ref.length
        self.frames += 1
        st = self._stream
        if st is not None:
            cut = st.feed(head)
            if st.feed(payload) or cut:
                self._w.flush()  # the upload threads read the part back from the local file
                st.send()
        return ref

    def hexdigest(self) -> str:
        return f"{self._digest.intdigest():016x}"

    def __enter__(self) -> "_ObjectSink":
        return self

    def __exit__(self, et, e, tb) -> None:
        st = self._stream
        if et is None:
            try:
                self._w.commit()
            except BaseException:
                if st is not None:
                    st.abort()
                raise
            if st is not None:
                st.written(self.offset)
        else:
            self._w.abort()
            if st is not None:
                st.abort()


def _write_frames(sink: _ObjectSink, codec: FrameCodec, name: str, chunks, pool=None, window: int = 0) -> None:
    """The one frame-writing loop: encode each (chunk, width, refs, cell) — in ``pool``, at most ``window``
    frames ahead — and append the frames to ``sink`` in order, recording a FrameRef in ``refs``."""
    pending: collections.deque = collections.deque()

    def drain(limit: int) -> None:
        while len(pending) > limit:
            refs, index, raw_len, job = pending.popleft()
            head, payload, h = job.result() if pool is not None else job
            refs.append(sink.append(head, payload, h, raw_len, index))

    try:
        for index, (chunk, width, refs, cell) in enumerate(chunks):
            if pool is not None:
                job = pool.submit(codec.encode, name, index, chunk, width, cell)
            else:
                job = codec.encode(name, index, chunk, width, cell)
            pending.append((refs, index, len(chunk), job))
            drain(window if pool is not None else 0)
        drain(0)
    finally:
        for _refs, _i, _n, job in pending:  # an error: do not leave encodes running
            if pool is not None:
                job.cancel()


def _chain_of(head: bytes) -> str:
    n = int.from_bytes(head[6:8], "little")
    return head[FIXED_LEN : FIXED_LEN + n].decode("ascii")




def _version() -> str:
    from .. import __version__

    return __version__
