"""``ckptstore.StorageReader``: a DCP StorageReader that verifies every byte it returns.

Call sequence (as DCP drives it; see ``torch.distributed.checkpoint.storage.StorageReader``):

0. (all ranks) ``reset(checkpoint_id)`` when a ``checkpoint_id`` is passed.
1. (all ranks) ``read_metadata()`` — resolves the version (``checkpoint_id``, else ``version=``,
   else the newest committed one), picks the tier (local when committed there, else remote),
   verifies the manifest (format, XXH3 seal, and with a key its HMAC), then reads the DCP metadata
   object, verifies every frame (checksum, AEAD tag) and only then unpickles it with an allow-list
   unpickler. Sets ``storage_meta.load_id``.
2. (all ranks) ``set_up_storage_reader(metadata, is_coordinator, rank=, use_collectives=)``.
3. (all ranks) ``prepare_local_plan`` — unchanged.
4. (coordinator) ``prepare_global_plan`` — refuses (``StateDictKeysError``) when the checkpoint
   holds keys no rank asked for, unless ``allow_partial_load=True``: nothing is dropped silently.
5. (all ranks) ``read_data`` — fetches only the frames each read item overlaps (ranged, coalesced,
   in parallel), verifies each against the index and its checksum/tag, decodes, narrows by
   ``storage_offsets``/``lengths`` and copies into the destination; bytes items go through
   ``planner.load_bytes`` from position 0.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import io
import logging
import os
import pickle
import threading
import uuid
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader as _DCPStorageReader
from torch.futures import Future

from .._names import check_object_name, check_version
from ..codec import FrameCodec, FrameRef
from ..codec.crypto import FrameCipher, resolve_key, unwrap_key
from ..codec.frame import FrameWalk
from ..codec.stages import env_threads
from ..errors import (
    CkptStoreError,
    DtypeMismatchError,
    IntegrityError,
    KeyMismatchError,
    ObjectNotFoundError,
    StateDictKeysError,
    TransientStorageError,
    VersionNotFoundError,
)
from ..manifest import layout, placement
from ..manifest.schema import Manifest, ObjectEntry
from ..manifest.schema import parse as parse_manifest
from ..store import Store
from ._checks import install_log_filter, quiet_single_process, reject_unknown_kwargs
from . import _job, _subclass
from ._types import ItemLocation, PeerPlan

log = logging.getLogger("ckptstore")
install_log_filter()

_BATCH_BYTES = 32 << 20  # decoded bytes fetched per pipeline stage
_GROUP_BYTES = 8 << 20  # stored bytes per fetch task (ranged reads are coalesced within it)


class StorageReader(_DCPStorageReader):
    """Read DCP checkpoints from a ckptstore.

    Args:
        root: local directory of the store (may be empty or absent when reading from S3 only).
        remote: ``"s3://bucket/prefix"`` or None.
        key: master key (32 bytes or key provider); default ``CKPTSTORE_KEY``/``CKPTSTORE_KEY_FILE``.
        version: version to load when no ``checkpoint_id`` is given; default the newest committed.
        allow_cast: load into destination tensors of another dtype (default: raise
            :class:`DtypeMismatchError`), and into tensor subclasses without memory of their own
            (quantized / Float8 weights) whose ``copy_`` re-encodes the stored values (default: raise
            :class:`UnsupportedStateError`; the values must read back bit for bit).
        allow_partial_load: allow the checkpoint to hold keys the destination state dict lacks
            (True), or only keys starting with one of the given prefixes (a tuple of strings: e.g.
            ``("rng/rank",)`` for per-rank values of the saving ranks in a resharded load).
        allow_unencrypted: accept an unencrypted version although a key is configured.
        threads: decode threads (default ``CKPTSTORE_THREADS``, else cores / ``LOCAL_WORLD_SIZE`` + 1, 2..8).
        read_repair: when an object fails verification in the tier read first (local) and the
            verified copy of another tier (S3) is used instead, also rewrite the local copy from
            those verified bytes (temp file + atomic replace). Off by default.
        avoid: ``{(global rank, object name)}``: copies not to read — that rank's root is treated as
            not holding that object, so the load reads it from another root or the remote tier
            (``CheckpointManager.restore`` passes the copies an earlier try found unverifiable).
        process_group: the process group of the load (pass the one given to ``dcp.load``; default
            the default group). In a job of more than one rank the reader exchanges, over this group,
            what each rank's root holds (docs/FORMAT.md, "Placement"): without a version it loads the
            newest version every rank can load; each rank reads its own root first, then another
            rank's root through ``torch.distributed`` (a gloo-capable group), then the remote tier.

    Roots may be node-local: every node passes the same path, each is a different disk. A root
    that holds objects of the loaded version but lacks its manifest (a crash right after the commit)
    gets the manifest from another rank's root during the load.

    Every read served by another tier than the one chosen is logged as a warning (logger
    ``ckptstore``) naming the object and both tiers, and counted in :attr:`stats`
    (``fallback_reads``, ``repaired``), which add up over the loads of this reader, as do
    ``remote_reads`` (GET requests to the remote tier, manifests included) and ``peer_bytes`` (bytes
    received from other ranks' roots).

    Raises (through DCP's ``CheckpointException``): :class:`VersionNotFoundError`,
    :class:`IntegrityError` / :class:`ManifestError`, :class:`KeyMismatchError`,
    :class:`DtypeMismatchError`, :class:`StateDictKeysError`, :class:`DamagedVersionError`,
    :class:`UnsupportedStateError` (a tensor subclass that cannot take the stored values, raised before
    anything is written into any destination when its ``copy_`` cannot take a plain tensor at all).
    """

    def __init__(
        self,
        root: str | os.PathLike | None,
        *,
        remote: str | None = None,
        key: Any = None,
        version: str | None = None,
        allow_cast: bool = False,
        allow_partial_load: bool | tuple = False,
        allow_unencrypted: bool = False,
        threads: int | None = None,
        endpoint_url: str | None = None,
        read_repair: bool = False,
        process_group: Any = None,
        avoid: Any = frozenset(),
        record_digests: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        reject_unknown_kwargs(type(self), kwargs)
        quiet_single_process()
        self.read_repair = read_repair
        self.avoid = frozenset(avoid)
        #: with ``record_digests``: ``{(fqn, offset): (XXH3-128, ItemLocation)}`` of the items loaded whole
        self.record_digests = record_digests
        self.item_digests: dict = {}
        self.stats: dict[str, int] = {"fallback_reads": 0, "repaired": 0, "remote_reads": 0, "peer_bytes": 0}
        self._pg = process_group
        #: keys this reader GET from the remote tier (all its loads)
        self.remote_keys: set[str] = set()
        self.root = None if root is None else os.path.abspath(os.fspath(root))
        self.remote_url = remote
        self.endpoint_url = endpoint_url
        self._master = resolve_key(key)
        self.version = check_version(version) if version is not None else None
        self.allow_cast = allow_cast
        self.allow_partial_load = allow_partial_load
        self.allow_unencrypted = allow_unencrypted
        self.threads = threads or env_threads()
        self._store = Store(self.root, remote=remote, endpoint_url=endpoint_url)
        if self._store.remote is not None:
            self._store.remote = _Counted(self._store.remote, self.stats, self.remote_keys)
        self._reset_state()

    def __getstate__(self):
        s = self.__dict__.copy()
        s["_pool"] = None
        s.pop("_alt_lock", None)
        s["_pg"] = None
        return s

    def __setstate__(self, s):
        self.__dict__.update(s)
        self._alt_lock = threading.Lock()

    def _reset_state(self) -> None:
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict = {}
        self.manifest: Manifest | None = None
        self.tier = None
        self.codec: FrameCodec | None = None
        self._objects: dict[str, ObjectEntry] = {}
        self._metadata: Metadata | None = None
        self._deferred: Exception | None = None
        self._alt_lock = threading.Lock()
        self._repaired: set[str] = set()
        self.rank = 0
        self.is_coordinator = True
        self._joined: tuple | None = None  # (view, group rank, manifest file, metadata bytes) or (exception,)
        self._peer: dict = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            # a path-like (``pathlib.Path("step-1")``) as ``reset`` takes it; frameworks that auto-detect
            # the storage class ask this first
            check_version(os.fspath(checkpoint_id) if isinstance(checkpoint_id, (str, os.PathLike)) else None)
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

    # -- metadata --------------------------------------------------------------------------
    def _join(self) -> tuple:
        """The load's decisions (:func:`ckptstore.choice.decide` over every rank's report, ``_job``):
        in a job made once per load by every rank together — before anything that can fail on one
        rank only, and never again for DCP's retry of ``read_metadata``; outside a job from this
        process's own report. Returns ``(view, group rank, manifest file, metadata bytes or None)``."""
        if self._joined is None:
            try:
                view, me = _job.exchange(self._store.local, self._store.remote, self._pg, self.version, bad=self.avoid)
                body, meta = _job.fetch_manifest(view, me, self._store.local, self._store.remote, self._pg)
                self._joined = (view, me, body, meta)
            except Exception as e:  # noqa: BLE001 - raised again, the same on every call
                self._joined = (e,)
        if len(self._joined) == 1:
            raise self._joined[0]
        return self._joined

    @property
    def view(self):
        """The :class:`ckptstore.choice.View` of the last load (None before ``read_metadata``)."""
        j = self._joined
        return j[0] if j is not None and len(j) > 1 else None

    def _tier_for(self, obj: str):
        """The tier this rank reads ``obj`` from first: its root, else another rank's root (bytes
        received in ``read_data``), else the remote tier (``choice.View.source``)."""
        view, me = self._joined[0], self._joined[1]
        src = view.source(me, obj)
        if src == "local":
            return self._store.local
        if src == "remote" or (view.remote_ok and obj == self.manifest.metadata_object.name):
            return self._store.remote  # the metadata object is read whole: never from a peer's bytes
        return _PeerTier(self.version, self._peer, view.global_rank(src), view.reports[src].get("root"))

    def _open_parsed(self, parsed, tier) -> None:
        """Verify ``parsed`` (the HMAC with a key) and set up the frame codec for its version."""
        version = parsed.manifest.version
        m = parsed.manifest
        cipher = None
        if m.encrypted:
            if self._master is None:
                raise KeyMismatchError(
                    f"version {version!r} is encrypted (key id {m.encryption['key_id']}) but no key was given; "
                    "pass key=, or set CKPTSTORE_KEY or CKPTSTORE_KEY_FILE"
                )
            data_key = unwrap_key(self._master, m.encryption["wrapped_key"], version, m.attempt, m.encryption["key_id"])
            parsed.verify_mac(data_key)
            cipher = FrameCipher(data_key)
        elif self._master is not None and not self.allow_unencrypted:
            raise KeyMismatchError(
                f"version {version!r} is not encrypted, but a key was given; a store that should be encrypted "
                "may have been tampered with. Pass allow_unencrypted=True (or drop the key) to load it"
            )
        self.manifest = m
        self.tier = tier
        self.codec = FrameCodec(version, m.attempt, cipher)
        self._objects = {o.name: o for o in m.all_objects()}
        # objects of earlier versions whose frames items reference (docs/FORMAT.md, "References")
        self._refs = m.ref_by_name()
        self._objects.update({r.name: r.entry for r in m.refs})
        self._codecs = {m.attempt: self.codec}

    def _key(self, obj: str) -> str:
        """The key of object ``obj``: in this version's directory, or in its origin version's for a
        referenced object."""
        ref = self._refs.get(obj)
        return layout.object_key(self.version if ref is None else ref.version, obj)

    def _codec_of(self, obj: str) -> FrameCodec:
        """The frame codec of ``obj``'s attempt: a referenced object's frames are bound to (and, with a
        key, encrypted under the data key of) the version and attempt that wrote them."""
        ref = self._refs.get(obj)
        if ref is None:
            return self.codec
        with self._alt_lock:
            codec = self._codecs.get(ref.attempt)
            if codec is None:
                if self.manifest.encrypted != (ref.wrapped_key is not None):
                    raise IntegrityError(f"version {self.version!r} references {obj!r} of {ref.version!r} with "
                                         "another encryption than its own", object=obj, version=self.version)
                cipher = None
                if ref.wrapped_key is not None:
                    cipher = FrameCipher(unwrap_key(self._master, ref.wrapped_key, ref.version, ref.attempt, ref.key_id))
                codec = self._codecs[ref.attempt] = FrameCodec(ref.version, ref.attempt, cipher)
            return codec

    def _alt_tiers(self, obj: str) -> list:
        """Other places holding ``obj`` of the chosen attempt, tried when the first fails: this rank's
        root (when it holds an unmarked copy) and the remote tier (when its committed copy is this
        attempt) — known from the view, so a healthy load reads no other manifest."""
        view, me = self._joined[0], self._joined[1]
        out = []
        if self._store.local is not None and obj in view.present(me):
            out.append(self._store.local)
        if view.remote_ok and self._store.remote is not None:
            out.append(self._store.remote)
        return out

    def _place(self, tier) -> str:
        name = self._tier_name(tier)
        return f"the {name} tier ({tier.url})" if name in ("local", "remote") else getattr(tier, "url", name)

    def _with_fallback(self, obj: str, read):
        """``read(tier)`` on the chosen tier, then on the other places holding the same attempt.

        A read served by another tier is never silent: warned, counted, optionally repaired. When no
        place serves a verified copy, :class:`IntegrityError` names the version, the object and every
        place tried (``.version``/``.object`` set, so a manager can skip the version).
        """
        first_tier = self._tier_for(obj)
        tried = []
        places = []
        try:
            return read(first_tier)
        except (IntegrityError, ObjectNotFoundError) as e:
            last: Exception = e
            tried.append(f"{self._place(first_tier)}: {e}")
            places.append(self._place_id(first_tier))
        first = last
        for tier in self._alt_tiers(obj):
            if tier is first_tier:
                continue
            try:
                out = read(tier)
            except (IntegrityError, ObjectNotFoundError) as e:
                last = e
                tried.append(f"{self._place(tier)}: {e}")
                places.append(self._place_id(tier))
                continue
            self._fell_back(obj, tier, first, first_tier)
            return out
        what = "is missing from" if isinstance(last, ObjectNotFoundError) else "fails verification in"
        err = IntegrityError(
            f"version {self.version!r}: object {obj!r} {what} every place that holds it ({'; '.join(tried)}). "
            "Load another version (CheckpointManager.resume() falls back to the next older loadable one), "
            "or restore the object ('ckptstore scrub --repair' with a tier that holds a verified copy)",
            object=obj, version=self.version)
        #: ``[("root", global rank) | ("remote", None)]``: the copies that failed (a manager retries
        #: the load without them before it passes over the version)
        err.places = places
        raise err

    def _place_id(self, tier) -> tuple:
        if isinstance(tier, _PeerTier):
            return ("root", tier.rank)
        if tier is self._store.remote:
            return ("remote", None)
        return ("root", self._joined[0].global_rank(self._joined[1]))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Verify and return the DCP metadata of the version (see the module docstring).

        torch ≤ 2.13's loader turns any exception from ``read_metadata()`` into a bare
        ``AssertionError`` and then retries with ``rank=``. So that callers see the typed error, the
        retry returns an empty placeholder and ``set_up_storage_reader`` raises the original error.
        """
        try:
            return self._read_metadata()
        except CkptStoreError as e:
            if kwargs.get("rank") is None:
                raise
            self._deferred = e
            md = Metadata(state_dict_metadata={}, storage_data={})
            md.storage_meta = StorageMeta(load_id=self.load_id)
            return md

    def _tier_name(self, tier) -> str:
        for name, t in self._store.tiers.items():
            if t is tier:
                return name
        return type(tier).__name__

    def _fell_back(self, obj: str, tier, cause: Exception, failed) -> None:
        with self._alt_lock:
            self.stats["fallback_reads"] += 1
        log.warning(
            "ckptstore: object %r of version %r failed in %s (%s); read it from %s instead%s",
            obj, self.version, self._place(failed), cause, self._place(tier),
            "" if self.read_repair else " (pass read_repair=True to StorageReader to rewrite the local copy, "
            "or run 'ckptstore scrub --repair')",
        )
        if self.read_repair and failed is self._store.local:
            self._repair(obj, tier)

    def _repair(self, obj: str, good_tier) -> None:
        """Rewrite ``obj`` in this rank's root from ``good_tier``'s copy, verified in full first."""
        from ..tiers import LocalTier

        local = self._store.local
        if not isinstance(local, LocalTier):
            return
        with self._alt_lock:
            if obj in self._repaired:  # once per object and load, whichever thread fails first
                return
            self._repaired.add(obj)
        entry = self._objects.get(obj)
        if entry is None:
            return
        key = self._key(obj)
        try:
            data = good_tier.get(key)
            self._decode_whole(entry, data)  # every frame, the header digest and the size
            local.put(key, data)  # temp file, fsync, atomic replace
        except CkptStoreError as e:
            log.warning("ckptstore: read-repair of %r in version %r failed: %s", obj, self.version, e)
            return
        with self._alt_lock:
            self.stats["repaired"] += 1
        log.warning("ckptstore: repaired %r of version %r in %s from %s",
                    obj, self.version, self._place(local), self._place(good_tier))

    def _read_metadata(self) -> Metadata:
        if self._metadata is not None:
            return self._metadata
        view, me, body, meta = self._join()
        self.version = view.version
        tier = self._store.local if view.has_manifest(me) or not view.remote_ok else self._store.remote
        parsed = parse_manifest(body, expect_version=view.version)
        if parsed.manifest.attempt != view.attempt:  # re-committed between the listing and this read
            raise TransientStorageError(f"version {view.version!r} was committed again while this load started "
                                        f"(attempt {parsed.manifest.attempt}, chose {view.attempt}); load again")
        self._open_parsed(parsed, tier)
        entry = self.manifest.metadata_object
        blob = self._decode_whole(entry, meta) if meta is not None else self._read_whole_object(entry)
        md = _restricted_loads(blob, entry.name)
        if not isinstance(md, Metadata):
            raise IntegrityError(f"{entry.name} does not hold DCP Metadata", object=entry.name, version=self.version)
        self._validate_storage_data(md)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        self._metadata = md
        return md

    def _read_whole_object(self, entry: ObjectEntry) -> bytes:
        key = self._key(entry.name)
        return self._with_fallback(entry.name, lambda tier: self._decode_whole(entry, tier.get(key)))

    def _decode_whole(self, entry: ObjectEntry, data: bytes) -> bytes:
        if len(data) != entry.size:
            raise IntegrityError(f"{entry.name}: size {len(data)} != {entry.size} in the manifest", object=entry.name)
        mv = memoryview(data)
        walk = FrameWalk(lambda off, n: mv[off : off + n], len(data), entry.name)
        out = [self.codec.decode(entry.name, mv[off : off + length], None) for off, _hd, length in walk]
        if walk.mismatch(entry.frames, entry.digest) is not None:
            raise IntegrityError(f"{entry.name}: frames do not match the manifest (count or header digest)", object=entry.name)
        blob = b"".join(out)
        if len(blob) != entry.nbytes:
            raise IntegrityError(f"{entry.name}: decoded size mismatch", object=entry.name)
        return blob

    def _validate_storage_data(self, md: Metadata) -> None:
        sd = md.storage_data
        if not isinstance(sd, dict):
            raise IntegrityError("DCP metadata has no ckptstore storage_data")
        for idx, loc in sd.items():
            if not isinstance(loc, ItemLocation):
                raise IntegrityError(f"storage_data[{idx}] is not an ItemLocation")
            fqn = getattr(idx, "fqn", idx)
            try:
                check_object_name(loc.object)
            except CkptStoreError as e:
                raise IntegrityError(f"item {fqn!r}: {e}") from None
            if not isinstance(loc.frames, tuple) or not isinstance(loc.nbytes, int) or loc.nbytes < 0:
                raise IntegrityError(f"item {fqn!r} has a malformed frame list")
            if loc.dtype is not None:
                if not isinstance(loc.dtype, str) or not isinstance(getattr(torch, loc.dtype, None), torch.dtype):
                    raise IntegrityError(f"item {fqn!r} has unknown dtype {loc.dtype!r}")
                shape = loc.shape
                if not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
                    raise IntegrityError(f"item {fqn!r} has a malformed shape {shape!r}")
                numel = 1
                for n in shape:
                    numel *= n
                if numel * getattr(torch, loc.dtype).itemsize != loc.nbytes:
                    raise IntegrityError(f"item {fqn!r}: shape {shape} of {loc.dtype} does not hold {loc.nbytes} bytes")
            elif loc.shape is not None:
                raise IntegrityError(f"item {fqn!r}: a bytes item has a shape")
            ent = self._objects.get(loc.object)
            if ent is None:
                raise IntegrityError(f"item {idx.fqn!r} names object {loc.object!r}, which the manifest does not list")
            total = 0
            for f in loc.frames:
                if not isinstance(f, FrameRef) or f.offset < 0 or f.length <= 0 or f.offset + f.length > ent.size:
                    raise IntegrityError(f"item {idx.fqn!r} has a frame outside {loc.object!r}", object=loc.object)
                total += f.raw_len
            if total != loc.nbytes:
                raise IntegrityError(f"item {idx.fqn!r}: frames hold {total} bytes, index says {loc.nbytes}")

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._deferred is not None:
            raise self._deferred
        self.storage_data = metadata.storage_data
        self._metadata = metadata
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", 0) or 0
        if self.codec is None:  # metadata handed in from elsewhere: open our version now
            self._read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        plans = self._check_unread(plans)
        if self._joined is None or len(self._joined) == 1:
            return plans

        def needed(ri):
            loc = self.storage_data[ri.storage_index]
            return loc.object, self._needed(ri, loc)[0]

        pp = _job.peer_plans(self._joined[0], plans, needed)
        return [dataclasses.replace(p, storage_data=PeerPlan(snd, rcv)) if (snd or rcv) else p for p, (snd, rcv) in zip(plans, pp)]

    def _check_unread(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if self.allow_partial_load is True or self._metadata is None:
            return plans
        requested = {ri.storage_index.fqn for p in plans for ri in p.items}
        stored = set()
        for fqn, md in self._metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata) or all(s > 0 for s in md.size):
                stored.add(fqn)
        unread = sorted(stored - requested)
        if isinstance(self.allow_partial_load, (tuple, list, set, frozenset)):
            unread = [k for k in unread if not k.startswith(tuple(self.allow_partial_load))]
        if unread:
            shown = ", ".join(repr(k) for k in unread[:20]) + (" ..." if len(unread) > 20 else "")
            raise StateDictKeysError(
                f"version {self.version!r} holds {len(unread)} key(s) that no rank's state dict asks for: {shown}. "
                "They would be dropped silently (e.g. per-rank entries saved on more ranks than are loading). "
                "Load them explicitly, or pass allow_partial_load=True to StorageReader"
                + (_OPTIM_HINT if any(".state." in k for k in unread) else "")
            )
        return plans

    # -- data --------------------------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._fetch_from_peers(plan)
        pool = cf.ThreadPoolExecutor(self.threads, thread_name_prefix="ckptstore-dec")
        try:
            batches: list[list] = [[]]
            size = 0
            # every destination is resolved and checked before any byte is written into any of them
            for ri, loc, dest, asm in self._destinations(plan, planner):
                job = (ri, loc, self._needed(ri, loc), dest, asm)
                batches[-1].append(job)
                size += sum(f.raw_len for f in job[2][0])
                if size >= _BATCH_BYTES:
                    batches.append([])
                    size = 0
            # double-buffered: fetch+decode batch k+1 while batch k is copied into place
            pending = self._submit_batch(batches[0], pool)
            for k, batch in enumerate(batches):
                nxt = self._submit_batch(batches[k + 1], pool) if k + 1 < len(batches) else None
                decoded: dict = {}
                for t in pending:
                    decoded.update(t.result())
                for ri, loc, (frames, start, b0, b1), dest, asm in batch:
                    if ri.type == LoadItemType.BYTE_IO:
                        self._deliver(ri, loc, frames, start, b0, b1, decoded, planner, None)
                    elif asm is None:
                        if dest is None:  # a planner's own resolve_tensor may allocate: one at a time
                            dest = planner.resolve_tensor(ri).detach()
                        self._deliver(ri, loc, frames, start, b0, b1, decoded, planner, dest)
                        planner.commit_tensor(ri, dest)
                    else:
                        self._deliver(ri, loc, frames, start, b0, b1, decoded, planner, dest)
                        asm.left -= 1
                        if asm.left == 0:  # every part is in: into the subclass, read back and compared
                            asm.finish()
                            for pri, pt in asm.parts:
                                planner.commit_tensor(pri, pt)
                pending = nxt
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            self._store.close()  # tier pools and clients: no thread outlives the load
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _fetch_from_peers(self, plan: LoadPlan) -> None:
        """Serve and receive the byte ranges this load moves between ranks' roots (peer fetch)."""
        pp = plan.storage_data
        if isinstance(pp, PeerPlan) and (pp.send or pp.recv):
            got = _job.run_peer_exchange(pp.send, pp.recv, self._store.local, self._key, self._pg)
            self.stats["peer_bytes"] += sum(len(b) for b in got.values())
            self._peer.update(got)

    def _needed(self, ri, loc: ItemLocation):
        """Frames of ``loc`` that overlap the read item, and the byte offset of the first one."""
        if ri.type == LoadItemType.BYTE_IO or loc.shape is None:
            return list(loc.frames), 0, 0, loc.nbytes
        itemsize = getattr(torch, loc.dtype).itemsize
        shape = loc.shape
        if len(ri.storage_offsets) != len(shape) or len(ri.lengths) != len(shape) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(ri.storage_offsets, ri.lengths, shape)
        ):
            raise IntegrityError(
                f"{ri.dest_index.fqn!r}: the requested slice (offsets {tuple(ri.storage_offsets)}, lengths "
                f"{tuple(ri.lengths)}) is outside the stored chunk of shape {tuple(shape)}"
            )
        if any(n == 0 for n in ri.lengths) or loc.nbytes == 0:
            return [], 0, 0, 0
        strides = _contig_strides(shape)
        first = sum(o * s for o, s in zip(ri.storage_offsets, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(ri.storage_offsets, ri.lengths, strides))
        b0, b1 = first * itemsize, (last + 1) * itemsize
        sel = []
        pos = 0
        start = None
        for f in loc.frames:
            end = pos + f.raw_len
            if end > b0 and pos < b1:
                if start is None:
                    start = pos
                sel.append(f)
            pos = end
        return sel, start or 0, b0, b1

    def _submit_batch(self, batch, pool) -> list:
        by_obj: dict[str, set] = collections.defaultdict(set)
        for _ri, loc, (frames, *_rest), *_dest in batch:
            by_obj[loc.object].update(frames)
        tasks = []
        for obj, frames in by_obj.items():
            fl = sorted(frames, key=lambda f: f.offset)
            group: list = []
            gsize = 0
            for f in fl:
                group.append(f)
                gsize += f.length
                if gsize >= _GROUP_BYTES:
                    tasks.append(pool.submit(self._fetch_decode, obj, group))
                    group, gsize = [], 0
            if group:
                tasks.append(pool.submit(self._fetch_decode, obj, group))
        return tasks

    def _fetch_decode(self, obj: str, frames: list) -> dict:
        key = self._key(obj)
        codec = self._codec_of(obj)
        ranges = [(f.offset, f.offset + f.length) for f in frames]

        def read(tier):
            bufs = tier.get_ranges(key, ranges)
            return {(obj, f.offset): codec.decode(obj, b, f) for f, b in zip(frames, bufs)}

        return self._with_fallback(obj, read)

    def _destinations(self, plan: LoadPlan, planner: LoadPlanner):
        """``(read item, location, destination, assembly)`` for each item of ``plan``, every tensor
        destination resolved (once) and checked first: its dtype (``DtypeMismatchError``) and shape, and
        for a tensor subclass without memory of its own (a wrapper subclass: quantized / Float8 weights)
        an :class:`_subclass.Assembly` — its parts go into a plain buffer, then through its ``copy_``
        (``UnsupportedStateError`` here when that cannot work). Bytes items have no destination, nor do
        tensors of a planner whose ``resolve_tensor`` is its own (it may allocate a temporary per item
        and copy it back in ``commit_tensor``: resolved again when delivered, one at a time)."""
        out = []
        assemblies: dict = {}
        cls = type(planner)
        views = all(getattr(cls, m, None) is getattr(DefaultLoadPlanner, m) for m in ("resolve_tensor", "lookup_tensor", "transform_tensor"))
        for ri in plan.items:
            loc: ItemLocation = self.storage_data[ri.storage_index]
            if ri.type == LoadItemType.BYTE_IO:
                out.append((ri, loc, None, None))
                continue
            dtype = getattr(torch, loc.dtype)
            target = planner.resolve_tensor(ri).detach()
            if target.dtype != dtype and not self.allow_cast:
                raise DtypeMismatchError(
                    f"{ri.dest_index.fqn!r} is stored as {dtype} but the destination tensor is {target.dtype}; "
                    "load into a tensor of the stored dtype, or pass allow_cast=True to StorageReader"
                )
            if target.numel() and tuple(target.shape) != tuple(ri.lengths):
                raise IntegrityError(f"{ri.dest_index.fqn!r}: read item lengths {tuple(ri.lengths)} do not fit {tuple(target.shape)}")
            whole = self._whole_destination(planner, ri, target)
            if whole.numel() == 0 or _subclass.has_memory(whole):
                out.append((ri, loc, target if views else None, None))
                continue
            k = (ri.dest_index.fqn, tuple(ri.dest_index.offset) if ri.dest_index.offset is not None else None)
            asm = assemblies.get(k)
            if asm is None:
                asm = assemblies[k] = _subclass.Assembly(ri.dest_index.fqn, whole, exact=not self.allow_cast)
            asm.parts.append((ri, target))
            out.append((ri, loc, asm.part(ri), asm))
        return out

    def _whole_destination(self, planner: LoadPlanner, ri, target: torch.Tensor) -> torch.Tensor:
        """The tensor ``ri`` loads a part of: ``target`` when ``ri`` spans the whole stored tensor (DCP
        checks that a destination's global size is the stored one, so nothing was narrowed), else the
        planner's ``lookup_tensor`` (DCP's default planners) before ``transform_tensor`` narrowed it."""
        md = self._metadata.state_dict_metadata.get(ri.dest_index.fqn) if self._metadata is not None else None
        if tuple(getattr(md, "size", ())) == tuple(ri.lengths):
            return target
        lookup = getattr(planner, "lookup_tensor", None)
        if lookup is None:
            return target
        try:
            whole = lookup(ri.dest_index)
        except Exception:  # noqa: BLE001 - a planner of its own: what resolve_tensor gave is all we know
            return target
        return whole.detach() if isinstance(whole, torch.Tensor) else target

    def _record_digest(self, ri, loc: ItemLocation, parts: list) -> None:
        """The XXH3-128 of an item loaded whole, and where it is stored: the baseline an incremental
        writer starts from after this restore (``dcp/_incremental.py``)."""
        from ..codec.frame import xxh128_stream

        from ._incremental import item_key

        h = xxh128_stream()
        for p in parts:
            h.update(p)
        with self._alt_lock:
            self.item_digests[item_key(ri.storage_index)] = (h.intdigest(), loc)

    def _deliver(self, ri, loc: ItemLocation, frames, start, b0, b1, decoded, planner, target) -> None:
        """Write read item ``ri``'s bytes into ``target`` (bytes items: ``planner.load_bytes``).

        The fast path copies decoded frames straight into ``target``'s memory, only when that memory
        is checked to be ``target``'s own (``_subclass.own_bytes``); otherwise ``target.copy_``."""
        parts = [decoded[(loc.object, f.offset)] for f in frames]
        if self.record_digests and b0 == 0 and b1 == loc.nbytes and start == 0 and (
                ri.type == LoadItemType.BYTE_IO or tuple(ri.lengths) == tuple(loc.shape)):
            self._record_digest(ri, loc, parts)
        if ri.type == LoadItemType.BYTE_IO:
            planner.load_bytes(ri, io.BytesIO(b"".join(parts)))
            return
        dtype = getattr(torch, loc.dtype)
        if target.numel() == 0 or not frames:
            return
        whole = b0 == 0 and b1 == loc.nbytes and start == 0 and tuple(ri.lengths) == tuple(loc.shape)
        dst = _subclass.own_bytes(target) if whole and target.dtype == dtype else None
        if dst is not None:
            # fast path: the item is the whole stored chunk; copy frames straight into place
            pos = 0
            for p in parts:  # numpy copies release the GIL (a memoryview slice assignment holds it)
                n = len(p)
                np.copyto(dst[pos : pos + n], np.frombuffer(p, dtype=np.uint8))
                pos += n
            return
        total = sum(len(p) for p in parts)
        buf = bytearray(total)
        pos = 0
        for p in parts:
            buf[pos : pos + len(p)] = p
            pos += len(p)
        flat = torch.frombuffer(buf, dtype=torch.uint8).view(dtype)
        src = flat.as_strided(tuple(ri.lengths), _contig_strides(loc.shape), (b0 - start) // dtype.itemsize)
        target.copy_(src)


_OPTIM_HINT = (
    ". For optimizers, save and load optim state through torch.distributed.checkpoint.state_dict's "
    "get_state_dict/set_state_dict (a fresh optimizer's state_dict() has no state entries to load into; "
    "see the README)"
)


class _PeerTier:
    """Bytes of another rank's root, received in ``read_data`` (``{(object, offset): bytes}``)."""

    name = "peer"

    def __init__(self, version: str, got: dict, rank: int, root: str | None = None) -> None:
        self._got = got
        self.rank = rank
        self.url = f"the root of rank {rank} ({root or '?'})"

    def get_ranges(self, key: str, ranges) -> list[bytes]:
        obj = key.split("/", 2)[2]  # the object name: past "versions/<version>/" (its origin's, for a reference)
        try:
            return [self._got[(obj, a)] for a, _b in ranges]
        except KeyError:
            raise ObjectNotFoundError(f"{obj!r}: bytes from {self.url} did not arrive", object=obj) from None

    def get(self, key: str) -> bytes:
        raise ObjectNotFoundError(f"{key!r} is read whole only from a tier", object=key)


class _Counted:
    """A tier that counts its GET requests into ``stats["remote_reads"]`` (everything else passes)."""

    def __init__(self, tier, stats: dict, keys: set) -> None:
        self._tier = tier
        self._stats = stats
        self._keys = keys

    def get(self, key, *a, **k):
        self._stats["remote_reads"] += 1
        self._keys.add(key)
        return self._tier.get(key, *a, **k)

    def get_ranges(self, key, ranges, *a, **k):
        self._stats["remote_reads"] += len(ranges)
        self._keys.add(key)
        return self._tier.get_ranges(key, ranges, *a, **k)

    def __getattr__(self, name):
        return getattr(self._tier, name)


def _contig_strides(shape) -> tuple:
    strides = []
    acc = 1
    for n in reversed(tuple(shape)):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


class RefusedClassError(pickle.UnpicklingError):
    """The pickle refers to a class outside the allow-list (``qualname``: ``module.name``)."""

    def __init__(self, module: str, name: str):
        self.qualname = f"{module}.{name}"
        super().__init__(f"DCP metadata refers to {self.qualname}, which is not allowed")


class _MetadataUnpickler(pickle.Unpickler):
    """Only the classes DCP metadata is made of (plus torch dtypes/``Size`` and our records).

    That is every class torch ≥ 2.6 DCP itself puts in ``Metadata`` (``metadata.py``:
    ``ChunkStorageMetadata``, ``TensorStorageMetadata``, ``BytesStorageMetadata``,
    ``TensorProperties`` with ``_MEM_FORMAT_ENCODING``, ``MetadataIndex``, ``StorageMeta``;
    ``torch.dtype``/``Size``/``layout``/``memory_format``), and the sharded-tensor
    ``TensorProperties``/``MEM_FORMAT_ENCODING`` that older DCP wrote. The writer checks every
    Metadata against this list before committing (``_checks.check_metadata_loads``).

    Names must be plain (no dots: protocol 4 resolves dotted names through attributes) and resolve
    to classes, except torch dtypes/layouts and ``torch.serialization._get_layout``.
    """

    _MODULES = frozenset(
        {
            "torch.distributed.checkpoint.metadata",
            "torch.distributed.checkpoint.planner",
            "ckptstore.dcp._types",
            "ckptstore.codec.frame",
        }
    )
    _EXACT = {
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
        ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    }

    def find_class(self, module: str, name: str):
        if "." in name or not name.isidentifier():
            raise RefusedClassError(module, name)
        if (module, name) in self._EXACT:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if module in self._MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        raise RefusedClassError(module, name)


def _restricted_loads(blob: bytes, what: str):
    """The DCP ``Metadata`` of a *verified* metadata object (format 1: a pickle; format 2: a pickle
    plus packed tables, ``_metadata.unpack``); everything unpickled goes through the allow-list."""
    from ._metadata import unpack

    try:
        return unpack(blob, lambda mv: _MetadataUnpickler(io.BytesIO(mv)).load(), what)
    except IntegrityError:
        raise
    except Exception as e:
        raise IntegrityError(f"{what}: DCP metadata does not unpickle with the allow-list: {e}", object=what) from None
