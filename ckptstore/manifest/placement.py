"""Which root holds which objects of a version (docs/FORMAT.md, "Placement").

On node-local disks every node passes the same path, but each path is a different disk. The writer
discovers which ranks share a root and records the *root groups* in the manifest (``placement``):
``[[0, 1], [2, 3]]`` means ranks 0 and 1 wrote their objects to one root, 2 and 3 to another. The
coordinator's root holds the commit point; every other root that holds objects gets a copy of the
manifest and of the metadata object after the commit.

A root therefore holds a *part* of a version: the objects of one group, plus the metadata object
and the manifest. :func:`part_held` says which part a tier holds, from the objects present in it.

**Replicas** (docs/FORMAT.md, "Replicas"): with a replication factor F (the manifest's
``replicas``), the objects of root group *i* are also copied to the roots of groups ``i+1 … i+F``
(mod the number of groups; at most every other group): :func:`replica_targets`. Within a target
group the copy of rank *r*'s object goes to one rank (:func:`replica_assignment`), which writes it
under the object's own name and then lists it in its record ``attempts/<a>/replicas.rNNNNN.json``.
A root's part is then its group's objects plus the replicas it holds (``local(part 1/2 + replica of
part 2)``).
"""

from __future__ import annotations

import dataclasses

from ..tiers.base import Tier
from . import layout
from .schema import Manifest


def groups(m: Manifest) -> list[tuple[int, ...]]:
    """The root groups of ``m``, in order; one group of every writing rank when not recorded."""
    if m.placement:
        return [tuple(g) for g in m.placement]
    ranks = sorted({o.rank for o in m.objects if o.rank is not None})
    return [tuple(ranks)] if ranks else [()]


def is_split(m: Manifest) -> bool:
    """More than one root holds objects of ``m``."""
    return len(groups(m)) > 1


@dataclasses.dataclass(frozen=True)
class Part:
    """The part of a version one tier holds.

    ``index``: 1-based group index (``k`` of ``part k/n``); ``count``: number of groups (``n``);
    ``ranks``: the group's ranks; ``objects``: the objects this tier must hold (the metadata object
    and the group's shard objects); ``whole``: the tier holds every object (a shared root, a remote
    tier, or a version written by one root group).
    """

    index: int
    count: int
    ranks: tuple
    objects: tuple
    whole: bool
    #: 1-based indices of the groups whose objects this root holds as replicas
    replica_of: tuple = ()
    #: names of the objects this root holds as replicas (a subset of ``objects``)
    replicas: tuple = ()

    @property
    def label(self) -> str:
        if self.whole:
            return ""
        return f"part {self.index}/{self.count}" + "".join(f" + replica of part {k}" for k in self.replica_of)

    def to_json(self) -> dict:
        out = {"index": self.index, "count": self.count, "ranks": list(self.ranks), "whole": self.whole}
        if self.replica_of:  # the parts of other groups this root holds as replicas
            out["replica_of"] = list(self.replica_of)
        return out


def whole(m: Manifest) -> Part:
    g = groups(m)
    return Part(1, 1, tuple(r for grp in g for r in grp), tuple(m.all_objects()), True)


def _present(tier: Tier, m: Manifest) -> set[str]:
    """Names of ``m``'s objects that exist in ``tier`` (one listing of the attempt directory)."""
    prefix = layout.object_key(m.version, layout.attempt_dir(m.attempt)) + "/"
    vdir = layout.version_dir(m.version) + "/"
    return {i.key[len(vdir):] for i in tier.list(prefix)}


def part_held(tier: Tier, m: Manifest, *, remote: bool = False) -> Part:
    """The part of ``m`` that ``tier`` holds.

    A remote tier (``remote=True``) and a version with one root group hold the whole version. On a
    local root of a split version, the part is the group whose shard objects are present (at least
    one) and are not listed as replicas by the root's replica records, plus the replicas those
    records list; when no primary object is present (every object lost, or a group of ranks that
    wrote nothing) it is the whole version, so that a check reports every object missing rather than
    none.
    """
    g = groups(m)
    if remote or len(g) <= 1:
        return whole(m)
    present, replicas = _held(tier, m)
    by_rank = {o.rank: o for o in m.objects}
    for i, grp in enumerate(g, 1):
        objs = [by_rank[r] for r in grp if r in by_rank]
        if any(o.name in present and o.name not in replicas for o in objs):
            extra = [o for o in m.objects if o.name in replicas and o not in objs]
            of = tuple(sorted({j for j, gg in enumerate(g, 1) for o in extra if o.rank in gg}))
            return Part(i, len(g), grp, (m.metadata_object, *objs, *extra), False, of, tuple(o.name for o in extra))
    return whole(m)


def _held(tier: Tier, m: Manifest) -> tuple[set[str], set[str]]:
    """(names of ``m``'s objects present in ``tier``, names its replica records list) — one listing
    of the attempt directory and a read of each record."""
    import json

    prefix = layout.object_key(m.version, layout.attempt_dir(m.attempt)) + "/"
    vdir = layout.version_dir(m.version) + "/"
    present: set[str] = set()
    replicas: set[str] = set()
    for i in tier.list(prefix):
        name = i.key[len(vdir):]
        present.add(name)
        if layout.replica_record_rank(i.key) is not None:
            try:
                replicas.update(json.loads(tier.get(i.key)).get("objects", []))
            except Exception:  # noqa: BLE001 - a damaged record lists nothing (scrub reports the objects)
                pass
    return present, replicas & present


def replica_targets(n_groups: int, factor: int) -> list[list[int]]:
    """``targets[i]``: the (0-based) groups that hold replicas of group ``i``'s objects — the next
    ``factor`` groups in rank order, ``i+1 … i+F`` mod ``n_groups`` (NVRx's "replication jump" with a
    jump of one root group: a copy never lands on its own root). With fewer than ``F+1`` groups each
    group's objects go to every other group; with one group there is nowhere to copy to."""
    f = max(0, min(int(factor), n_groups - 1))
    return [[(i + k) % n_groups for k in range(1, f + 1)] for i in range(n_groups)]


def replica_assignment(groups_: list, factor: int, owners: set | None = None) -> list[tuple[int, int]]:
    """``[(owner rank, receiver rank), ...]``: every replica to make. ``groups_``: the root groups
    (tuples of ranks, in rank order); ``owners``: the ranks that have an object (default: all). The
    owner at position ``j`` of its group sends to member ``j mod |target|`` of each target group, so
    the copies spread over the target's ranks."""
    gs = [tuple(g) for g in groups_]
    out = []
    for i, targets in enumerate(replica_targets(len(gs), factor)):
        for j, owner in enumerate(gs[i]):
            if owners is not None and owner not in owners:
                continue
            for t in targets:
                out.append((owner, gs[t][j % len(gs[t])]))
    return out


__all__ = ["Part", "groups", "is_split", "part_held", "replica_assignment", "replica_targets", "whole"]
