"""Which root holds which objects of a version (docs/FORMAT.md, "Placement").

On node-local disks every node passes the same path, but each path is a different disk. The writer
discovers which ranks share a root and records the *root groups* in the manifest (``placement``):
``[[0, 1], [2, 3]]`` means ranks 0 and 1 wrote their objects to one root, 2 and 3 to another. The
coordinator's root holds the commit point; every other root that holds objects gets a copy of the
manifest and of the metadata object after the commit.

A root therefore holds a *part* of a version: the objects of one group, plus the metadata object
and the manifest. :func:`part_held` says which part a tier holds, from the objects present in it.
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

    @property
    def label(self) -> str:
        return "" if self.whole else f"part {self.index}/{self.count}"

    def to_json(self) -> dict:
        return {"index": self.index, "count": self.count, "ranks": list(self.ranks), "whole": self.whole}


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
    one); when none is present (every object lost, or a group of ranks that wrote nothing) it is the
    whole version, so that a check reports every object missing rather than none.
    """
    g = groups(m)
    if remote or len(g) <= 1:
        return whole(m)
    present = _present(tier, m)
    by_rank = {o.rank: o for o in m.objects}
    for i, grp in enumerate(g, 1):
        objs = [by_rank[r] for r in grp if r in by_rank]
        if any(o.name in present for o in objs):
            return Part(i, len(g), grp, (m.metadata_object, *objs), False)
    return whole(m)


__all__ = ["Part", "groups", "is_split", "part_held", "whole"]
