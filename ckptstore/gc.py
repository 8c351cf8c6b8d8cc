"""Garbage collection and retention: plan first (pure), then apply (DESIGN invariant 8).

``ckptstore gc`` works in three steps:

1. :func:`collect` takes a :class:`TierSnapshot` of each tier: the listing of everything under
   ``versions/`` **first**, then the committed manifests (``catalogue.scan``), stale multipart
   uploads (S3) and empty directories (local). Listing before reading manifests means an object
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
     aborted or superseded attempts, ``.tmp-*`` files, rank upload markers, leftovers of deleted
     versions — deleted only when older than the grace period (age from the object's mtime; for a
     superseded attempt of a committed version, from the newer of the object and the manifest), and
     only when their size and mtime are still what was planned (a growing file is skipped).
     Fault point ``gc.delete`` before each object deletion.
   * stale incomplete multipart uploads (tiers with ``list_multipart_uploads``) older than grace
     are aborted; empty local directories older than grace are removed.

Retention also keeps, in each tier, the versions newer than everything committed in another tier
of the same run (an upload to it may still be reading them); pins count across tiers.

Never touched: ``manifest.json`` of kept versions; ``pinned`` and ``damaged.json`` of committed
versions (they belong to their version and go only with it); anything in a version directory whose
``manifest.json`` fails to parse (reported as a problem: a damaged commit is for ``scrub`` to look
at); anything outside ``versions/``.

The grace period must exceed the longest save (and upload): an object of a save still in flight is
younger than that and survives.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
from typing import Callable, Iterable, Mapping

from . import _faults
from ._names import decode_version
from .errors import CkptStoreError, ObjectNotFoundError, ManifestError, UnsupportedFormatError
from .manifest import catalogue, layout
from .manifest.schema import Manifest, parse
from .retention import Decision, RetentionPolicy, format_duration
from .tiers.base import ObjectInfo, Tier

DEFAULT_GRACE = 3600.0

UNCOMMIT = "uncommit"
DELETE = "delete"
ABORT_UPLOAD = "abort-upload"
RMDIR = "rmdir"


@dataclasses.dataclass(frozen=True)
class Upload:
    """An incomplete multipart upload: ``key``, ``upload_id``, ``initiated`` (POSIX seconds)."""

    key: str
    upload_id: str
    initiated: float


@dataclasses.dataclass
class TierSnapshot:
    """What :func:`plan` needs to know about one tier (gathered by :func:`collect`)."""

    name: str
    listing: list[ObjectInfo]
    entries: dict  # version -> catalogue.TierEntry (valid manifests only)
    invalid: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (manifest key, why)
    uploads: list[Upload] = dataclasses.field(default_factory=list)
    empty_dirs: list[ObjectInfo] = dataclasses.field(default_factory=list)  # local only


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of a plan. ``op``: ``uncommit`` | ``delete`` | ``abort-upload`` | ``rmdir``.

    ``kind`` says what is removed: ``manifest``, ``version-object`` (object or marker of a version
    deleted by retention), ``garbage``, ``upload``, ``dir``. ``mtime``/``size``: as planned
    (checked again before a garbage deletion). ``attempt``: the attempt the manifest must still
    name for an un-commit.
    """

    tier: str
    op: str
    key: str
    kind: str
    reason: str
    version: str | None = None
    attempt: str | None = None
    size: int = 0
    mtime: float | None = None
    upload_id: str | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Survivor:
    """A garbage candidate (or upload/dir) that the plan leaves alone, and why."""

    tier: str
    key: str
    reason: str
    size: int = 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GcPlan:
    """The full, ordered plan of one gc run. ``to_json()`` is what ``gc --json`` prints as ``plan``."""

    now: _dt.datetime
    grace: float
    policy: RetentionPolicy
    tiers: list[str]
    decisions: dict[str, list[Decision]]
    actions: list[Action]
    survivors: list[Survivor]
    problems: list[tuple[str, str, str]]  # (tier, key, why)

    @property
    def deleted_versions(self) -> dict[str, list[str]]:
        return {t: [d.version for d in ds if not d.keep] for t, ds in self.decisions.items()}

    @property
    def bytes_removed(self) -> int:
        return sum(a.size for a in self.actions if a.op in (DELETE, UNCOMMIT))

    def counts(self) -> dict[str, int]:
        c = {UNCOMMIT: 0, DELETE: 0, ABORT_UPLOAD: 0, RMDIR: 0}
        for a in self.actions:
            c[a.op] += 1
        return c

    def to_json(self) -> dict:
        return {
            "now": self.now.isoformat().replace("+00:00", "Z"),
            "grace_seconds": self.grace,
            "policy": self.policy.to_json(),
            "tiers": {
                t: {
                    "rules": self.policy.describe(t),
                    "decisions": [d.to_json() for d in self.decisions.get(t, [])],
                }
                for t in self.tiers
            },
            "actions": [a.to_json() for a in self.actions],
            "survivors": [s.to_json() for s in self.survivors],
            "problems": [list(p) for p in self.problems],
            "counts": self.counts(),
            "bytes_removed": self.bytes_removed,
        }


