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
   holds keys no rank asked for under a top-level entry the load asks for other keys of (the
   entries it does not ask for at all stay unread: loading the model alone, then the optimizer),
   unless ``allow_partial_load=True``: nothing is dropped silently.
5. (all ranks) ``read_data`` — fetches only the frames each read item overlaps (ranged, coalesced,
   in parallel), verifies each against the index and its checksum/tag, decodes, narrows by
   ``storage_offsets``/``lengths`` and copies into the destination; bytes items go through
   ``planner.load_bytes`` from position 0.

Stages: the reader keeps the DCP contract and the state of one load and hands each step to a
collaborator — the restore choice (``_job``: every rank's report, :func:`ckptstore.choice.decide`),
verification (``_verify.OpenVersion``: the manifest's key and HMAC, frame codecs, whole objects,
item locations; ``_unpickle``: the allow-list unpickler), sources (``_sources.Sources``: which
root, peer or tier each object is read from, fallback to the other copies, read-repair), the
exchange (``_peers``: what several ranks need from one place is read once, verified and relayed;
docs/FORMAT.md, Read rule 11) and apply (``_apply``: destinations checked first, then the decoded bytes
delivered into them).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import logging
import os
import threading
import uuid
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader as _DCPStorageReader
from torch.futures import Future

from .. import _groups
from .._names import check_version
from ..codec import FrameCodec
from ..codec.crypto import RawKey, key_or_file
from ..codec.stages import env_threads
from ..errors import CkptStoreError, IntegrityError, KeyMismatchError, StateDictKeysError, TransientStorageError
from ..keys import resolve_master
from ..manifest import layout
from ..manifest.schema import Manifest, ObjectEntry
from ..manifest.schema import parse as parse_manifest
from ..store import Store
from ..tiers import remote_options_of
from . import _apply, _job, _peers
from ._checks import install_log_filter, quiet_single_process, reject_unknown_kwargs
from ._keys import DataKeys
from ._sources import Counted, Sources
from ._types import ExchangePlan, ItemLocation
from ._unpickle import RefusedClassError, _MetadataUnpickler, _restricted_loads  # noqa: F401  (importable here)
from ._verify import OpenVersion

log = logging.getLogger("ckptstore")
install_log_filter()

_GROUP_BYTES = 8 << 20  # stored bytes per fetch task (ranged reads are coalesced within it)


class StorageReader(_DCPStorageReader):
    """Read DCP checkpoints from a ckptstore.

    Args:
        root: local directory of the store (may be empty or absent when reading from the remote
            tier only).
        remote: a remote tier's URL (``"s3://bucket/prefix"``, ``"gs://…"``, ``"az://…"``;
            docs/tiers.md), a :class:`~ckptstore.tiers.Tier`, or None.
        key: master key (32 bytes or key provider); default ``CKPTSTORE_KEY``/``CKPTSTORE_KEY_FILE``.
        key_file: instead of ``key``, a key file (32 bytes or their base64; the CLI's ``--key-file``).
        version: version to load when no ``checkpoint_id`` is given; default the newest committed
            version every rank can load that holds no NaN/Inf values (``allow_nonfinite``).
        allow_cast: load into destination tensors of another dtype (default: raise
            :class:`DtypeMismatchError`), and into tensor subclasses without memory of their own
            (quantized / Float8 weights) whose ``copy_`` re-encodes the stored values (default: raise
            :class:`UnsupportedStateError`; the values must read back bit for bit).
        allow_partial_load: allow the checkpoint to hold keys the destination state dict lacks
            (True), or only keys starting with one of the given prefixes (a tuple of strings: e.g.
            ``("rng/rank",)`` for per-rank values of the saving ranks in a resharded load). Without
            it, a load may leave whole top-level entries it asks nothing of unread (``{"model": ...}``
            of a version that also holds ``"optim"``: PyTorch's recipe of loading the model, then
            ``load_sharded_optimizer_state_dict``), but not keys of an entry it asks for.
        allow_unencrypted: accept an unencrypted version although a key is configured.
        threads: decode threads (default ``CKPTSTORE_THREADS``, else cores / ``LOCAL_WORLD_SIZE`` + 1, 2..8).
        read_repair: when an object fails verification in the tier read first (local) and the
            verified copy of another tier (the remote one) is used instead, also rewrite the local copy from
            those verified bytes (temp file + atomic replace). Off by default.
        avoid: ``{(global rank, object name)}``: copies not to read — that rank's root is treated as
            not holding that object, so the load reads it from another root or the remote tier
            (``CheckpointManager.restore`` passes the copies an earlier try found unverifiable).
        allow_nonfinite: without a version, also consider versions whose manifest records NaN/Inf
            values (default: the newest version without any; docs/FORMAT.md, "Restore choice").
            A named version is loaded whatever its values.
        process_group: the process group of the load (pass the one given to ``dcp.load``; default
            the default group). In a job of more than one rank the reader exchanges, over this group,
            what each rank's root holds (docs/FORMAT.md, "Placement"): without a version it loads the
            newest version every rank can load; each rank reads its own root first, then another
            rank's root through ``torch.distributed``, then the remote tier. What several ranks need
            from one place (a replicated weight, the manifest and metadata object of a remote-only
            restore) is read once, verified and relayed (docs/FORMAT.md, Read rule 11) over this
            group when it is not the default group (it must then be gloo-capable for bytes to move
            between ranks), else over a gloo group the reader makes for the load.

    Roots may be node-local: every node passes the same path, each is a different disk. A root
    that holds objects of the loaded version but lacks its manifest (a crash right after the commit)
    gets the manifest from another rank's root during the load.

    Every read served by another tier than the one chosen is logged as a warning (logger
    ``ckptstore``) naming the object and both tiers, and counted in :attr:`stats`
    (``fallback_reads``, ``repaired``), which add up over the loads of this reader, as do
    ``remote_reads`` (GET requests to the remote tier, manifests included), ``remote_bytes`` (the
    bytes they returned), ``peer_bytes`` (bytes received from other ranks: their roots' copies or
    what they read from the remote tier for this rank) and ``peer_sent_bytes``.

    Raises (through DCP's ``CheckpointException``): :class:`VersionNotFoundError`,
    :class:`IntegrityError` / :class:`ManifestError`, :class:`KeyMismatchError`,
    :class:`KeyServiceError` / :class:`KeyServiceUnavailableError` (``key=`` an AWS KMS key —
    :class:`ckptstore.KmsKey`, ``"kms://…"``, ``CKPTSTORE_KMS_KEY_ID`` — that KMS refused or did not
    answer: nothing is returned, nothing marked),
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
        key_file: str | os.PathLike | None = None,
        version: str | None = None,
        allow_cast: bool = False,
        allow_partial_load: bool | tuple = False,
        allow_unencrypted: bool = False,
        threads: int | None = None,
        remote_options: dict | None = None,
        read_repair: bool = False,
        process_group: Any = None,
        avoid: Any = frozenset(),
        record_digests: bool = False,
        allow_nonfinite: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        remote_options = remote_options_of(remote_options, kwargs, where="StorageReader")
        reject_unknown_kwargs(type(self), kwargs)
        quiet_single_process()
        self.read_repair = read_repair
        self.allow_nonfinite = allow_nonfinite
        self.avoid = frozenset(avoid)
        #: with ``record_digests``: ``{(fqn, offset): (XXH3-128, ItemLocation)}`` of the items loaded whole
        self.record_digests = record_digests
        self.item_digests: dict = {}
        self.stats: dict[str, int] = {"fallback_reads": 0, "repaired": 0, "remote_reads": 0, "remote_bytes": 0,
                                      "peer_bytes": 0, "peer_sent_bytes": 0}
        self._pg = process_group
        #: keys this reader GET from the remote tier (all its loads)
        self.remote_keys: set[str] = set()
        self.root = None if root is None else os.path.abspath(os.fspath(root))
        self.remote_url = getattr(remote, "url", remote)
        self.remote_options = remote_options
        self._keys = DataKeys(resolve_master(key_or_file(key, key_file)))
        self.version = check_version(version) if version is not None else None
        self.allow_cast = allow_cast
        self.allow_partial_load = allow_partial_load
        self.allow_unencrypted = allow_unencrypted
        self.threads = threads or env_threads()
        self._store = Store(self.root, remote=remote, remote_options=remote_options)
        if self._store.remote is not None:
            self._store.remote = Counted(self._store.remote, self.stats, self.remote_keys)
        self._reset_state()

    def __getstate__(self):
        s = self.__dict__.copy()
        s["_pool"] = None
        s.pop("_alt_lock", None)
        s["_pg"] = None
        s["_xg"] = None
        s["_xg_own"] = False
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
        self._opened: OpenVersion | None = None  # the version of this load, verified (read_metadata)
        self._sources: Sources | None = None  # where this load reads each object
        self._metadata: Metadata | None = None
        self._deferred: Exception | None = None
        self._alt_lock = threading.Lock()
        self.rank = 0
        self.is_coordinator = True
        self._joined: tuple | None = None  # (view, group rank, manifest file, metadata bytes, from where) or (exception,)
        self._peer: dict = {}  # {(object, offset): stored bytes} the exchange brought (docs/FORMAT.md, Read rule 11)
        self._peer_from: dict = {}  # {(object, offset): (origin, relayed by)} of those bytes
        self._drop_group()

    @property
    def _master(self):
        """The master key as ``key=`` takes it (32 bytes, or the ``KmsKey``), or None."""
        return self._keys.given

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
        process's own report. Returns ``(view, group rank, manifest file, metadata bytes or None,
        where the manifest came from)``."""
        if self._joined is None:
            try:
                view, me = _job.exchange(self._store.local, self._store.remote, self._pg, self.version,
                                         key_id=_raw_key_id(self._keys.master), master=self._keys.master, bad=self.avoid,
                                         allow_nonfinite=self.allow_nonfinite)
                if (_job.in_job(self._pg) and not view.holders and view.remote_ok and self._store.remote is not None
                        and self._can_relay()):
                    body, meta = self._manifest_once(view, me)  # no root holds it: one rank reads it
                    where = f"the remote tier ({self._store.remote.url})"
                else:
                    body, meta, where = _job.fetch_manifest(view, me, self._store.local, self._store.remote, self._pg)
                self._joined = (view, me, body, meta, where)
            except Exception as e:  # noqa: BLE001 - raised again, the same on every call
                self._joined = (e,)
        if len(self._joined) == 1:
            raise self._joined[0]
        return self._joined

    def _manifest_once(self, view, me: int) -> tuple[bytes, bytes | None]:
        """The manifest file and the metadata object's stored bytes of ``view``'s version when only
        the remote tier holds them (docs/FORMAT.md, Read rule 11): the load's first rank reads both,
        verifies them (seal, HMAC with a key, every frame of the metadata object) and broadcasts them
        as stored over the exchange group; every rank verifies them again in ``read_metadata``. When
        the first rank has nothing verified to send, every rank reads them itself, as before."""
        remote = self._store.remote
        pg = self._exchange_group(make=True)
        parts = None
        if me == 0:
            try:
                body = remote.get(layout.manifest_key(view.version))
                parsed = parse_manifest(body, expect_version=view.version)
                if parsed.manifest.attempt == view.attempt:
                    opened = OpenVersion(parsed, self._keys, self.allow_unencrypted)
                    entry = parsed.manifest.metadata_object
                    meta = remote.get(opened.key(entry.name))
                    opened.decode_whole(entry, meta)  # verified before it is sent
                    parts = [body, meta]
            except Exception as e:  # noqa: BLE001 - every rank must reach the broadcast; each reads for itself
                log.warning("ckptstore: could not read a verified manifest and metadata object of %r from the remote "
                            "tier for every rank (%s); every rank reads them itself", view.version, e)
        got = _peers.broadcast_bytes(parts, view.global_rank(0), pg)
        if got is None:
            return remote.get(layout.manifest_key(view.version)), None
        if parts is not None:  # the first rank: what it read and verified
            return parts[0], parts[1]
        self.stats["peer_bytes"] += sum(map(len, got))
        try:
            parse_manifest(got[0], expect_version=view.version)  # its seal, before anything uses it
        except CkptStoreError as e:
            self.stats["fallback_reads"] += 1
            log.warning("ckptstore: the manifest of %r received from rank %d fails verification (%s); reading it "
                        "from the remote tier", view.version, view.global_rank(0), e)
            return remote.get(layout.manifest_key(view.version)), None
        return got[0], got[1]

    def _exchange_group(self, make: bool):
        """The gloo group the load's bytes travel over (docs/FORMAT.md, Read rule 11): the load's own
        process group when it is not the default one (``CheckpointManager`` passes its own gloo
        group), else — never the training group — a gloo group of every rank that this reader makes
        (``make``: a collective on the default group, made by every rank at the same step of the load)
        and destroys when the load ends."""
        if self._xg is None:
            pg = self._pg
            if pg is not None and pg is not dist.group.WORLD:
                self._xg = pg
            elif make:
                self._xg = _groups.new_gloo_group()
                self._xg_own = True
        return self._xg

    def _can_relay(self) -> bool:
        """Whether bytes read for other ranks can travel to them: the load runs on the default group
        (the reader makes a gloo group), or on a gloo-capable group of its own. Otherwise each rank
        reads what it needs from the remote tier itself, as without the exchange."""
        pg = self._pg
        return pg is None or pg is dist.group.WORLD or "gloo" in str(dist.get_backend(pg))

    def _drop_group(self) -> None:
        xg, own = getattr(self, "_xg", None), getattr(self, "_xg_own", False)
        self._xg, self._xg_own = None, False
        if own:
            _groups.destroy_group(xg)

    @property
    def view(self):
        """The :class:`ckptstore.choice.View` of the last load (None before ``read_metadata``)."""
        j = self._joined
        return j[0] if j is not None and len(j) > 1 else None

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

    def _read_metadata(self) -> Metadata:
        if self._metadata is not None:
            return self._metadata
        view, me, body, meta, where = self._join()
        self.version = view.version
        tier = self._store.local if view.has_manifest(me) or not view.remote_ok else self._store.remote
        parsed = parse_manifest(body, expect_version=view.version)
        if parsed.manifest.attempt != view.attempt:  # re-committed between the listing and this read
            raise TransientStorageError(f"version {view.version!r} was committed again while this load started "
                                        f"(attempt {parsed.manifest.attempt}, chose {view.attempt}); load again")
        try:
            opened = OpenVersion(parsed, self._keys, self.allow_unencrypted)
        except KeyMismatchError as e:
            raise _key_mismatch(e, parsed.manifest, self._keys.master, where, self._store) from None
        self._opened = opened
        self.manifest, self.tier, self.codec = opened.manifest, tier, opened.codec
        self._sources = Sources(self._store, view, me, opened, self._peer, self.stats, self.read_repair)
        entry = self.manifest.metadata_object
        blob = None
        if meta is not None:  # stored bytes another rank sent: verified here like any read
            try:
                blob = opened.decode_whole(entry, meta)
            except IntegrityError as e:
                self.stats["fallback_reads"] += 1
                log.warning("ckptstore: the metadata object of %r received from another rank fails verification (%s); "
                            "reading it from its places", view.version, e)
        if blob is None:
            blob = self._read_whole_object(entry)
        md = _restricted_loads(blob, entry.name)
        if not isinstance(md, Metadata):
            raise IntegrityError(f"{entry.name} does not hold DCP Metadata", object=entry.name, version=self.version)
        opened.check_storage_data(md)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        self._metadata = md
        return md

    def _read_whole_object(self, entry: ObjectEntry) -> bytes:
        key = self._opened.key(entry.name)
        return self._sources.read(entry.name, lambda tier: self._opened.decode_whole(entry, tier.get(key)))

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
            return loc.object, _apply.needed(ri, loc)[0]

        # the exchange (docs/FORMAT.md, Read rule 11): every rank makes the group in read_data when
        # the load runs on the default group and none was made yet (the same on every rank)
        make = self._xg is None and (self._pg is None or self._pg is dist.group.WORLD)
        xps = _peers.plan(self._joined[0], plans, needed, make_group=make, share_remote=self._can_relay())
        return [p if x is None else dataclasses.replace(p, storage_data=x) for p, x in zip(plans, xps)]

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
        # a load of whole parts (the model alone, then the optimizer: PyTorch's documented FSDP recipe
        # with load_sharded_optimizer_state_dict) leaves the top-level entries it does not ask for at
        # all unread; within an entry it asks for, every stored key must be asked for
        paths = getattr(self._metadata, "planner_data", None)
        asked = {_entry_of(k, paths) for k in requested}
        unread = [k for k in unread if _entry_of(k, paths) in asked]
        if unread:
            shown = ", ".join(repr(k) for k in unread[:20]) + (" ..." if len(unread) > 20 else "")
            entries = sorted({_entry_of(k, paths) for k in unread})
            raise StateDictKeysError(
                f"version {self.version!r} holds {len(unread)} key(s) that no rank's state dict asks for, under "
                f"{', '.join(repr(e) for e in entries)} which the load asks for other keys of: {shown}. "
                "They would be dropped silently (e.g. per-rank entries saved on more ranks than are loading). "
                "Load them explicitly, or pass allow_partial_load=True (or a tuple of key prefixes that may stay "
                "unread) to StorageReader"
                + (_OPTIM_HINT if any(".state." in k for k in unread) else "")
            )
        return plans

    # -- data --------------------------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        pool = cf.ThreadPoolExecutor(self.threads, thread_name_prefix="ckptstore-dec")
        record = self._record_digest if self.record_digests else None
        try:
            self._exchange(plan, pool)  # first: nothing before it may fail on one rank only
            # every destination is resolved and checked before any byte is written into any of them
            batches = _apply.batches(_apply.destinations(plan, planner, self.storage_data, self._metadata, self.allow_cast))
            # double-buffered: fetch+decode batch k+1 while batch k is copied into place
            # frames of whole items go straight into their destination's memory (no buffer per
            # frame, no copy in this thread); each verified before it is written, a frame that fails
            # fails the load (docs/FORMAT.md, Read rule 13)
            pending = self._submit_batch(batches[0], pool)
            for k, batch in enumerate(batches):
                nxt = self._submit_batch(batches[k + 1], pool) if k + 1 < len(batches) else None
                decoded: dict = {}
                for t in pending:
                    decoded.update(t.result())
                _apply.apply(batch, decoded, planner, record)
                pending = nxt
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            self._store.close()  # tier pools and clients: no thread outlives the load
            self._peer.clear()
            self._peer_from.clear()
            self._drop_group()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _exchange(self, plan: LoadPlan, pool) -> None:
        """This rank's part of the load's exchange (``_peers``, docs/FORMAT.md Read rule 11): read and
        verify the chunks it reads for others, then relay and receive, round by round; the bytes go
        to ``self._peer`` (served through ``_peers.PeerTier``, verified again when decoded)."""
        xp = plan.storage_data
        if not isinstance(xp, ExchangePlan):
            return
        pg = self._exchange_group(make=True)
        held: dict = {}
        futs = {k: pool.submit(self._read_chunk, xp.chunks[k]) for k in xp.read}
        for k, f in futs.items():
            held[k] = f.result()
        received, sent = _peers.run(xp, held, pg)
        self.stats["peer_bytes"] += received
        self.stats["peer_sent_bytes"] += sent
        parent = {k: peer for _r, peer, send, ks in xp.steps if not send for k in ks}
        for k, frames in held.items():
            if frames is None:
                continue
            chunk = xp.chunks[k]
            src = (("remote", None) if chunk.origin is None else ("root", chunk.origin), parent.get(k))
            for (obj, f), b in zip(chunk.frames, frames):
                self._peer[(obj, f.offset)] = b
                self._peer_from[(obj, f.offset)] = src

    def _read_chunk(self, chunk) -> list | None:
        """The stored bytes of ``chunk``'s frames, read from this rank's place for them (its root, or
        the remote tier) with the usual fallback, every frame verified (index entry, checksum, AEAD
        tag) before any is sent; None when no place serves a verified copy (the receivers then read
        from their own places). Never raises: every rank must reach the exchange."""
        got: dict = {}
        try:
            by_obj: dict[str, list] = {}
            for obj, f in chunk.frames:
                by_obj.setdefault(obj, []).append(f)
            for obj, frames in by_obj.items():
                got.update(self._sources.read(obj, self._verified_reader(obj, frames)))
            return [got[(obj, f.offset)] for obj, f in chunk.frames]
        except Exception as e:  # noqa: BLE001 - reported; the receivers read for themselves
            log.warning("ckptstore: no verified copy of %s to send to the ranks of this load that need it (%s); "
                        "they read it from its other places", ", ".join(sorted({o for o, _f in chunk.frames})), e)
            return None

    def _verified_reader(self, obj: str, frames: list):
        key = self._opened.key(obj)
        codec = self._opened.codec_of(obj)
        ranges = [(f.offset, f.offset + f.length) for f in frames]

        def read(tier) -> dict:
            bufs = tier.get_ranges(key, ranges)
            for f, b in zip(frames, bufs):
                codec.decode(obj, b, f)  # raises IntegrityError unless the frame verifies
            return {(obj, f.offset): b for f, b in zip(frames, bufs)}

        return read

    def _submit_batch(self, batch, pool) -> list:
        by_obj: dict[str, set] = collections.defaultdict(set)
        for _ri, loc, (frames, *_rest), *_dest in batch:
            by_obj[loc.object].update(frames)
        placed = _apply.placements(batch)
        tasks = []
        for obj, frames in by_obj.items():
            fl = sorted(frames, key=lambda f: f.offset)
            group: list = []
            gsize = 0
            for f in fl:
                group.append(f)
                gsize += f.length
                if gsize >= _GROUP_BYTES:
                    tasks.append(pool.submit(self._fetch_decode, obj, group, placed))
                    group, gsize = [], 0
            if group:
                tasks.append(pool.submit(self._fetch_decode, obj, group, placed))
        return tasks

    def _fetch_decode(self, obj: str, frames: list, placed: dict | None = None) -> dict:
        """A decoder thread's task: ``frames`` of ``obj`` read (ranged, from its sources: the bytes
        the exchange brought first) and decoded — every frame verified as it is decoded. A frame
        with a place in ``placed`` (``{(object, offset): destination bytes}``) is decoded straight
        into it (:class:`_apply.Placed` in the result); from this rank's root it is read with
        ``readv_ranges`` into this thread's reusable buffer first."""
        key = self._opened.key(obj)
        codec = self._opened.codec_of(obj)
        placed = placed or {}

        def reader(fs: list):
            def read(tier):
                out: dict = {}
                rest = [f for f in fs if (obj, f.offset) not in placed]
                mine = [f for f in fs if (obj, f.offset) in placed]
                if mine and getattr(type(tier), "readv_ranges", None) is not None:
                    out.update(_read_placed(tier, key, obj, codec, mine, placed))
                elif mine:
                    rest = fs
                    mine = []
                if rest:
                    bufs = tier.get_ranges(key, [(f.offset, f.offset + f.length) for f in rest])
                    for f, b in zip(rest, bufs):
                        dst = placed.get((obj, f.offset))
                        if dst is None:
                            out[(obj, f.offset)] = codec.decode(obj, b, f)
                        else:
                            codec.decode(obj, b, f, out=memoryview(dst))
                            out[(obj, f.offset)] = _apply.Placed(dst)
                return out

            return read

        peer = self._peer
        if not peer:
            return self._sources.read(obj, reader(frames))
        by_src: dict = {}  # (origin, relayed by) -> frames the exchange brought from there; None: the rest
        for f in frames:
            by_src.setdefault(self._peer_from.get((obj, f.offset)), []).append(f)
        out: dict = {}
        for src, fs in by_src.items():
            first = None if src is None else self._sources.peer_tier(*src)
            out.update(self._sources.read(obj, reader(fs), first=first))
        return out

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


_tls = threading.local()


def _read_buffer(nbytes: int) -> memoryview:
    """This decoder thread's reusable read buffer of at least ``nbytes`` (grown in whole MiB): the
    stored bytes of frames decoded into place land here, not in fresh memory per frame."""
    buf = getattr(_tls, "buf", None)
    if buf is None or len(buf) < nbytes:  # not zero-filled: every byte used is read into first
        buf = _tls.buf = np.empty(max(nbytes + (4 << 20), _GROUP_BYTES + (4 << 20)), dtype=np.uint8)
    return memoryview(buf)


def _read_placed(tier, key: str, obj: str, codec, frames: list, placed: dict) -> dict:
    """Read ``frames`` of ``obj`` from a local tier (``readv_ranges``: into this thread's reusable
    buffer, no fresh memory per frame) and decode each into its place once its header and payload
    checksum verify (``FrameCodec.decode(out=)``; a raw frame is then one cache-hot copy). Raises
    :class:`IntegrityError` (a short read: the object is truncated) like ``FrameCodec.decode``."""
    buf = _read_buffer(sum(f.length for f in frames))
    reqs: list = []
    views = []
    pos = 0
    for f in frames:
        v = buf[pos : pos + f.length]
        views.append(v)
        reqs.append((f.offset, [v]))
        pos += f.length
    got = tier.readv_ranges(key, reqs)
    # every frame of the task is checked (length, header, index entry, payload XXH3) before any is
    # decoded into place: one damaged frame leaves all the task's destinations untouched
    # (docs/FORMAT.md, Read rule 13)
    for f, v, g in zip(frames, views, got):
        if g != f.length:
            raise IntegrityError(f"{obj}: frame at offset {f.offset} is cut short ({g} of {f.length} bytes; the "
                                 "object is truncated)", object=obj)
        codec.check(obj, v, f)
    out: dict = {}
    for f, v in zip(frames, views):
        dst = placed[(obj, f.offset)]
        codec.decode(obj, v, f, out=memoryview(dst), checked=True)  # checked just above, same buffer
        out[(obj, f.offset)] = _apply.Placed(dst)
    return out


EMPTY_ROOT = "\"\""  # the command line's "no local tier"


def _raw_key_id(master) -> str | None:
    """The key id of a raw master key, which every rank reports for Read rule 12 (docs/FORMAT.md);
    None without a key or with an AWS KMS key (knowing its id may take a KMS request, and a
    multi-Region key's replicas wrap under other ids: the copy is opened and KMS decides)."""
    return master.key_id if isinstance(master, RawKey) else None


def _key_mismatch(e: KeyMismatchError, m: Manifest, master, where: str, store) -> KeyMismatchError:
    """The error of a manifest copy wrapped by another raw master key than the one given, when no copy
    of the job opens with it (docs/FORMAT.md, Read rule 12): names the copy and, since a key rotation
    that missed this copy looks the same as a wrong key, the command that re-wraps it."""
    kid = (m.encryption or {}).get("key_id")
    mine = _raw_key_id(master)
    if mine is None or kid is None or kid == mine or (m.encryption or {}).get("kms"):
        return e
    remote = getattr(store.remote, "url", None)
    root = store.local.url if store.local is not None else None
    cmd = (f"'ckptstore rekey {root or EMPTY_ROOT} --key-file OLD --new-key-file NEW"
           + (f" --remote {remote}" if remote else "") + "'")
    return KeyMismatchError(
        f"version {m.version!r}: its manifest in {where} is wrapped by master key id {kid}, the key given has id "
        f"{mine}, and no other copy this job can read opens with it. If the master key was rotated, "
        f"this copy was missed: run {cmd} (OLD: the key of id {kid}); otherwise supply the right key")


def _entry_of(fqn: str, paths) -> str:
    """The top-level entry of the state dict a stored key belongs to: the first element of its
    object path (DCP's ``planner_data``; ``"model"`` for ``{"model": {...}}``), up to its first ``.``
    or ``/`` (``"layers"`` for a flattened ``"layers.0.w"``, ``"rng"`` for ``"rng/rank3"``)."""
    path = paths.get(fqn) if isinstance(paths, dict) else None
    first = str(path[0]) if isinstance(path, (tuple, list)) and path else fqn
    for i, ch in enumerate(first):
        if ch in "./":
            return first[:i]
    return first


_OPTIM_HINT = (
    ". For optimizers, save and load optim state through torch.distributed.checkpoint.state_dict's "
    "get_state_dict/set_state_dict (a fresh optimizer's state_dict() has no state entries to load into; "
    "see docs/howto/dcp.md, \"Optimizers\")"
)
