"""``ckptstore.StorageWriter``: a DCP StorageWriter with framed, checksummed, encrypted shards and a
two-phase manifest commit.

Call sequence (as DCP drives it; see ``torch.distributed.checkpoint.storage.StorageWriter``):

0. (all ranks) ``reset(checkpoint_id)`` — only when a ``checkpoint_id`` is passed; sets the version
   name and clears per-checkpoint state. ``storage_meta()`` returns
   ``StorageMeta(checkpoint_id=version, save_id=...)``.
1. (all ranks) ``set_up_storage_writer(is_coordinator, rank=, use_collectives=)`` — validates the
   version name and fails fast with :class:`VersionExistsError` unless ``overwrite=True``.
2. (all ranks) ``prepare_local_plan`` — records the rank in ``plan.storage_data``.
3. (coordinator) ``prepare_global_plan`` — draws the attempt id and (with a key) a fresh data key,
   wrapped by the master key; returns one plan per rank, in order, via ``dataclasses.replace``.
4. (all ranks) ``write_data`` — **phase 1**: encodes frames in a thread pool (byte-group/zstd,
   AES-GCM, XXH3), appends them to the rank's object ``attempts/<attempt>/rNNNNN.ckd`` and fsyncs
   it and its directory; returns ``WriteResult``s carrying frame locations and the object's size
   and digest.
5. (coordinator) ``finish`` — **phase 2**: writes the pickled DCP ``Metadata`` as a framed object,
   fsyncs it, then commits ``manifest.json`` with put-if-absent (temp file, fsync, ``os.link``,
   fsync dir). Only then does the version exist.

A crash anywhere before the link leaves only objects no manifest references (garbage for
``ckptstore gc`` after the grace period); the previous version stays the latest.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import io
import os
import pickle
import uuid
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
from ..codec import FrameCodec, FrameRef, xxh3
from ..codec.frame import FIXED_LEN, xxh3_stream
from ..codec.crypto import FrameCipher, key_id, new_data_key, resolve_key, unwrap_key, wrap_key
from ..codec.stages import env_threads
from ..errors import CkptStoreError, KeyMismatchError, StateDictKeysError, VersionExistsError
from ..manifest import layout
from ..manifest.commit import commit_manifest
from ..manifest.schema import Manifest, ObjectEntry, utcnow
from ..tiers import LocalTier, make_remote
from ._types import ItemLocation, LocalPlanData, ObjectReport, PlanData, ReplicaDigest
from .staging import Stager

DEFAULT_FRAME_SIZE = 2 << 20  # bytes; a multiple of every element size (≤ 16). 2 MiB: AES-GCM and
# zstd run fastest on buffers that stay below the allocator's mmap threshold; 48 B of header per frame.
_SENTINEL = "\x00ckptstore/"
_FLOAT_WIDTH = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4, torch.float64: 8}


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` in C order as a flat memoryview (copies only if non-contiguous/non-CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous() or t.storage_offset() < 0:
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


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
        step: training step recorded in the manifest (for ``list`` and retention).
        user_metadata: free-form JSON-serialisable dict recorded in the manifest.
        threads: encoder threads per rank (default ``CKPTSTORE_THREADS``, else cores / ``LOCAL_WORLD_SIZE`` + 1, 2..8).
        frame_size: raw bytes per frame (default 2 MiB); big tensors are split into frames.
        compression: ``"auto"`` (zstd / byte-grouped floats, kept only when ≥ 3 % smaller) or ``"none"``.
        level: zstd level (default 1, fastest).
        durability: ``"local"`` (the save completes at the local commit; upload continues) or
            ``"remote"`` (the save completes at the remote commit). Only with ``remote``.
        endpoint_url: S3 endpoint, overriding the boto3 chain.
        upload_timeout: seconds ``close()``/exit and the remote commit wait for uploads (default 1 h).
        retention: a :class:`ckptstore.retention.RetentionPolicy` applied by the coordinator right
            after each commit, per tier (opt-in; default None keeps everything). It considers only
            versions committed at or before the one just committed, never deletes that one, and
            locally never deletes a version not yet committed in the remote tier.
        allow_divergent_replicas: when two ranks hold different values under one non-sharded key,
            save rank 0's copy (DCP's behaviour) instead of raising :class:`StateDictKeysError`.

    Raises (through DCP's ``CheckpointException``): :class:`VersionExistsError`,
    :class:`InvalidNameError`, :class:`StorageFullError`, :class:`StorageError`,
    :class:`KeyMismatchError`, :class:`StateDictKeysError`.
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
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if compression not in ("auto", "none"):
            raise ValueError("compression must be 'auto' or 'none'")
        if durability not in ("local", "remote"):
            raise ValueError("durability must be 'local' or 'remote'")
        if frame_size < 4096 or frame_size % 16:
            raise ValueError("frame_size must be a multiple of 16 bytes and at least 4096")
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
        self.options = kwargs
        self.version = check_version(version) if version is not None else None
        self._tier = LocalTier(self.root)
        self._remote = make_remote(remote, endpoint_url=endpoint_url) if remote else None
        self._stager = Stager()
        self._uploader = None
        self._caught_up = False
        self._reset_state()

    # -- pickling (AsyncCheckpointerType.PROCESS): configuration only, no pools or clients ------
    def __getstate__(self):
        s = self.__dict__.copy()
        s["_uploader"] = None
        s["_pool"] = None
        return s

    def __setstate__(self, s):
        self.__dict__.update(s)

    def _reset_state(self) -> None:
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = True
        self.use_collectives = True
        self.world_size = 1
        self._local_items: list = []
        self.attempt: str | None = None
        self._wrapped: tuple = (None, None)
        self.last_manifest: Manifest | None = None

    # -- DCP contract --------------------------------------------------------------------------
    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True for strings that are valid version names; never raises."""
        try:
            check_version(checkpoint_id if isinstance(checkpoint_id, str) else None)
            return True
        except Exception:
            return False

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._reset_state()
        if checkpoint_id is not None:
            self.version = check_version(os.fspath(checkpoint_id) if isinstance(checkpoint_id, os.PathLike) else checkpoint_id)

    @property
    def checkpoint_id(self) -> str | None:
        return self.version

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.version, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.use_collectives = kwargs.get("use_collectives", True)
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = int(rank)
        if self.version is None:
            raise CkptStoreError(
                "no version name: pass checkpoint_id= to dcp.save/async_save or version= to StorageWriter"
            )
        if not self.use_collectives and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise CkptStoreError(
                "ckptstore commits one manifest per version and needs rank coordination; "
                "call dcp.save/async_save with use_collectives=True (the default)"
            )
        if not self.overwrite and self._tier.exists(layout.manifest_key(self.version)):
            raise VersionExistsError(
                f"version {self.version!r} already exists in {self.root}; choose a new checkpoint_id "
                "or pass overwrite=True to replace it"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._local_items = [i for i in plan.items if i.type in (WriteItemType.TENSOR, WriteItemType.BYTE_IO)]
        return dataclasses.replace(plan, storage_data=LocalPlanData(rank=self.rank))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        attempt = layout.new_attempt()
        wrapped = kid = None
        if self._master is not None:
            wrapped = wrap_key(self._master, new_data_key(), self.version, attempt)
            kid = key_id(self._master)
        out = []
        for i, p in enumerate(plans):
            sd = p.storage_data
            rank = sd.rank if isinstance(sd, LocalPlanData) else i
            out.append(dataclasses.replace(p, storage_data=PlanData(rank, attempt, wrapped, kid)))
        self.attempt = attempt
        self._wrapped = (wrapped, kid)
        return out

    def _codec(self, pd: PlanData) -> FrameCodec:
        cipher = None
        if pd.wrapped_key is not None:
            if self._master is None:
                raise KeyMismatchError(f"rank {self.rank} has no master key but the coordinator encrypts; give every rank the same key")
            cipher = FrameCipher(unwrap_key(self._master, pd.wrapped_key, self.version, pd.attempt, pd.key_id))
        return FrameCodec(self.version, pd.attempt, cipher, compress=self.compression, level=self.level)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            results = self._write_data(plan, planner)
        finally:
            self._stager.release()
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _write_data(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        pd: PlanData = plan.storage_data
        self.attempt = pd.attempt
        codec = self._codec(pd)
        results: list[WriteResult] = []
        if plan.items:
            results.extend(self._write_object(plan, planner, pd, codec))
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if not self.allow_divergent_replicas and world > 1:  # one rank cannot diverge from itself
            for item in self._local_items:
                data = planner.resolve_data(item)
                mv = data.getbuffer() if isinstance(data, io.BytesIO) else tensor_bytes(data)
                rd = ReplicaDigest(item.index.fqn, pd.rank, xxh3(mv))
                results.append(WriteResult(MetadataIndex(_SENTINEL + "replica/" + item.index.fqn), 0, rd))
        return results

    def _write_object(self, plan, planner, pd: PlanData, codec: FrameCodec) -> list[WriteResult]:
        name = layout.shard_name(pd.attempt, pd.rank)
        key = layout.object_key(self.version, name)
        fs = self.frame_size
        window = max(2, 2 * self.threads)
        pool = cf.ThreadPoolExecutor(self.threads, thread_name_prefix="ckptstore-enc")
        w = self._tier.open_writer(key)
        offset = 0
        digest = xxh3_stream()
        codecs: set[str] = set()
        nframes = 0
        total_raw = 0
        per_item: list[tuple[Any, list, int, str | None, tuple | None]] = []
        try:
            pending: collections.deque = collections.deque()

            def drain(limit: int) -> None:
                nonlocal offset, nframes
                while len(pending) > limit:
                    refs, idx, fut = pending.popleft()
                    head, payload, h = fut.result()
                    _faults.point("write.frame")
                    w.write(head)
                    w.write(payload)
                    digest.update(head)
                    length = len(head) + len(payload)
                    raw_len = fut.raw_len
                    refs.append(FrameRef(offset, length, raw_len, h, idx))
                    codecs.add(_chain_of(head))
                    offset += length
                    nframes += 1

            frame_index = 0
            for item in plan.items:
                data = planner.resolve_data(item)
                if isinstance(data, io.BytesIO):
                    mv = data.getbuffer()
                    dtype = shape = None
                    width = 0
                else:
                    dtype, shape = _dtype_name(data.dtype), tuple(data.shape)
                    width = _FLOAT_WIDTH.get(data.dtype, 0)
                    mv = tensor_bytes(data)
                n = len(mv)
                total_raw += n
                refs: list = []
                per_item.append((item, refs, n, dtype, shape))
                for start in range(0, max(n, 1), fs) if n else [0]:
                    chunk = mv[start : start + fs]
                    fut = pool.submit(codec.encode, name, frame_index, chunk, width)
                    fut.raw_len = len(chunk)
                    pending.append((refs, frame_index, fut))
                    frame_index += 1
                    drain(window)
            drain(0)
            _faults.point("write.commit")
            w.commit()
        except BaseException:
            w.abort()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        results = [
            WriteResult(item.index, n, ItemLocation(name, tuple(refs), n, dtype, shape)) for item, refs, n, dtype, shape in per_item
        ]
        rep = ObjectReport(name, offset, f"{digest.intdigest():016x}", nframes, pd.rank, total_raw, tuple(sorted(codecs)))
        results.append(WriteResult(MetadataIndex(_SENTINEL + f"object/{pd.rank}"), total_raw, rep))
        if self._remote is not None:
            self._upload_rank_object(rep)
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        reports: list[ObjectReport] = []
        replicas: dict[str, dict[int, int]] = {}
        storage_md: dict = {}
        for per_rank in results:
            for wr in per_rank:
                sd = wr.storage_data
                if isinstance(sd, ObjectReport):
                    reports.append(sd)
                elif isinstance(sd, ReplicaDigest):
                    replicas.setdefault(sd.fqn, {})[sd.rank] = sd.digest
                else:
                    storage_md[wr.index] = sd
        for fqn, by_rank in replicas.items():
            if len(set(by_rank.values())) > 1:
                raise StateDictKeysError(
                    f"state dict key {fqn!r} holds different values on ranks {sorted(by_rank)} "
                    "(a plain tensor or object, not a DTensor, is saved once for all ranks, so the other "
                    f"ranks' values would be lost). Save per-rank state under per-rank keys, e.g. "
                    f"f'{fqn}.rank{{rank}}', or pass allow_divergent_replicas=True to keep only one copy"
                )
        metadata.storage_data = storage_md
        attempt = self.attempt
        if attempt is None:  # a rank-less save (empty plans everywhere)
            raise CkptStoreError("finish() called before write_data(); this is a DCP protocol error")
        pd_wrapped, pd_kid = self._plan_key
        data_key = None
        cipher = None
        if pd_wrapped is not None:
            data_key = unwrap_key(self._master, pd_wrapped, self.version, attempt, pd_kid)
            cipher = FrameCipher(data_key)
        codec = FrameCodec(self.version, attempt, cipher, compress=self.compression, level=self.level)
        meta_name = layout.metadata_name(attempt)
        blob = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        meta_entry = self._write_small_object(codec, meta_name, blob)
        reports.sort(key=lambda r: r.rank)
        objects = [ObjectEntry(r.name, r.size, r.digest, r.frames, r.rank, r.nbytes) for r in reports]
        codecs = sorted({c for r in reports for c in r.codecs} | set(meta_entry[1]))
        m = Manifest(
            version=self.version,
            attempt=attempt,
            created=utcnow(),
            world_size=len(results),
            objects=objects,
            metadata_object=meta_entry[0],
            nbytes=sum(r.nbytes for r in reports),
            stored_bytes=sum(o.size for o in objects) + meta_entry[0].size,
            step=self.step,
            user=self.user_metadata,
            encryption=None if pd_wrapped is None else {"alg": "AES-256-GCM", "key_id": pd_kid, "wrapped_key": pd_wrapped},
            codecs=[c for c in codecs if c],
            writer=f"ckptstore {_version()} torch {torch.__version__}",
        )
        body = m.to_bytes(data_key)
        commit_manifest(
            self._tier, self.version, body, overwrite=self.overwrite, fault="commit.manifest",
            hint="another save committed it first; its data is intact. Choose a new checkpoint_id or pass overwrite=True",
        )
        _faults.point("commit.after_manifest")
        self.last_manifest = m
        if self._remote is not None:
            self._commit_remote(m, body)
        self._after_commit(m)

    @property
    def _plan_key(self) -> tuple[str | None, str | None]:
        return getattr(self, "_wrapped", (None, None))

    def _write_small_object(self, codec: FrameCodec, name: str, blob: bytes) -> tuple[ObjectEntry, tuple]:
        key = layout.object_key(self.version, name)
        w = self._tier.open_writer(key)
        digest = xxh3_stream()
        off = 0
        codecs = set()
        n = 0
        try:
            mv = memoryview(blob)
            for i, start in enumerate(range(0, max(len(mv), 1), self.frame_size)):
                head, payload, _h = codec.encode(name, i, mv[start : start + self.frame_size], 0)
                _faults.point("write.metadata")
                w.write(head)
                w.write(payload)
                digest.update(head)
                off += len(head) + len(payload)
                codecs.add(_chain_of(head))
                n += 1
            w.commit()
        except BaseException:
            w.abort()
            raise
        return ObjectEntry(name, off, f"{digest.intdigest():016x}", n, None, len(blob)), tuple(codecs)

    # -- remote tier ---------------------------------------------------------------------------
    @property
    def uploader(self):
        if self._uploader is None and self._remote is not None:
            from .upload import Uploader

            self._uploader = Uploader(
                self._tier, self._remote, threads=max(2, self.threads), timeout=self.upload_timeout, retention=self.retention
            )
        return self._uploader

    def _upload_rank_object(self, rep: ObjectReport) -> None:
        entry = ObjectEntry(rep.name, rep.size, rep.digest, rep.frames, rep.rank, rep.nbytes)
        fut = self.uploader.upload_object(self.version, entry, rep.rank)
        if self.durability == "remote":
            fut.result()

    def _commit_remote(self, m: Manifest, body: bytes) -> None:
        if not self._caught_up:  # once per writer: finish remote commits a crash cut off
            self._caught_up = True
            self.uploader.catch_up(exclude=m.version)
        fut = self.uploader.commit(m, body, self.overwrite)
        if self.durability == "remote":
            fut.result()

    def wait_uploads(self, timeout: float | None = None) -> None:
        """Block until this writer's pending uploads and remote commits finish.

        Raises :class:`ckptstore.dcp.upload.UploadError` (a :class:`StorageError`) listing what
        did not complete within ``timeout`` seconds or failed.
        """
        from .upload import check_uploads

        check_uploads(self._uploader, timeout)

    def _after_commit(self, m: Manifest) -> None:
        if self.retention is None:
            return
        from ..manifest import catalogue
        from ..retention import apply_after_commit

        protect = {}
        others = []
        if self._remote is not None:
            others = [self._remote]
            try:
                remote_versions = set(catalogue.scan(self._remote))
            except CkptStoreError:
                remote_versions = None
            for v in catalogue.scan(self._tier):
                if remote_versions is None or v not in remote_versions:
                    protect[v] = "not yet committed in the remote tier"
        apply_after_commit(self._tier, self.retention, m, tier_name="local", other_tiers=others, protect=protect)

    # -- AsyncStager protocol (dcp.async_save uses the writer as its stager) --------------------
    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into reusable host buffers (what ``async_save`` blocks on)."""
        return self._stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        pass

    def close(self, timeout: float | None = None) -> None:
        """Wait for pending uploads (bounded by ``timeout`` or ``upload_timeout`` seconds) and
        release resources; raises ``UploadError`` naming what was not uploaded."""
        if self._uploader is not None:
            try:
                self.wait_uploads(self.upload_timeout if timeout is None else timeout)
            finally:
                self._uploader.shutdown()
                self._uploader = None
                self._remote.close()  # its pool and client (re-created on the next use)


def _chain_of(head: bytes) -> str:
    n = int.from_bytes(head[6:8], "little")
    return head[FIXED_LEN : FIXED_LEN + n].decode("ascii")




def _version() -> str:
    from .. import __version__

    return __version__
