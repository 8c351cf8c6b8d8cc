"""Which version a job restores, and where each rank reads each object: a pure function of what
the job's roots hold (docs/FORMAT.md, Read rules 6-10 and "Restore choice").

The I/O lives around it: ``ckptstore/dcp/_job.py`` has one rank per root list that root, gathers the
roots' reports (and the remote tier's listing, the restore log) into one *job report* and hands it
to every rank; every rank then calls :func:`decide` on the same job report and gets the same
:class:`View`. A manager that found a version unverifiable while loading calls it again with that
version in ``exclude``.

The job report (its size grows with roots × versions, never with ranks × anything; docs/FORMAT.md,
"Restore choice")::

    {"ranks":     [[global rank, root index | None], ...],   # per group rank (None: no local root)
     "roots":     [{"root": url, "leader": group rank that listed it,
                    "committed": {version: [manifest digest, damaged]},
                    "held":      {version: {attempt: object set}},   # the objects present in the root
                    "invalid":   {version: why}}, ...],
     "manifests": {digest: {"attempt", "created", "seq", "step", "world_size", "nbytes",
                            "supersedes": [attempts], "groups": n, "objects": object set,
                            "refs": [[origin version, origin attempt, object set], ...],
                            "nonfinite": None | {"count", "items", "first"}}},
     "remote":    None | {version: {"manifest": digest | None (not read), "damaged": bool}},
     "remote_error": None | "why the remote tier could not be read",
     "invalid":   {version: why},                            # the remote tier's invalid manifests
     "restores":  [restore log entries of the first rank's root, oldest first],
     "chain":     [catalogue chain findings of the first rank's root and the remote tier]}  # optional

A manifest's facts appear once per distinct manifest, keyed by the MD5 of the manifest file (what a
remote tier's listing reports, docs/FORMAT.md "Tiers", rule 3); an *object set* is ``[meta, rank runs, other names]`` of one attempt
(:class:`ckptstore.manifest.objsets.ObjSet`): a root of one node holds its group's part as one run.
Roots are listed in the order of the lowest group rank on each.

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

With a key, the catalogue chain's findings (``job["chain"]``, docs/FORMAT.md "Catalogue chain") add:
a copy the chain shows to be an older manifest put back (``rolled-back``) is skipped like rule 4;
a newest commit that is gone everywhere (``missing-newest``) skips nothing — there is nothing to
load — but heads the view's ``skipped`` so the restore says it loads an older version.

Every skipped version is recorded with its reason (:class:`Skipped`); an explicit ``version``
skips nothing: it is loaded or the reason is raised. :func:`decide` is linear in the size of the job
report (plus one pass over ``ranks``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

from .errors import (CkptStoreError, DamagedVersionError, IntegrityError, ManifestError, TransientStorageError,
                     VersionNotFoundError, version_not_found)
from .manifest.objsets import ObjSet, runs_of
from .manifest.order import order_key, resolve
from .manifest.schema import nonfinite_text

#: kinds of :attr:`Skipped.kind`
DAMAGED = "damaged"
MISSING = "missing"
UNVERIFIED = "unverified"
SHAPE = "shape"
RESTARTS = "restarts"
NONFINITE = "nonfinite"
#: the catalogue chain (docs/FORMAT.md, "Catalogue chain"): a manifest put back in place of a newer
#: commit (skipped), and the newest commit gone (recorded, nothing to skip)
ROLLED_BACK = "rolled-back"
MISSING_NEWEST = "missing-newest"


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


class _Roots:
    """The job's ranks and roots, indexed once per :func:`decide` (one pass over ``ranks``)."""

    def __init__(self, job: Mapping) -> None:
        ranks = job.get("ranks") or []
        self.size = len(ranks)
        self.global_ = [int(g) for g, _k in ranks]
        self.root_of = [None if k is None else int(k) for _g, k in ranks]
        first: dict[int, int] = {}
        self.shared: set[int] = set()  # roots more than one rank of the load writes to
        for i, k in enumerate(self.root_of):
            if k is not None and k not in first:
                first[k] = i
            elif k is not None:
                self.shared.add(k)
        self.first_member = first  # root -> its lowest group rank
        self.order = sorted(first, key=first.get)  # roots in the order of their lowest group rank
        self._by_global: dict[int, int] | None = None
        self.reports = list(job.get("roots") or [])
        self._where: dict[int, str] = {}

    def index_of(self, global_rank: int) -> int | None:
        if self._by_global is None:
            self._by_global = {g: i for i, g in enumerate(self.global_)}
        return self._by_global.get(global_rank)

    def root_of_global(self, global_rank: int) -> int | None:
        i = self.index_of(global_rank)
        return None if i is None else self.root_of[i]

    def where(self, k: int) -> str:
        w = self._where.get(k)
        if w is None:
            i = self.first_member.get(k)
            rank = self.global_[i] if i is not None else "?"
            w = self._where[k] = f"the root of rank {rank} ({self.reports[k].get('root') or '?'})"
        return w


