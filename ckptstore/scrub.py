"""Scrub: verify every committed version's stored objects, per tier, and optionally repair them.

What is checked, for each version committed in a tier (its ``manifest.json`` parses with a valid
seal) and each object the manifest names (the DCP metadata object and every rank's shard):

* **presence** and **size** (kinds ``missing``, ``truncated``, ``oversized``);
* the **frame walk** without an index or key (:class:`ckptstore.codec.frame.FrameWalk`: every
  header checksum, frame index, payload XXH3-64; kind ``corrupt``);
* the **object digest** — XXH3-64 over the concatenated frame headers, as recorded in the
  manifest's :class:`~ckptstore.manifest.schema.ObjectEntry` (kind ``digest``) — and the **frame
  count** (kind ``frame-count``);
* with ``deep``: the wrapped data key unwraps (kind ``key``, a damaged wrapped key), the manifest's
  HMAC (kind ``manifest``), every frame decrypts (AEAD tag) and decompresses to its raw length
  (:meth:`FrameCodec.decode`; kind ``undecodable``), and the DCP metadata (read with
  :meth:`ckptstore.StorageReader.read_metadata` and the same allow-list unpickler) references only
  objects the manifest lists and frames that exist in them, exactly (kind ``metadata``). Needs the
  key for encrypted versions (``key=``, ``CKPTSTORE_KEY``, ``CKPTSTORE_KEY_FILE``); without it
  the deep part of those versions is reported as *not checked*.

A manifest that is present but fails to parse is reported as damage of kind ``manifest``.

With ``repair``: a damaged or missing object is restored from another tier where the same version
is committed by the **same attempt** and whose copy verifies (to the same depth); the copy is
verified again before it replaces the damaged one (locally through a ``.tmp-*`` file and an atomic
rename). Damage that cannot be repaired marks the version damaged in that tier
(``versions/<v>/damaged.json`` with the reason, the attempt and the objects); ``Store.latest()``
skips, and ``StorageReader`` refuses, such a version. A version marked damaged that now verifies
(at least as deeply as when it was marked, or whose mark names another attempt) has its mark
removed. Fault point ``scrub.repair`` precedes every repair write (object restore, mark, unmark).

Exit codes (``ckptstore scrub``; also :attr:`ScrubReport.exit_code`), most severe first:

====  ======================  =========================================================
10    ``EXIT_DAMAGE``         damage found and not (all) repaired
12    ``EXIT_UNCHECKED``      no unrepaired damage, but something could not be checked
                              (key missing for ``--deep``, tier unreachable, read error)
11    ``EXIT_REPAIRED``       damage found and all of it repaired
0     ``EXIT_CLEAN``          everything checked and clean
====  ======================  =========================================================
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

from . import _faults
from .codec.crypto import FrameCipher, resolve_key, unwrap_key
from .codec.frame import FrameCodec, FrameWalk
from .errors import (
    CkptStoreError,
    IntegrityError,
    KeyMismatchError,
    ManifestError,
    ObjectNotFoundError,
    UnsupportedFormatError,
    VersionNotFoundError,
)
from .manifest import catalogue, layout
from .manifest.schema import ObjectEntry, utcnow
from .tiers.base import Tier, tiers_of

EXIT_CLEAN = 0
EXIT_DAMAGE = 10
EXIT_REPAIRED = 11
EXIT_UNCHECKED = 12

OK = "ok"
DAMAGED = "damaged"
REPAIRED = "repaired"
UNCHECKED = "unchecked"

#: damage kinds of one object
OBJECT_KINDS = ("missing", "truncated", "oversized", "corrupt", "digest", "frame-count", "undecodable")
#: damage kinds of a version as a whole
VERSION_KINDS = ("manifest", "key", "metadata", "marked")

_WINDOW = 16 << 20


@dataclasses.dataclass
class ObjectCheck:
    """The verdict on one object of one version in one tier."""

    tier: str
    version: str
    name: str
    key: str
    size: int
    status: str = OK
    kind: str | None = None
    detail: str = ""
    repaired_from: str | None = None
    frames: list = dataclasses.field(default_factory=list, repr=False, compare=False)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("name", "key", "size", "status", "kind", "detail", "repaired_from")}


@dataclasses.dataclass
class Issue:
    """A finding about a version as a whole (``kind`` in :data:`VERSION_KINDS`, or a note)."""

    kind: str
    detail: str
    status: str = DAMAGED

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class VersionCheck:
    """The verdict on one version in one tier: its objects, version-level issues, mark changes."""

    tier: str
    version: str
    attempt: str | None
    encrypted: bool = False
    deep: bool = False
    objects: list[ObjectCheck] = dataclasses.field(default_factory=list)
    issues: list[Issue] = dataclasses.field(default_factory=list)
    was_marked: bool = False
    mark: str | None = None  # "marked damaged" | "mark removed"

    @property
    def status(self) -> str:
        items = [o.status for o in self.objects] + [i.status for i in self.issues]
        if DAMAGED in items:
            return DAMAGED
        if UNCHECKED in items:
            return UNCHECKED
        if REPAIRED in items or self.mark == "mark removed":
            return REPAIRED
        return OK

    def damaged_objects(self) -> list[ObjectCheck]:
        return [o for o in self.objects if o.status == DAMAGED]

    def to_json(self) -> dict:
        return {
            "tier": self.tier,
            "version": self.version,
            "attempt": self.attempt,
            "status": self.status,
            "encrypted": self.encrypted,
            "deep": self.deep,
            "was_marked_damaged": self.was_marked,
            "mark": self.mark,
            "issues": [i.to_json() for i in self.issues],
            "objects": [o.to_json() for o in self.objects],
        }


@dataclasses.dataclass
class ScrubReport:
    deep: bool
    repair: bool
    versions: list[VersionCheck] = dataclasses.field(default_factory=list)
    unreachable: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (tier, why)

    @property
    def exit_code(self) -> int:
        st = [v.status for v in self.versions]
        if DAMAGED in st:
            return EXIT_DAMAGE
        if UNCHECKED in st or self.unreachable:
            return EXIT_UNCHECKED
        if REPAIRED in st:
            return EXIT_REPAIRED
        return EXIT_CLEAN

    def damage(self) -> list[tuple[str, str, str, str]]:
        """``(tier, version, object or '', kind)`` of every damage found (repaired or not)."""
        out = []
        for v in self.versions:
            for o in v.objects:
                if o.kind is not None and o.status in (DAMAGED, REPAIRED):
                    out.append((v.tier, v.version, o.name, o.kind))
            for i in v.issues:
                if i.status in (DAMAGED, REPAIRED):
                    out.append((v.tier, v.version, "", i.kind))
        return out

    def to_json(self) -> dict:
        return {
            "exit_code": self.exit_code,
            "deep": self.deep,
            "repair": self.repair,
            "unreachable": [{"tier": t, "why": w} for t, w in self.unreachable],
            "versions": [v.to_json() for v in self.versions],
            "summary": {
                "versions": len(self.versions),
                "objects": sum(len(v.objects) for v in self.versions),
                "damaged": sum(1 for v in self.versions if v.status == DAMAGED),
                "repaired": sum(1 for v in self.versions if v.status == REPAIRED),
                "unchecked": sum(1 for v in self.versions if v.status == UNCHECKED) + len(self.unreachable),
            },
        }


# -- reading -----------------------------------------------------------------------------------------
class _Window:
    """``read(offset, n)`` over an object, fetching windows of at least 16 MiB."""

    def __init__(self, fetch: Callable[[int, int], bytes], size: int):
        self._fetch = fetch
        self._size = size
        self._start = 0
        self._buf = b""

    def __call__(self, off: int, n: int):
        if self._start <= off and off + n <= self._start + len(self._buf):
            s = off - self._start
            return memoryview(self._buf)[s : s + n]
        end = min(self._size, off + max(n, _WINDOW))
        data = self._fetch(off, end)
        if len(data) != end - off:
            raise IntegrityError(f"short read at offset {off}: {len(data)} of {end - off} bytes (object changed?)")
        self._start, self._buf = off, data
        return memoryview(data)[:n]


def _open_object(tier: Tier, key: str):
    """``(size, fetch, close)`` for ``key``; raises ObjectNotFoundError."""
    path = tier.local_path(key)
    if path is not None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ObjectNotFoundError(f"object {key!r} not found in {tier.name} tier", object=key) from None
        except OSError as e:
            raise CkptStoreError(f"cannot open {key!r}: {e.strerror}") from None
        size = os.fstat(fd).st_size

        def fetch(s, e):
            first = os.pread(fd, e - s, s)
            if len(first) == e - s or not first:
                return first
            out = bytearray(first)
            while len(out) < e - s:
                chunk = os.pread(fd, e - s - len(out), s + len(out))
                if not chunk:
                    break
                out += chunk
            return bytes(out)

        return size, fetch, lambda: os.close(fd)
    size = tier.stat(key).size
    return size, (lambda s, e: tier.get(key, s, e)), (lambda: None)


def verify_stream(read, size: int, entry: ObjectEntry, codec: FrameCodec | None = None,
                  on_bytes: Callable[[int], None] | None = None) -> tuple[str | None, str, list]:
    """Check one object held in ``read(offset, n)`` of ``size`` bytes against its manifest entry.

    Returns ``(kind, detail, frames)``: ``kind`` None when clean; ``frames`` the walked frames as
    ``(offset, length, index, payload_xxh3, raw_len)``. With ``codec`` every frame is decoded too.
    """
    if size < entry.size:
        return "truncated", f"{size} bytes, the manifest says {entry.size} ({entry.size - size} missing)", []
    if size > entry.size:
        return "oversized", f"{size} bytes, the manifest says {entry.size}", []
    walk = FrameWalk(read, entry.size, entry.name)
    try:
        for off, hd, length in walk:
            if codec is not None:
                try:
                    codec.decode(entry.name, read(off, length), None)
                except (IntegrityError, KeyMismatchError) as e:
                    return "undecodable", _about(entry.name, e), walk.frames
            if on_bytes is not None:
                on_bytes(length)
    except IntegrityError as e:
        return "corrupt", _about(entry.name, e), walk.frames
    bad = walk.mismatch(entry.frames, entry.digest, entry.nbytes)
    if bad is not None:
        return bad[0], bad[1], walk.frames
    return None, "", walk.frames


def _about(name: str, e: Exception) -> str:
    """``e``'s message without a leading ``"<name>: "`` (the report names the object already)."""
    text = str(e)
    return text[len(name) + 2:] if text.startswith(name + ": ") else text


