"""The catalogue: which versions are committed in which tier (docs/FORMAT.md, "committed"; Read rule 5).

A version is listed for a tier if and only if ``versions/<v>/manifest.json`` is present there and
parses with a valid checksum. Nothing is inferred from directory or object names.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as _dt
import functools
import hashlib
import json
import logging
import os
import stat
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from .._names import decode_version
from ..codec import xxh128
from ..errors import (
    InvalidNameError,
    ManifestError,
    ObjectNotFoundError,
    UnsupportedFormatError,
    VersionNotFoundError,
)
from ..tiers.base import ObjectInfo, Tier
from . import layout, order
from .schema import Manifest, ParsedManifest, parse

log = logging.getLogger("ckptstore")


@dataclasses.dataclass(frozen=True)
class VersionRecord:
    """A committed version as ``Store.versions()`` lists it.

    ``created``: commit time (UTC, timezone-aware). ``nbytes``: logical bytes (decoded tensors and
    blobs). ``stored_bytes``: bytes stored in one tier. ``tiers``: the tiers where it is committed.
    ``local_part``: for a version split over several local roots (``placement.is_split``), the
    :class:`~ckptstore.manifest.placement.Part` this local root holds; None for every other version
    (and when the ``local`` tier does not commit it) — see :attr:`tier_labels`.
    ``seq``: commit sequence (docs/FORMAT.md, "Order"; None for older manifests); ``supersedes``:
    ``((attempt, reason), ...)`` the earlier attempts of this name the commit replaced; ``stale``:
    ``((tier, attempt), ...)`` tiers that hold another copy of the name, which lost to this one
    (docs/FORMAT.md, "One name, one content"): reported, never loaded. Records sort by :attr:`order`.
    """

    version: str
    created: _dt.datetime
    step: int | None
    world_size: int
    nbytes: int
    stored_bytes: int
    tiers: frozenset
    pinned: bool
    damaged: bool
    attempt: str
    encrypted: bool
    key_id: str | None
    user: dict
    local_part: object = None  # placement.Part | None
    seq: int | None = None
    supersedes: tuple = ()
    stale: tuple = ()
    #: bytes deleting the version would free in its tier: its ``stored_bytes`` minus the objects other
    #: committed versions there reference (incremental saves, docs/FORMAT.md "References")
    unique_bytes: int | None = None
    #: bytes of earlier versions' objects this version references
    ref_bytes: int = 0
    #: NaN/±Inf values its floating tensors hold (docs/FORMAT.md, "Manifest": ``nonfinite``); None:
    #: not counted (an older release, ``count_nonfinite=False``). A version with any is not what
    #: ``Store.latest()`` returns nor what a restore picks by default
    nonfinite: int | None = None
    #: ``((ranks, domain), ...)``: each root group of a split version and its failure domain, as the
    #: manifest records them (docs/FORMAT.md, "Replicas"); empty when not recorded
    domains: tuple = ()

    @functools.cached_property  # a sort key, compared many times per listing
    def order(self) -> tuple:
        """The sort key (oldest first): step, commit sequence, commit time, name (docs/FORMAT.md, "Order")."""
        return order.order_key(self.step, self.seq, _iso(self.created), self.version)

    @property
    def in_future(self) -> bool:
        """The commit time lies in the future of this host's clock (by more than a few minutes): a
        skewed clock on the saving host. Order does not depend on it (docs/FORMAT.md, "Order")."""
        return order.in_future(self.created)

    @property
    def tier_labels(self) -> list[str]:
        """The tiers, sorted, the local one as ``local(part k/n)`` when it holds a part only."""
        part = self.local_part
        return [f"local({part.label})" if t == "local" and part is not None and not part.whole else t
                for t in sorted(self.tiers)]

    def to_json(self) -> dict:
        """The record as ``ckptstore list --json`` prints it; ``parts`` maps a tier that holds a part
        of a split version to ``{"index", "count", "ranks", "whole"}`` (and ``"domain"`` when recorded;
        empty otherwise); ``domains`` lists every root group as ``{"ranks", "domain"}``."""
        d = dataclasses.asdict(dataclasses.replace(self, local_part=None))
        del d["local_part"]
        d["created"] = _iso(self.created)
        d["tiers"] = sorted(self.tiers)
        d["supersedes"] = [{"attempt": a, "reason": r} for a, r in self.supersedes]
        d["stale"] = [{"tier": t, "attempt": a} for t, a in self.stale]
        d["in_future"] = self.in_future
        d["parts"] = {} if self.local_part is None else {"local": self.local_part.to_json()}
        d["domains"] = [{"ranks": list(g), "domain": dom} for g, dom in self.domains]
        return d


def _iso(t: _dt.datetime) -> str:
    return t.astimezone(_dt.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclasses.dataclass
class TierEntry:
    manifest: Manifest
    parsed: ParsedManifest
    pinned: bool
    damaged: bool
    md5: str = ""  # MD5 (hex) of the manifest file: what a remote listing reports (docs/FORMAT.md, "Tiers", rule 3)


@dataclasses.dataclass(frozen=True)
class VersionDir:
    """One version directory as a listing of it shows it (docs/FORMAT.md, "Layout by example"):
    ``enc`` (its name, the encoded version), ``manifest`` (the ``manifest.json`` listing entry:
    size, mtime and, on a remote tier, the listed MD5; None when absent), whether ``pinned`` and ``damaged.json``
    are there, and whether it has an ``attempts/`` directory."""

    enc: str
    manifest: ObjectInfo | None
    pinned: bool
    damaged: bool
    attempts: bool

    @property
    def manifest_key(self) -> str:
        return f"{layout.VERSIONS}/{self.enc}/{layout.MANIFEST}"


#: concurrent listings of version directories on a tier that is not local (one request each)
_LIST_THREADS = 16


class _Settled:
    """What was read from local directories and files, held while their ``stat`` is unchanged.

    Committing, un-committing, pinning and marking a version each add, rename or remove an entry of
    its directory (docs/FORMAT.md, "Layout by example"), which sets the directory's mtime and
    ctime; a file rewritten in place sets its own. So a listing or a manifest read earlier is still
    what a read now returns while the same paths show the same ``(device, inode, size, mtime, ctime)``
    — except for a change made within the file system's timestamp granularity (a kernel tick) of
    the earlier read. Hence the rule git's index follows for "racily clean" entries: a value is held
    only for paths whose timestamps are older than :attr:`SETTLE_NS`, and a path touched since is
    read again. The save path's housekeeping (retention after each commit, the commit-sequence hint,
    the reclaim of killed writers' attempts) thus costs a ``stat`` or two per version of a large root
    instead of a listing and a manifest read and parse. On a remote tier whose listing carries each
    manifest's MD5 (docs/FORMAT.md, "Tiers", rule 3) a parse is held by that MD5 instead
    (:meth:`hold`, :meth:`recall`): a listing still asks for each version directory, but fetches only
    the manifests it has not read. Bounded in count and bytes (:meth:`hold`)."""

    SETTLE_NS = 1_000_000_000
    #: held values at most, and at most this many bytes of the files they were read from (the
    #: manifests: their parses are held, as by :class:`_ParseCache`)
    LIMIT = 1 << 16
    LIMIT_BYTES = 32 << 20
    #: when full, an entry unused this long (seconds) makes room; a listing pass touches every live one
    IDLE_S = 60.0

    def __init__(self) -> None:
        self._held: collections.OrderedDict = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple, paths: tuple, compute: Callable[[], Any], *, first: os.stat_result | None = None,
            settled_before: int | None = None) -> Any:
        """``compute()``, or what it returned before for ``key`` while ``paths`` are unchanged and
        settled. A path that does not exist is a stamp of its own (compute decides what it means).
        ``first``: the ``stat`` of ``paths[0]`` when the caller has it (a ``scandir`` entry's);
        ``settled_before``: the cut-off (ns) of one listing pass."""
        stamp = []
        if settled_before is None:
            settled_before = time.time_ns() - self.SETTLE_NS
        settled = True
        weight = 256  # an entry's own cost, plus the bytes of the files (not directories) it was read from
        for i, p in enumerate(paths):
            try:
                st = first if i == 0 and first is not None else os.stat(p)
            except FileNotFoundError:
                stamp.append(None)
                continue
            stamp.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
            settled = settled and max(st.st_mtime_ns, st.st_ctime_ns) < settled_before
            if stat.S_ISREG(st.st_mode):
                weight += st.st_size
        stamp = tuple(stamp)
        with self._lock:
            hit = self._held.get(key)
            if hit is not None and hit[0] == stamp and settled:
                hit[3] = time.monotonic()
                self._held.move_to_end(key)
                return hit[1]
        value = compute()  # after the stat: a change made meanwhile changes the stamp seen next time
        if settled:
            self.hold(key, stamp, value, weight)
        else:
            with self._lock:
                old = self._held.pop(key, None)
                if old is not None:
                    self._bytes -= old[2]
        return value

    def recall(self, key: tuple, stamp: Any) -> Any:
        """What :meth:`hold` put for ``key`` with this very ``stamp`` (a stamp the caller vouches for:
        a listed MD5), or None."""
        with self._lock:
            hit = self._held.get(key)
            if hit is None or hit[0] != stamp:
                return None
            hit[3] = time.monotonic()
            self._held.move_to_end(key)
            return hit[1]

    def hold(self, key: tuple, stamp: Any, value: Any, weight: int) -> None:
        """Hold ``value`` for ``key`` while the caller sees ``stamp``. When full, the entries unused for
        :attr:`IDLE_S` go first (least recently used); if that is not enough the new one is not held:
        a root larger than the bound keeps the part held that fits, instead of every listing's
        sequential pass evicting what the next pass needs (a plain LRU would hold nothing useful)."""
        now = time.monotonic()
        with self._lock:
            old = self._held.pop(key, None)
            if old is not None:
                self._bytes -= old[2]
            while self._held and (len(self._held) >= self.LIMIT or self._bytes + weight > self.LIMIT_BYTES):
                first = next(iter(self._held.values()))
                if now - first[3] < self.IDLE_S:
                    return  # full of entries in use
                self._bytes -= self._held.popitem(last=False)[1][2]
            if weight <= self.LIMIT_BYTES // 8:
                self._held[key] = [stamp, value, weight, now]
                self._bytes += weight

    def peek(self, key: tuple) -> Any:
        """What is held for ``key`` (no check: for a value :meth:`get` returned in the same pass), or None."""
        with self._lock:
            hit = self._held.get(key)
        return None if hit is None else hit[1]


_settled = _Settled()

#: file systems whose timestamps this host sets itself at the change, at most 1 s coarse, and whose
#: ``stat`` is never served from a cache of another host's attributes: the ones :class:`_Settled`
#: trusts. A root elsewhere (NFS, Lustre, GPFS, CIFS, a FUSE mount such as gcsfuse or s3fs, whose
#: attributes may be cached for seconds or set by another clock) is listed and read every time.
_HELD_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "zfs", "f2fs", "bcachefs", "overlay", "ramfs", "jfs"})


@functools.lru_cache(maxsize=256)
def _holds(path: str) -> bool:
    """Whether ``path`` lies on a file system of :data:`_HELD_FS` (the longest mount point of
    ``/proc/self/mounts`` above it); False where that cannot be told."""
    try:
        real = os.path.realpath(path)
        best, kind = "", None
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mnt = fields[1].replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, fields[2]
        return kind in _HELD_FS
    except OSError:
        return False


def version_dirs(tier: Tier, *, held: bool = False) -> dict[str, VersionDir]:
    """``{encoded name: VersionDir}`` of every directory under ``versions/``: one listing of
    ``versions/`` and one of each version directory, both one level deep (``Tier.list_dir``: the object store's
    ``Delimiter="/"``) — never the objects of the attempts (docs/FORMAT.md, "Restore choice"). On
    an object store that is 1 + V small requests (the directories' listings run concurrently) instead of one page
    per 1,000 objects of every version. A directory whose name is not a valid key is listed
    empty. ``held``: on a local tier, each directory's entry is held while it is unchanged
    (:class:`_Settled`; for the listings a process repeats: :func:`scan`, the save path's), so a
    listing of a large root costs a ``scandir`` and two ``stat`` calls per version; a one-time
    listing (a restore's root report) passes False and makes no ``stat`` call."""
    def one(enc: str) -> VersionDir:
        try:
            files, sub = tier.list_dir(f"{layout.VERSIONS}/{enc}/")
        except InvalidNameError:  # not a version's directory ("versions/a copy"): nothing committed there
            return VersionDir(enc, None, False, False, False)
        names = {i.key.rsplit("/", 1)[-1]: i for i in files}
        return VersionDir(enc, names.get(layout.MANIFEST), layout.PINNED in names, layout.DAMAGED in names,
                          f"{layout.VERSIONS}/{enc}/{layout.ATTEMPTS}/" in sub)

    root = tier.local_path(layout.VERSIONS) if held else None
    if root is not None and _holds(root):
        # one entry per version, [VersionDir, TierEntry or None], held while the directory and its
        # manifest are unchanged (_entry fills the second slot): one scandir, and the stat of each
        # directory it makes and of its manifest
        cut = time.time_ns() - _Settled.SETTLE_NS
        found = []
        try:
            with os.scandir(root) as it:
                for e in it:
                    try:
                        if not e.is_dir():
                            continue
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    found.append(_settled.get(("v", root, e.name), (e.path, os.path.join(e.path, layout.MANIFEST)),
                                              lambda e=e.name: [one(e), None], first=st, settled_before=cut)[0])
            return {d.enc: d for d in sorted(found, key=lambda d: d.enc)}
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError:
            pass  # a refused stat or listing: the tier's own listing below raises it, typed
    _files, dirs = tier.list_dir(layout.VERSIONS + "/")
    encs = [d[len(layout.VERSIONS) + 1 : -1] for d in dirs]

    if tier.local_path(layout.VERSIONS) is not None or len(encs) <= 1:
        found = [one(e) for e in encs]
    else:
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(min(_LIST_THREADS, len(encs)), thread_name_prefix="ckptstore-list") as ex:
            found = list(ex.map(one, encs))
    return {d.enc: d for d in found}


def attempt_dirs(tier: Tier, vd: VersionDir) -> list[str]:
    """The keys (``versions/<v>/attempts/<attempt>/``) of the attempt directories of a listed version
    directory: one listing (held while unchanged on a local tier, :class:`_Settled`)."""
    if not vd.attempts:
        return []
    prefix = f"{layout.VERSIONS}/{vd.enc}/{layout.ATTEMPTS}/"
    root = tier.local_path(layout.VERSIONS)
    if root is None:
        return tier.list_dir(prefix)[1]
    return _settled.get(("attempts", root, vd.enc), (os.path.join(root, vd.enc, layout.ATTEMPTS),),
                        lambda: tier.list_dir(prefix)[1])


def committed_attempt(tier: Tier, vd: VersionDir) -> str | None:
    """The attempt the manifest of a listed version directory commits; None when it has no valid
    manifest (quietly: :func:`scan` reports invalid ones)."""
    if vd.manifest is None:
        return None
    try:
        return _entry(tier, vd, decode_version(vd.enc), tier.local_path(layout.VERSIONS)).manifest.attempt
    except (ObjectNotFoundError, ManifestError, UnsupportedFormatError, InvalidNameError):
        return None


def manifest_keys(tier: Tier) -> list[str]:
    """Keys of every ``manifest.json`` in the tier (one directory listing locally, plus an
    existence check per version; elsewhere :func:`version_dirs`)."""
    root = tier.local_path(layout.VERSIONS)
    if root is not None:
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            return []
        return [f"{layout.VERSIONS}/{n}/{layout.MANIFEST}" for n in names if os.path.exists(os.path.join(root, n, layout.MANIFEST))]
    return [d.manifest_key for d in version_dirs(tier).values() if d.manifest is not None]


def read_manifest(tier: Tier, version: str) -> ParsedManifest:
    try:
        data = tier.get(layout.manifest_key(version))
    except ObjectNotFoundError:
        raise VersionNotFoundError(
            f"version {version!r} is not committed in the {tier.name} tier ({tier.url}); "
            "run 'ckptstore list' to see the versions there"
        ) from None
    return parse(data, expect_version=version)


class _ParseCache:
    """Manifests :func:`scan` parsed, by (version, length and XXH3-128 of the bytes): a manifest's
    parse depends on its bytes and name alone, so bytes read again (retention after every commit
    scans the whole root: a positions save every 0.2 s re-read hundreds of manifests) are not parsed
    again. Bounded by the bytes of the manifests held (the most recently used kept); a manifest
    that does not parse is never held."""

    LIMIT = 32 << 20

    def __init__(self) -> None:
        self._held: collections.OrderedDict = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def parse(self, data: bytes, version: str) -> ParsedManifest:
        key = (version, len(data), xxh128(data))
        with self._lock:
            hit = self._held.get(key)
            if hit is not None:
                self._held.move_to_end(key)
                return hit
        parsed = parse(data, expect_version=version)  # raises for a manifest that is not valid
        if len(data) <= self.LIMIT // 8:
            with self._lock:
                if key not in self._held:
                    self._held[key] = parsed
                    self._bytes += len(data)
                while self._bytes > self.LIMIT:
                    (_v, n, _h), _p = self._held.popitem(last=False)
                    self._bytes -= n
        return parsed


_parsed = _ParseCache()


def scan(tier: Tier, problems: list | None = None) -> dict[str, TierEntry]:
    """The versions committed in ``tier``: ``{version: TierEntry}``.

    A manifest that fails to parse or its checksum (or sits in a directory that is not a version
    name) is *invalid*: skipped, logged, and appended to ``problems`` as ``(tier, key, why)``. A
    storage error is not a verdict on the manifest (docs/FORMAT.md, Read rule 5): the tier has
    already retried it (its SDK's retries on a remote tier), so it is raised, never turned into a missing
    version.
    """
    out: dict[str, TierEntry] = {}
    root = tier.local_path(layout.VERSIONS)
    for vd in version_dirs(tier, held=True).values():
        if vd.manifest is None:
            continue
        key = vd.manifest_key
        try:
            version = decode_version(vd.enc)
            entry = _entry(tier, vd, version, root)
        except ObjectNotFoundError:
            continue  # un-committed while we listed
        except (ManifestError, UnsupportedFormatError, InvalidNameError) as e:
            log.warning("ignoring invalid manifest %s in %s tier: %s", key, tier.name, e)
            if problems is not None:
                problems.append((tier.name, key, str(e)))
            continue
        out[version] = TierEntry(entry.manifest, entry.parsed, entry.pinned, entry.damaged, entry.md5)  # the held one is shared
    return out


def _entry(tier: Tier, vd: VersionDir, version: str, root: str | None) -> TierEntry:
    """The :class:`TierEntry` of one listed version directory (raises as :func:`scan` expects);
    ``root``: the local path of ``versions/`` (the entry is then held with the listing's
    :class:`VersionDir`, while the directory and its manifest are unchanged: a damage mark or a pin
    is added, replaced or removed by a rename or an unlink in the directory, :class:`_Settled`), or None."""
    if root is not None:
        held = _settled.peek(("v", root, vd.enc))  # what version_dirs(held=True) just returned
        if held is not None and held[0] is vd:  # the listing just returned this one: same stamp
            if held[1] is None:
                held[1] = _entry(tier, vd, version, None)
            return held[1]
    elif tier.listing_md5 and vd.manifest is not None and vd.manifest.md5:
        # a remote tier whose listing carries each manifest's MD5 (docs/FORMAT.md, "Tiers", rule 3):
        # a manifest listed with the MD5 of one already read and parsed is not fetched again
        key = ("md5", tier.url, vd.enc)
        parsed = _settled.recall(key, vd.manifest.md5)
        if parsed is None:
            data = tier.get(vd.manifest_key)
            md5 = hashlib.md5(data, usedforsecurity=False).hexdigest()
            parsed = _parsed.parse(data, version)
            if md5 == vd.manifest.md5:  # else it changed since the listing: the next scan reads it again
                _settled.hold(key, md5, parsed, 256 + len(data))
        else:
            md5 = vd.manifest.md5
        damaged = vd.damaged and _mark_applies(tier, f"{layout.VERSIONS}/{vd.enc}/{layout.DAMAGED}", parsed.manifest.attempt)
        return TierEntry(parsed.manifest, parsed, vd.pinned, damaged, md5)
    data = tier.get(vd.manifest_key)
    parsed = _parsed.parse(data, version)
    damaged = vd.damaged and _mark_applies(tier, f"{layout.VERSIONS}/{vd.enc}/{layout.DAMAGED}", parsed.manifest.attempt)
    return TierEntry(parsed.manifest, parsed, vd.pinned, damaged, hashlib.md5(data, usedforsecurity=False).hexdigest())


def _mark_applies(tier: Tier, key: str, attempt: str) -> bool:
    """Whether the damage mark ``key`` applies to ``attempt``: a mark left by scrub for an older
    attempt does not; an unreadable mark counts as damage, a storage error is raised."""
    try:
        att = json.loads(tier.get(key)).get("attempt")
    except ObjectNotFoundError:
        return False  # removed while we listed
    except (ValueError, AttributeError, RecursionError):  # not JSON / not an object: treat as damaged
        return True
    return att is None or att == attempt


def merge(per_tier: dict[str, dict[str, TierEntry]]) -> list[VersionRecord]:
    """Combine the tiers' entries into records, oldest → newest by :func:`order.order_key`.

    When tiers hold different attempts of one name, :func:`order.resolve` decides which copy is the
    version (docs/FORMAT.md, "One name, one content"); the others are listed as ``stale``."""
    names: set[str] = set()
    for entries in per_tier.values():
        names.update(entries)
    refs = {t: referenced(e) for t, e in per_tier.items()}
    recs = []
    for v in names:
        holders = {t: e[v] for t, e in per_tier.items() if v in e}
        one = len(holders) == 1
        if one:  # one copy: it is the version (order.resolve's answer, without its inputs)
            att = next(iter(holders.values())).manifest.attempt
        else:
            att = order.resolve([copy_of(e.manifest, remote=(t == "remote")) for t, e in holders.items()])
        t_best, best = next((t, e) for t, e in holders.items() if e.manifest.attempt == att)
        m = best.manifest
        held = refs[t_best]
        shared = sum(o.size for o in m.all_objects() if layout.object_key(v, o.name) in held) if held else 0
        alone = one and not shared
        if alone:
            hit = _records.get(m, (t_best, v))
            if hit is not None and hit[0] == (best.pinned, best.damaged):
                recs.append(hit[1])
                continue
        tiers = frozenset(t for t, e in holders.items() if e.manifest.attempt == att)
        rec = (
            VersionRecord(
                version=v,
                created=m.created_dt,
                step=m.step,
                world_size=m.world_size,
                nbytes=m.nbytes,
                stored_bytes=m.stored_bytes,
                tiers=tiers,
                pinned=any(e.pinned for e in holders.values()),
                damaged=any(e.damaged for e in holders.values() if e.manifest.attempt == att),
                attempt=att,
                encrypted=m.encrypted,
                key_id=(m.encryption or {}).get("key_id"),
                user=m.user,
                seq=m.seq,
                supersedes=tuple((d["attempt"], d.get("reason", "")) for d in m.supersedes or ()),
                stale=tuple(sorted((t, e.manifest.attempt) for t, e in holders.items() if e.manifest.attempt != att)),
                unique_bytes=m.stored_bytes - shared,
                ref_bytes=sum(r.size for r in m.refs),
                nonfinite=m.nonfinite_count,
                domains=tuple((tuple(g), dom) for g, dom in zip(m.placement or (), m.domains or ())),
            )
        )
        recs.append(rec)
        if alone:
            _records.put(m, (t_best, v), ((best.pinned, best.damaged), rec))
    recs.sort(key=lambda r: r.order)
    return recs


class _Records:
    """The :class:`VersionRecord` :func:`merge` built for a version held by one tier, while that tier's
    entry holds the same manifest object (a held listing returns the same parse while the directory
    is unchanged, :class:`_Settled`) with the same pin and damage marks and no other version
    references its objects: a save's retention pass then builds records only for what changed
    (10.7 → 1.5 µs per version of a root of 852). Records are immutable. A manifest's records live
    as long as the manifest object (a weak reference: what holds the parses, :class:`_Settled` and
    :class:`_ParseCache`, bounds them in bytes; a version deleted or rewritten takes its records
    with its parse)."""

    def __init__(self) -> None:
        self._held: dict = {}  # id(manifest) -> (weak reference to it, {(tier, version): (flags, record)})
        self._lock = threading.Lock()

    def get(self, m: Manifest, key: tuple):
        h = self._held.get(id(m))
        return None if h is None or h[0]() is not m else h[1].get(key)

    def put(self, m: Manifest, key: tuple, value: tuple) -> None:
        with self._lock:
            h = self._held.get(id(m))
            if h is None or h[0]() is not m:
                h = (weakref.ref(m, functools.partial(self._drop, id(m))), {})
                self._held[id(m)] = h
            h[1][key] = value

    def _drop(self, ident: int, ref: weakref.ref) -> None:
        # called by the collector at any point, maybe in a thread that holds the lock: no lock here;
        # a racing put for a new object at the same address loses its entry (a later miss, no harm)
        h = self._held.get(ident)
        if h is not None and h[0] is ref:
            self._held.pop(ident, None)


_records = _Records()


def referenced(entries: dict, exclude=()) -> dict:
    """``{key: [referencing versions]}``: the objects of earlier versions that the committed manifests
    ``entries`` (``{version: TierEntry}``, one tier) reference (docs/FORMAT.md, "References"),
    leaving out the manifests of the versions in ``exclude`` (those being deleted)."""
    out: dict = {}
    for v, e in entries.items():
        if v in exclude:
            continue
        for r in e.manifest.refs:
            out.setdefault(layout.object_key(r.version, r.name), []).append(v)
    return out


def copy_of(m: Manifest, *, remote: bool = False) -> dict:
    """The facts :func:`order.resolve` compares about one copy of a version."""
    return {"attempt": m.attempt, "supersedes": m.superseded_attempts, "remote": remote, "seq": m.seq,
            "created": m.created}


#: per local root (path of ``versions/``): ``{encoded name: (directory stamp, commit sequence)}`` of
#: the manifests :func:`max_seq` read, replaced whole by each pass; the roots most recently used
_seqs: dict[str, dict[str, tuple]] = {}
_seqs_lock = threading.Lock()
_SEQS_ROOTS = 64


def _seq_of(tier: Tier, enc: str) -> int | None:
    try:
        return _parsed.parse(tier.get(f"{layout.VERSIONS}/{enc}/{layout.MANIFEST}"), decode_version(enc)).manifest.seq
    except (ObjectNotFoundError, ManifestError, UnsupportedFormatError, InvalidNameError):
        return None


def max_seq(tier: Tier, newest: int = 4) -> int | None:
    """The highest commit sequence among the manifests of a local ``tier``: a hint for
    :func:`order.next_seq`, taken at every save. Where a root's entries may be held
    (:func:`_holds`), every manifest counts: one ``scandir`` of ``versions/`` and the ``stat`` it
    makes of each version directory, and a manifest is read again only when its directory changed
    (a commit links it in, an overwrite renames it in: both set the directory's timestamps; unlike
    :class:`_Settled`, without waiting for them to settle: a change within one timestamp tick of
    the previous read may be missed, which only makes the hint lower);
    elsewhere the ``newest`` most recently modified ones (reading every manifest of a large root at
    every save would cost more than the hint is worth). None when it holds none with a sequence, and
    for a tier that is not local. Never raises for what it finds in the root."""
    root = tier.local_path(layout.VERSIONS)
    if root is None:
        return None
    best = None
    if _holds(root):
        with _seqs_lock:
            held = _seqs.get(root, {})  # never changed in place: a pass replaces it
        now: dict[str, tuple] = {}
        try:
            with os.scandir(root) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if not stat.S_ISDIR(st.st_mode):
                        continue
                    stamp = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
                    h = held.get(e.name)
                    # unlike a listing, the hint holds a directory not settled yet too: a change
                    # within one timestamp tick of the read can be missed, which a hint may afford,
                    # while reading every recent manifest at every save made quick saves quadratic
                    seq = h[1] if h is not None and h[0] == stamp else _seq_of(tier, e.name)
                    now[e.name] = (stamp, seq)
                    if seq is not None and (best is None or seq > best):
                        best = seq
        except (FileNotFoundError, NotADirectoryError):
            return None
        with _seqs_lock:
            _seqs.pop(root, None)
            _seqs[root] = now  # the directories gone since are dropped
            while len(_seqs) > _SEQS_ROOTS:
                del _seqs[next(iter(_seqs))]
        return best
    stamped = []
    for key in manifest_keys(tier):
        try:
            stamped.append((os.stat(tier.local_path(key)).st_mtime_ns, key))
        except FileNotFoundError:
            continue
    for _t, key in sorted(stamped, reverse=True)[:newest]:
        try:
            m = parse(tier.get(key)).manifest
        except (ObjectNotFoundError, ManifestError, UnsupportedFormatError, InvalidNameError):
            continue
        if m.seq is not None and (best is None or m.seq > best):
            best = m.seq
    return best


def damage_note(tier: Tier, version: str) -> str:
    try:
        return json.loads(tier.get(layout.damaged_key(version))).get("reason", "")
    except Exception:
        return ""
