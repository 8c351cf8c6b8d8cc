"""Re-wrap the data keys of every committed version under a new master key (key rotation).

Each version's data is encrypted with its own random *data key*; the manifest stores that data key
wrapped by the master key, the master key's id, and an HMAC over the manifest body keyed from the
data key (docs/FORMAT.md, "Manifest"). Rotating the master key therefore never touches the data:
for every encrypted version committed in a tier, :func:`rekey`

1. reads and parses the manifest, checks that it names the *old* key's id, unwraps the data key
   with the old key and verifies the manifest's HMAC with it (a manifest that fails is reported
   and left alone: re-sealing it would launder a tampered or damaged manifest);
2. builds the new body — the same JSON with only ``encryption.key_id`` and
   ``encryption.wrapped_key`` replaced (the data key wrapped by the new key, fresh nonce, same
   associated data) — and seals it again (XXH3, and the HMAC under the *unchanged* data key);
3. checks the result (it parses, unwraps under the new key to the same data key, and its HMAC
   verifies), re-reads the stored manifest to make sure it did not change meanwhile, and replaces
   it atomically with ``tier.put`` (local: temporary file, fsync, ``os.replace``, fsync of the
   directory; a remote tier: one single-request put);
4. checks that the version's objects are still there (on a node-local root, its part of them); if a
   concurrent retention/gc un-committed
   the version in between (so the put re-created a manifest whose objects are being deleted), the
   manifest written is removed again and the version reported as ``changed``.

Tiers are handled one by one (``local`` then ``remote``); a version committed in both gets a new
manifest in each. Versions already wrapped by the new key are reported ``already`` (so an
interrupted rekey can simply be run again), unencrypted versions ``not-encrypted``, versions
wrapped by a third key ``other-key``, versions whose wrapped key does not unwrap under the old key
although the key id matches ``damaged-key``, and versions whose HMAC fails ``damaged-manifest``.
After a rekey the old key is refused with :class:`~ckptstore.errors.KeyMismatchError` (key id
mismatch) and the new key loads the versions bit-exactly.

Run it while no save with the *old* key is in flight (such a save commits a version wrapped by the
old key; run rekey again afterwards) and while no gc runs (see step 4).

**AWS KMS.** Either key may be a :class:`ckptstore.KmsKey` (raw → KMS, KMS → KMS, KMS → raw; the
command line's ``--kms-key``/``--new-kms-key``). The old data key comes from ``Decrypt``; the new
wrapping from ``Encrypt`` of that data key under the new KMS key and the version's encryption
context (docs/FORMAT.md, "Manifest"), not ``ReEncrypt``: rekey must hold the data key anyway, to
verify the HMAC before and to seal the manifest again after (its key is derived from the data key),
so ``ReEncrypt`` would keep nothing more inside KMS — and ``Encrypt`` is one path for raw → KMS and
KMS → KMS. Step 3's check is a real ``Decrypt`` under the new key (never a cached data key), so a
caller who may encrypt but not decrypt under the new key replaces nothing. An earlier version that
many manifests reference is re-wrapped once per run. Calls per re-wrapped version, each reference
to a not yet re-wrapped origin adding the same: at most 1 ``Decrypt`` (old key in KMS), 1
``Encrypt`` and 1 ``Decrypt`` (new key in KMS); plus one ``DescribeKey`` per KMS key and run. A key
service that refuses or does not answer stops nothing else: that version is reported
``key-service`` (exit 14) and left unchanged.
"""

from __future__ import annotations

import dataclasses
import hmac
import json

from .codec.crypto import WrappedKey
from .errors import (
    CkptStoreError,
    IntegrityError,
    KeyMismatchError,
    KeyServiceError,
    ManifestError,
    ObjectNotFoundError,
    StorageError,
    UnsupportedFormatError,
)
from .keys import resolve_master
from .manifest import catalogue, layout, placement
from .manifest.schema import canonical, parse, seal
from .tiers.base import tiers_of

