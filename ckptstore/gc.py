"""Garbage collection and retention: plan first (pure), then apply (docs/FORMAT.md, Delete rules 1-15).

``ckptstore gc`` works in three steps:

1. :func:`collect` takes a :class:`TierSnapshot` of each tier: the listing of everything under
   ``versions/`` **first**, then the committed manifests (``catalogue.scan``), stale multipart
   uploads (tiers with ``supports_multipart``) and empty directories (local). Listing before reading manifests means an object
   that a save commits while we look is referenced by the manifests we read, or was written after
   the listing and so is not in it.
2. :func:`plan` — pure: snapshots + :class:`~ckptstore.retention.RetentionPolicy` + ``now`` +
   ``grace`` → :class:`GcPlan`: the retention decisions per tier (with reasons), the ordered
   :class:`Action` s, and every garbage candidate that survives and why. ``gc --dry-run`` prints
   this plan; the real run applies this same object.
3. :func:`apply` runs the actions in plan order:

   * **un-commits** (retention): delete ``versions/<v>/manifest.json`` — after re-reading it to
     check it still names the planned attempt and that the version was not pinned meanwhile
     (otherwise the version is skipped). Fault point ``gc.uncommit`` before each.
   * **then** the objects of the un-committed versions (and their ``damaged.json``), skipped when
     their un-commit failed or was skipped. All un-commits of the plan come before any object
     deletion, so a crash mid-gc never leaves a committed version with missing objects.
   * garbage: objects under ``versions/`` that no committed manifest references — objects of
     aborted attempts, ``.tmp-*`` files, rank upload markers, leftovers of deleted versions —
     deleted only when older than the grace period (age from the object's mtime; for an attempt of
     a committed version that its manifest does not name, from the newer of the object and the
     manifest), and only when their size and mtime are still what was planned (a growing file is
     skipped). Objects of an attempt that a committed manifest lists in ``supersedes`` go at once
     (Delete rule 12: retired by that commit, nothing writes to them any more).
     Objects of an attempt whose coordinator is provably dead (its writer record, judged before the
     manifests are read: Delete rule 15) go without the grace period too.
     Fault point ``gc.delete`` before each object deletion.
   * stale incomplete multipart uploads (tiers that declare ``supports_multipart``) older than grace
     are aborted; empty local directories older than grace are removed; root claims
     (``probes/root.<token>``, written by a save or a load to find which ranks share a root, and the
     ``probes/r<rank>.<nonce>`` probes of older releases) older than grace are deleted.

On node-local roots (a version split over several roots, docs/FORMAT.md "Placement") gc on a node
plans for what that root holds: retention runs over the versions committed there (every root holds
a manifest copy of each version it has a part of), a version's deletion removes the objects present
here (the other groups' objects live on other roots; their absence is no problem), and objects of
a split version that another tier of the run (the remote one) commits but this root does not yet
(its manifest copy is missing after a crash) are left alone.

What the other tiers of the run protect (pins travel; locally, a version waits for its upload; an
absent or empty local tier protects nothing remotely) is :func:`ckptstore.retention.across_tiers`.
The same deletion runs right after a commit (:func:`apply_after_commit`, the writer's
``retention=``) and on request for one version (:func:`plan_drop`, then :func:`apply`).

Never touched: ``manifest.json`` of kept versions; ``pinned`` and ``damaged.json`` of committed
versions (they belong to their version and go only with it); anything in a version directory whose
``manifest.json`` fails to parse (reported as a problem: a damaged commit is for ``scrub`` to look
at); anything outside ``versions/`` and ``probes/``.

The grace period must exceed the longest save (and upload): an object of a save still in flight is
younger than that and survives.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import re
import time
from typing import Callable, Iterable, Mapping

from . import _faults, _pace
from ._gc_types import ABORT_UPLOAD, DELETE, RMDIR, UNCOMMIT, Action, GcPlan, GcResult, Survivor, TierSnapshot, Upload
from .errors import CkptStoreError, ManifestError, ObjectNotFoundError, UnsupportedFormatError, VersionNotFoundError, version_not_found
from .manifest import catalogue, layout, leases, placement, writers
from .manifest.order import order_key
from .manifest.schema import Manifest, parse
from .retention import Decision, RetentionPolicy, across_tiers, format_duration
from .tiers.base import ObjectInfo, Tier, tiers_of

log = logging.getLogger("ckptstore")

DEFAULT_GRACE = 3600.0

#: top-level directory of the root claims (``probes/root.<token>``; ``probes/r<rank>.<nonce>`` from
#: older releases) that a save or a load writes to find out which ranks see the same root
#: (docs/FORMAT.md, "Placement"); gc deletes them once older than the grace period and leaves
#: anything else in it alone
PROBES = "probes"
_PROBE_NAME = re.compile(r"r[0-9]+\.[A-Za-z0-9_-]+|root\.[A-Za-z0-9_-]+|put-if-absent\.[0-9a-f]+|if-match\.[0-9a-f]+")

# -- collect -----------------------------------------------------------------------------------------
def collect(tier: Tier, name: str | None = None) -> TierSnapshot:
    """Snapshot one tier: listing first, then manifests, uploads and (local) empty directories."""
    name = name or tier.name
    listing = sorted(tier.list(layout.VERSIONS + "/"), key=lambda i: i.key)
    # whose writer is dead, before the manifests are read: a coordinator dead now committed nothing after
    # this point, so an attempt the manifests below do not name never commits (Delete rule 15)
    dead = writers.dead_attempts(tier, [i.key for i in listing if layout.is_writer_record(i.key)])
    problems: list = []
    entries = catalogue.scan(tier, problems)
    invalid = [(key, why) for _t, key, why in problems]
    uploads: list[Upload] = []
    if tier.supports_multipart:
        for u in tier.list_multipart_uploads(layout.VERSIONS + "/"):
            uploads.append(_upload(u))
        uploads.sort(key=lambda u: (u.key, u.upload_id))
    empty_dirs = sorted(tier.list_empty_dirs(layout.VERSIONS + "/"), key=lambda i: i.key)
    probes = sorted(tier.list(PROBES + "/"), key=lambda i: i.key)
    return TierSnapshot(name, listing, entries, invalid, uploads, empty_dirs, probes, leases.read(tier), dead)


def _upload(u) -> Upload:
    if isinstance(u, Upload):
        return u
    if isinstance(u, Mapping):
        key = u.get("key", u.get("Key"))
        uid = u.get("upload_id", u.get("UploadId"))
        init = u.get("initiated", u.get("Initiated"))
    elif isinstance(u, (tuple, list)):
        key, uid, init = u[0], u[1], u[2]
    else:
        key, uid, init = u.key, u.upload_id, u.initiated
    if isinstance(init, _dt.datetime):
        if init.tzinfo is None:
            init = init.replace(tzinfo=_dt.timezone.utc)
        init = init.timestamp()
    return Upload(str(key), str(uid), float(init))


# -- plan (pure) ------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Parts:
    """The pieces of a plan as they are found, put in order by :meth:`actions`."""

    uncommits: list[Action] = dataclasses.field(default_factory=list)
    version_deletes: list[Action] = dataclasses.field(default_factory=list)
    garbage: list[Action] = dataclasses.field(default_factory=list)
    aborts: list[Action] = dataclasses.field(default_factory=list)
    rmdirs: list[Action] = dataclasses.field(default_factory=list)
    survivors: list[Survivor] = dataclasses.field(default_factory=list)
    problems: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)

    def add_version(self, actions: Iterable[Action]) -> None:
        for a in actions:
            (self.uncommits if a.op == UNCOMMIT else self.version_deletes).append(a)

    def actions(self) -> list[Action]:
        """Every un-commit first, then the objects of un-committed versions, then the rest."""
        return self.uncommits + self.version_deletes + self.garbage + self.aborts + self.rmdirs


def _classify(key: str) -> str:
    base = key.rsplit("/", 1)[-1]
    attempt = layout.attempt_of_key(key)
    if layout.is_temporary(key):
        return "temporary file"
    if base in (layout.PINNED, layout.DAMAGED) and key.count("/") == 2:
        return f"{base} marker of a version not committed here"
    if attempt is not None:
        if layout.marker_rank(key) is not None:
            return f"rank upload marker of attempt {attempt}"
        return f"object of attempt {attempt}"
    return "unreferenced file"


def plan(
    snapshots: Iterable[TierSnapshot],
    policy: RetentionPolicy | None,
    now: _dt.datetime,
    grace: float = DEFAULT_GRACE,
) -> GcPlan:
    """The gc plan: pure function of the snapshots, the policy, ``now`` and ``grace`` (seconds)."""
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware (UTC)")
    if grace < 0:
        raise ValueError("grace must be >= 0 seconds")
    policy = policy or RetentionPolicy()
    snaps = list(snapshots)
    records = {s.name: catalogue.merge({s.name: s.entries}) for s in snaps}
    parts = _Parts()
    decisions: dict[str, list[Decision]] = {}
    for s in snaps:
        others = {o.name: records[o.name] for o in snaps if o is not s}
        recs, protect = across_tiers(s.name, records[s.name], others)
        decisions[s.name] = ds = policy.decide(s.name, recs, now, protect=protect)
        sizes = {i.key: i for i in s.listing}
        kept_refs = catalogue.referenced(s.entries, exclude={d.version for d in ds if not d.keep})
        leased = leases.live(s.leases, now.timestamp(), leases.ttl_for(grace))
        for d in ds:
            if not d.keep:
                acts = version_actions(s.name, d.version, s.entries[d.version].manifest, "; ".join(d.reasons), sizes,
                                       referenced=kept_refs, leased=leased)
                parts.add_version(acts)
                parts.survivors.extend(_kept_references(s.name, d.version, s.entries[d.version].manifest, kept_refs, sizes,
                                                        leased))
        elsewhere = _split_parts_elsewhere(s, snaps)
        _plan_garbage(s, {layout.version_dir(d.version) + "/" for d in ds if not d.keep}, now.timestamp(), grace, parts,
                      elsewhere, leased)
        _plan_uploads_and_dirs(s, now.timestamp(), grace, parts)
        _plan_probes(s, now.timestamp(), grace, parts)
        _plan_leases(s, now.timestamp(), grace, parts)
    return GcPlan(now=now, grace=float(grace), policy=policy, tiers=[s.name for s in snaps], decisions=decisions,
                  actions=parts.actions(), survivors=parts.survivors, problems=parts.problems)


@dataclasses.dataclass
class _Committed:
    """What the committed manifests of one tier say about its keys."""

    claimed: set[str]  # keys that belong to a committed version (kept or deleted)
    manifest_mtime: dict[str, float]  # version dir -> mtime of its manifest
    attempt: dict[str, str]  # version dir -> the committed attempt
    referenced: dict = dataclasses.field(default_factory=dict)  # key -> versions whose manifests reference it
    superseded: dict = dataclasses.field(default_factory=dict)  # version dir -> attempts its manifest supersedes

    @classmethod
    def of(cls, s: TierSnapshot, sizes: Mapping[str, ObjectInfo]) -> "_Committed":
        c = cls(set(), {}, {}, catalogue.referenced(s.entries))
        for v, e in s.entries.items():
            d = layout.version_dir(v) + "/"
            c.attempt[d] = e.manifest.attempt
            gone = e.manifest.superseded_attempts - {e.manifest.attempt}
            if gone:
                c.superseded[d] = gone
            c.claimed.update((d + layout.MANIFEST, d + layout.PINNED, d + layout.DAMAGED))
            c.claimed.update(d + o.name for o in e.manifest.all_objects())
            c.claimed.update(layout.object_key(r.version, r.name) for r in e.manifest.refs)  # referenced objects
            adir = d + layout.attempt_dir(e.manifest.attempt) + "/"  # the committed attempt's replica records
            c.claimed.update(k for k in sizes if k.startswith(adir) and layout.replica_record_rank(k) is not None)
            mi = sizes.get(d + layout.MANIFEST)
            if mi is not None:
                c.manifest_mtime[d] = mi.mtime
        return c


def _split_parts_elsewhere(s: TierSnapshot, snaps: list[TierSnapshot]) -> dict[str, tuple[str, str]]:
    """``{attempt dir key prefix: (version, tier)}`` of the versions split over several roots
    (``placement.is_split``) that another tier of the run commits and ``s`` does not."""
    out: dict[str, tuple[str, str]] = {}
    for o in snaps:
        if o is s:
            continue
        for v, e in o.entries.items():
            if v in s.entries or not placement.is_split(e.manifest):
                continue
            out[layout.object_key(v, layout.attempt_dir(e.manifest.attempt)) + "/"] = (v, o.name)
    return out


def _plan_garbage(s: TierSnapshot, deleted_dirs: set[str], now_ts: float, grace: float, parts: _Parts,
                  elsewhere: Mapping[str, tuple[str, str]] | None = None, leased: Mapping[str, list] | None = None) -> None:
    """Objects no committed manifest references: deleted once older than ``grace``, else survivors.

    ``elsewhere``: attempt directories of split versions another tier commits (see
    :func:`_split_parts_elsewhere`): their objects here are this root's part of a committed version
    whose manifest copy has not arrived (Delete rule 10) and are left alone. ``leased``: objects a
    save in flight references (``leases.live``): left alone (Delete rule 13).
    """
    committed = _Committed.of(s, {i.key: i for i in s.listing})
    skip_dirs = set()
    for key, why in s.invalid:
        vd = layout.version_dir_of(key)
        if vd is not None:
            skip_dirs.add(vd)
        parts.problems.append((s.name, key, why))
    for info in s.listing:
        if info.key in committed.claimed:
            vd = layout.version_dir_of(info.key)
            if info.key in committed.referenced and vd not in committed.attempt:
                by = ", ".join(repr(v) for v in sorted(committed.referenced[info.key]))
                parts.survivors.append(Survivor(s.name, info.key, f"object of a version no longer committed here, "
                                                f"referenced by {by}; kept", info.size))
            continue
        left_alone = _left_alone(info.key, skip_dirs)
        if left_alone is None and leased and info.key in leased:
            left_alone = f"{leased[info.key][0].describe()}; kept"
        if left_alone is None and elsewhere:
            adir = info.key.rsplit("/", 1)[0] + "/"
            if adir in elsewhere:
                v, where = elsewhere[adir]
                left_alone = (f"part of version {v!r}, committed in the {where} tier with objects on several roots, "
                              "whose manifest copy is missing here; left alone (the next load or save on this node "
                              "repairs it)")
        if left_alone is not None:
            parts.survivors.append(Survivor(s.name, info.key, left_alone, info.size))
            continue
        attempt = layout.attempt_of_key(info.key)
        if attempt is not None and attempt in committed.superseded.get(layout.version_dir_of(info.key), ()):
            parts.garbage.append(Action(s.name, DELETE, info.key, "garbage", _superseded_reason(attempt),
                                        version=layout.version_of_key(info.key), size=info.size, mtime=info.mtime))
            continue
        adir = info.key.rsplit("/", 1)[0] + "/"
        if attempt is not None and adir in s.dead_writers and committed.attempt.get(layout.version_dir_of(info.key)) != attempt:
            parts.garbage.append(Action(s.name, DELETE, info.key, "garbage",
                                        f"{_classify(info.key)} of a save whose writer died: {s.dead_writers[adir]}; "
                                        "no grace period", version=layout.version_of_key(info.key), size=info.size,
                                        mtime=info.mtime))
            continue
        what, ref_t = _describe_garbage(info, committed, deleted_dirs)
        age = now_ts - ref_t
        if age >= grace:
            parts.garbage.append(Action(s.name, DELETE, info.key, "garbage",
                                        f"{what}; age {format_duration(age)} >= grace {format_duration(grace)}",
                                        version=layout.version_of_key(info.key), size=info.size, mtime=info.mtime))
        else:
            parts.survivors.append(Survivor(s.name, info.key, f"{what}; younger than the grace period "
                                            f"(age {format_duration(age)} < {format_duration(grace)})", info.size))


def _superseded_reason(attempt: str) -> str:
    return (f"object of attempt {attempt}, which the committed manifest supersedes: retired by that commit, "
            "not in flight, so no grace period (Delete rule 12)")


def superseded_actions(tier: str, entries: Mapping, listing: Iterable[ObjectInfo], referenced: Mapping[str, list],
                       scope: Callable[[str], bool] = lambda v: True) -> list[Action]:
    """The deletion of every object of an attempt that a committed manifest of ``entries`` (``{version:
    TierEntry}``, one tier) supersedes (docs/FORMAT.md, Delete rule 12): keys under
    ``versions/<v>/attempts/<a>/`` of ``listing`` for each ``a`` in ``v``'s ``supersedes`` (never
    ``v``'s own attempt), except objects in ``referenced`` (``{key: [versions]}``: frames a committed
    manifest references). No grace period: such an attempt was committed before it was superseded,
    so nothing writes to it any more. ``scope(version)``: the versions considered."""
    gone: dict[str, frozenset] = {}
    for v, e in entries.items():
        atts = e.manifest.superseded_attempts - {e.manifest.attempt}
        if atts and scope(v):
            gone[layout.version_dir(v) + "/"] = atts
    out = []
    for info in listing:
        vd = layout.version_dir_of(info.key)
        attempt = layout.attempt_of_key(info.key)
        if vd in gone and attempt in gone[vd] and info.key not in referenced:
            out.append(Action(tier, DELETE, info.key, "garbage", _superseded_reason(attempt),
                              version=layout.version_of_key(info.key), size=info.size, mtime=info.mtime))
    return out


def _left_alone(key: str, skip_dirs: set[str]) -> str | None:
    """Why an unreferenced key is never garbage (None: it may be)."""
    vd = layout.version_dir_of(key)
    if vd is None:
        return "not inside a version directory; left alone"
    if layout.version_of_key(key) is None:
        return "not in a ckptstore version directory; left alone"
    if vd in skip_dirs:
        return f"its version's {layout.MANIFEST} is invalid (see problems); left for scrub"
    return None


def _describe_garbage(info: ObjectInfo, c: _Committed, deleted_dirs: set[str]) -> tuple[str, float]:
    """What an unreferenced object is, and the time its age counts from (for a superseded attempt
    of a committed version: the newer of the object and the manifest)."""
    vd = layout.version_dir_of(info.key)
    what = _classify(info.key)
    if vd in c.manifest_mtime and vd not in deleted_dirs:
        if layout.attempt_of_key(info.key) == c.attempt.get(vd):
            what += ", not named by the committed manifest"
        else:
            what += " not referenced by the committed manifest (superseded or aborted attempt)"
        return what, max(info.mtime, c.manifest_mtime[vd])
    if vd in deleted_dirs:
        return what + " in a version deleted by retention", info.mtime
    return what + " (version not committed in this tier)", info.mtime


def _plan_uploads_and_dirs(s: TierSnapshot, now_ts: float, grace: float, parts: _Parts) -> None:
    """Stale incomplete multipart uploads are aborted, old empty directories removed."""
    for u in s.uploads:
        age = now_ts - u.initiated
        if layout.version_dir_of(u.key) is None:
            parts.survivors.append(Survivor(s.name, u.key, f"multipart upload {u.upload_id} outside {layout.VERSIONS}/; left alone"))
        elif age >= grace:
            parts.aborts.append(Action(s.name, ABORT_UPLOAD, u.key, "upload",
                                       f"incomplete multipart upload started {format_duration(age)} ago (>= grace {format_duration(grace)})",
                                       version=layout.version_of_key(u.key), upload_id=u.upload_id, mtime=u.initiated))
        else:
            parts.survivors.append(Survivor(s.name, u.key, f"multipart upload {u.upload_id} in progress (started {format_duration(age)} ago < grace)"))
    for dinfo in s.empty_dirs:
        age = now_ts - dinfo.mtime
        if age >= grace:
            parts.rmdirs.append(Action(s.name, RMDIR, dinfo.key, "dir", f"empty directory, age {format_duration(age)} >= grace",
                                       mtime=dinfo.mtime))
        else:
            parts.survivors.append(Survivor(s.name, dinfo.key + "/", f"empty directory younger than the grace period (age {format_duration(age)})"))


def _plan_probes(s: TierSnapshot, now_ts: float, grace: float, parts: _Parts) -> None:
    """Root claims (``probes/root.<token>``, and older releases' ``probes/r<rank>.<nonce>``),
    conditional-write probes left by a killed process (``probes/put-if-absent.<nonce>``,
    ``probes/if-match.<nonce>``) and the
    temporary files of a probe write a killed process left (``probes/.tmp-<random>``) older than
    ``grace`` are deleted; younger ones (a save or load running now) and anything else under
    ``probes/`` survive."""
    for info in s.probes:
        base = info.key[len(PROBES) + 1:]
        temporary = "/" not in base and layout.is_temporary(base)  # a probe being written, or a killed writer's
        if not (_PROBE_NAME.fullmatch(base) or temporary):
            parts.survivors.append(Survivor(s.name, info.key, "not a root-sharing probe; left alone", info.size))
            continue
        age = now_ts - info.mtime
        what = ("temporary file of a probe" if temporary else
                "conditional-write probe" if base.startswith(layout.CONDITIONAL_PROBE) else "root-sharing probe")
        if age >= grace:
            parts.garbage.append(Action(s.name, DELETE, info.key, "probe",
                                        f"{what}; age {format_duration(age)} >= grace {format_duration(grace)}",
                                        size=info.size, mtime=info.mtime))
        else:
            parts.survivors.append(Survivor(s.name, info.key, f"{what} younger than the grace period "
                                            f"(age {format_duration(age)} < {format_duration(grace)})", info.size))


def _plan_leases(s: TierSnapshot, now_ts: float, grace: float, parts: _Parts) -> None:
    """Leases older than the lease time (``leases.ttl_for(grace)``: their save is gone) are deleted;
    younger ones protect what they name (Delete rule 13)."""
    ttl = leases.ttl_for(grace)
    for lease in s.leases:
        age = now_ts - lease.mtime
        if age >= ttl:
            parts.garbage.append(Action(s.name, DELETE, lease.key, "lease",
                                        f"lease of a save that is gone; age {format_duration(age)} >= "
                                        f"{format_duration(ttl)}", size=lease.size, mtime=lease.mtime))
        else:
            parts.survivors.append(Survivor(s.name, lease.key, f"lease of a save in flight ({lease.version!r}, "
                                            f"{lease.holder}; age {format_duration(age)} < {format_duration(ttl)})",
                                            lease.size))


def version_actions(tier: str, version: str, manifest: Manifest, reason: str,
                    listing: Mapping[str, ObjectInfo] | None = None, *, force: bool = False,
                    referenced: Mapping[str, list] | None = None, leased: Mapping[str, list] | None = None) -> list[Action]:
    """The actions that delete one committed version: un-commit, then its objects and damage mark
    (with ``force``, a pinned version too: the un-commit ignores the pin, and the pin goes last).
    Objects in ``referenced`` (``{key: [versions]}``: frames another committed manifest of the tier
    references, docs/FORMAT.md "References") or ``leased`` (``{key: [Lease]}``: frames a save in flight
    references, Delete rule 13) are kept; they become garbage once nothing references them."""
    referenced = referenced or {}
    leased = leased or {}
    d = layout.version_dir(version) + "/"

    def size(key: str) -> int:
        i = (listing or {}).get(key)
        return i.size if i is not None else 0

    out = [Action(tier, UNCOMMIT, d + layout.MANIFEST, "manifest", f"un-commit: {reason}", version=version,
                  attempt=manifest.attempt, size=size(d + layout.MANIFEST), force=force)]
    for o in manifest.all_objects():
        key = d + o.name
        if listing is not None and key not in listing:
            continue  # already missing: nothing to delete
        if key in referenced or key in leased:
            continue  # frames of it are referenced by a version that stays, or by a save in flight
        out.append(Action(tier, DELETE, key, "version-object", f"object of deleted version {version!r}", version=version,
                          attempt=manifest.attempt, size=size(key) if listing is not None else o.size))
    adir = d + layout.attempt_dir(manifest.attempt) + "/"
    for key in sorted(listing or ()):  # the attempt's replica records go with it (docs/FORMAT.md, "Replicas")
        if key.startswith(adir) and layout.replica_record_rank(key) is not None:
            out.append(Action(tier, DELETE, key, "version-object", f"replica record of deleted version {version!r}",
                              version=version, attempt=manifest.attempt, size=size(key)))
    markers = [(layout.DAMAGED, "damage mark")] + ([(layout.PINNED, "pin")] if force else [])
    for name, what in markers:
        if listing is None or d + name in listing:
            out.append(Action(tier, DELETE, d + name, "version-object", f"{what} of deleted version {version!r}",
                              version=version, attempt=manifest.attempt, size=size(d + name)))
    return out


# -- apply -------------------------------------------------------------------------------------------
def apply(
    tiers: Mapping[str, Tier],
    the_plan: GcPlan | Iterable[Action],
    *,
    on_action: Callable[[Action, str], None] | None = None,
) -> GcResult:
    """Run the plan's actions in order. ``on_action(action, outcome)`` is called after each
    (``outcome`` = ``"applied"``, ``"skipped"`` or ``"failed"``), e.g. to drive a progress bar.

    Never raises for storage errors: they are collected in :attr:`GcResult.failed`.
    """
    actions = the_plan.actions if isinstance(the_plan, GcPlan) else list(the_plan)
    now = the_plan.now if isinstance(the_plan, GcPlan) else _dt.datetime.now(_dt.timezone.utc)
    ttl = leases.ttl_for(the_plan.grace if isinstance(the_plan, GcPlan) else 0.0)
    res = GcResult()
    blocked: set[tuple[str, str]] = set()  # (tier, version) whose un-commit did not happen
    leased: dict[str, dict] = {}  # tier -> what the leases protect, read after the run's un-commits
    for a in actions:
        tier = tiers.get(a.tier)
        try:
            if tier is not None and a.op == DELETE and a.kind in ("version-object", "garbage") and a.tier not in leased:
                # after every un-commit of this run, before its first deletion (docs/FORMAT.md, Delete rule 13)
                leased[a.tier] = leases.live(leases.read(tier), now.timestamp(), ttl)
            lease = leased.get(a.tier, {}).get(a.key) if a.op == DELETE else None
            if lease:
                why = f"{lease[0].describe()}; kept"
            else:
                why = f"no {a.tier} tier in this store" if tier is None else _apply_one(tier, a, tiers, blocked)
        except (CkptStoreError, OSError) as e:
            if a.op == UNCOMMIT:
                blocked.add((a.tier, a.version))
            res.failed.append((a, e))
            outcome = "failed"
        else:
            if why is None:
                res.applied.append(a)
                outcome = "applied"
            else:
                if a.op == UNCOMMIT:
                    blocked.add((a.tier, a.version))
                res.skipped.append((a, why))
                outcome = "skipped"
        if on_action is not None:
            on_action(a, outcome)
    return res


def _apply_one(tier: Tier, a: Action, tiers: Mapping[str, Tier], blocked: set[tuple[str, str]]) -> str | None:
    """Run one action; returns why it was skipped (None: done). Storage errors propagate."""
    if a.op == UNCOMMIT:
        why = _garbage_blocker(tier, a) if a.kind == "invalid-manifest" else _uncommit_blocker(tier, a, tiers)
        if why is None:
            _faults.point("gc.uncommit")
            tier.delete(a.key)
        return why
    if a.op == DELETE:
        if a.kind == "version-object":
            why = "its version was not un-committed" if (a.tier, a.version) in blocked else None
        else:
            why = _garbage_blocker(tier, a)
        if why is None:
            _faults.point("gc.delete")
            tier.delete(a.key)
        return why
    if a.op == ABORT_UPLOAD:
        tier.abort_multipart_upload(a.key, a.upload_id)
        return None
    if a.op == RMDIR:
        return None if tier.remove_empty_dir(a.key) else "no longer an empty directory"
    raise ValueError(f"unknown gc action {a.op!r}")  # pragma: no cover


def _uncommit_blocker(tier: Tier, a: Action, tiers: Mapping[str, Tier]) -> str | None:
    """Why the un-commit of ``a.version`` must not happen now (None: go ahead)."""
    try:
        data = tier.get(a.key)
    except ObjectNotFoundError:
        return None  # already un-committed (e.g. an interrupted gc): the objects may go
    try:
        m = parse(data, expect_version=a.version).manifest
    except (ManifestError, UnsupportedFormatError) as e:
        return f"manifest no longer parses ({e}); left for scrub"
    if m.attempt != a.attempt:
        return f"version was re-committed meanwhile (attempt {m.attempt}, planned {a.attempt})"
    if a.force:
        return None
    for name, t in {a.tier: tier, **tiers}.items():
        if t.exists(layout.pin_key(a.version)):
            return f"version was pinned meanwhile (in the {name} tier)"
    return None


def _garbage_blocker(tier: Tier, a: Action) -> str | None:
    try:
        st = tier.stat(a.key)
    except ObjectNotFoundError:
        return "already gone"
    # an object store's stat may report whole seconds where its listing does not: allow one second
    if st.size != a.size or (a.mtime is not None and abs(st.mtime - a.mtime) >= 1.0):
        return "changed since the plan was made (still being written?)"
    return None


def remove_version(tier: Tier, version: str, manifest: Manifest, *, tier_name: str | None = None,
                   reason: str = "retention", referenced: Mapping[str, list] | None = None) -> GcResult:
    """Delete one committed version from ``tier``: un-commit (checked, as in :func:`apply`), then
    its objects and damage mark, but not the objects in ``referenced`` (default: what the tier's other
    committed manifests reference). Raises the first storage error, if any."""
    name = tier_name or tier.name
    if referenced is None:
        referenced = catalogue.referenced(catalogue.scan(tier), exclude={version})
    listing = {i.key: i for i in tier.list(layout.version_dir(version) + "/")}
    res = apply({name: tier}, version_actions(name, version, manifest, reason, listing, referenced=referenced))
    if res.failed:
        raise res.failed[0][1]
    skipped = [w for a, w in res.skipped if a.op == UNCOMMIT]
    if skipped:
        raise CkptStoreError(f"version {version!r} was not deleted: {skipped[0]}")
    return res


# -- retention right after a commit ------------------------------------------------------------------------
def apply_after_commit(tier: Tier, policy: RetentionPolicy | None, committed: Manifest, *, tier_name: str | None = None,
                       now: _dt.datetime | None = None, others: Mapping[str, Tier | None] | None = None,
                       in_flight: Iterable[str] = (), protect: Mapping[str, str] | None = None) -> list[Decision]:
    """Apply ``policy`` in ``tier`` right after ``committed`` was committed there (docs/FORMAT.md,
    Delete rule 7).

    Only versions ordered at or before ``committed`` are considered (docs/FORMAT.md, "Order": step,
    then commit sequence — a newer save that committed meanwhile is neither counted nor deleted, so
    the newest durable version is never deleted on behalf of an older save, whatever the clocks say),
    and ``committed`` itself is always kept. Each
    version to delete is un-committed first (re-checked as in :func:`apply`), then its objects are
    deleted. Garbage is left to :func:`run` and its grace period.

    ``tier_name``: which of the policy's tiers applies (default ``tier.name``); ``now``: for
    ``keep-within``; ``others``: the store's other tiers by name (``{"remote": ...}`` from the
    local tier, ``{"local": ...}`` from the remote one): what they protect here is decided by
    :func:`ckptstore.retention.across_tiers` (pins travel; locally, a version waits for its
    upload); ``in_flight``: versions whose upload is known to be running; ``protect``: more
    ``{version: reason}`` to keep.

    Never raises for storage trouble (the save is already committed): failures are logged as
    warnings. Returns the decisions about the versions in the policy's scope (empty when the policy
    has no rule for the tier).
    """
    if policy is None:
        return []
    name = tier_name or tier.name
    rules = policy.rules_for(name)
    if not rules:
        return []
    try:
        _pace.point()  # a paced save thread's piece ends here; the listing up to the deletions is one (ckptstore/_pace.py)
        entries = catalogue.scan(tier)
        mine = order_key(committed.step, committed.seq, committed.created, committed.version)
        # the versions in the policy's scope only: the others are kept whatever it decides (a root
        # that several managers share: one save does not build records of every other series)
        scoped = entries if policy.match is None else {v: e for v, e in entries.items() if policy.in_scope(v)}
        recs = [r for r in catalogue.merge({name: scoped}) if r.order <= mine]
        other_recs = {n: _records_or_none(t, n) for n, t in (others or {}).items() if t is not None}
        recs, cross = across_tiers(name, recs, other_recs, in_flight=in_flight)
        keep = {**cross, **(protect or {}), committed.version: "just committed"}
        decisions = policy.decide(name, recs, now or _dt.datetime.now(_dt.timezone.utc), protect=keep)
    except Exception as e:  # noqa: BLE001 - the save is committed; retention is best effort
        log.warning("retention after committing %r in the %s tier failed: %s", committed.version, name, e)
        return []
    gone = {d.version for d in decisions if not d.keep and d.version in entries}
    kept_refs = catalogue.referenced(entries, exclude=gone)
    for d in decisions:
        if d.keep or d.version not in entries:
            continue
        try:
            remove_version(tier, d.version, entries[d.version].manifest, tier_name=name, reason="; ".join(d.reasons),
                           referenced=kept_refs)
            log.info("retention: deleted version %r from the %s tier (%s)", d.version, name, "; ".join(d.reasons))
        except Exception as ex:  # noqa: BLE001
            log.warning("retention: could not delete version %r from the %s tier: %s", d.version, name, ex)
    _reclaim_superseded(tier, name, entries, kept_refs, policy)
    return decisions


def _reclaim_superseded(tier: Tier, name: str, entries: Mapping, referenced: Mapping[str, list],
                        policy: RetentionPolicy) -> None:
    """Retention's second half (docs/FORMAT.md, Delete rule 12): the objects of the attempts that the
    committed manifests in scope supersede — the abandoned ``step-6`` after a rewind to ``step-4`` —
    once no kept manifest references them (also when retention just deleted the superseding version).
    Best effort, like the rest of :func:`apply_after_commit`: failures are logged."""
    dirs = [layout.version_dir(v) + "/" for v, e in entries.items()
            if policy.in_scope(v) and e.manifest.superseded_attempts - {e.manifest.attempt}]
    if not dirs:
        return
    try:
        listing = [i for d in dirs for i in tier.list(d)]
        acts = superseded_actions(name, entries, listing, referenced, policy.in_scope)
        if acts:  # read before the first deletion: what a save in flight references stays (Delete rule 13)
            leased = leases.live(leases.read(tier), _dt.datetime.now(_dt.timezone.utc).timestamp(), leases.TTL)
            acts = [a for a in acts if a.key not in leased]
    except Exception as e:  # noqa: BLE001 - the save is committed; this is best effort
        log.warning("retention: could not list superseded attempts in the %s tier: %s", name, e)
        return
    for a in acts:
        try:
            _faults.point("gc.delete")
            tier.delete(a.key)
        except Exception as e:  # noqa: BLE001
            log.warning("retention: could not delete %s of a superseded attempt from the %s tier: %s", a.key, name, e)
            return
    if acts:
        log.info("retention: deleted %d object(s) of superseded attempts from the %s tier", len(acts), name)


def _records_or_none(tier: Tier, name: str):
    """The committed versions of another tier, or None when its catalogue cannot be read now."""
    try:
        return catalogue.merge({name: catalogue.scan(tier)})
    except (CkptStoreError, OSError) as e:
        log.warning("retention: cannot read the %s tier's versions (%s); keeping what may depend on them", name, e)
        return None


# -- a failed save's own objects ---------------------------------------------------------------------------
def reclaim_failed_attempt(tier: Tier, version: str, attempt: str) -> int | None:
    """Delete the objects of ``attempt`` of ``version`` in ``tier`` — a save that certainly did not
    commit (docs/FORMAT.md, Delete rule 14): a rank whose own write failed (DCP then never calls
    ``finish``), a coordinator whose commit failed before the commit point, a root told that the
    commit was aborted. Nothing is deleted when the tier's manifest of ``version`` names ``attempt``
    (it did commit). Best effort, without a grace period (the save is over); returns how many
    objects went. Without it, every save that failed on a full disk left its objects there, and the
    disk stayed full after the cause went away (the chaos run)."""
    _reclaim_looked.pop(tier.url, None)  # a failed save (a full disk?) makes the next one look for killed writers
    try:
        if catalogue.read_manifest(tier, version).manifest.attempt == attempt:
            return None
    except (VersionNotFoundError, ManifestError, UnsupportedFormatError):
        pass
    except Exception as e:  # noqa: BLE001 - cannot tell: leave it to gc and its grace period
        log.warning("ckptstore: not reclaiming the failed attempt %s of %r (%s); gc removes it later", attempt, version, e)
        return 0
    n = 0
    try:
        for info in list(tier.list(layout.object_key(version, layout.attempt_dir(attempt)) + "/")):
            tier.delete(info.key)
            n += 1
    except Exception as e:  # noqa: BLE001
        log.warning("ckptstore: reclaiming the failed attempt %s of %r stopped (%s); gc removes the rest", attempt, version, e)
    if n:
        log.info("ckptstore: deleted %d object(s) of the failed attempt %s of %r", n, attempt, version)
    return n


#: the save path looks for killed writers' attempts at its first save in a root, then at most once
#: per this many seconds (docs/FORMAT.md, Delete rule 15): a look costs a few ``stat`` calls per
#: version of the root, too much for every save of a root of thousands of versions
RECLAIM_EVERY_S = 60.0
_reclaim_looked: dict[str, float] = {}


def reclaim_dead_writers_due(tier: Tier) -> int:
    """:func:`reclaim_dead_writers` for the save path: at this process's first save in ``tier``, then
    at most once per :data:`RECLAIM_EVERY_S` (0 when not due)."""
    now = time.monotonic()
    last = _reclaim_looked.get(tier.url)
    if last is not None and now - last < RECLAIM_EVERY_S:
        return 0
    _reclaim_looked[tier.url] = now
    return reclaim_dead_writers(tier)


def reclaim_dead_writers(tier: Tier) -> int:
    """Delete the objects of every attempt in ``tier`` whose coordinator is provably dead
    (docs/FORMAT.md, Delete rule 15; ``manifest.writers``) and that no manifest of the tier names:
    what killed saves left, at once instead of after the grace period. Objects a committed manifest
    references and objects a live lease names stay (Delete rules 12, 13). The save path's
    housekeeping (the coordinator, before it draws an attempt); best effort, returns how many
    objects went."""
    try:
        keys = []
        for vd in catalogue.version_dirs(tier, held=True).values():
            # the attempt a manifest commits is passed over at once (its coordinator removed the
            # record at the commit; were it left, the manifest protects the attempt): in a large
            # root of committed versions this costs a stat or two per version (catalogue._Settled)
            done = catalogue.committed_attempt(tier, vd)
            for ad in catalogue.attempt_dirs(tier, vd):
                if (done is None or ad.rsplit("/", 2)[-2] != done) and tier.exists(ad + layout.WRITER_RECORD):
                    keys.append(ad + layout.WRITER_RECORD)
        dead = writers.dead_attempts(tier, keys)  # before the manifests are read (see collect)
        if not dead:
            return 0
        entries = catalogue.scan(tier)
        keep = set(catalogue.referenced(entries))
        keep |= set(leases.live(leases.read(tier), _dt.datetime.now(_dt.timezone.utc).timestamp(), leases.TTL))
    except Exception as e:  # noqa: BLE001 - housekeeping: gc does it later
        log.warning("ckptstore: could not look for the attempts of killed saves in %s: %s", tier.url, e)
        return 0
    n = 0
    for adir, why in dead.items():
        version, attempt = layout.version_of_key(adir + "x"), layout.attempt_of_key(adir + "x")
        e = entries.get(version)
        if version is None or attempt is None or (e is not None and e.manifest.attempt == attempt):
            continue
        try:
            objs = [i.key for i in tier.list(adir)]
            for key in sorted(objs, key=layout.is_writer_record):  # the record last: a crash leaves it to find again
                if key not in keep:
                    tier.delete(key)
                    n += 1
        except Exception as ex:  # noqa: BLE001
            log.warning("ckptstore: reclaiming attempt %s of %r stopped (%s); gc removes the rest", attempt, version, ex)
    if n:
        log.info("ckptstore: deleted %d object(s) of saves whose writer died in %s", n, tier.url)
    return n


# -- drop: one version, on request ---------------------------------------------------------------------------
REASON_DROP = "dropped on request"


def plan_drop(store, version: str, *, tiers: Iterable[str] | None = None, force: bool = False,
              now: _dt.datetime | None = None) -> GcPlan:
    """The plan that removes ``version`` on request, for :func:`apply` — also the newest version
    and a damaged one, which retention never deletes.

    ``store``: a :class:`~ckptstore.Store` or ``{name: Tier}``; ``tiers``: the tiers to remove it
    from (default: every tier of the store). Same order as gc: every un-commit first, then the
    objects and markers. A pinned version (a pin in any tier counts) is refused with
    :class:`CkptStoreError` unless ``force`` (its pin then goes too). In a tier where its
    ``manifest.json`` is invalid, every key of its directory goes, the manifest first. Raises
    :class:`VersionNotFoundError` when none of the tiers holds the version.
    """
    all_tiers = tiers_of(store)
    names = list(all_tiers) if tiers is None else list(tiers)
    for n in names:
        if n not in all_tiers:
            raise VersionNotFoundError(f"this store has no {n} tier (it has: {', '.join(all_tiers) or 'none'})")
    parts = _Parts()
    decisions: dict[str, list[Decision]] = {}
    pinned_in = []
    for n, t in all_tiers.items():
        problems: list = []
        e = catalogue.scan(t, problems).get(version)
        invalid = e is None and any(layout.version_of_key(k) == version for _t, k, _w in problems)
        if e is None and not invalid:
            continue
        listing = {i.key: i for i in t.list(layout.version_dir(version) + "/")}
        if (e.pinned if e is not None else layout.pin_key(version) in listing):
            pinned_in.append(n)
        if n not in names:
            continue
        if e is None:
            parts.add_version(_invalid_version_actions(n, version, listing))
            continue
        why = REASON_DROP + (" (marked damaged)" if e.damaged else "")
        refs_here = catalogue.referenced(catalogue.scan(t), exclude={version})
        now_ts = (now or _dt.datetime.now(_dt.timezone.utc)).timestamp()
        leased = leases.live(leases.read(t), now_ts, leases.TTL)
        parts.add_version(version_actions(n, version, e.manifest, why, listing, force=force, referenced=refs_here,
                                          leased=leased))
        parts.survivors.extend(_kept_references(n, version, e.manifest, refs_here, listing, leased))
        m = e.manifest
        decisions[n] = [Decision(version, False, (why,), m.created_dt, m.step, m.attempt, e.pinned, e.damaged)]
    if pinned_in and not force:
        raise CkptStoreError(f"version {version!r} is pinned (in the {' and '.join(pinned_in)} tier); "
                             "unpin it first ('ckptstore unpin'), or drop it with force")
    if not parts.uncommits:
        committed = [v for n in names for v in catalogue.scan(all_tiers[n])]
        raise version_not_found(version, " or ".join(f"the {n} tier ({all_tiers[n].url})" for n in names) or "no tier",
                                committed)
    return GcPlan(now=now or _dt.datetime.now(_dt.timezone.utc), grace=0.0, policy=RetentionPolicy(),
                  tiers=[n for n in names if any(a.tier == n for a in parts.uncommits)], decisions=decisions,
                  actions=parts.actions(), survivors=parts.survivors, problems=[])


def _kept_references(tier: str, version: str, manifest: Manifest, referenced: Mapping[str, list],
                     listing: Mapping[str, ObjectInfo], leased: Mapping[str, list] | None = None) -> list[Survivor]:
    """The objects of a deleted ``version`` that stay because other versions, or saves in flight
    (``leased``), reference them."""
    d = layout.version_dir(version) + "/"
    out = []
    for o in manifest.all_objects():
        key = d + o.name
        if key not in listing:
            continue
        if key in referenced:
            by = ", ".join(repr(v) for v in sorted(referenced[key]))
            out.append(Survivor(tier, key, f"object of deleted version {version!r} referenced by {by}; kept",
                                listing[key].size))
        elif leased and key in leased:
            out.append(Survivor(tier, key, f"object of deleted version {version!r} {leased[key][0].describe()}; kept",
                                listing[key].size))
    return out


def _invalid_version_actions(tier: str, version: str, listing: Mapping[str, ObjectInfo]) -> list[Action]:
    """Every key of a version directory whose manifest is invalid: the manifest first (an un-commit
    checked against the planned size and mtime), then the rest."""
    mkey = layout.manifest_key(version)
    mi = listing[mkey]
    out = [Action(tier, UNCOMMIT, mkey, "invalid-manifest", f"un-commit: {REASON_DROP} (its manifest is invalid)",
                  version=version, size=mi.size, mtime=mi.mtime)]
    for key, i in sorted(listing.items()):
        if key != mkey:
            out.append(Action(tier, DELETE, key, "version-object", f"file of dropped version {version!r}",
                              version=version, size=i.size))
    return out

# -- convenience ---------------------------------------------------------------------------------------
def run(
    tiers: Mapping[str, Tier],
    policy: RetentionPolicy | None = None,
    *,
    now: _dt.datetime | None = None,
    grace: float = DEFAULT_GRACE,
    dry_run: bool = False,
    on_action: Callable[[Action, str], None] | None = None,
) -> tuple[GcPlan, GcResult | None]:
    """Collect, plan and (unless ``dry_run``) apply. Returns ``(plan, result or None)``."""
    now = now or _dt.datetime.now(_dt.timezone.utc)
    snaps = [collect(t, n) for n, t in tiers.items()]
    p = plan(snaps, policy, now, grace)
    if dry_run:
        return p, None
    return p, apply(tiers, p, on_action=on_action)

