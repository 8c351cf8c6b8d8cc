"""Where a load reads each object (docs/FORMAT.md, "Placement", "Replicas"; Read rules): the place
the restore choice named first — this rank's root, another rank's root (bytes received in the peer
exchange), or the remote tier — then the other places that hold the same attempt, each read verified.
A read served elsewhere than first is never silent: warned, counted in the reader's ``stats``, and
with ``read_repair`` the local copy is rewritten from the verified one.
"""

from __future__ import annotations

import logging
import threading

from ..errors import CkptStoreError, IntegrityError, ObjectNotFoundError
from ._peers import PeerTier
from ._stage import OwnLock

log = logging.getLogger("ckptstore")


class Sources(OwnLock):
    """The places of one load. ``store``: the reader's ``Store`` (``local``, ``remote``, ``tiers``);
    ``view``/``me``: the restore choice's ``View`` and this rank's index in it; ``opened``: the
    ``_verify.OpenVersion``; ``peer``: ``{(object, offset): bytes}`` received from other ranks (filled
    by the peer exchange); ``stats``: the reader's counters (``fallback_reads``, ``repaired``)."""

    def __init__(self, store, view, me: int, opened, peer: dict, stats: dict, read_repair: bool) -> None:
        super().__init__()
        self.store = store
        self.view = view
        self.me = me
        self.opened = opened
        self.peer = peer
        self.stats = stats
        self.read_repair = read_repair
        self._repaired: set[str] = set()

    def first(self, obj: str):
        """The tier this rank reads ``obj`` from first: its root, else another rank's root (bytes
        received in ``read_data``), else the remote tier (``choice.View.source``)."""
        view = self.view
        src = view.source(self.me, obj)
        if src == "local":
            return self.store.local
        if src == "remote" or (view.remote_ok and obj == self.opened.manifest.metadata_object.name):
            return self.store.remote  # the metadata object is read whole: never from a peer's bytes
        return self.peer_tier(("root", view.global_rank(src)), root=view.root_url(src))

    def peer_tier(self, origin: tuple, via: int | None = None, root: str | None = None) -> PeerTier:
        """The bytes this load's exchange brought (``_peers``), as read from ``origin``."""
        return PeerTier(self.peer, origin, via, root)

    def others(self, obj: str) -> list:
        """Other places holding ``obj`` of the chosen attempt, tried when the first fails: this rank's
        root (when it holds an unmarked copy) and the remote tier (when its committed copy is this
        attempt) — known from the view, so a healthy load reads no other manifest."""
        out = []
        if self.store.local is not None and obj in self.view.present(self.me):
            out.append(self.store.local)
        if self.view.remote_ok and self.store.remote is not None:
            out.append(self.store.remote)
        return out

    def read(self, obj: str, read, first=None):
        """``read(tier)`` on the first place (``first``, default :meth:`first`), then on the other
        places holding the same attempt.

        A read served by another tier is never silent: warned, counted, optionally repaired. When no
        place serves a verified copy, :class:`IntegrityError` names the version, the object and every
        place tried (``.version``/``.object`` set, so a manager can skip the version).
        """
        first_tier = self.first(obj) if first is None else first
        tried = []
        places = []
        try:
            return read(first_tier)
        except (IntegrityError, ObjectNotFoundError) as e:
            last: Exception = e
            tried.append(f"{self.place(first_tier)}: {e}")
            places.append(self.place_id(first_tier))
        first = last
        for tier in self.others(obj):
            if tier is first_tier:
                continue
            try:
                out = read(tier)
            except (IntegrityError, ObjectNotFoundError) as e:
                last = e
                tried.append(f"{self.place(tier)}: {e}")
                places.append(self.place_id(tier))
                continue
            self._fell_back(obj, tier, first, first_tier)
            return out
        version = self.opened.version
        what = "is missing from" if isinstance(last, ObjectNotFoundError) else "fails verification in"
        err = IntegrityError(
            f"version {version!r}: object {obj!r} {what} every place that holds it ({'; '.join(tried)}). "
            "Load another version (CheckpointManager.resume() falls back to the next older loadable one), "
            "or restore the object ('ckptstore scrub --repair' with a tier that holds a verified copy)",
            object=obj, version=version)
        #: ``[("root", global rank) | ("remote", None)]``: the copies that failed (a manager retries
        #: the load without them before it passes over the version)
        err.places = places
        raise err

    def tier_name(self, tier) -> str:
        for name, t in self.store.tiers.items():
            if t is tier:
                return name
        return type(tier).__name__

    def place(self, tier) -> str:
        name = self.tier_name(tier)
        return f"the {name} tier ({tier.url})" if name in ("local", "remote") else getattr(tier, "url", name)

    def place_id(self, tier) -> tuple:
        if isinstance(tier, PeerTier):
            return tier.origin
        if tier is self.store.remote:
            return ("remote", None)
        return ("root", self.view.global_rank(self.me))

    def _fell_back(self, obj: str, tier, cause: Exception, failed) -> None:
        with self._lock:
            self.stats["fallback_reads"] += 1
        log.warning(
            "ckptstore: object %r of version %r failed in %s (%s); read it from %s instead%s",
            obj, self.opened.version, self.place(failed), cause, self.place(tier),
            "" if self.read_repair or failed is not self.store.local else " (pass read_repair=True to StorageReader "
            "to rewrite the local copy, or run 'ckptstore scrub --repair')",
        )
        if self.read_repair and failed is self.store.local:
            self._repair(obj, tier)

    def _repair(self, obj: str, good_tier) -> None:
        """Rewrite ``obj`` in this rank's root from ``good_tier``'s copy, verified in full first."""
        from ..tiers import LocalTier

        local = self.store.local
        if not isinstance(local, LocalTier):
            return
        with self._lock:
            if obj in self._repaired:  # once per object and load, whichever thread fails first
                return
            self._repaired.add(obj)
        entry = self.opened.objects.get(obj)
        if entry is None:
            return
        key = self.opened.key(obj)
        try:
            data = good_tier.get(key)
            self.opened.decode_whole(entry, data)  # every frame, the header digest and the size
            local.put(key, data)  # temp file, fsync, atomic replace
        except CkptStoreError as e:
            log.warning("ckptstore: read-repair of %r in version %r failed: %s", obj, self.opened.version, e)
            return
        with self._lock:
            self.stats["repaired"] += 1
        log.warning("ckptstore: repaired %r of version %r in %s from %s",
                    obj, self.opened.version, self.place(local), self.place(good_tier))


class Counted:
    """A tier that counts its GET requests into ``stats["remote_reads"]`` and the bytes they returned
    into ``stats["remote_bytes"]`` (everything else passes)."""

    def __init__(self, tier, stats: dict, keys: set) -> None:
        self._tier = tier
        self._stats = stats
        self._keys = keys
        self._lock = threading.Lock()

    def _count(self, key, requests: int, nbytes: int) -> None:
        with self._lock:
            self._stats["remote_reads"] += requests
            self._stats["remote_bytes"] = self._stats.get("remote_bytes", 0) + nbytes
            self._keys.add(key)

    def get(self, key, *a, **k):
        try:
            data = self._tier.get(key, *a, **k)
        except BaseException:
            self._count(key, 1, 0)
            raise
        self._count(key, 1, len(data))
        return data

    def get_ranges(self, key, ranges, *a, **k):
        try:
            out = self._tier.get_ranges(key, ranges, *a, **k)
        except BaseException:
            self._count(key, len(ranges), 0)
            raise
        self._count(key, len(ranges), sum(len(b) for b in out))
        return out

    def __getattr__(self, name):
        return getattr(self._tier, name)


__all__ = ["Counted", "Sources"]
