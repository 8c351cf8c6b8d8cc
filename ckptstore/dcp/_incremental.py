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

Identity: XXH3-128 is not a cryptographic hash. The two byte strings compared are this rank's own
state at two saves, not chosen by an adversary; the chance that two different tensors collide is
2^-128 per comparison (about 2^-100 over 2^28 item-saves). A store whose tensors an adversary can
choose should leave ``incremental`` off.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from ..codec import xxh128
from ..errors import CkptStoreError
from ..manifest import catalogue, layout
from ..manifest.schema import Manifest, RefEntry


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

    def for_save(self, tier, key_id: str | None) -> "SaveRefs":
        """The references of one save of this rank (``tier``: its root; ``key_id``: the save's master
        key id, None: unencrypted)."""
        return SaveRefs(self, tier, key_id)


class SaveRefs:
    """One rank's references in one save, called by the encode stage for each write item
    (:meth:`match`) and once the rank's object is written (:meth:`remember`)."""

    def __init__(self, inc: Incremental, tier, key_id: str | None) -> None:
        self._inc = inc
        self._tier = tier
        self._key_id = key_id
        self._digests: dict = {}
        self._present: dict = {}  # {origin object name: still in this rank's root}
        self.used: dict = {}  # {object name: RefEntry} of the earlier objects referenced

    def match(self, index, mv, dtype: Any, shape: Any):
        """The baseline's ``ItemLocation`` of the write item ``index`` when its bytes ``mv`` (and
        dtype, shape, size) equal the baseline's, else None (the item is written). Frames encrypted
        under another master key than this save's, and origin objects no longer in this rank's root,
        are never referenced."""
        key = item_key(index)
        self._digests[key] = h = xxh128(mv)
        base = self._inc.base
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
        present = self._present
        if loc.object not in present:
            present[loc.object] = self._tier.exists(layout.object_key(ref.version, ref.name))
        if not present[loc.object]:
            return None
        self.used[ref.name] = ref
        return loc

    def refs(self) -> tuple:
        """The ``RefEntry``s of the earlier objects this save's items reference, by name."""
        return tuple(sorted(self.used.values(), key=lambda r: r.name))

    def remember(self, version: str, attempt: str, indexes: list, locs: list) -> None:
        """The save's items (``MetadataIndex`` ``indexes`` → ``ItemLocation`` ``locs``, written or
        referenced) become a candidate baseline (:meth:`Incremental.candidate`)."""
        self._inc.candidate(version, attempt, {item_key(i): (self._digests[item_key(i)], loc)
                                               for i, loc in zip(indexes, locs)})


__all__ = ["Baseline", "Incremental", "SaveRefs", "item_key", "refs_of"]