REKEYED = "rekeyed"
ALREADY = "already"
NOT_ENCRYPTED = "not-encrypted"
OTHER_KEY = "other-key"
DAMAGED_KEY = "damaged-key"
DAMAGED_MANIFEST = "damaged-manifest"
CHANGED = "changed"
KEY_SERVICE = "key-service"
ERROR = "error"
WOULD_REKEY = "would-rekey"

#: statuses that mean "this version is fine under the new key"
OK_STATUSES = (REKEYED, ALREADY, NOT_ENCRYPTED, WOULD_REKEY)


@dataclasses.dataclass
class RekeyEntry:
    """The outcome for one version in one tier."""

    tier: str
    version: str
    status: str
    detail: str = ""
    attempt: str | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class RekeyReport:
    old_key_id: str
    new_key_id: str
    dry_run: bool = False
    old_key: str = ""  # the keys in words ("master key id …", "AWS KMS key arn:…")
    new_key: str = ""
    entries: list[RekeyEntry] = dataclasses.field(default_factory=list)
    problems: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (tier, key, why): invalid manifests

    @property
    def ok(self) -> bool:
        return all(e.status in OK_STATUSES for e in self.entries) and not self.problems

    @property
    def exit_code(self) -> int:
        """0 all done; 4 a damaged wrapped key or manifest (or an invalid manifest); 5 a version
        wrapped by another key; 14 the key service refused or did not answer; 7 a storage error;
        1 a version changed meanwhile."""
        st = {e.status for e in self.entries}
        if DAMAGED_KEY in st or DAMAGED_MANIFEST in st or self.problems:
            return IntegrityError.exit_code
        if OTHER_KEY in st:
            return KeyMismatchError.exit_code
        if KEY_SERVICE in st:
            return KeyServiceError.exit_code
        if ERROR in st:
            return StorageError.exit_code
        if CHANGED in st:
            return 1
        return 0

    def to_json(self) -> dict:
        counts: dict[str, int] = {}
        for e in self.entries:
            counts[e.status] = counts.get(e.status, 0) + 1
        return {
            "old_key_id": self.old_key_id,
            "new_key_id": self.new_key_id,
            "old_key": self.old_key,
            "new_key": self.new_key,
            "dry_run": self.dry_run,
            "exit_code": self.exit_code,
            "counts": counts,
            "versions": [e.to_json() for e in self.entries],
            "problems": [list(p) for p in self.problems],
        }


class Rewrapper:
    """The new wrapping of data keys under ``new`` for one rekey run: each (version, attempt)'s data
    key is wrapped once and checked once with a real unwrap under ``new`` (with KMS a ``Decrypt``,
    never a cached key), then reused for every manifest that references that version."""

    def __init__(self, new) -> None:
        self.new = new
        self._done: dict = {}  # {(version, attempt): (data key, WrappedKey)}

    def wrap(self, data_key: bytes, version: str, attempt: str) -> WrappedKey:
        hit = self._done.get((version, attempt))
        if hit is not None and hmac.compare_digest(hit[0], data_key):
            return hit[1]
        w = self.new.wrap(data_key, version, attempt)
        back = self.new.unwrap(w, version, attempt, cached=False)
        if not hmac.compare_digest(back, data_key):
            raise IntegrityError(f"re-wrapped data key of version {version!r} does not round-trip")  # pragma: no cover
        self._done[(version, attempt)] = (data_key, w)
        return w


def _ref_wrapping(r: dict) -> WrappedKey:
    return WrappedKey(r["wrapped_key"], r["key_id"], (r.get("kms") or {}).get("key_arn"))


def _set_wrapping(d: dict, w: WrappedKey) -> None:
    d.update(key_id=w.key_id, wrapped_key=w.wrapped_key)
    if w.kms_key_arn is not None:
        d["kms"] = {"key_arn": w.kms_key_arn}
    else:
        d.pop("kms", None)


