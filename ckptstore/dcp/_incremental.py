"""Incremental saves: a write item whose bytes did not change is referenced, not written again
(docs/FORMAT.md, "References").

Each rank of a ``StorageWriter(incremental=True)`` keeps a *baseline*: for every write item of the
newest version it committed (or restored), the XXH3-128 of the item's raw bytes and where the item's
frames are stored. At the next save an item with the same key (FQN and chunk offset), dtype, shape,
size and XXH3-128 gets the baseline's location instead of new frames: the frames stay in the object
of the version that wrote them, bound (AAD) to that version, attempt, object and position, and the new
manifest lists that object under ``refs`` (docs/FORMAT.md). No delta is ever computed: an item is
either identical or written in full.

A save's items become the baseline only once the save is committed in this rank's root (checked at
the next save's set-up, after the manifest copy of a node-local root arrived), so the baseline always
names a committed version; an origin object that is no longer in the root is never referenced.

**A writer without a baseline in memory** (a new ``StorageWriter`` per save, as DCP's own examples
build them; DCP's checkpoint subprocess, which gets a fresh copy of the writer) takes it from the
store: the ranks say so in their local plans, and the coordinator reads the newest version of the
writer's scope committed in its root — its manifest and DCP metadata object, whose optional
``item.xxh128_*`` columns hold every item's XXH3-128 (an incremental writer records them) — and hands
each such rank its own items in its global plan (:func:`store_baseline`), so no rank reads more than
its share.

**What the save references stays until it commits** (docs/FORMAT.md, "References", Delete rule 13):
at its first reference, a rank writes its lease on every object its baseline may name into its root
(``manifest/leases.py``), *then* checks that the baseline is still committed there — if not (a
``drop`` or ``gc`` removed it since), the save references nothing and writes every item whole. gc and
drop keep what a live lease names; the lease goes once the save is committed in that root (the
manifest then names the objects) or failed.

Identity: XXH3-128 is not a cryptographic hash. The two byte strings compared are this rank's own
state at two saves, not chosen by an adversary; the chance that two different tensors collide is
2^-128 per comparison (about 2^-100 over 2^28 item-saves). A store whose tensors an adversary can
choose should leave ``incremental`` off.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import logging
import re

from ..codec import xxh128
from ..errors import CkptStoreError, ObjectNotFoundError
from ..manifest import catalogue, layout, leases
from ..manifest.order import order_key
from ..manifest.schema import Manifest, RefEntry

log = logging.getLogger("ckptstore")


def item_key(index) -> tuple:
    """The key of a write item across saves: its FQN and chunk offset (``MetadataIndex``)."""
    off = getattr(index, "offset", None)
    return (index.fqn, None if off is None else tuple(off))


@dataclasses.dataclass
class Baseline:
    """The newest committed version a rank can reference: ``items`` ``{key: (xxh128, ItemLocation)}``
    and ``refs`` ``{object name: RefEntry}`` for every object those locations name."""

    version: str
    attempt: str
    items: dict
    refs: dict


def refs_of(m: Manifest) -> dict:
    """``{name: RefEntry}``: every object a version's item locations may name — its own shard objects
    (origin: the version itself) and the objects it references itself (their origins)."""
    enc = m.encryption or {}
    arn = (enc.get("kms") or {}).get("key_arn")
    out = {o.name: RefEntry(m.version, m.attempt, o.name, o.size, o.digest, o.frames, o.rank, o.nbytes,
                            enc.get("wrapped_key"), enc.get("key_id"), arn) for o in m.objects}
    out.update(m.ref_by_name())
    return out


class Incremental:
    """One rank's baseline and the candidates that may become it (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.base: Baseline | None = None
        self._pending: list = []  # [(version, attempt, items)] saves not yet known to be committed

    def __getstate__(self):
        return {"base": None, "_pending": []}

    def __setstate__(self, s):
        self.__init__()

    def candidate(self, version: str, attempt: str, items: dict) -> None:
        """This rank wrote (or referenced) ``items`` for the save ``version``/``attempt``."""
        with self._lock:
            self._pending.append((version, attempt, items))
            del self._pending[:-4]

    def promote(self, tier) -> None:
        """Make the newest candidate that is committed in ``tier`` (this rank's root) the baseline."""
        with self._lock:
            pending, self._pending = self._pending, []
        for version, attempt, items in reversed(pending):
            try:
                m = catalogue.read_manifest(tier, version).manifest
            except CkptStoreError:
                continue
            if m.attempt == attempt:
                with self._lock:
                    self.base = Baseline(version, attempt, items, refs_of(m))
                return

    def seed(self, m: Manifest, items: dict) -> None:
        """The baseline after a restore of ``m``: ``items`` ``{key: (xxh128, ItemLocation)}`` of what
        this rank loaded whole."""
        with self._lock:
            self.base = Baseline(m.version, m.attempt, dict(items), refs_of(m))
            self._pending = []

    def adopt(self, base: "Baseline | None") -> None:
        """The baseline the coordinator read from the store for this rank (:func:`store_baseline`),
        unless this rank has one of its own meanwhile."""
        if base is None:
            return
        with self._lock:
            if self.base is None:
                self.base = base

    @property
    def wants_base(self) -> bool:
        """No baseline in memory: the next save asks the coordinator for one from the store."""
        return self.base is None

    def for_save(self, tier, key_id: str | None, version: str | None = None, attempt: str | None = None,
                 rank: int = 0, *, whole: bool = False) -> "SaveRefs":
        """The references of one save of this rank (``tier``: its root; ``key_id``: the save's master
        key id, None: unencrypted; ``version``/``attempt``/``rank``: the save, which names its lease;
        ``whole``: reference nothing, only record the items' digests)."""
        return SaveRefs(self, tier, key_id, version, attempt, rank, whole=whole)