@dataclasses.dataclass
class GcResult:
    """What :func:`apply` did: ``applied`` actions, ``skipped`` (action, why), ``failed`` (action, error)."""

    applied: list[Action] = dataclasses.field(default_factory=list)
    skipped: list[tuple[Action, str]] = dataclasses.field(default_factory=list)
    failed: list[tuple[Action, Exception]] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed

    def exit_code(self) -> int:
        for _a, e in self.failed:
            return getattr(e, "exit_code", 1) or 1
        return 0

    def to_json(self) -> dict:
        return {
            "applied": [a.to_json() for a in self.applied],
            "skipped": [{"action": a.to_json(), "why": w} for a, w in self.skipped],
            "failed": [{"action": a.to_json(), "error": f"{type(e).__name__}: {e}"} for a, e in self.failed],
        }


# -- collect -----------------------------------------------------------------------------------------
def collect(tier: Tier, name: str | None = None) -> TierSnapshot:
    """Snapshot one tier: listing first, then manifests, uploads and (local) empty directories."""
    name = name or tier.name
    listing = sorted(tier.list(layout.VERSIONS + "/"), key=lambda i: i.key)
    problems: list = []
    entries = catalogue.scan(tier, problems)
    invalid = [(key, why) for _t, key, why in problems]
    uploads: list[Upload] = []
    if tier.supports_multipart:
        for u in tier.list_multipart_uploads(layout.VERSIONS + "/"):
            uploads.append(_upload(u))
        uploads.sort(key=lambda u: (u.key, u.upload_id))
    empty_dirs = sorted(tier.list_empty_dirs(layout.VERSIONS + "/"), key=lambda i: i.key)
    return TierSnapshot(name, listing, entries, invalid, uploads, empty_dirs)


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
def _version_dir_of(key: str) -> str | None:
    parts = key.split("/")
    if len(parts) < 3 or parts[0] != layout.VERSIONS:
        return None
    return f"{parts[0]}/{parts[1]}/"


