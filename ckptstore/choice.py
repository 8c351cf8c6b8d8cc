"""Which version a job restores, and where each rank reads each object: a pure function of every
rank's report (docs/FORMAT.md, Read rules 6-10 and "Restore choice").

The I/O lives around it: ``ckptstore/dcp/_job.py`` builds the reports (what each rank's root holds,
what the remote tier holds, the restore log) and exchanges them with one ``all_gather_object``; every
rank then calls :func:`decide` on the same reports and gets the same :class:`View`. A manager that
found a version unverifiable while loading calls it again with that version in ``exclude``.

A report (one per rank, in group-rank order)::

    {"rank": 3, "root": "/nvme/ckpt",
     "committed": {version: {"attempt", "created", "seq", "step", "damaged", "objects": [names],
                             "world_size", "nbytes", "supersedes": [attempts], "md5",
                             "nonfinite": None | {"count", "items", "first"}}},
     "parts":     {version: {attempt: [object names present in this root]}},
     "remote": None | {version: {"attempt": str | None (None: not read), "damaged", ...as committed}},
     "remote_error": None | "why the remote tier could not be read",
     "restores": [restore log entries, oldest first]}          # rank 0's root only

The rules, in order, for each version name, newest first (docs/FORMAT.md, "Order"):

1. **Identity.** Copies of one name may hold different attempts; :func:`ckptstore.manifest.order.resolve`
   picks the one that is the version. The others are *stale*: never read.
2. **Scope.** Only names matching ``scope`` (a regular expression) are considered at all.
3. **Damage marks.** A copy marked damaged (``damaged.json`` for its attempt) serves no object; the
   version is loadable only when every object it needs has another source.
4. **Excluded.** A version that failed verification while loading (``exclude``) is skipped.
5. **Job shape.** Unless ``reshard``, a version saved by another number of ranks is skipped.
6. **Completeness.** Every object must be on some root of the job (unmarked) or the remote copy must
   be committed and unmarked; otherwise skipped.
7. **Restart loop.** With ``fall_back_after=K``, a version restored K times in a row with nothing
   newer committed in between is skipped.
8. **Numerical health.** Unless ``allow_nonfinite``, a version whose manifest records NaN/Inf values
   (``nonfinite.count > 0``) is skipped; one whose values were not counted is not.

Every skipped version is recorded with its reason (:class:`Skipped`); an explicit ``version``
skips nothing: it is loaded or the reason is raised.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

from .errors import (CkptStoreError, DamagedVersionError, IntegrityError, ManifestError, TransientStorageError,
                     VersionNotFoundError, version_not_found)
from .manifest.order import order_key, resolve
from .manifest.schema import nonfinite_text

#: kinds of :attr:`Skipped.kind`
DAMAGED = "damaged"
MISSING = "missing"
UNVERIFIED = "unverified"
SHAPE = "shape"
RESTARTS = "restarts"
NONFINITE = "nonfinite"


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A version the restore passed over: ``kind`` (``damaged``, ``missing``, ``unverified``,
    ``shape``, ``restarts``, ``nonfinite``), a sentence ``reason``, and where known the ``object``
    and the place (``where``: a root or the remote tier) it concerns."""

    version: str
    attempt: str
    kind: str
    reason: str
    object: str | None = None
    where: str | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class View:
    """The decisions of one load, identical on every rank.

    ``version``/``attempt``: what is loaded; ``reports``: every rank's report (group-rank order);
    ``remote_ok``: the remote tier's committed, unmarked copy is this attempt; ``holders``: group
    ranks whose root has this attempt's manifest (unmarked); ``needed``: its object names (metadata
    object included); ``skipped``: newer versions passed over, newest first; ``stale``: ``(where,
    attempt)`` copies of this name that are not the version; ``remote_error``: why the remote tier
    was not consulted (None: it was, or there is none); ``restore_count``: how many restores in a row
    picked this version before (restore log of rank 0's root); ``newer``: ``{name: attempts}`` of
    every version in scope ordered after this one (abandoned or unloadable: a later save of one of
    these names supersedes it); ``newest``: ``(name, attempt)`` of the newest version in scope.
    """

    version: str
    attempt: str
    reports: list
    remote_ok: bool
    holders: list
    needed: list
    skipped: list = dataclasses.field(default_factory=list)
    stale: list = dataclasses.field(default_factory=list)
    remote_error: str | None = None
    restore_count: int = 0
    newer: dict = dataclasses.field(default_factory=dict)
    newest: tuple | None = None
    step: int | None = None
    world_size: int | None = None
    created: str | None = None
    marked: frozenset = frozenset()  # group ranks whose copy of this attempt is marked damaged
    #: ``{(global rank, object)}``: copies in a rank's root that failed verification while loading
    bad: frozenset = frozenset()
    #: ``((object, origin version, origin attempt), ...)``: objects of earlier versions the version's
    #: items reference (docs/FORMAT.md, "References"); held where their origin's files are
    refs: tuple = ()

    def __post_init__(self) -> None:
        # derived once: peer plans ask for every read item of every rank
        bad_at: dict[int, set] = {}  # global rank -> its objects that failed verification
        for g, o in self.bad:
            bad_at.setdefault(g, set()).add(o)
        by_origin: dict[tuple, list] = {}  # (origin version, origin attempt) -> referenced objects
        for name, v, a in self.refs:
            by_origin.setdefault((v, a), []).append(name)
        self._present = []
        for i, r in enumerate(self.reports):
            held = set() if i in self.marked else set(r["parts"].get(self.version, {}).get(self.attempt, []))
            for (v, a), names in by_origin.items():
                part = r["parts"].get(v, {}).get(a)
                if part:
                    part = set(part)
                    held.update(n for n in names if n in part)
            self._present.append(held - bad_at.get(r["rank"], set()))
        self._first_holder: dict[str, int] = {}
        for j in reversed(range(len(self.reports))):
            for name in self._present[j]:
                self._first_holder[name] = j

    def present(self, i: int) -> set:
        return self._present[i]

    def global_rank(self, i: int) -> int:
        return self.reports[i]["rank"]

    def source(self, i: int, name: str):
        """Where group rank ``i`` reads object ``name``: "local", "remote" or a peer's group rank."""
        if name in self._present[i]:
            return "local"
        if name in self._first_holder:
            return self._first_holder[name]
        if self.remote_ok:
            return "remote"
        raise CkptStoreError(f"object {name!r} of version {self.version!r} is on no root of this job")

    def has_manifest(self, i: int) -> bool:
        return i in self.holders


