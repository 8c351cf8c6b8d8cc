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
   directory; S3: one PUT);
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
"""

from __future__ import annotations

import dataclasses
import hmac
import json

from .codec.crypto import key_id, resolve_key, unwrap_key, wrap_key
from .errors import (
    CkptStoreError,
    IntegrityError,
    KeyMismatchError,
    ManifestError,
    ObjectNotFoundError,
    StorageError,
    UnsupportedFormatError,
)
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
    entries: list[RekeyEntry] = dataclasses.field(default_factory=list)
    problems: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (tier, key, why): invalid manifests

    @property
    def ok(self) -> bool:
        return all(e.status in OK_STATUSES for e in self.entries) and not self.problems

    @property
    def exit_code(self) -> int:
        """0 all done; 4 a damaged wrapped key or manifest (or an invalid manifest); 5 a version
        wrapped by another key; 7 a storage error; 1 a version changed meanwhile."""
        st = {e.status for e in self.entries}
        if DAMAGED_KEY in st or DAMAGED_MANIFEST in st or self.problems:
            return IntegrityError.exit_code
        if OTHER_KEY in st:
            return KeyMismatchError.exit_code
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
            "dry_run": self.dry_run,
            "exit_code": self.exit_code,
            "counts": counts,
            "versions": [e.to_json() for e in self.entries],
            "problems": [list(p) for p in self.problems],
        }


def rewrap_manifest(data: bytes, version: str, old_key: bytes, new_key: bytes) -> tuple[bytes, str]:
    """Return ``(new manifest bytes, attempt)`` for the manifest ``data`` of ``version``.

    Raises :class:`KeyMismatchError` (not wrapped by ``old_key``), :class:`IntegrityError`
    (wrapped key or HMAC damaged), :class:`ManifestError`/:class:`UnsupportedFormatError`.
    """
    pm = parse(data, expect_version=version)
    m = pm.manifest
    if not m.encrypted:
        raise KeyMismatchError(f"version {version!r} is not encrypted")
    enc = m.encryption
    data_key = unwrap_key(old_key, enc["wrapped_key"], version, m.attempt, enc["key_id"])
    pm.verify_mac(data_key)
    body = json.loads(pm.body)
    body["encryption"] = dict(body["encryption"], key_id=key_id(new_key), wrapped_key=wrap_key(new_key, data_key, version, m.attempt))
    for r in body.get("refs", ()):  # a referenced object's frames: its origin's data key, re-wrapped the same way
        ref_key = unwrap_key(old_key, r["wrapped_key"], r["version"], r["attempt"], r["key_id"])
        r.update(key_id=key_id(new_key), wrapped_key=wrap_key(new_key, ref_key, r["version"], r["attempt"]))
    new = seal(canonical(body), data_key)
    # the result must read back exactly as intended before it replaces anything
    check = parse(new, expect_version=version)
    ce = check.manifest.encryption
    dk2 = unwrap_key(new_key, ce["wrapped_key"], version, check.manifest.attempt, ce["key_id"])
    if not hmac.compare_digest(dk2, data_key):
        raise IntegrityError(f"re-wrapped data key of version {version!r} does not round-trip")  # pragma: no cover
    check.verify_mac(dk2)
    for r in check.manifest.refs:
        unwrap_key(new_key, r.wrapped_key, r.version, r.attempt, r.key_id)
    plain = [dataclasses.replace(r, wrapped_key=None, key_id=None) for r in m.refs]
    if dataclasses.replace(check.manifest, encryption=None, refs=[dataclasses.replace(r, wrapped_key=None, key_id=None)
                                                               for r in check.manifest.refs]) \
            != dataclasses.replace(m, encryption=None, refs=plain):
        raise ManifestError(f"re-sealed manifest of version {version!r} differs beyond its key fields")  # pragma: no cover
    return new, m.attempt


def _classify(data: bytes, version: str, old_key: bytes, new_key: bytes) -> tuple[str, str]:
    """Status of a stored manifest before any change: (status, detail)."""
    pm = parse(data, expect_version=version)
    m = pm.manifest
    if not m.encrypted:
        return NOT_ENCRYPTED, ""
    kid = m.encryption["key_id"]
    for key, status in ((new_key, ALREADY), (old_key, REKEYED)):
        if kid != key_id(key):
            continue
        try:
            dk = unwrap_key(key, m.encryption["wrapped_key"], version, m.attempt, kid)
        except IntegrityError:
            return DAMAGED_KEY, (
                f"the wrapped data key does not authenticate under the {'new' if status == ALREADY else 'old'} key "
                f"(key id {kid}): the wrapped key is damaged"
            )
        try:
            pm.verify_mac(dk)
        except ManifestError as e:
            return DAMAGED_MANIFEST, str(e)
        return status, ""
    return OTHER_KEY, f"wrapped by master key id {kid}, which is neither the old ({key_id(old_key)}) nor the new ({key_id(new_key)})"


def rekey_tier(tier, tier_name: str, old_key: bytes, new_key: bytes, report: RekeyReport, *, version: str | None = None,
               dry_run: bool = False) -> None:
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
            new, attempt = rewrap_manifest(data, v, old_key, new_key)
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
        except (ManifestError, UnsupportedFormatError) as ex:
            e.status, e.detail = DAMAGED_MANIFEST, str(ex)
        except IntegrityError as ex:
            e.status, e.detail = DAMAGED_KEY, str(ex)
        except KeyMismatchError as ex:
            e.status, e.detail = OTHER_KEY, str(ex)
        except (CkptStoreError, OSError) as ex:
            e.status, e.detail = ERROR, f"{type(ex).__name__}: {ex}"


def rekey(store, old_key, new_key, *, version: str | None = None, dry_run: bool = False) -> RekeyReport:
    """Re-wrap the data key of every committed, encrypted version of ``store`` (a
    :class:`ckptstore.Store` or a ``{name: Tier}`` mapping) from master key ``old_key`` to
    ``new_key`` (32 bytes or key providers), in every tier. Data objects are not touched.

    Returns a :class:`RekeyReport`; per-version failures are reported there, not raised.
    Raises :class:`KeyMismatchError` when a key is missing or malformed.
    """
    old = resolve_key(old_key) if old_key is not None else None
    new = resolve_key(new_key) if new_key is not None else None
    if old is None or new is None:
        raise KeyMismatchError("rekey needs both the old and the new master key (32 bytes each)")
    tiers = tiers_of(store)
    report = RekeyReport(key_id(old), key_id(new), dry_run=dry_run)
    for name, tier in tiers.items():
        rekey_tier(tier, name, old, new, report, version=version, dry_run=dry_run)
    return report


__all__ = ["rekey", "rekey_tier", "rewrap_manifest", "seal", "RekeyReport", "RekeyEntry"]