def _classify(key: str) -> str:
    base = key.rsplit("/", 1)[-1]
    parts = key.split("/")
    if base.startswith(".tmp-"):
        return "temporary file"
    if base in (layout.PINNED, layout.DAMAGED) and len(parts) == 3:
        return f"{base} marker of a version not committed here"
    if len(parts) == 5 and parts[2] == "attempts":
        if base.startswith("uploaded.") and base.endswith(".json"):
            return f"rank upload marker of attempt {parts[3]}"
        return f"object of attempt {parts[3]}"
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
    now_ts = now.timestamp()
    # a pin in any tier protects the version in every tier
    pinned_any = {v for s in snaps for v, e in s.entries.items() if e.pinned}
    decisions: dict[str, list[Decision]] = {}
    uncommits: list[Action] = []
    version_deletes: list[Action] = []
    garbage: list[Action] = []
    aborts: list[Action] = []
    rmdirs: list[Action] = []
    survivors: list[Survivor] = []
    problems: list[tuple[str, str, str]] = []

    newest = {s.name: max((e.manifest.created_dt for e in s.entries.values()), default=None) for s in snaps}
    for s in snaps:
        recs = catalogue.merge({s.name: s.entries})
        recs = [dataclasses.replace(r, pinned=True) if r.version in pinned_any and not r.pinned else r for r in recs]
        # a version newer than everything committed in another tier may still be on its way there
        # (an upload reads the local copy): keep it until it arrives
        protect = {}
        for o in snaps:
            if o is s:
                continue
            for r in recs:
                if r.version not in o.entries and (newest[o.name] is None or r.created > newest[o.name]):
                    protect[r.version] = f"not yet committed in the {o.name} tier (its upload may be pending)"
        ds = policy.decide(s.name, recs, now, protect=protect)
        decisions[s.name] = ds
        sizes = {i.key: i for i in s.listing}
        claimed: set[str] = set()  # keys that belong to a committed version (kept or deleted)
        manifest_mtime: dict[str, float] = {}
        dir_attempt: dict[str, str] = {}
        for v, e in s.entries.items():
            d = layout.version_dir(v) + "/"
            dir_attempt[d] = e.manifest.attempt
            claimed.add(d + layout.MANIFEST)
            claimed.add(d + layout.PINNED)
            claimed.add(d + layout.DAMAGED)
            for o in e.manifest.all_objects():
                claimed.add(d + o.name)
            mi = sizes.get(d + layout.MANIFEST)
            if mi is not None:
                manifest_mtime[d] = mi.mtime
        for dec in ds:
            if dec.keep:
                continue
            e = s.entries[dec.version]
            why = "; ".join(dec.reasons)
            for a in version_actions(s.name, dec.version, e.manifest, why, sizes):
                (uncommits if a.op == UNCOMMIT else version_deletes).append(a)
        deleted_dirs = {layout.version_dir(d.version) + "/" for d in ds if not d.keep}
        skip_dirs = set()
        for key, why in s.invalid:
            vd = _version_dir_of(key)
            if vd is not None:
                skip_dirs.add(vd)
            problems.append((s.name, key, why))
        for info in s.listing:
            key = info.key
            if key in claimed:
                continue
            vd = _version_dir_of(key)
            if vd is None:
                survivors.append(Survivor(s.name, key, "not inside a version directory; left alone", info.size))
                continue
            try:
                decode_version(key.split("/")[1])
            except CkptStoreError:
                survivors.append(Survivor(s.name, key, "not in a ckptstore version directory; left alone", info.size))
                continue
            if vd in skip_dirs:
                survivors.append(Survivor(s.name, key, "its version's manifest.json is invalid (see problems); left for scrub", info.size))
                continue
            what = _classify(key)
            ref_t = info.mtime
            if vd in manifest_mtime and vd not in deleted_dirs:
                ref_t = max(ref_t, manifest_mtime[vd])
                parts = key.split("/")
                if len(parts) == 5 and parts[3] == dir_attempt.get(vd):
                    what += ", not named by the committed manifest"
                else:
                    what += " not referenced by the committed manifest (superseded or aborted attempt)"
            elif vd in deleted_dirs:
                what += " in a version deleted by retention"
            else:
                what += " (version not committed in this tier)"
            age = now_ts - ref_t
            if age >= grace:
                garbage.append(
                    Action(s.name, DELETE, key, "garbage", f"{what}; age {format_duration(age)} >= grace {format_duration(grace)}",
                           version=_safe_version(key), size=info.size, mtime=info.mtime)
                )
            else:
                survivors.append(
                    Survivor(s.name, key, f"{what}; younger than the grace period (age {format_duration(age)} < {format_duration(grace)})", info.size)
                )
        for u in s.uploads:
            age = now_ts - u.initiated
            if _version_dir_of(u.key) is None:
                survivors.append(Survivor(s.name, u.key, f"multipart upload {u.upload_id} outside versions/; left alone"))
            elif age >= grace:
                aborts.append(Action(s.name, ABORT_UPLOAD, u.key, "upload",
                                     f"incomplete multipart upload started {format_duration(age)} ago (>= grace {format_duration(grace)})",
                                     version=_safe_version(u.key), upload_id=u.upload_id, mtime=u.initiated))
            else:
                survivors.append(Survivor(s.name, u.key, f"multipart upload {u.upload_id} in progress (started {format_duration(age)} ago < grace)"))
        for dinfo in s.empty_dirs:
            age = now_ts - dinfo.mtime
            if age >= grace:
                rmdirs.append(Action(s.name, RMDIR, dinfo.key, "dir", f"empty directory, age {format_duration(age)} >= grace",
                                     mtime=dinfo.mtime))
            else:
                survivors.append(Survivor(s.name, dinfo.key + "/", f"empty directory younger than the grace period (age {format_duration(age)})"))

    return GcPlan(
        now=now,
        grace=float(grace),
        policy=policy,
        tiers=[s.name for s in snaps],
        decisions=decisions,
        actions=uncommits + version_deletes + garbage + aborts + rmdirs,
        survivors=survivors,
        problems=problems,
    )