def check_object(tier: Tier, tier_name: str, version: str, entry: ObjectEntry, codec: FrameCodec | None = None,
                 on_bytes: Callable[[int], None] | None = None) -> ObjectCheck:
    key = layout.object_key(version, entry.name)
    oc = ObjectCheck(tier_name, version, entry.name, key, entry.size)
    try:
        size, fetch, close = _open_object(tier, key)
    except ObjectNotFoundError:
        oc.status, oc.kind, oc.detail = DAMAGED, "missing", "object is missing"
        return oc
    except CkptStoreError as e:
        oc.status, oc.detail = UNCHECKED, f"could not read: {e}"
        return oc
    try:
        kind, detail, frames = verify_stream(_Window(fetch, size), size, entry, codec, on_bytes)
    except UnsupportedFormatError as e:
        oc.status, oc.detail = UNCHECKED, f"codec not supported by this release: {e}"
        return oc
    except ObjectNotFoundError:
        oc.status, oc.kind, oc.detail = DAMAGED, "missing", "object vanished while being read"
        return oc
    except CkptStoreError as e:
        oc.status, oc.detail = UNCHECKED, f"could not read: {e}"
        return oc
    finally:
        close()
    oc.frames = frames
    if kind is not None:
        oc.status, oc.kind, oc.detail = DAMAGED, kind, detail
    return oc


