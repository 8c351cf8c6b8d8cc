"""``ckptstore.StorageWriter``: a DCP StorageWriter with framed, checksummed, encrypted shards and a
two-phase manifest commit.

Call sequence (as DCP drives it; see ``torch.distributed.checkpoint.storage.StorageWriter``):

0. (all ranks) ``reset(checkpoint_id)`` — only when a ``checkpoint_id`` is passed; starts a new
   per-save state (``_plan.Save``: version, attempt, data key, plan items) for the calling thread, so
   overlapping saves through one writer never share it (see the class docstring).
   ``storage_meta()`` returns ``StorageMeta(checkpoint_id=version, save_id=...)``.
1. (all ranks) ``set_up_storage_writer(is_coordinator, rank=, use_collectives=)`` — validates the
   version name and fails fast with :class:`VersionExistsError` unless ``overwrite=True``.
2. (all ranks) ``prepare_local_plan`` — records the rank in ``plan.storage_data``.
3. (coordinator) ``prepare_global_plan`` — draws the attempt id and (with a key) a fresh data key,
   wrapped by the master key (with AWS KMS: ``GenerateDataKey``); returns one plan per rank, in
   order, via ``dataclasses.replace``.
4. (all ranks) ``write_data`` — **phase 1**: encodes frames in a thread pool (byte-group/zstd,
   AES-GCM, XXH3), appends them to the rank's object ``attempts/<attempt>/rNNNNN.ckd`` and fsyncs
   it and its directory; returns ``WriteResult``s carrying frame locations and the object's size
   and digest.
5. (coordinator) ``finish`` — **phase 2**: writes DCP's ``Metadata`` (compact format 3,
   docs/FORMAT.md "DCP metadata object") as a framed object, fsyncs it, then commits
   ``manifest.json`` with put-if-absent (temp file, fsync, ``os.link``, fsync dir). Only then does
   the version exist. With node-local roots the other roots then receive copies
   (docs/FORMAT.md, "Placement").

A crash anywhere before the link leaves only objects no manifest references (garbage for
``ckptstore gc`` after the grace period); the previous version stays the latest.

Stages: the writer keeps the DCP contract and the per-save state and hands each step to a
collaborator — staging (``staging.Stager``: ``stage``), planning (``_plan.Planner``: steps 1-3),
encoding and writing frames (``_frames.ShardWriter``: step 4, with the references of incremental
saves, ``_incremental.SaveRefs``), the commit (``_commit.Committer``: step 5 and retention), the
peer replicas (``replicas.ReplicaStage``) and the uploads (``_remote.RemoteStage``); the data keys
come from ``_keys.DataKeys`` and the whole-job checks from ``_liveness.Guard``.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter as _DCPStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import _pace
from .._names import check_version
from ..codec.crypto import key_or_file
from ..codec.stages import env_threads
from ..errors import CkptStoreError
from ..keys import resolve_master
from ..manifest import layout
from ..manifest.schema import Manifest, utcnow
from ..tiers import LocalTier, make_remote, remote_options_of
from . import _roots
from ._checks import quiet_single_process, reject_unknown_kwargs
from ._commit import Committer, divergence_checked, value_digests
from ._config import Setting, WriterConfig, check_options, multi_rank, resolve_domain
from ._frames import DEFAULT_FRAME_SIZE, ShardWriter, tensor_bytes  # noqa: F401  (tensor_bytes: public here)
from ._incremental import Incremental
from ._keys import DataKeys
from ._liveness import Guard
from ._plan import Planner, Save
from ._remote import RemoteStage
from ._reports import SENTINEL as _SENTINEL  # noqa: F401  (benchmarks build write results with these)
from ._reports import items_result as _items_result  # noqa: F401
from ._reports import root_result, upload_failure_result
from ._types import PlanData
from .replicas import ReplicaStage
from .staging import Stager

log = logging.getLogger("ckptstore")


class StorageWriter(_DCPStorageWriter):
    """Write DCP checkpoints into a ckptstore.

    Args:
        root: local directory (the fast NVMe tier). Created if missing.
        remote: a remote tier's URL (``"s3://bucket/prefix"``, ``"gs://bucket/prefix"``,
            ``"az://container/prefix"``; docs/tiers.md) or a :class:`~ckptstore.tiers.Tier`, to
            also stage every version there, or None.
        key: master key, 32 bytes or a key provider (``get_key() -> bytes``), or an AWS KMS key
            (:class:`ckptstore.KmsKey`, ``"kms://<key id>"``; docs/howto/kms.md); default
            ``CKPTSTORE_KEY`` (base64) / ``CKPTSTORE_KEY_FILE`` / ``CKPTSTORE_KMS_KEY_ID``. With a key
            everything is encrypted; with KMS a save that cannot get its data key raises
            :class:`KeyServiceError` before anything is written.
        key_file: instead of ``key``, a key file (32 bytes or their base64, what ``ckptstore keygen``
            writes; the CLI's ``--key-file``). Not with ``key`` (``ValueError``).
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
        remote_options: the remote tier's own keyword arguments (docs/tiers.md, "Options": an
            endpoint, a project, an account...); by default each tier reads its SDK's environment.
            The per-tier keyword arguments this constructor took before are deprecated aliases
            (a ``DeprecationWarning``; docs/tiers.md).
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
        replica_domain: this rank's failure domain (a rack, a switch, a power feed: any string of at
            most 256 characters without control characters) — default the environment variable
            ``CKPTSTORE_REPLICA_DOMAIN``, else the host name. A root group's domain is its lowest
            rank's; the manifest records each group's (``domains``). With ``replicas``, a group's
            copies never go to a root of its own domain while another domain exists, and spread over
            the other domains (docs/FORMAT.md, "Replicas"). Give every rank of a rack the same string.
        incremental: reference, instead of writing again, every write item whose bytes (XXH3-128 of
            the raw bytes) equal those of the same item in the newest version this writer committed
            (or, through ``CheckpointManager``, restored): the new manifest names the earlier object
            (``refs``, docs/FORMAT.md "References"), nothing of the item is written or uploaded again.
            Pays when much of the state does not change between saves (a frozen base model under a
            LoRA adapter, untouched experts); costs one XXH3-128 pass over every item. Off by default.
            A writer with no baseline in memory — a new ``StorageWriter`` for every save, or DCP's
            checkpoint subprocess — takes it from the store: the newest version of its ``scope``
            committed in the coordinator's root. While a save references an earlier version it holds
            a lease on those objects in its root, which ``gc`` and ``drop`` honour (docs/FORMAT.md,
            "References", Delete rule 13).
        scope: with ``incremental``, the regular expression of the version names whose newest
            committed version is the baseline of a writer that has none in memory (default: the name
            being saved with every run of digits standing for any digits, ``step-\\d+`` for
            ``step-000200``; ``CheckpointManager`` passes its prefix / version format).
        count_nonfinite: count the NaN and ±Inf values of every floating tensor (bf16, fp16, fp32,
            fp64, the fp8 formats, complex) while its frames are encoded, and record them in the
            manifest (``nonfinite``: the count and the first keys, docs/FORMAT.md "Manifest"); a
            version that holds any is not the default restore point (docs/FORMAT.md, "Restore
            choice"). Costs two max-reductions over the bytes per frame (benchmarks/README.md:
            the save time with and without). Default True; False records nothing (read as unknown).
        commit_check: ``commit_check(version) -> str | None``, called by the coordinator right before
            the local commit point of every save (after every object is durable): a returned reason
            refuses the commit with :class:`FencedError` and nothing is committed (docs/FORMAT.md,
            Save rule 9) — the hook of an owner that may lose its claim while the save is in flight
            (:mod:`ckptstore.integrations.torchft`: the replica group left the quorum). THREAD
            executor and ``dcp.save`` only (a callable does not travel to DCP's checkpoint subprocess).
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

    # the settings above, kept in the WriterConfig every stage reads (``_config.Setting``)
    root = Setting()
    remote_url = Setting()
    remote_options = Setting()
    overwrite = Setting()
    step = Setting()
    user_metadata = Setting()
    threads = Setting()
    frame_size = Setting()
    compression = Setting()
    level = Setting()
    durability = Setting()
    allow_divergent_replicas = Setting()
    upload_timeout = Setting()
    retention = Setting()
    world_size = Setting()
    replicas = Setting()
    replica_domain = Setting()
    incremental = Setting()
    scope = Setting()
    count_nonfinite = Setting()
    commit_check = Setting()

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        remote: str | None = None,
        key: Any = None,
        key_file: str | os.PathLike | None = None,
        version: str | None = None,
        overwrite: bool = False,
        step: int | None = None,
        user_metadata: dict | None = None,
        threads: int | None = None,
        frame_size: int = DEFAULT_FRAME_SIZE,
        compression: str = "auto",
        level: int = 1,
        durability: str = "local",
        remote_options: dict | None = None,
        allow_divergent_replicas: bool = False,
        upload_timeout: float = 3600.0,
        retention: Any = None,
        max_staged: int = 2,
        world_size: int | None = None,
        replicas: int = 0,
        incremental: bool = False,
        scope: str | None = None,
        count_nonfinite: bool = True,
        commit_check: Any = None,
        replica_domain: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        remote_options = remote_options_of(remote_options, kwargs, where="StorageWriter")
        reject_unknown_kwargs(type(self), kwargs)
        quiet_single_process()
        world_size = check_options(compression=compression, durability=durability, replicas=replicas,
                                   frame_size=frame_size, max_staged=max_staged, world_size=world_size)
        self._cfg = cfg = WriterConfig(
            root=os.path.abspath(os.fspath(root)), remote_url=getattr(remote, "url", remote),
            remote_options=remote_options, overwrite=overwrite,
            step=step, user_metadata=dict(user_metadata or {}), threads=threads or env_threads(), frame_size=frame_size,
            compression=compression, level=level, durability=durability, allow_divergent_replicas=allow_divergent_replicas,
            upload_timeout=upload_timeout, retention=retention, world_size=world_size, replicas=replicas,
            incremental=bool(incremental), scope=scope, count_nonfinite=bool(count_nonfinite),
            commit_check=commit_check, replica_domain=resolve_domain(replica_domain))
        self._keys = DataKeys(resolve_master(key_or_file(key, key_file)))
        if durability == "remote" and not remote:
            raise ValueError("durability='remote' needs a remote tier (remote='s3://...', 'gs://...', 'az://...')")
        self._default_version = check_version(version) if version is not None else None
        self._tier = LocalTier(cfg.root)
        self._remote = make_remote(remote, **remote_options) if remote else None
        self._stager = Stager(max_staged, timeout=upload_timeout)
        self._shipped = False  # a copy of this writer was sent to DCP's checkpoint subprocess
        self._ship_rank = 0  # the rank that sent it (only rank 0 re-checks the uploads at close)
        self._born = utcnow()
        self._options_for: dict[str, tuple] = {}
        self._timings: dict[str, dict] = {}
        #: DCP's checkpoint subprocess leaves the trainer's process group (set by
        #: CheckpointManager(save_on_signal=...)): torchrun signals a worker's whole process group
        #: (os.killpg), and a save in flight there must be able to finish after a preemption signal; it
        #: still exits once its trainer is gone (the watcher) and when the trainer ends it
        self._subprocess_own_group = False
        self.last_manifest: Manifest | None = None
        self._publisher = _roots.Publisher()
        #: version -> (attempt, root discovery, this rank coordinated it): the last saves, for :meth:`save_failed`
        self._attempt_of: dict[str, tuple[str, bool, bool]] = {}
        self._inc = Incremental()
        self._guard = Guard(cfg)
        self._up = RemoteStage(cfg, self._tier, self._remote, self._guard)
        self._planner = Planner(cfg, self._tier, self._remote, self._keys, self._guard, self._up)
        self._shards = ShardWriter(cfg, self._tier, self._keys, self._inc)
        self._committer = Committer(cfg, self._tier, self._remote, self._keys, self._guard, self._publisher,
                                    self._up.in_flight, _software())
        self._replicas = ReplicaStage.create(cfg, self._tier, multi_rank())
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._follower = _roots.Follower()

    # -- pickling (AsyncCheckpointerType.PROCESS): configuration only, no pools or clients ------
    def __getstate__(self):
        if self._replicas.replicator is not None:
            raise CkptStoreError(
                "StorageWriter(replicas=...) cannot run in DCP's checkpoint subprocess (AsyncCheckpointerType.PROCESS): "
                "the copies travel between the trainers' processes. Use the THREAD executor (the default) or dcp.save")
        if self._cfg.commit_check is not None:
            raise CkptStoreError("StorageWriter(commit_check=...) cannot run in DCP's checkpoint subprocess "
                                 "(AsyncCheckpointerType.PROCESS): use the THREAD executor (the default) or dcp.save")
        if not self._guard.in_subprocess and self._remote is not None and not self._shipped:
            self._shipped = True  # close()/exit here check that the subprocess's versions reached the remote tier
            self._ship_rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
            _shipped.add(self)
        s = self.__dict__.copy()  # the guard's copy knows this process as its trainer (Guard.__getstate__)
        for k in ("_lock", "_tls", "_follower"):
            s.pop(k, None)
        s["_timings"] = {}
        return s

    def __setstate__(self, s):
        self.__dict__.update(s)
        self._init_runtime()
        self._guard.attach(self._subprocess_own_group)

    # The attributes below are the stages' (tests, benchmarks and CheckpointManager read them).
    @property
    def _master(self):
        """The master key as ``key=`` takes it (32 bytes, or the ``KmsKey``), or None."""
        return self._keys.given

    @property
    def _uploader(self):
        return self._up.current

    @property
    def uploader(self):
        """The ``upload.Uploader`` of the remote tier (made at first use), or None without one."""
        return self._up.uploader

    @property
    def _replicator(self):
        return self._replicas.replicator

    # -- per-save state --------------------------------------------------------------------------
    def _new_save(self, version: str | None) -> Save:
        step, user, supersede = self.step, self.user_metadata, {}
        if version is not None:
            with self._lock:
                step, user, supersede = self._options_for.pop(version, (step, user, supersede))
        s = Save(version, step, dict(user), supersede=dict(supersede))
        self._tls.save = s
        return s

    def _cur(self, *, starting: bool = False) -> Save:
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
        _pace.point()  # a paced save thread's pieces end at each hook (ckptstore/_pace.py)
        s = self._cur(starting=True)
        self._planner.begin(s, is_coordinator, kwargs)
        self._follower.wait(self.upload_timeout)  # the previous save's copy into this root, if any
        if self.incremental:
            self._inc.promote(self._tier)  # the previous save, once it is committed here, is the baseline
        self._planner.check_existing(s)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        _pace.point()
        return self._planner.local_plan(self._cur(), plan, want_base=self.incremental and self._inc.wants_base)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        _pace.point()
        plans = self._planner.global_plan(self._cur(), plans)
        _pace.point()
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        _pace.point()
        s = self._cur()
        staged: list[int] = []  # storage address of the first staged tensor: which host copy to free
        t0 = time.monotonic()
        try:
            results = self._write_data(s, plan, planner, staged)
        except BaseException:
            # this rank's write failed, so DCP will not call finish: the attempt cannot commit, and what
            # it left in this root goes now (docs/FORMAT.md, Delete rule 14)
            self._reclaim_failed(s)
            raise
        finally:
            self._stager.release(staged[0] if staged else None)
        self._timed(s.version, write_s=time.monotonic() - t0)
        if self._guard.in_subprocess and not s.is_coordinator:
            self._up.drop()
        self._guard.check_trainer(f"to report the write results of {s.version!r}")
        fut: Future = Future()
        fut.set_result(results)
        _pace.point()
        return fut

    def _reclaim_failed(self, s: Save) -> None:
        if s.attempt is None:
            return
        self._up.abandon(s.version)  # its object's upload, if queued, is not sent
        _attempt, discover, coordinator = self._attempt_of.get(s.version, (s.attempt, False, s.is_coordinator))
        self._reclaim(s.version, s.attempt, coordinator, discover)

    def _reclaim(self, version: str, attempt: str, coordinator: bool, discover: bool) -> None:
        """The attempt did not commit (or, on the coordinator's root, the commit point says so): its
        objects in this root go; the coordinator also tells the other roots' followers, which stop
        waiting for a manifest copy and reclaim theirs (docs/FORMAT.md, Delete rule 14)."""
        from .. import gc

        gone = gc.reclaim_failed_attempt(self._tier, version, attempt)
        if gone is not None and coordinator and discover:
            self._publisher.publish(attempt, b"", None)

    def save_failed(self, version: str) -> None:
        """DCP raised for the save of ``version`` on this rank (``CheckpointManager`` calls this): on
        the coordinator, whose root is the commit point, an attempt its root does not name never
        committed — its objects there go and the other roots are told (their followers reclaim
        theirs). Other ranks reclaim only what their own failed write left (:meth:`write_data`) or
        what their follower is told: a manifest copy may still be on its way to their root."""
        rec = self._attempt_of.pop(version, None)
        if rec is not None and rec[2]:
            self._reclaim(version, rec[0], True, rec[1])

    def _write_data(self, s: Save, plan: SavePlan, planner: SavePlanner, staged: list) -> list[WriteResult]:
        """Phase 1 of this rank: stage again what an earlier run did not upload, write (and upload)
        the rank's object, join the replica exchange, report the root group and value digests."""
        pd: PlanData = plan.storage_data
        s.attempt = pd.attempt
        s.restage = pd.restage
        self._attempt_of[s.version] = (pd.attempt, bool(pd.discover), s.is_coordinator)
        while len(self._attempt_of) > 16:
            self._attempt_of.pop(next(iter(self._attempt_of)))
        if pd.restage:
            self._up.restage_objects(pd)
        results: list[WriteResult] = []
        rep = None
        try:
            if plan.items:
                # the data key first (with KMS a request): a rank that cannot get it writes and uploads
                # nothing (docs/FORMAT.md, Save rule 10)
                codec = self._shards.codec(s.version, s.rank, pd)
                stream = self._up.open_stream(s.version, self._shards.name(pd))
                results, rep, refs = self._shards.write(s.version, s.rank, plan, planner, pd, staged, stream, codec)
                gone = refs.missing() if refs is not None and refs.used else []
                if gone:  # removed by something that ignores leases: write those items whole (Save rule 11)
                    log.warning("ckptstore: objects %s that save %r references were removed while it ran; writing "
                                "every item of rank %d whole", gone[:3], s.version, s.rank)
                    if stream is not None:
                        stream.abort()
                    refs.release()
                    self._tier.delete(layout.object_key(s.version, rep.name))
                    stream = self._up.open_stream(s.version, self._shards.name(pd))
                    results, rep, refs = self._shards.write(s.version, s.rank, plan, planner, pd, staged, stream, codec,
                                                            whole=True)
                failed = self._up.upload_object(s.version, rep)
                if failed is not None:
                    results.append(upload_failure_result(failed))
            # this rank's root group: who claimed the root for this attempt (docs/FORMAT.md, "Placement")
            leader = _roots.claim(self._tier, pd.attempt, pd.rank) if pd.discover else pd.rank
        finally:
            # every rank joins the version's replica exchange, also when its write failed (docs/FORMAT.md, "Replicas")
            replicated = self._replicas.save(s.version, pd, rep)
        self._replicas.settle(s.version, replicated)
        results.append(root_result(pd.rank, leader, self.replica_domain))
        if pd.discover and leader == pd.rank and pd.rank != pd.coordinator:
            # this rank leads a root without the commit point (the coordinator leads its own): copy the
            # manifest in once committed; its retention runs once the copy is in (the same rules as after
            # the commit)
            self._follower.follow(self._tier, s.version, pd.attempt, pd.rank, self.upload_timeout, self._committer.after_commit)
        if divergence_checked(self.allow_divergent_replicas):
            results.extend(value_digests(s.local_items, planner, pd.rank))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        _pace.point()
        s = self._cur()
        if s.attempt is None:  # a rank-less save (empty plans everywhere)
            raise CkptStoreError("finish() called before write_data(); this is a DCP protocol error")
        try:
            m, body, upload_failures = self._committer.commit(s, metadata, results, self._timed)
        finally:
            _roots.release(self._tier, s.attempt)  # every rank read the coordinator's claim before finish
        self.last_manifest = m
        if upload_failures:  # PROCESS + durability="local": the local version stands, the future fails
            self._committer.after_commit(m)
            raise self._up.failed(s.version, upload_failures)
        if self._remote is not None:
            try:
                self._up.commit(s.restage, m, body)
            finally:
                if self._guard.in_subprocess:
                    self._up.drop()
        self._committer.after_commit(m)

    # -- what the writer reports -----------------------------------------------------------------
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
        return self._up.remote_commit_future(version)

    def replica_future(self, version: str):
        """The ``concurrent.futures.Future`` of ``version``'s replica exchange on this rank (its result:
        the replicas of the version not made, on any rank — ``[]``: every replica in place), or None
        without replicas; handed out once."""
        return self._replicas.replica_future(version)

    def wait_copies(self, timeout: float | None = None) -> None:
        """Block (at most ``timeout`` seconds, default ``upload_timeout``) until the manifest copies of
        committed saves are in this rank's root, when this rank leads a root group other than the
        coordinator's (docs/FORMAT.md, "Placement": ``dcp.save`` may return before them). Never raises:
        a copy that failed is repaired by the next load."""
        _roots.wait_for_copies(self._tier, self.upload_timeout if timeout is None else timeout)

    def wait_uploads(self, timeout: float | None = None) -> None:
        """Block until this writer's pending uploads and remote commits finish.

        Raises :class:`ckptstore.dcp.upload.UploadError` (a :class:`StorageError`) listing what
        did not complete within ``timeout`` seconds or failed.
        """
        self._up.wait(timeout)

    @property
    def skipped_uploads(self) -> list[str]:
        """Versions committed locally that this writer did not stage to the remote tier because
        :data:`~ckptstore.dcp.upload.UPLOAD_BACKLOG` newer versions were submitted before their upload
        or remote commit finished (docs/FORMAT.md, Save rule 8), oldest first (the last 1,000; also
        after :meth:`close`)."""
        return self._up.skipped()

    def pruned(self) -> list[dict]:
        """What automatic retention deleted after this writer's commits since the last call (one
        dict per run: ``tier``, ``after`` (the version just committed), ``deleted`` versions,
        ``seconds``)."""
        return self._committer.pruned()

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
        :class:`~ckptstore.dcp.replicas.ReplicaError` (make a new writer). A replica of a
        ``durability="local"`` save that was not made raises :class:`~ckptstore.dcp.replicas.ReplicaError`
        naming it (after the uploads were waited for; with an ``UploadError`` too, that one is raised
        and names the replicas as well): a redundancy gap is reported like an upload that did not complete."""
        timeout = self.upload_timeout if timeout is None else timeout
        gap = None
        try:
            self._follower.wait(timeout)
            try:
                self._replicas.close(timeout)
            except CkptStoreError as e:
                gap = e
            if self._shipped and self._ship_rank == 0:  # the coordinator stages again what did not reach the remote tier
                self._up.check_shipped(timeout, self._born)
            self._up.wait(timeout)
        except CkptStoreError as e:
            if gap is not None:
                raise type(e)(f"{e}\nand: {gap}") from e
            raise
        finally:
            _shipped.discard(self)
            self._up.drop()
        if gap is not None:
            raise gap

    def heal(self, view, manifest: bytes | None, metadata: bytes | None):
        """After a restore of ``view``'s version (a collective call, on every rank): copy, in the
        background, the objects each rank's root should hold of it — its own shard and the replicas the
        saved placement assigns to it — but lacks, from the ranks whose roots hold them
        (docs/FORMAT.md, "Replicas": re-replication). Returns the future (True: all copied), or None
        when there is nothing to do."""
        return self._replicas.heal(view, manifest, metadata)


_shipped: "weakref.WeakSet[StorageWriter]" = weakref.WeakSet()


def _software() -> str:
    """What a manifest records as its ``writer``."""
    from .._version import __version__

    return f"ckptstore {__version__} torch {torch.__version__}"


@atexit.register
def _check_shipped_at_exit() -> None:  # pragma: no cover - exercised by subprocess tests
    for w in list(_shipped):
        try:
            w.close()
        except Exception as e:  # noqa: BLE001 - report every writer
            print(f"ckptstore: NOT uploaded before exit: {e}", file=sys.stderr, flush=True)
