"""The plan and result types of ``ckptstore gc`` (docs/FORMAT.md, "Delete rules"): an :class:`Action`
per step, the :class:`GcPlan` of one run (what ``gc --json`` prints), the :class:`GcResult` of
applying it. Imported from :mod:`ckptstore.gc`, which makes and applies them."""

from __future__ import annotations

import dataclasses
import datetime as _dt

from .retention import Decision, RetentionPolicy
from .tiers.base import ObjectInfo

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
    probes: list[ObjectInfo] = dataclasses.field(default_factory=list)  # probes/ (root-sharing probes)
    leases: list = dataclasses.field(default_factory=list)  # leases/ of saves in flight (manifest.leases.Lease)
    #: ``{attempt dir prefix: why}``: attempts whose coordinator was provably dead before the manifests
    #: were read (``manifest.writers``, Delete rule 15)
    dead_writers: dict = dataclasses.field(default_factory=dict)


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
    force: bool = False  # an un-commit that goes ahead although the version is pinned (drop --force)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        if not self.force:
            del d["force"]
        return d


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