def _where_root(rep: dict) -> str:
    return f"the root of rank {rep['rank']} ({rep.get('root') or '?'})"


def _copies(reports: list, remote: Mapping) -> dict[str, list[dict]]:
    """Every committed copy of every version name: ``{name: [copy]}``; a copy carries the facts of
    its manifest, ``where``, ``remote`` and ``index`` (group rank, None for the remote tier)."""
    out: dict[str, list[dict]] = {}
    for i, rep in enumerate(reports):
        for v, e in rep["committed"].items():
            out.setdefault(v, []).append({**e, "where": _where_root(rep), "remote": False, "index": i})
    for v, e in remote.items():
        if e.get("attempt") is not None:
            out.setdefault(v, []).append({**e, "where": "the remote tier", "remote": True, "index": None})
    return out


def _resolved(reports: list, remote: Mapping, scope: str | None) -> tuple[dict[str, dict], list[str]]:
    """Rules 1 and 2: each name in ``scope`` with the facts of the copy that is the version (plus
    ``copies``: every copy of the name), and the names newest first (docs/FORMAT.md, "Order")."""
    pattern = re.compile(scope) if scope else None
    facts: dict[str, dict] = {}
    for v, cs in _copies(reports, remote).items():
        if pattern is not None and not pattern.fullmatch(v):
            continue
        a = resolve(cs)
        facts[v] = {**next(c for c in cs if c["attempt"] == a), "copies": cs}
    order = sorted(facts, key=lambda v: order_key(facts[v].get("step"), facts[v].get("seq"), facts[v].get("created") or "", v),
                   reverse=True)
    return facts, order


def restore_count(log: list, version: str, attempt: str, newest: tuple | None) -> int:
    """Restores in a row (the last entries of the restore log) that loaded ``(version, attempt)``
    while the newest version in scope was ``newest``: the job died after each and saved nothing newer."""
    n = 0
    for e in reversed(log or []):
        if e.get("version") == version and e.get("attempt") == attempt and tuple(e.get("newest") or ()) == tuple(newest or ()):
            n += 1
        else:
            break
    return n