class SaveRefs:
    """One rank's references in one save, called by the encode stage for each write item
    (:meth:`match`) and once the rank's object is written (:meth:`remember`)."""

    def __init__(self, inc: Incremental, tier, key_id: str | None, version: str | None = None,
                 attempt: str | None = None, rank: int = 0, *, whole: bool = False) -> None:
        self._inc = inc
        self._tier = tier
        self._key_id = key_id
        self._save = (version, attempt, f"r{rank:05d}")
        self._digests: dict = {}
        self._present: dict = {}  # {origin object name: still in this rank's root}
        self.used: dict = {}  # {object name: RefEntry} of the earlier objects referenced
        self._base: Baseline | None = None if whole else inc.base  # the baseline of this save (read once)
        self._leased: bool | None = None  # None: not yet; True: leased and the baseline still committed
        self.lease: str | None = None  # the key of this rank's lease in its root

    def match(self, index, mv, dtype: Any, shape: Any):
        """The baseline's ``ItemLocation`` of the write item ``index`` when its bytes ``mv`` (and
        dtype, shape, size) equal the baseline's, else None (the item is written). Frames encrypted
        under another master key than this save's, and origin objects no longer in this rank's root,
        are never referenced."""
        key = item_key(index)
        self._digests[key] = h = xxh128(mv)
        base = self._base
        if base is None:
            return None
        hit = base.items.get(key)
        if hit is None or hit[0] != h:
            return None
        loc = hit[1]
        if loc.dtype != dtype or loc.shape != shape or loc.nbytes != len(mv):
            return None
        ref = base.refs.get(loc.object)
        if ref is None or ref.key_id != self._key_id:
            return None
        if self._leased is None:
            self._leased = self._lease(base)
        if not self._leased:
            return None
        present = self._present
        if loc.object not in present:
            present[loc.object] = self._tier.exists(layout.object_key(ref.version, ref.name))
        if not present[loc.object]:
            return None
        self.used[ref.name] = ref
        return loc

    def _lease(self, base: Baseline) -> bool:
        """Lease every object ``base`` may name, then check that ``base`` is still committed in this
        root (in that order: see ``manifest/leases.py``). False: reference nothing in this save."""
        version, attempt, holder = self._save
        if attempt is None:
            return False
        keys = [layout.object_key(r.version, r.name) for r in base.refs.values()]
        try:
            self.lease = leases.write(self._tier, version, attempt, holder, keys)
        except (CkptStoreError, OSError) as e:
            log.warning("ckptstore: cannot write the lease of save %r in %s (%s); this save writes every item whole",
                        version, self._tier.url, e)
            return False
        try:
            ok = catalogue.read_manifest(self._tier, base.version).manifest.attempt == base.attempt
        except CkptStoreError:
            ok = False
        if not ok:
            log.warning("ckptstore: version %r, the baseline of incremental save %r, is no longer committed in %s "
                        "(dropped or pruned); this save writes every item whole", base.version, version, self._tier.url)
            self.release()
        return ok

    def release(self) -> None:
        """Remove this rank's lease (the save failed, or it references nothing)."""
        key, self.lease = self.lease, None
        if key is not None:
            leases.release(self._tier, self._save[1], self._save[2])

    def missing(self) -> list[str]:
        """The referenced objects that are no longer in this root with their size (something that does
        not honour leases removed them): the save must write those items whole."""
        gone = []
        for ref in self.used.values():
            try:
                if self._tier.stat(layout.object_key(ref.version, ref.name)).size != ref.size:
                    gone.append(f"{ref.name} of {ref.version!r}")
            except ObjectNotFoundError:
                gone.append(f"{ref.name} of {ref.version!r}")
        return gone

    def refs(self) -> tuple:
        """The ``RefEntry``s of the earlier objects this save's items reference, by name."""
        return tuple(sorted(self.used.values(), key=lambda r: r.name))

    def digests(self, indexes: list) -> list:
        """The XXH3-128 of the items ``indexes`` (``MetadataIndex``), in order: recorded in the
        metadata (``item.xxh128_*``) so that a later writer can start from this save."""
        return [self._digests[item_key(i)] for i in indexes]

    def remember(self, version: str, attempt: str, indexes: list, locs: list) -> None:
        """The save's items (``MetadataIndex`` ``indexes`` → ``ItemLocation`` ``locs``, written or
        referenced) become a candidate baseline (:meth:`Incremental.candidate`)."""
        self._inc.candidate(version, attempt, {item_key(i): (self._digests[item_key(i)], loc)
                                               for i, loc in zip(indexes, locs)})