# -- the scrub ---------------------------------------------------------------------------------------
def scrub(
    store,
    *,
    version: str | None = None,
    deep: bool = False,
    repair: bool = False,
    key=None,
    on_total: Callable[[int], None] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> ScrubReport:
    """Verify (and with ``repair`` fix) the committed versions of ``store`` (a :class:`Store` or a
    ``{name: Tier}`` mapping). ``version``: only that one (raises :class:`VersionNotFoundError` when
    no reachable tier commits it). ``key``: master key for ``deep`` (default ``CKPTSTORE_KEY`` /
    ``CKPTSTORE_KEY_FILE``). ``on_total(bytes)``/``on_bytes(n)``: progress callbacks.
    """
    tiers = tiers_of(store)
    report = ScrubReport(deep=deep, repair=repair)
    master = None
    key_problem = None
    if deep:
        try:
            master = resolve_key(key if key is not None else getattr(store, "key", None))
        except KeyMismatchError as e:
            key_problem = str(e)
    entries: dict[str, dict] = {}
    for name, t in tiers.items():
        problems: list = []
        try:
            entries[name] = catalogue.scan(t, problems)
        except (CkptStoreError, OSError) as e:
            report.unreachable.append((name, f"{type(e).__name__}: {e}"))
            continue
        for _t, mkey, why in problems:
            v = layout.version_of_key(mkey)
            if version is not None and v != version:
                continue
            report.versions.append(VersionCheck(name, v or mkey, None, issues=[Issue("manifest", f"{mkey}: {why}")]))
    names = {v for e in entries.values() for v in e}
    if version is not None:
        if version not in names and not report.unreachable and not report.versions:
            raise VersionNotFoundError(f"version {version!r} is not committed in any tier of this store")
        names &= {version}
    recs = catalogue.merge({n: {v: e[v] for v in names if v in e} for n, e in entries.items()})
    order = [r.version for r in recs]
    if on_total is not None:
        on_total(sum(o.size for e in entries.values() for v in order if v in e for o in e[v].manifest.all_objects()))
    for v in order:
        holders = {n: e[v] for n, e in entries.items() if v in e}
        checks: dict[str, VersionCheck] = {}
        codecs: dict[str, FrameCodec | None] = {}
        for n, te in holders.items():
            checks[n], codecs[n] = _check_version(tiers[n], n, v, te, deep, master, key_problem, on_bytes)
        if repair:
            _repair_objects(tiers, holders, checks, codecs)
        if deep:
            for n, vc in checks.items():
                _check_metadata(tiers[n], vc, holders[n], codecs[n], master)
        for n, vc in checks.items():
            _settle_mark(tiers[n], vc, holders[n], repair, deep)
        report.versions.extend(checks[n] for n in tiers if n in checks)
    return report


def _codec_for(vc: VersionCheck, te, master, key_problem) -> FrameCodec | None:
    """The frame codec for a deep check, or None (with an issue recorded) when not possible."""
    m = te.manifest
    if not m.encrypted:
        return FrameCodec(m.version, m.attempt, None)
    if master is None:
        vc.issues.append(Issue("key", key_problem or (
            f"version is encrypted (key id {m.encryption['key_id']}); the deep check needs the key "
            "(--key-file, CKPTSTORE_KEY or CKPTSTORE_KEY_FILE)"), UNCHECKED))
        return None
    try:
        data_key = unwrap_key(master, m.encryption["wrapped_key"], m.version, m.attempt, m.encryption["key_id"])
    except KeyMismatchError as e:
        vc.issues.append(Issue("key", str(e), UNCHECKED))
        return None
    except IntegrityError:
        vc.issues.append(Issue("key", "the wrapped data key does not authenticate under the master key "
                                      "whose key id the manifest names: the wrapped key is damaged"))
        return None
    try:
        te.parsed.verify_mac(data_key)
    except ManifestError as e:
        vc.issues.append(Issue("manifest", str(e)))
    return FrameCodec(m.version, m.attempt, FrameCipher(data_key))


def _check_version(tier, name, version, te, deep, master, key_problem, on_bytes) -> tuple[VersionCheck, FrameCodec | None]:
    m = te.manifest
    # any damaged.json counts here, also one naming another attempt (the catalogue ignores those):
    # scrub reports it and --repair removes it
    marked = te.damaged or tier.exists(layout.damaged_key(version))
    vc = VersionCheck(name, version, m.attempt, encrypted=m.encrypted, deep=deep, was_marked=marked)
    codec = _codec_for(vc, te, master, key_problem) if deep else None
    vc.deep = deep and codec is not None
    for entry in m.all_objects():
        vc.objects.append(check_object(tier, name, version, entry, codec, on_bytes))
    return vc, codec


def _repair_objects(tiers, holders, checks: dict[str, VersionCheck], codecs: dict) -> None:
    for n, vc in checks.items():
        for oc in vc.damaged_objects():
            sources = [
                s for s, svc in checks.items()
                if s != n and holders[s].manifest.attempt == holders[n].manifest.attempt
                and any(so.name == oc.name and so.status == OK for so in svc.objects)
                and (not vc.deep or svc.deep)
            ]
            entry = next(o for o in holders[n].manifest.all_objects() if o.name == oc.name)
            errors = []
            for s in sources:
                try:
                    restore_object(tiers[s], tiers[n], oc.key, entry)
                except (CkptStoreError, OSError) as e:
                    errors.append(f"restore from the {s} tier failed: {e}")
                    continue
                again = check_object(tiers[n], n, vc.version, entry, codecs[n])
                if again.status == OK:
                    oc.status, oc.repaired_from, oc.frames = REPAIRED, s, again.frames
                    oc.detail += f"; restored from the {s} tier"
                    break
                errors.append(f"copy from the {s} tier does not verify after restore: {again.kind} {again.detail}")
            if oc.status == DAMAGED:
                if not sources:
                    errors.append("no other tier holds a verified copy of the same attempt")
                oc.detail += "; not repaired: " + "; ".join(errors)


def restore_object(src: Tier, dst: Tier, key: str, entry: ObjectEntry) -> None:
    """Copy ``key`` from ``src`` to ``dst``, replacing the damaged copy only with a verified one."""
    _faults.point("scrub.repair")

    def verify(fetch, size):
        kind, detail, _fr = verify_stream(_Window(lambda s, e: fetch(s, e - s), size), size, entry)
        if kind is not None:
            raise IntegrityError(f"the {src.name} copy of {key} does not verify: {kind} {detail}", object=key)

    dst.put_verified(key, lambda path: src.get_file(key, path), verify)


def _check_metadata(tier: Tier, vc: VersionCheck, te, codec: FrameCodec | None, master) -> None:
    """Deep: the DCP metadata unpickles (allow-list) and names only frames that exist."""
    from .dcp._types import ItemLocation
    from .dcp.reader import StorageReader, _restricted_loads

    if codec is None:
        return
    m = te.manifest
    by_name = {o.name: o for o in vc.objects}
    meta = by_name.get(m.metadata_object.name)
    if meta is None or meta.status not in (OK, REPAIRED):
        return  # already reported
    md = None
    if not tier.exists(layout.damaged_key(vc.version)):
        try:
            reader = StorageReader(None, remote=tier, key=master, version=vc.version, allow_unencrypted=True)
            md = reader.read_metadata()
        except KeyMismatchError as e:
            vc.issues.append(Issue("metadata", f"not checked: {e}", UNCHECKED))
            return
        except (CkptStoreError, OSError) as e:
            vc.issues.append(Issue("metadata", f"StorageReader.read_metadata failed: {e}"))
            return
    else:  # StorageReader refuses versions marked damaged; decode it here instead
        try:
            entry = m.metadata_object
            size, fetch, close = _open_object(tier, layout.object_key(vc.version, entry.name))
            try:
                read = _Window(fetch, size)
                blob = b"".join(bytes(codec.decode(entry.name, read(off, length), None))
                                for off, _hd, length in FrameWalk(read, size, entry.name))
            finally:
                close()
            md = _restricted_loads(blob, entry.name)
        except (CkptStoreError, OSError) as e:
            vc.issues.append(Issue("metadata", f"DCP metadata does not decode: {e}"))
            return
    sd = getattr(md, "storage_data", None)
    if not isinstance(sd, dict):
        vc.issues.append(Issue("metadata", "DCP metadata has no ckptstore storage_data"))
        return
    walked = {o.name: set(o.frames) for o in vc.objects if o.status in (OK, REPAIRED)}
    listed = {o.name for o in m.all_objects()}
    bad = []
    for idx, loc in sd.items():
        fqn = getattr(idx, "fqn", idx)
        if not isinstance(loc, ItemLocation):
            bad.append(f"{fqn!r}: not an ItemLocation")
            continue
        if loc.object not in listed:
            bad.append(f"{fqn!r} names object {loc.object!r}, which the manifest does not list")
            continue
        have = walked.get(loc.object)
        if have is None:
            continue  # that object is damaged: reported on its own
        total = 0
        for f in loc.frames:
            if (f.offset, f.length, f.index, f.xxh3, f.raw_len) not in have:
                bad.append(f"{fqn!r} references frame {f.index} at offset {f.offset} of {loc.object!r}, which does not exist")
                break
            total += f.raw_len
        else:
            if total != loc.nbytes:
                bad.append(f"{fqn!r}: its frames hold {total} bytes, the index says {loc.nbytes}")
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        vc.issues.append(Issue("metadata", "; ".join(bad[:5]) + more))


def _read_mark(tier: Tier, version: str) -> dict:
    try:
        d = json.loads(tier.get(layout.damaged_key(version)))
        return d if isinstance(d, dict) else {}
    except Exception:  # noqa: BLE001 - an unreadable mark is still a mark
        return {}


def _settle_mark(tier: Tier, vc: VersionCheck, te, repair: bool, deep: bool) -> None:
    """Mark versions that stay damaged; clear marks of versions that verify (with ``repair``)."""
    unrepaired = [o for o in vc.objects if o.status == DAMAGED] + [i for i in vc.issues if i.status == DAMAGED]
    if vc.was_marked:
        mark = _read_mark(tier, vc.version)
        if unrepaired:
            vc.issues.append(Issue("marked", f"marked damaged: {mark.get('reason', '?')}"))
            return
        stale = mark.get("attempt") not in (None, vc.attempt)
        needs_deep = bool(mark.get("deep")) and not vc.deep and not stale
        if UNCHECKED in [o.status for o in vc.objects]:
            vc.issues.append(Issue("marked", f"marked damaged: {mark.get('reason', '?')}"))
            return
        if not repair or needs_deep:
            hint = "run 'ckptstore scrub --deep --repair' to re-check it" if needs_deep else "run 'ckptstore scrub --repair' to clear the mark"
            vc.issues.append(Issue("marked", f"marked damaged ({mark.get('reason', '?')}), but verifies clean now; {hint}"))
            return
        _faults.point("scrub.repair")
        tier.delete(layout.damaged_key(vc.version))
        vc.mark = "mark removed"
        return
    if unrepaired and repair:
        reasons = [f"{o.name}: {o.kind} ({o.detail})" for o in unrepaired if isinstance(o, ObjectCheck)]
        reasons += [f"{i.kind}: {i.detail}" for i in unrepaired if isinstance(i, Issue)]
        body = {
            "reason": "; ".join(reasons),
            "attempt": vc.attempt,
            "objects": {o.name: o.kind for o in unrepaired if isinstance(o, ObjectCheck)},
            "deep": vc.deep,
            "time": utcnow(),
            "by": "ckptstore scrub",
        }
        _faults.point("scrub.repair")
        tier.put(layout.damaged_key(vc.version), json.dumps(body, sort_keys=True).encode())
        vc.mark = "marked damaged"


def format_report(report: ScrubReport) -> list[str]:
    """Human-readable lines (what ``ckptstore scrub`` prints without ``--json``)."""
    lines = []
    for t, why in report.unreachable:
        lines.append(f"{t} tier: NOT CHECKED ({why})")
    for v in report.versions:
        bad = [o for o in v.objects if o.status != OK]
        head = f"{v.tier:<6} {v.version}: {v.status.upper()}"
        if v.objects:
            head += f" ({len(v.objects)} objects{', deep' if v.deep else ''})"
        if v.mark:
            head += f" [{v.mark} now]"
        lines.append(head)
        for i in v.issues:  # a "marked" issue's detail says "marked damaged ..." itself
            lines.append(f"         {i.detail}" if i.kind == "marked" else f"         {i.status}: {i.kind}: {i.detail}")
        for o in bad:
            what = o.kind or "not checked"
            lines.append(f"         {o.status}: {o.name}: {what}: {o.detail}")
    return lines


__all__ = [
    "EXIT_CLEAN",
    "EXIT_DAMAGE",
    "EXIT_REPAIRED",
    "EXIT_UNCHECKED",
    "ObjectCheck",
    "VersionCheck",
    "Issue",
    "ScrubReport",
    "scrub",
    "check_object",
    "verify_stream",
    "restore_object",
    "format_report",
]
