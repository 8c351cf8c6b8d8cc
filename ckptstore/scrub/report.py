"""Scrub's findings and how they are reported: the verdict on each object (:class:`ObjectCheck`)
and on each version in each tier (:class:`VersionCheck` with its :class:`Issue` list), the whole
:class:`ScrubReport` with its JSON form and exit code, and :func:`format_report` (what
``ckptstore scrub`` prints without ``--json``).

Exit codes (``ckptstore scrub``; also :attr:`ScrubReport.exit_code`), most severe first:

====  ======================  =========================================================
10    ``EXIT_DAMAGE``         damage found and not (all) repaired
5     ``EXIT_KEY``            no unrepaired damage, but the key given does not fit an
                              encrypted version (``--deep``): the key's exit code, as everywhere
12    ``EXIT_UNCHECKED``      no unrepaired damage, but something could not be checked
                              (key missing for ``--deep``, tier unreachable, read error)
13    ``EXIT_NONFINITE``      no damage left, every version checked, but a version's
                              manifest records NaN/Inf values in its tensors: the bytes
                              are intact (not damage, never marked), the values are not
                              a restore point (docs/FORMAT.md, "Restore choice")
11    ``EXIT_REPAIRED``       damage found and all of it repaired
0     ``EXIT_CLEAN``          everything checked and clean
====  ======================  =========================================================

A finding is not damage: an :class:`Issue` with status :data:`FINDING` (kind ``nonfinite``) leaves
its version's status as it is (``ok``), is never repaired, marked or counted by :meth:`ScrubReport.damage`.
"""

from __future__ import annotations

import dataclasses

from ..manifest import placement

EXIT_CLEAN = 0
EXIT_KEY = 5  # KeyMismatchError.exit_code
EXIT_DAMAGE = 10
EXIT_REPAIRED = 11
EXIT_UNCHECKED = 12
EXIT_NONFINITE = 13

OK = "ok"
DAMAGED = "damaged"
REPAIRED = "repaired"
UNCHECKED = "unchecked"
#: an Issue that reports a fact about the version, not damage (kind ``nonfinite``)
FINDING = "finding"

#: damage kinds of one object
OBJECT_KINDS = ("missing", "truncated", "oversized", "corrupt", "digest", "frame-count", "undecodable")
#: damage kinds of a version as a whole
VERSION_KINDS = ("manifest", "key", "metadata", "marked", "divergent")
#: findings about a version that are not damage
FINDING_KINDS = ("nonfinite",)


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
    #: this root holds the object as a replica of another root group's (docs/FORMAT.md, "Replicas")
    replica: bool = False

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("name", "key", "size", "status", "kind", "detail", "repaired_from", "replica")}


@dataclasses.dataclass
class Issue:
    """A finding about a version as a whole (``kind`` in :data:`VERSION_KINDS`, or a note; with
    ``status`` :data:`FINDING`, a kind of :data:`FINDING_KINDS`: not damage)."""

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
    #: the part of the version this tier holds and that was checked (None: not looked at)
    part: placement.Part | None = None
    #: ``deep``: a key was given, but not the one this encrypted version was written with
    wrong_key: bool = False

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
            "part": None if self.part is None else self.part.to_json(),
            "wrong_key": self.wrong_key,
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
        if any(v.wrong_key for v in self.versions):
            return EXIT_KEY
        if UNCHECKED in st or self.unreachable:
            return EXIT_UNCHECKED
        if self.nonfinite():
            return EXIT_NONFINITE
        if REPAIRED in st:
            return EXIT_REPAIRED
        return EXIT_CLEAN

    def nonfinite(self) -> list[tuple[str, str, str]]:
        """``(tier, version, what)`` of every version copy whose manifest records NaN/Inf values."""
        return [(v.tier, v.version, i.detail) for v in self.versions for i in v.issues
                if i.status == FINDING and i.kind == "nonfinite"]

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
                "nonfinite": len(self.nonfinite()),
            },
        }


def format_report(report: ScrubReport) -> list[str]:
    """Human-readable lines (what ``ckptstore scrub`` prints without ``--json``)."""
    lines = []
    for t, why in report.unreachable:
        lines.append(f"{t} tier: NOT CHECKED ({why})")
    for v in report.versions:
        bad = [o for o in v.objects if o.status != OK]
        head = f"{v.tier:<6} {v.version}: {v.status.upper()}"
        if v.objects:
            where = f"{v.part.label}: " if v.part is not None and not v.part.whole else ""
            head += f" ({where}{len(v.objects)} objects{', deep' if v.deep else ''})"
        if v.mark:
            head += f" [{v.mark} now]"
        lines.append(head)
        for i in v.issues:  # a "marked" issue's detail says "marked damaged ..." itself
            lines.append(f"         {i.detail}" if i.kind == "marked" else f"         {i.status}: {i.kind}: {i.detail}")
        for o in bad:
            what = o.kind or "not checked"
            lines.append(f"         {o.status}: {o.name}{' (replica)' if o.replica else ''}: {what}: {o.detail}")
    return lines