class Presence:
    """What one root holds of a view's version, as a set of object names (``name in p``, ``bool(p)``,
    iteration): the attempt's own objects (none when the copy there is marked damaged) and the
    referenced objects of earlier versions, less the copies that failed verification."""

    def __init__(self, view: "View", k: int | None) -> None:
        self._view = view
        self._k = k

    def __contains__(self, name: object) -> bool:
        return self._k is not None and isinstance(name, str) and self._view._holds(self._k, name)

    def __bool__(self) -> bool:
        return self._k is not None and self._view._holds_any(self._k)

    def __iter__(self):
        if self._k is None:
            return iter(())
        return iter(n for n in self._view._candidates(self._k) if self._view._holds(self._k, n))


class View:
    """The decisions of one load, identical on every rank.

    ``version``/``attempt``: what is loaded; ``job``: the job report (module docstring);
    ``remote_ok``: the remote tier's committed, unmarked copy is this attempt; ``holders``: group
    ranks whose root has this attempt's manifest (unmarked); ``needed``: its object names (metadata
    object and referenced objects included); ``skipped``: newer versions passed over, newest first;
    ``stale``: ``(where, attempt)`` copies of this name that are not the version; ``remote_error``:
    why the remote tier was not consulted (None: it was, or there is none); ``restore_count``: how
    many restores in a row picked this version before (restore log of the first rank's root);
    ``newer``: ``{name: attempts}`` of every version in scope ordered after this one (abandoned or
    unloadable: a later save of one of these names supersedes it); ``newest``: ``(name, attempt)`` of
    the newest version in scope; ``marked``: roots whose copy of this attempt is marked damaged;
    ``bad``: ``{(global rank, object)}`` copies in a rank's root that failed verification while
    loading (that root serves no such object); ``refs``: ``((origin version, origin attempt, ObjSet),
    ...)`` objects of earlier versions the version's items reference (docs/FORMAT.md, "References"),
    held where their origin's files are.

    Per group rank ``i``: :meth:`present` (what its root holds), :meth:`source` (where it reads an
    object), :meth:`has_manifest`, :meth:`global_rank`, :meth:`root_url`, :meth:`root_id`; per object
    :meth:`first_holder`. Each answer costs O(roots) at most, never O(ranks).
    """

    def __init__(self, version: str, attempt: str, job: Mapping, remote_ok: bool, *, roots: _Roots | None = None,
                 objects: ObjSet | None = None, refs: tuple = (), holder_roots: frozenset = frozenset(),
                 marked: frozenset = frozenset(), bad: frozenset = frozenset(), skipped: list | None = None,
                 stale: list | None = None, remote_error: str | None = None, restore_count: int = 0,
                 newer: dict | None = None, newest: tuple | None = None, step: int | None = None,
                 world_size: int | None = None, created: str | None = None, nbytes: int = 0) -> None:
        self.version, self.attempt, self.job, self.remote_ok = version, attempt, job, remote_ok
        self._roots = roots or _Roots(job)
        self.objects = objects if objects is not None else ObjSet(attempt)
        self.refs = tuple(refs)
        self.holder_roots = frozenset(holder_roots)
        self.marked = frozenset(marked)
        self.bad = frozenset(bad)
        self.skipped = skipped if skipped is not None else []
        self.stale = stale if stale is not None else []
        self.remote_error = remote_error
        self.restore_count = restore_count
        self.newer = newer if newer is not None else {}
        self.newest = newest
        self.step, self.world_size, self.created, self.nbytes = step, world_size, created, nbytes
        self._bad_at: dict[int, set] = {}  # root -> its objects that failed verification
        for g, o in self.bad:
            k = self._roots.root_of_global(g)
            if k is not None:
                self._bad_at.setdefault(k, set()).add(o)
        self._origin = {a: (v, a) for v, a, _s in self.refs}  # origin attempt -> (version, attempt)
        self._ref_sets = {(v, a): st for v, a, st in self.refs}
        self._held: dict[tuple, ObjSet] = {}  # (root, version, attempt) -> what the root holds of it
        self._first: dict[str, int | None] = {}
        self._holders: list | None = None

    # -- the job ----------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Ranks of the load's group."""
        return self._roots.size

    def global_rank(self, i: int) -> int:
        return self._roots.global_[i]

    def index_of(self, global_rank: int) -> int | None:
        """The group rank of ``global_rank`` (None: not in the load's group)."""
        return self._roots.index_of(global_rank)

    def root_url(self, i: int) -> str | None:
        k = self._roots.root_of[i]
        return None if k is None else self._roots.reports[k].get("root")

    def root_id(self, i: int) -> int | None:
        """An identity of group rank ``i``'s root when other ranks of the load share it (its index in
        the job report), else None: the load's exchange reads what several of them need from it once
        (``dcp/_peers.py``; docs/FORMAT.md, Read rule 11)."""
        k = self._roots.root_of[i]
        return k if k in self._roots.shared else None

    @property
    def holders(self) -> list:
        if self._holders is None:
            self._holders = [i for i, k in enumerate(self._roots.root_of) if k in self.holder_roots]
        return self._holders

    @property
    def needed(self) -> list:
        """Every object name the version needs (its own, then the referenced ones)."""
        return list(self.objects) + [n for _v, _a, st in self.refs for n in st]

    def has_manifest(self, i: int) -> bool:
        return self._roots.root_of[i] in self.holder_roots

    def manifest_key_id(self, i: int) -> str | None:
        """The id of the master key that wraps the copy of the version's manifest in group rank
        ``i``'s root (None: not encrypted, no copy there, or not known)."""
        k = self._roots.root_of[i]
        if k is None:
            return None
        entry = (self._roots.reports[k].get("committed") or {}).get(self.version)
        facts = (self.job.get("manifests") or {}).get(entry[0]) if entry else None
        return None if facts is None else facts.get("key_id")

    def lists_root(self, i: int) -> bool:
        """Group rank ``i`` is the one that listed its root for this load (its leader)."""
        k = self._roots.root_of[i]
        return k is not None and self._roots.reports[k].get("leader") == i

    # -- where objects are --------------------------------------------------------------------------
    def held(self, k: int, version: str, attempt: str) -> ObjSet:
        """What root ``k`` holds of ``(version, attempt)``, less its copies that failed verification."""
        key = (k, version, attempt)
        got = self._held.get(key)
        if got is None:
            raw = ((self._roots.reports[k].get("held") or {}).get(version) or {}).get(attempt)
            got = ObjSet(attempt) if raw is None else ObjSet.from_json(attempt, raw)
            if k in self._bad_at:
                got = got.without(self._bad_at[k])
            self._held[key] = got
        return got

    def _holds(self, k: int, name: str) -> bool:
        if k not in self.marked and name in self.held(k, self.version, self.attempt):
            return True
        origin = self._origin.get(_attempt_of(name))
        return origin is not None and name in self._ref_sets[origin] and name in self.held(k, *origin)

    def _holds_any(self, k: int) -> bool:
        if k not in self.marked and self.held(k, self.version, self.attempt):
            return True
        return any(self.held(k, v, a) for v, a, _s in self.refs)

    def _candidates(self, k: int):
        yield from self.held(k, self.version, self.attempt)
        for v, a, _s in self.refs:
            yield from self.held(k, v, a)

    def present(self, i: int) -> Presence:
        """What group rank ``i``'s root holds of the version (a set of object names)."""
        return Presence(self, self._roots.root_of[i])

    def first_holder(self, name: str) -> int | None:
        """The lowest group rank whose root holds ``name`` (None: no root of the job does)."""
        if name not in self._first:
            self._first[name] = next((self._roots.first_member[k] for k in self._roots.order if self._holds(k, name)), None)
        return self._first[name]

    def source(self, i: int, name: str):
        """Where group rank ``i`` reads object ``name``: "local", "remote" or a peer's group rank."""
        k = self._roots.root_of[i]
        if k is not None and self._holds(k, name):
            return "local"
        j = self.first_holder(name)
        if j is not None:
            return j
        if self.remote_ok:
            return "remote"
        raise CkptStoreError(f"object {name!r} of version {self.version!r} is on no root of this job")

    def missing(self) -> list[ObjSet]:
        """The needed objects no unmarked root of the job holds (one set per attempt involved:
        the version's own, then each origin of its references); all empty when it is complete."""
        own = self.objects.minus(ObjSet.union(self.attempt, (self.held(k, self.version, self.attempt)
                                                             for k in self._roots.order if k not in self.marked)))
        out = [own]
        for v, a, st in self.refs:
            out.append(st.minus(ObjSet.union(a, (self.held(k, v, a) for k in self._roots.order))))
        return out