def rewrap_manifest(data: bytes, version: str, old_key, new_key, rewrapper: Rewrapper | None = None) -> tuple[bytes, str]:
    """Return ``(new manifest bytes, attempt)`` for the manifest ``data`` of ``version``; ``old_key``
    / ``new_key``: master keys (32 bytes, key providers, :class:`ckptstore.KmsKey`); ``rewrapper``:
    the run's :class:`Rewrapper` (one is made when not given).

    Raises :class:`KeyMismatchError` (not wrapped by ``old_key``), :class:`IntegrityError`
    (wrapped key or HMAC damaged), :class:`ManifestError`/:class:`UnsupportedFormatError`,
    :class:`KeyServiceError` (KMS refused or did not answer).
    """
    old, new = resolve_master(old_key), resolve_master(new_key)
    rw = rewrapper if rewrapper is not None else Rewrapper(new)
    pm = parse(data, expect_version=version)
    m = pm.manifest
    if not m.encrypted:
        raise KeyMismatchError(f"version {version!r} is not encrypted")
    data_key = old.unwrap(WrappedKey.of_encryption(m.encryption), version, m.attempt)
    pm.verify_mac(data_key)
    body = json.loads(pm.body)
    nw = rw.wrap(data_key, version, m.attempt)
    body["encryption"] = nw.encryption()
    for r in body.get("refs", ()):  # a referenced object's frames: its origin's data key, re-wrapped the same way
        ref_key = old.unwrap(_ref_wrapping(r), r["version"], r["attempt"])
        _set_wrapping(r, rw.wrap(ref_key, r["version"], r["attempt"]))
    new_bytes = seal(canonical(body), data_key)
    # the result must read back exactly as intended before it replaces anything
    check = parse(new_bytes, expect_version=version)
    dk2 = new.unwrap(WrappedKey.of_encryption(check.manifest.encryption), version, check.manifest.attempt)
    if not hmac.compare_digest(dk2, data_key):
        raise IntegrityError(f"re-wrapped data key of version {version!r} does not round-trip")  # pragma: no cover
    check.verify_mac(dk2)
    for r in check.manifest.refs:
        new.unwrap(WrappedKey.of(r), r.version, r.attempt)

    def plain(refs):
        return [dataclasses.replace(r, wrapped_key=None, key_id=None, kms_key_arn=None) for r in refs]

    if dataclasses.replace(check.manifest, encryption=None, refs=plain(check.manifest.refs)) \
            != dataclasses.replace(m, encryption=None, refs=plain(m.refs)):
        raise ManifestError(f"re-sealed manifest of version {version!r} differs beyond its key fields")  # pragma: no cover
    return new_bytes, m.attempt


def _short(key) -> str:
    """How a report line names a master key: a raw key by its key id, a KMS key by its ARN."""
    return key.key_id_hex if key.kind == "raw" else key.describe()


def _classify(data: bytes, version: str, old, new) -> tuple[str, str]:
    """Status of a stored manifest before any change: (status, detail)."""
    pm = parse(data, expect_version=version)
    m = pm.manifest
    if not m.encrypted:
        return NOT_ENCRYPTED, ""
    w = WrappedKey.of_encryption(m.encryption)
    for key, status in ((new, ALREADY), (old, REKEYED)):
        if not key.owns(w):
            continue
        try:
            dk = key.unwrap(w, version, m.attempt)
        except IntegrityError:
            return DAMAGED_KEY, (
                f"the wrapped data key does not authenticate under the {'new' if status == ALREADY else 'old'} key "
                f"({'key id ' + w.key_id if w.kms_key_arn is None else w.describe()}): the wrapped key is damaged"
            )
        try:
            pm.verify_mac(dk)
        except ManifestError as e:
            return DAMAGED_MANIFEST, str(e)
        return status, ""
    return OTHER_KEY, f"wrapped by {w.describe()}, which is neither the old ({_short(old)}) nor the new ({_short(new)})"