def default_scope(version: str) -> str:
    """The names a plain writer's incremental saves take their baseline from when none is given: the
    version's name with every run of digits standing for any digits (``step-000200`` →
    ``step-\\d+``). Any committed version is a correct baseline (items are referenced only when
    identical); the scope only picks the one most likely to share them."""
    return "".join(r"\d+" if part.isdigit() else re.escape(part) for part in re.split(r"(\d+)", version))


def store_baseline(tier, keys, scope: str | None, version: str, ranks) -> tuple[str | None, dict]:
    """The baseline of the ranks ``ranks`` read from the store (see the module docstring): the newest
    version committed in ``tier`` (the coordinator's root) whose name matches ``scope`` (a regular
    expression; None: :func:`default_scope` of ``version``), other than ``version``; returns its
    name and ``{rank: Baseline}`` for every rank of ``ranks`` that wrote or referenced items in it
    (``(None, {})``: none, or it cannot be read — the save writes everything whole, with a warning).
    ``keys``: the writer's ``_keys.DataKeys`` (a version under another master key is no baseline)."""
    from ._unpickle import _restricted_loads
    from ._verify import OpenVersion

    pat = re.compile(scope if scope is not None else default_scope(version))
    try:
        entries = catalogue.scan(tier)
    except CkptStoreError as e:
        log.warning("ckptstore: cannot list %s for an incremental baseline (%s)", tier.url, e)
        return None, {}
    cands = [e for v, e in entries.items() if v != version and pat.fullmatch(v)]
    if not cands:
        return None, {}
    e = max(cands, key=lambda e: order_key(e.manifest.step, e.manifest.seq, e.manifest.created, e.manifest.version))
    m = e.manifest
    try:
        opened = OpenVersion(catalogue.read_manifest(tier, m.version), keys, False)
        meta = m.metadata_object
        digests: list = []
        md = _restricted_loads(opened.decode_whole(meta, tier.get(layout.object_key(m.version, meta.name))), meta.name,
                               digests)
        opened.check_storage_data(md)
    except CkptStoreError as ex:
        log.warning("ckptstore: version %r cannot be the baseline of incremental save %r (%s); writing every item",
                    m.version, version, ex)
        return None, {}
    if len(digests) != len(md.storage_data):
        return None, {}  # saved without incremental: no digests recorded
    refs = refs_of(m)
    want = set(ranks)
    items: dict = {}
    names: dict = {}
    for (idx, loc), h in zip(md.storage_data.items(), digests):
        ref = refs.get(loc.object)
        if ref is None or ref.rank not in want:
            continue
        items.setdefault(ref.rank, {})[item_key(idx)] = (h, loc)
        names.setdefault(ref.rank, {})[loc.object] = ref
    return m.version, {r: Baseline(m.version, m.attempt, items[r], names[r]) for r in items}


__all__ = ["Baseline", "Incremental", "SaveRefs", "default_scope", "item_key", "refs_of", "store_baseline"]