def _attempt_of(name: str) -> str | None:
    """The attempt of an object name ``attempts/<attempt>/<file>``."""
    parts = name.split("/")
    return parts[1] if len(parts) == 3 else None


def _copies(job: Mapping, roots: _Roots) -> dict[str, list[dict]]:
    """Every committed copy of every version name: ``{name: [copy]}``; a copy carries the facts of
    its manifest, ``damaged``, ``where``, ``remote`` and ``root`` (None for the remote tier)."""
    manifests = job.get("manifests") or {}
    out: dict[str, list[dict]] = {}
    for k in roots.order:
        for v, (digest, damaged) in (roots.reports[k].get("committed") or {}).items():
            f = manifests.get(digest)
            if f is not None:
                out.setdefault(v, []).append({**f, "damaged": bool(damaged), "where": roots.where(k), "remote": False, "root": k})
    for v, e in (job.get("remote") or {}).items():
        f = manifests.get(e.get("manifest"))
        if f is not None:
            out.setdefault(v, []).append({**f, "damaged": bool(e.get("damaged")), "where": "the remote tier", "remote": True,
                                          "root": None})
    return out


def _resolved(job: Mapping, roots: _Roots, scope: str | None) -> tuple[dict[str, dict], list[str]]:
    """Rules 1 and 2: each name in ``scope`` with the facts of the copy that is the version (plus
    ``copies``: every copy of the name), and the names newest first (docs/FORMAT.md, "Order")."""
    pattern = re.compile(scope) if scope else None
    facts: dict[str, dict] = {}
    for v, cs in _copies(job, roots).items():
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