def rekey_tier(tier, tier_name: str, old_key, new_key, report: RekeyReport, *, version: str | None = None,
               dry_run: bool = False, rewrapper: Rewrapper | None = None) -> None:
    old_key, new_key = resolve_master(old_key), resolve_master(new_key)
    rewrapper = rewrapper if rewrapper is not None else Rewrapper(new_key)
    problems: list = []
    entries = catalogue.scan(tier, problems)
    report.problems.extend((tier_name, k, why) for _t, k, why in problems
                           if version is None or layout.version_of_key(k) == version)
    names = sorted(entries, key=lambda v: (entries[v].manifest.created, v))
    if version is not None:
        names = [v for v in names if v == version]
    for v in names:
        e = RekeyEntry(tier_name, v, ERROR, attempt=entries[v].manifest.attempt)
        report.entries.append(e)
        mkey = layout.manifest_key(v)
        try:
            data = tier.get(mkey)
            status, detail = _classify(data, v, old_key, new_key)
            if status != REKEYED:
                e.status, e.detail = status, detail
                continue
            new, attempt = rewrap_manifest(data, v, old_key, new_key, rewrapper)
            if dry_run:
                e.status = WOULD_REKEY
                continue
            if tier.get(mkey) != data:
                e.status, e.detail = CHANGED, "the manifest changed while it was being re-wrapped; run rekey again"
                continue
            tier.put(mkey, new)
            # the objects this tier holds of the version: all of them, or on a node-local root of a
            # version split over several roots its part (docs/FORMAT.md, "Placement") — another
            # root's objects are not missing here
            part = placement.part_held(tier, entries[v].manifest, remote=tier_name == "remote")
            missing = [o.name for o in part.objects if not tier.exists(layout.object_key(v, o.name))]
            if missing:
                try:
                    if tier.get(mkey) == new:
                        tier.delete(mkey)
                except ObjectNotFoundError:
                    pass
                e.status, e.detail = CHANGED, f"the version was deleted concurrently (objects gone: {missing[:3]})"
                continue
            e.status = REKEYED
        except ObjectNotFoundError:
            e.status, e.detail = CHANGED, "the version was un-committed while rekey ran"
        except KeyServiceError as ex:  # refused or unreachable: nothing changed, not damage
            e.status, e.detail = KEY_SERVICE, str(ex)
        except (ManifestError, UnsupportedFormatError) as ex:
            e.status, e.detail = DAMAGED_MANIFEST, str(ex)
        except IntegrityError as ex:
            e.status, e.detail = DAMAGED_KEY, str(ex)
        except KeyMismatchError as ex:
            e.status, e.detail = OTHER_KEY, str(ex)
        except (CkptStoreError, OSError) as ex:
            e.status, e.detail = ERROR, f"{type(ex).__name__}: {ex}"
    if not dry_run and version is None:  # the catalogue heads carry a wrapped data key too (docs/FORMAT.md, "Catalogue chain")
        from .manifest import chain

        chain.rewrap(tier, old_key, rewrapper)


def rekey(store, old_key, new_key, *, version: str | None = None, dry_run: bool = False) -> RekeyReport:
    """Re-wrap the data key of every committed, encrypted version of ``store`` (a
    :class:`ckptstore.Store` or a ``{name: Tier}`` mapping) from master key ``old_key`` to
    ``new_key`` (32 bytes, key providers, :class:`ckptstore.KmsKey` or ``"kms://…"``), in every
    tier. Data objects are not touched.

    Returns a :class:`RekeyReport`; per-version failures are reported there, not raised.
    Raises :class:`KeyMismatchError` when a key is missing or malformed, :class:`KeyServiceError`
    when a KMS key cannot be used at all (it does not exist, is disabled; checked before anything
    is read).
    """
    old = resolve_master(old_key) if old_key is not None else None
    new = resolve_master(new_key) if new_key is not None else None
    if old is None or new is None:
        raise KeyMismatchError("rekey needs both the old and the new master key (32 bytes each, or AWS KMS keys)")
    for k in (old, new):
        if k.kind == "kms":
            k.arn  # noqa: B018 - DescribeKey: a missing or disabled key stops the run before anything is read
    tiers = tiers_of(store)
    report = RekeyReport(old.key_id_hex, new.key_id_hex, dry_run=dry_run, old_key=old.describe(), new_key=new.describe())
    rewrapper = Rewrapper(new)
    for name, tier in tiers.items():
        rekey_tier(tier, name, old, new, report, version=version, dry_run=dry_run, rewrapper=rewrapper)
    return report


__all__ = ["rekey", "rekey_tier", "rewrap_manifest", "seal", "RekeyReport", "RekeyEntry", "Rewrapper"]
