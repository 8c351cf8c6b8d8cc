"""``ckptstore.Store``: the catalogue of committed versions across the local and remote tiers."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING

from .errors import (
    DamagedVersionError,
    StorageError,
    StoreNotFoundError,
    TransientStorageError,
    VersionNotFoundError,
    version_not_found,
)
from .manifest import catalogue, layout, placement
from .manifest.catalogue import VersionRecord
from .manifest.schema import ParsedManifest
from .tiers import LocalTier, Tier, make_remote, remote_options_of

if TYPE_CHECKING:
    from .choice import View


class Store:
    """The versions committed under a local ``root`` and, optionally, a ``remote`` tier.

    ``root``: local directory (created on first write); None or ``""``: no local tier (a
    remote-only store — ``""`` is never the current directory). ``remote``: a remote tier's URL
    (``"s3://bucket/prefix"``, ``"gs://bucket/prefix"``, ``"az://container/prefix"``), a
    :class:`~ckptstore.tiers.Tier`, or None; ``remote_options``: the tier's own options
    (docs/tiers.md, "Options"; the former per-tier keyword arguments are deprecated aliases), else
    its SDK's environment. ``key``: master key
    (32 bytes or a key provider), or ``key_file`` (a key file, as the CLI's ``--key-file``) — only
    needed to read encrypted data, not to list.

    The catalogue (:meth:`versions`, :meth:`latest`, :meth:`get`) checks the local root as the
    command line does (:func:`check_root`): without a ``remote``, a root that does not exist, is not
    a directory, or is a non-empty directory that is no store raises :class:`StoreNotFoundError`
    (one that cannot be read :class:`StorageError`), so a typo never reads as "no versions yet". An
    existing empty directory, or one holding only ckptstore's own files (``probes/``,
    ``events.jsonl``, ``restores.jsonl``: a job that has not saved yet), is an empty store.
    """

    def __init__(self, root: str | os.PathLike | None, *, remote: "str | Tier | None" = None, key=None,
                 remote_options: dict | None = None, key_file: str | os.PathLike | None = None, **legacy):
        remote_options = remote_options_of(remote_options, legacy, where="Store")
        if legacy:
            raise TypeError(f"Store() got unexpected keyword arguments {sorted(legacy)}")
        if key_file is not None:
            from .codec.crypto import key_or_file

            key = key_or_file(key, key_file)
        if root is not None and not os.fspath(root):
            root = None
        self._given_root = None if root is None else os.fspath(root)
        self.root = None if root is None else os.path.abspath(os.fspath(root))
        self.local: Tier | None = None if root is None else LocalTier(self.root)
        self.remote: Tier | None = make_remote(remote, **remote_options)
        self.key = key
        self.problems: list = []

    def master_key(self):
        """The master key this store was given (``key=``, else ``CKPTSTORE_KEY``/``CKPTSTORE_KEY_FILE``/
        ``CKPTSTORE_KMS_KEY_ID``) as a key object with ``unwrap``, or None (also when it cannot be read:
        what needs it then checks nothing). What the catalogue chain is verified with."""
        from .keys import resolve_master

        try:
            return resolve_master(self.key)
        except Exception:  # noqa: BLE001
            return None

    @property
    def tiers(self) -> dict[str, Tier]:
        t = {}
        if self.local is not None:
            t["local"] = self.local
        if self.remote is not None:
            t["remote"] = self.remote
        return t

    def tier(self, name: str) -> Tier:
        t = self.tiers.get(name)
        if t is None:
            raise VersionNotFoundError(f"this store has no {name} tier")
        return t

    def _scan(self) -> dict[str, dict[str, catalogue.TierEntry]]:
        self.problems = []
        return {name: catalogue.scan(t, self.problems) for name, t in self.tiers.items()}

    def versions(self, *, include_damaged: bool = True) -> list[VersionRecord]:
        """Committed versions, oldest → newest (by step, then commit sequence, then commit time and
        name: docs/FORMAT.md, "Order" — never by one host's clock against another's).

        Each record has ``version``, ``created`` (UTC), ``step``, ``world_size``, ``nbytes``
        (logical bytes), ``stored_bytes``, ``tiers`` (subset of {"local","remote"}), ``pinned``,
        ``damaged``, ``local_part`` (the part this local root holds of a version split over several
        roots, else None), ``nonfinite`` (NaN/Inf values its tensors hold; None: not counted).
        """
        if self.local is not None and self.remote is None:
            check_root(self._given_root)
        scans = self._scan()
        recs = [self._with_part(r, scans) for r in catalogue.merge(scans)]
        if not include_damaged:
            recs = [r for r in recs if not r.damaged]
        return recs

    def _with_part(self, rec: VersionRecord, scans: dict) -> VersionRecord:
        """``rec`` with ``local_part`` set when the local root holds a part of a split version
        (one listing of its attempt directory; unsplit versions cost nothing)."""
        e = scans.get("local", {}).get(rec.version)
        if self.local is None or e is None or "local" not in rec.tiers or not placement.is_split(e.manifest):
            return rec
        return dataclasses.replace(rec, local_part=placement.part_held(self.local, e.manifest))

    def local_part(self, version: str) -> "placement.Part | None":
        """The part of ``version`` the local root holds (whole for an unsplit version); None when
        the local tier does not commit it."""
        if self.local is None:
            return None
        try:
            m = catalogue.read_manifest(self.local, version).manifest
        except VersionNotFoundError:
            return None
        return placement.part_held(self.local, m)

    def latest(self, *, allow_nonfinite: bool = False) -> VersionRecord | None:
        """The newest committed version not marked damaged and not recorded as holding NaN/Inf values
        (``VersionRecord.nonfinite``: such a version is not a restore point, docs/FORMAT.md "Restore
        choice"; a version whose values were not counted counts as finite), or None when there is none.
        ``allow_nonfinite``: the newest not marked damaged, whatever its values."""
        recs = [r for r in self.versions(include_damaged=False) if allow_nonfinite or not r.nonfinite]
        return recs[-1] if recs else None

    def latest_in_job(self, process_group=None) -> VersionRecord | None:
        """The newest version that every rank of ``process_group`` (default: the default group) can
        load — the one ``StorageReader`` without a version loads (docs/FORMAT.md, "Restore choice") —
        or None when nothing is committed anywhere. A collective: every rank of the group calls it.
        Outside a job of more than one rank, the same choice from this process's roots.

        Raises :class:`VersionNotFoundError` (on every rank) when versions exist but none is
        loadable by every rank (objects on no root and not in a remote tier). A remote tier that does
        not answer does not stop it (Read rule 9: the roots' newest loadable version, with a
        warning); :class:`TransientStorageError` only when the roots hold nothing loadable.
        """
        return self.agree(None, process_group)

    def agree(self, version: str | None, process_group=None) -> VersionRecord | None:
        """:meth:`latest_in_job` for ``version`` (None: the newest loadable): its record as the job
        sees it — also on a rank whose own root does not hold it. A collective in a job."""
        view = self.choose(version, process_group)
        if view is None:
            return None
        try:
            for r in self.versions():
                if r.version == view.version and r.attempt == view.attempt:
                    return r
        except (TransientStorageError, StoreNotFoundError):  # the remote tier does not answer, or this
            pass  # node's root was never created (its part is on peers): the view's facts suffice
        return record_of(view)

    def choose(self, version: str | None = None, process_group=None, **choice) -> "View | None":
        """The restore choice (:func:`ckptstore.choice.decide`) over what every rank of
        ``process_group`` holds — a collective in a job of more than one rank, this process's roots
        otherwise. ``choice``: ``exclude``, ``scope``, ``world_size``, ``reshard``,
        ``fall_back_after``. None when nothing is committed anywhere (and every tier answered).
        Raises what :func:`~ckptstore.choice.decide` raises."""
        from .dcp import _job

        view, _me = _job.exchange(self.local, self.remote, process_group, version,
                                  empty_ok=version is None, master=self.master_key(), **choice)
        return view

    def get(self, version: str) -> VersionRecord:
        recs = self.versions()
        for r in recs:
            if r.version == version:
                return r
        raise version_not_found(version, self._where(), [r.version for r in recs])

    def _where(self) -> str:
        return " or ".join(f"the {n} tier ({t.url})" for n, t in self.tiers.items()) or "no tier"

    def manifest(self, version: str, tier: str | None = None) -> ParsedManifest:
        """The parsed manifest of ``version`` from ``tier`` (default: local if committed there, else remote)."""
        names = [tier] if tier else list(self.tiers)
        last: Exception | None = None
        for n in names:
            try:
                return catalogue.read_manifest(self.tier(n), version)
            except VersionNotFoundError as e:
                last = e
        raise last or VersionNotFoundError(f"version {version!r} not found")

    def check_not_damaged(self, version: str, tier: Tier) -> None:
        if tier.exists(layout.damaged_key(version)):
            raise DamagedVersionError(
                f"version {version!r} is marked damaged in the {tier.name} tier "
                f"({catalogue.damage_note(tier, version)}); load another version"
                + (" or run 'ckptstore scrub --repair' to restore it from the other tier" if len(self.tiers) > 1
                   else " (no other tier holds a copy to repair it from)")
            )

    # -- pins --------------------------------------------------------------------------------
    def pin(self, version: str, note: str = "") -> None:
        """Pin ``version`` in every tier where it is committed: retention never deletes it."""
        rec = self.get(version)
        for n in rec.tiers:
            self.tier(n).put(layout.pin_key(version), json.dumps({"note": note}).encode())

    def unpin(self, version: str) -> None:
        for t in self.tiers.values():
            t.delete(layout.pin_key(version))

    def close(self) -> None:
        for t in self.tiers.values():
            t.close()


#: what ckptstore itself puts at the top of a local root (docs/FORMAT.md, "Layout by example"): a
#: non-empty directory with none of these is not a store (a typo for the directory above or below one)
VERSIONS = layout.VERSIONS
OWN_ENTRIES = frozenset({VERSIONS, "probes", "restores.jsonl", "events.jsonl", "journals"})


def check_root(root: str) -> None:
    """Check that ``root`` is a local store (docs/FORMAT.md, "An initialised store"): an existing,
    readable directory that is empty, or holds ``versions/`` or another of ckptstore's own entries
    (:data:`OWN_ENTRIES`: a job that has not saved yet). The one check of ``Store``'s catalogue and
    the command line.

    Raises :class:`StoreNotFoundError` (exit 9) for a root that does not exist, is not a directory,
    or holds other things only (naming a store just above or below it); :class:`StorageError`
    (exit 7) for one that cannot be read."""
    if not os.path.exists(root):
        raise StoreNotFoundError(
            f"no ckptstore store at {root!r}: the directory does not exist (a typo? for a remote-only store "
            "pass '' as ROOT with --remote, or Store(None, remote=URL))"
        )
    if not os.path.isdir(root):
        raise StoreNotFoundError(f"no ckptstore store at {root!r}: not a directory")
    if not os.access(root, os.R_OK | os.X_OK):
        raise StorageError(f"cannot read the store directory {root!r}: permission denied")
    try:
        names = os.listdir(root)
    except OSError as e:
        raise StorageError(f"cannot read the store directory {root!r}: {e.strerror}") from None
    if names and not OWN_ENTRIES.intersection(names):
        raise StoreNotFoundError(f"no ckptstore store at {root!r}: the directory is not empty but holds no "
                                 f"{VERSIONS}/ (an empty directory is an empty store)" + _store_nearby(root))


def _is_store(path: str) -> bool:
    return os.path.isdir(os.path.join(path, VERSIONS))


def _store_nearby(root: str) -> str:
    """"; the store is at X" for a store just above or below ``root`` (``ROOT/versions`` named as
    ROOT, or the directory that holds the store), else ""."""
    here = os.path.abspath(root)
    parent = os.path.dirname(here)
    if os.path.basename(here) == VERSIONS and _is_store(parent):
        shown_parent = os.path.dirname(os.path.normpath(root)) or "."  # in the form ROOT was given
        return f"; it is the {VERSIONS}/ directory of the store {shown_parent!r}: pass that as ROOT"
    found = []
    try:
        for d in sorted(os.listdir(here)):
            p = os.path.join(here, d)
            if _is_store(p):
                found.append(p)
            elif os.path.isdir(p) and len(found) < 5:
                try:
                    found += [os.path.join(p, e) for e in sorted(os.listdir(p)) if _is_store(os.path.join(p, e))]
                except OSError:
                    pass
    except OSError:
        return ""
    if not found:
        return ""
    # named as ROOT was given (absolute stays absolute), not relative to the working directory
    shown = ", ".join(repr(os.path.join(root, os.path.relpath(f, here))) for f in found[:5])
    return f"; the store below it is {shown}" if len(found) == 1 else f"; stores below it: {shown}"


def record_of(view) -> VersionRecord:
    """The record of the view's version from the job report (no further I/O)."""
    import datetime as _dt

    created = _dt.datetime.fromisoformat((view.created or "1970-01-01T00:00:00Z").replace("Z", "+00:00"))
    tiers = set()
    if view.holders:
        tiers.add("local")
    if view.remote_ok:
        tiers.add("remote")
    return VersionRecord(view.version, created, view.step, view.world_size or 0, view.nbytes, 0, frozenset(tiers),
                         False, False, view.attempt, False, None, {})