def _safe_version(key: str) -> str | None:
    try:
        return layout.version_of_key(key)
    except Exception:  # pragma: no cover
        return None


def version_actions(tier: str, version: str, manifest: Manifest, reason: str,
                    listing: Mapping[str, ObjectInfo] | None = None) -> list[Action]:
    """The actions that delete one committed version: un-commit, then its objects and damage mark."""
    d = layout.version_dir(version) + "/"

    def size(key: str) -> int:
        i = (listing or {}).get(key)
        return i.size if i is not None else 0

    out = [Action(tier, UNCOMMIT, d + layout.MANIFEST, "manifest", f"un-commit: {reason}", version=version,
                  attempt=manifest.attempt, size=size(d + layout.MANIFEST))]
    for o in manifest.all_objects():
        key = d + o.name
        if listing is not None and key not in listing:
            continue  # already missing: nothing to delete
        out.append(Action(tier, DELETE, key, "version-object", f"object of deleted version {version!r}", version=version,
                          attempt=manifest.attempt, size=size(key) if listing is not None else o.size))
    if listing is None or d + layout.DAMAGED in listing:
        out.append(Action(tier, DELETE, d + layout.DAMAGED, "version-object", f"damage mark of deleted version {version!r}",
                          version=version, attempt=manifest.attempt, size=size(d + layout.DAMAGED)))
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
    res = GcResult()
    blocked: set[tuple[str, str]] = set()  # (tier, version) whose un-commit did not happen

    def note(a: Action, outcome: str, detail=None) -> None:
        if outcome == "applied":
            res.applied.append(a)
        elif outcome == "skipped":
            res.skipped.append((a, detail))
        else:
            res.failed.append((a, detail))
        if on_action is not None:
            on_action(a, outcome)

    for a in actions:
        tier = tiers.get(a.tier)
        if tier is None:
            note(a, "skipped", f"no {a.tier} tier in this store")
            continue
        try:
            if a.op == UNCOMMIT:
                why = _uncommit_blocker(tier, a, tiers)
                if why is not None:
                    blocked.add((a.tier, a.version))
                    note(a, "skipped", why)
                    continue
                _faults.point("gc.uncommit")
                tier.delete(a.key)
            elif a.op == DELETE:
                if a.kind == "version-object":
                    if (a.tier, a.version) in blocked:
                        note(a, "skipped", "its version was not un-committed")
                        continue
                else:
                    why = _garbage_blocker(tier, a)
                    if why is not None:
                        note(a, "skipped", why)
                        continue
                _faults.point("gc.delete")
                tier.delete(a.key)
            elif a.op == ABORT_UPLOAD:
                tier.abort_multipart_upload(a.key, a.upload_id)
            elif a.op == RMDIR:
                if not tier.remove_empty_dir(a.key):
                    note(a, "skipped", "no longer an empty directory")
                    continue
            else:  # pragma: no cover
                raise ValueError(f"unknown gc action {a.op!r}")
        except (CkptStoreError, OSError) as e:
            if a.op == UNCOMMIT:
                blocked.add((a.tier, a.version))
            note(a, "failed", e)
            continue
        note(a, "applied")
    return res


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
    for name, t in {a.tier: tier, **tiers}.items():
        if t.exists(layout.pin_key(a.version)):
            return f"version was pinned meanwhile (in the {name} tier)"
    return None


def _garbage_blocker(tier: Tier, a: Action) -> str | None:
    try:
        st = tier.stat(a.key)
    except ObjectNotFoundError:
        return "already gone"
    # S3 HEAD reports whole seconds where LIST may not: allow one second of difference
    if st.size != a.size or (a.mtime is not None and abs(st.mtime - a.mtime) >= 1.0):
        return "changed since the plan was made (still being written?)"
    return None


def remove_version(tier: Tier, version: str, manifest: Manifest, *, tier_name: str | None = None,
                   reason: str = "retention") -> GcResult:
    """Delete one committed version from ``tier``: un-commit (checked, as in :func:`apply`), then
    its objects and damage mark. Raises the first storage error, if any."""
    name = tier_name or tier.name
    res = apply({name: tier}, version_actions(name, version, manifest, reason))
    if res.failed:
        raise res.failed[0][1]
    skipped = [w for a, w in res.skipped if a.op == UNCOMMIT]
    if skipped:
        raise CkptStoreError(f"version {version!r} was not deleted: {skipped[0]}")
    return res


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