def _attempts(f: dict) -> list[str]:
    """Every attempt committed under the name of the version ``f`` (a later save supersedes them)."""
    return sorted({c["attempt"] for c in f["copies"]})


class _Choice:
    """The reports of one :func:`decide`, resolved once: each version's facts, the order, the newest;
    then the rules applied to one version at a time (each version's :class:`View` is built at most once)."""

    def __init__(self, reports: list, *, exclude, scope, bad, notes) -> None:
        self.reports = reports
        self.exclude = dict(exclude or {})
        self.notes = notes or {}
        self.bad = frozenset(bad)
        self.bad_objects = {o for _g, o in self.bad}
        self.remote = reports[0].get("remote") or {}
        self.remote_error = reports[0].get("remote_error")
        self.restores = reports[0].get("restores") or []
        self.scope = scope
        self.facts, self.order = _resolved(reports, self.remote, scope)
        self.newest = (self.order[0], self.facts[self.order[0]]["attempt"]) if self.order else None

    def view(self, v: str) -> View:
        """The :class:`View` of version ``v`` (its ``skipped`` and ``newer`` are the caller's to set)."""
        f = self.facts[v]
        a = f["attempt"]
        same = [c for c in f["copies"] if c["attempt"] == a]
        marked = frozenset(c["index"] for c in same if c["damaged"] and c["index"] is not None)
        rem = next((c for c in same if c["remote"]), None)
        holders = [c["index"] for c in same if c["index"] is not None and c["index"] not in marked]
        stale = [(c["where"], c["attempt"]) for c in f["copies"] if c["attempt"] != a]
        refs = tuple(tuple(x) for x in f.get("refs") or ())
        return View(v, a, self.reports, rem is not None and not rem["damaged"], sorted(holders),
                    list(f.get("objects") or []) + [x[0] for x in refs], refs=refs,
                    stale=stale, remote_error=self.remote_error,
                    restore_count=restore_count(self.restores, v, a, self.newest),
                    newest=self.newest, step=f.get("step"), world_size=f.get("world_size"), created=f.get("created"),
                    marked=marked, bad=self.bad)

    def check(self, v: str) -> tuple[View | None, Skipped | None]:
        """Rules 3, 4 and 6 for ``v``: its view, and why this job cannot load it (None: it can)."""
        f = self.facts[v]
        a = f["attempt"]
        if (v, a) in self.exclude:
            why = self.exclude[(v, a)]
            reason, obj = (why, None) if isinstance(why, str) else (why[0], why[1])
            return None, Skipped(v, a, UNVERIFIED, reason, obj)
        vw = self.view(v)
        lost = []
        for name in vw.needed:
            try:
                vw.source(0, name)
            except CkptStoreError:
                lost.append(name)
        if lost or not vw.needed:
            return vw, self._unservable(v, lost)
        return vw, None

    def _unservable(self, v: str, lost: list) -> Skipped:
        """Why version ``v`` is not loadable when no source serves ``lost`` (or it needs nothing): a
        copy that failed verification (``notes``), a damage mark, or objects missing everywhere."""
        f = self.facts[v]
        a = f["attempt"]
        gone_bad = [n for n in lost if n in self.bad_objects]
        if gone_bad and (v, a) in self.notes:
            why = self.notes[(v, a)]
            reason, obj = (why, gone_bad[0]) if isinstance(why, str) else (why[0], why[1])
            return Skipped(v, a, UNVERIFIED, f"{reason}; no other copy of {_shown(gone_bad)} verifies", obj)
        marks = [c for c in f["copies"] if c["attempt"] == a and c["damaged"]]
        if marks:
            wh = ", ".join(c["where"] for c in marks)
            return Skipped(v, a, DAMAGED, f"marked damaged by 'ckptstore scrub --repair' in {wh}, and no other copy "
                                          f"holds {_shown(lost)}", lost[0] if lost else None, marks[0]["where"])
        reason = f"objects {_shown(lost)} are on none of the roots of ranks {[r['rank'] for r in self.reports]}"
        if (f.get("groups") or 1) > 1 and len(self.reports) == 1:
            reason += (f" (the version is split over {f['groups']} roots: load it in a job whose ranks see those roots, "
                       "every node's ranks passing their node's root)")
        if self.remote_error:
            reason += f" and the remote tier could not be read ({self.remote_error})"
        elif self.remote:
            reason += " and the version is not committed in the remote tier"
        return Skipped(v, a, MISSING, reason, lost[0] if lost else None)

    def explicit(self, version: str, where: str) -> View:
        """An explicit ``version``: its view, or the reason it cannot be loaded raised; skips nothing."""
        if version not in self.facts:
            raise self._not_committed(version, where)
        vw, why = self.check(version)
        if why is not None:
            raise _explicit_error(version, why)
        vw.newer = {n: _attempts(self.facts[n]) for n in self.order[: self.order.index(version)]}
        return vw

    def _not_committed(self, version: str, where: str) -> CkptStoreError:
        invalid = [rep["invalid"][version] for rep in self.reports if version in (rep.get("invalid") or {})]
        if invalid:
            return ManifestError(f"version {version!r} has an invalid manifest: {invalid[0]}; run 'ckptstore scrub'")
        names = {v for rep in self.reports for v in rep["committed"]} | set(self.remote)
        if version in names and version not in self.facts:  # committed, but not a name of this scope
            shown = scope_shown(self.scope)
            return VersionNotFoundError(
                f"version {version!r} is committed, but it is outside this manager's names ({shown}): a manager "
                f"restores only the versions it names (docs/FORMAT.md, \"Restore choice\", rule 2). Restore it with a "
                f"CheckpointManager whose prefix= or version_format= names it, or load it with "
                f"dcp.load(state, checkpoint_id={version!r}, storage_reader=ckptstore.StorageReader(root))")
        if self.remote_error:
            return TransientStorageError(f"version {version!r} is not committed on any root of this job, and the remote "
                                         f"tier could not be read ({self.remote_error}); try again when it answers")
        in_scope = sorted(self.facts) if self.scope else sorted(names)
        return version_not_found(version, f"any root of this job or the {where}" if where else "any root of this job",
                                 in_scope)

    def walk(self, *, world_size: int | None, reshard: bool, fall_back_after: int | None,
             allow_nonfinite: bool = False) -> tuple[View | None, list]:
        """Rules 3-8 for each version, newest first: the view of the first loadable one (None: none
        is), and every version passed over before it with its reason."""
        skipped: list[Skipped] = []
        newer: dict[str, list] = {}  # every version ordered before the current one was skipped
        for v in self.order:
            f = self.facts[v]
            vw, why = self.check(v)
            if why is None and not reshard and world_size is not None and f.get("world_size") not in (None, world_size):
                why = Skipped(v, f["attempt"], SHAPE, f"saved by {f.get('world_size')} ranks, this job has {world_size} "
                                                      "(pass reshard=True to load it resharded)")
            if why is None and fall_back_after and vw.restore_count >= fall_back_after:
                why = Skipped(v, f["attempt"], RESTARTS, f"restored {vw.restore_count} times in a row and the job ended "
                              f"each time before committing anything newer (fall_back_after={fall_back_after})")
            if why is None and not allow_nonfinite and (f.get("nonfinite") or {}).get("count"):
                why = Skipped(v, f["attempt"], NONFINITE, f"its tensors hold {nonfinite_text(f['nonfinite'])} "
                              "(recorded at save; allow_nonfinite=True or naming the version loads it)")
            if why is None:
                vw.skipped, vw.newer = skipped, newer
                return vw, skipped
            skipped.append(why)
            newer[v] = _attempts(f)
        return None, skipped

    def nothing_loadable(self, skipped: list, where: str, empty_ok: bool) -> None:
        """After a walk that found nothing: raise why (or return None for ``empty_ok`` when nothing
        at all is committed and every tier answered)."""
        if skipped:
            lines = "; ".join(f"{s.version}: {s.reason}" for s in skipped[:8]) + (" ..." if len(skipped) > 8 else "")
            raise VersionNotFoundError(f"no version is loadable by every rank of this job ({len(skipped)} committed, all "
                                       f"skipped): {lines}")
        if self.remote_error:
            raise TransientStorageError(f"no committed version on any root of this job, and the remote tier could not be "
                                        f"read ({self.remote_error}); try again when it answers")
        if empty_ok:
            return None
        raise VersionNotFoundError(f"no committed version on any root of this job nor in {where}; nothing to load "
                                   "(save one first, or check root/remote)")