def _ranks_shown(ranks: list) -> str:
    """Global ranks as runs (``0-3, 8-11``), at most 8 runs shown."""
    runs = runs_of(ranks)
    shown = [f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in runs[:8]]
    return ", ".join(shown) + (" ..." if len(runs) > 8 else "")


class _Choice:
    """The job report of one :func:`decide`, resolved once: each version's facts, the order, the
    newest; then the rules applied to one version at a time (each version's :class:`View` is built
    at most once)."""

    def __init__(self, job: Mapping, *, exclude, scope, bad, notes) -> None:
        self.job = job
        self.roots = _Roots(job)
        self.exclude = dict(exclude or {})
        self.notes = notes or {}
        self.bad = frozenset(bad)
        self.bad_objects = {o for _g, o in self.bad}
        self.remote = job.get("remote") or {}
        self.remote_error = job.get("remote_error")
        self.restores = job.get("restores") or []
        self.scope = scope
        self.facts, self.order = _resolved(job, self.roots, scope)
        found = job.get("chain") or ()
        self.rolled_back = {(f["version"], f["attempt"]): f["message"] for f in found if f["kind"] == ROLLED_BACK}
        self.missing_newest = [Skipped(f["version"], f["attempt"], MISSING_NEWEST, f["message"]) for f in found
                               if f["kind"] == MISSING_NEWEST and f["version"] not in self.facts]
        self.newest = (self.order[0], self.facts[self.order[0]]["attempt"]) if self.order else None

    def view(self, v: str) -> View:
        """The :class:`View` of version ``v`` (its ``skipped`` and ``newer`` are the caller's to set)."""
        f = self.facts[v]
        a = f["attempt"]
        same = [c for c in f["copies"] if c["attempt"] == a]
        marked = frozenset(c["root"] for c in same if c["damaged"] and c["root"] is not None)
        rem = next((c for c in same if c["remote"]), None)
        holders = frozenset(c["root"] for c in same if c["root"] is not None and c["root"] not in marked)
        stale = [(c["where"], c["attempt"]) for c in f["copies"] if c["attempt"] != a]
        objects = ObjSet.from_json(a, f["objects"]) if f.get("objects") is not None else ObjSet(a)
        refs = tuple((rv, ra, ObjSet.from_json(ra, st)) for rv, ra, st in f.get("refs") or ())
        return View(v, a, self.job, rem is not None and not rem["damaged"], roots=self.roots, objects=objects, refs=refs,
                    holder_roots=holders, marked=marked, bad=self.bad, stale=stale, remote_error=self.remote_error,
                    restore_count=restore_count(self.restores, v, a, self.newest), newest=self.newest,
                    step=f.get("step"), world_size=f.get("world_size"), created=f.get("created"), nbytes=f.get("nbytes") or 0)

    def check(self, v: str) -> tuple[View | None, Skipped | None]:
        """Rules 3, 4 and 6 for ``v``: its view, and why this job cannot load it (None: it can)."""
        f = self.facts[v]
        a = f["attempt"]
        if (v, a) in self.exclude:
            why = self.exclude[(v, a)]
            reason, obj = (why, None) if isinstance(why, str) else (why[0], why[1])
            return None, Skipped(v, a, UNVERIFIED, reason, obj)

        vw = self.view(v)
        empty = not vw.objects and not any(st for _v, _a, st in vw.refs)
        missing = [] if vw.remote_ok else [m for m in vw.missing() if m]
        if missing or empty:
            return vw, self._unservable(v, missing)
        return vw, None

    def _unservable(self, v: str, missing: list) -> Skipped:
        """Why version ``v`` is not loadable when no source serves the ``missing`` object sets (or it
        needs nothing): a copy that failed verification (``notes``), a damage mark, or objects
        missing everywhere."""
        f = self.facts[v]
        a = f["attempt"]
        lost = [n for m in missing for n in m.head(9)]
        n_lost = sum(len(m) for m in missing)
        gone_bad = sorted(n for n in self.bad_objects if any(n in m for m in missing))
        if gone_bad and (v, a) in self.notes:
            why = self.notes[(v, a)]
            reason, obj = (why, gone_bad[0]) if isinstance(why, str) else (why[0], why[1])
            return Skipped(v, a, UNVERIFIED, f"{reason}; no other copy of {_shown(gone_bad)} verifies", obj)
        marks = [c for c in f["copies"] if c["attempt"] == a and c["damaged"]]
        if marks:
            wh = ", ".join(c["where"] for c in marks)
            return Skipped(v, a, DAMAGED, f"marked damaged by 'ckptstore scrub --repair' in {wh}, and no other copy "
                                          f"holds {_shown(lost, n_lost)}", lost[0] if lost else None, marks[0]["where"])
        reason = f"objects {_shown(lost, n_lost)} are on none of the roots of ranks [{_ranks_shown(self.roots.global_)}]"
        if (f.get("groups") or 1) > 1 and self.roots.size == 1:
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
        invalid = [rep["invalid"][version] for rep in self.roots.reports if version in (rep.get("invalid") or {})]
        invalid += [self.job["invalid"][version]] if version in (self.job.get("invalid") or {}) else []
        if invalid:
            return ManifestError(f"version {version!r} has an invalid manifest: {invalid[0]}; run 'ckptstore scrub'")
        names = {v for rep in self.roots.reports for v in rep["committed"]} | set(self.remote)
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
        skipped: list[Skipped] = list(self.missing_newest)
        newer: dict[str, list] = {}  # every version ordered before the current one was skipped
        for v in self.order:
            f = self.facts[v]
            vw, why = self.check(v)
            if why is None and (v, f["attempt"]) in self.rolled_back:  # an explicit version is loaded as asked
                why = Skipped(v, f["attempt"], ROLLED_BACK, self.rolled_back[(v, f["attempt"])])
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
    job: Mapping,
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
    """The :class:`View` of a load from the ``job`` report (see the module docstring). Raises the same error on every rank
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
    choice = _Choice(job, exclude=exclude, scope=scope, bad=bad, notes=notes)
    if version is not None:
        return choice.explicit(version, where)
    view, skipped = choice.walk(world_size=world_size, reshard=reshard, fall_back_after=fall_back_after,
                                allow_nonfinite=allow_nonfinite)
    if view is not None:
        return view
    return choice.nothing_loadable(skipped, where, empty_ok)


def _shown(names: list, total: int | None = None) -> str:
    total = len(names) if total is None else total
    return ", ".join(names[:8]) + (f" ... ({total} in all)" if total > 8 else "") if names else "every object"


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


__all__ = ["Presence", "Skipped", "View", "decide", "restore_count", "version_pattern", "DAMAGED", "MISSING", "UNVERIFIED",
           "ROLLED_BACK", "MISSING_NEWEST",
           "SHAPE", "RESTARTS", "NONFINITE"]