def _explicit_error(version: str, why: Skipped) -> CkptStoreError:
    """The error an explicit ``version`` raises when it cannot be loaded (``why``)."""
    if why.kind == DAMAGED:
        return DamagedVersionError(f"version {version!r} is {why.reason}; load another version or run "
                                   "'ckptstore scrub --repair' on that node")
    if why.kind == MISSING:
        return IntegrityError(f"version {version!r} cannot be loaded by this job: {why.reason}. Start the job on "
                              "the nodes that hold them, restore those roots, or load another version", object=why.object)
    return IntegrityError(f"version {version!r}: {why.reason}", object=why.object)


def decide(
    reports: list,
    version: str | None,
    *,
    exclude: Mapping[tuple, str] | None = None,
    scope: str | None = None,
    world_size: int | None = None,
    reshard: bool = True,
    fall_back_after: int | None = None,
    where: str = "",
    empty_ok: bool = False,
    bad: frozenset | set = frozenset(),
    notes: Mapping[tuple, object] | None = None,
    allow_nonfinite: bool = False,
) -> View | None:
    """The :class:`View` of a load (see the module docstring). Raises the same error on every rank
    when nothing can be loaded: :class:`VersionNotFoundError` (nothing committed, or no version
    loadable — the message lists why each was skipped), for an explicit ``version``
    :class:`DamagedVersionError` / :class:`IntegrityError` / :class:`VersionNotFoundError`;
    :class:`TransientStorageError` when only an unreachable remote tier could serve it.

    ``exclude``: ``{(name, attempt): reason or (reason, object)}`` of versions that failed
    verification while loading;
    ``scope``: regular expression the names must match (``re.fullmatch``); ``world_size``: ranks of
    this job (for ``reshard``); ``fall_back_after``: see rule 7; ``where``: the tiers, for messages;
    ``empty_ok``: return None (instead of raising) when nothing at all is committed and every tier
    answered; ``bad``: ``{(global rank, object)}`` copies that failed verification while loading —
    that rank's root does not serve that object, so the view routes it to another root that holds a
    copy (a replica, the primary) or the remote tier (rule 4 at the level of one copy); ``notes``:
    ``{(name, attempt): reason or (reason, object)}`` — why copies of that version are in ``bad``
    (reported as ``unverified`` when no other copy is left); ``allow_nonfinite``: do not skip versions
    that hold NaN/Inf values (rule 8).
    """
    choice = _Choice(reports, exclude=exclude, scope=scope, bad=bad, notes=notes)
    if version is not None:
        return choice.explicit(version, where)
    view, skipped = choice.walk(world_size=world_size, reshard=reshard, fall_back_after=fall_back_after,
                                allow_nonfinite=allow_nonfinite)
    if view is not None:
        return view
    return choice.nothing_loadable(skipped, where, empty_ok)


def _shown(names: list) -> str:
    return ", ".join(names[:8]) + (" ..." if len(names) > 8 else "") if names else "every object"


def scope_shown(scope: str | None) -> str:
    """A scope written by :func:`version_pattern` as a reader would (``step\\-\\d+`` → ``step-N``)."""
    if not scope:
        return "every name"
    return "names " + re.sub(r"\\(.)", r"\1", scope.replace(r"\d+", "N"))


def version_pattern(prefix: str = "", version_format: str | None = None) -> str:
    """The regular expression of the names a manager saves: ``prefix`` + a step, or
    ``version_format`` with ``{step...}`` standing for the digits."""
    if version_format is None:
        return re.escape(prefix) + r"\d+"
    out, pos = [], 0
    for m in re.finditer(r"\{step(?::[^}]*)?\}", version_format):
        out.append(re.escape(version_format[pos:m.start()]))
        out.append(r"\d+")
        pos = m.end()
    out.append(re.escape(version_format[pos:]))
    return "".join(out)


__all__ = ["Skipped", "View", "decide", "restore_count", "version_pattern", "DAMAGED", "MISSING", "UNVERIFIED",
           "SHAPE", "RESTARTS", "NONFINITE"]
