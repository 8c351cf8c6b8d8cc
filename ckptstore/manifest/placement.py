"""Which root holds which objects of a version (docs/FORMAT.md, "Placement").

On node-local disks every node passes the same path, but each path is a different disk. The writer
discovers which ranks share a root and records the *root groups* in the manifest (``placement``):
``[[0, 1], [2, 3]]`` means ranks 0 and 1 wrote their objects to one root, 2 and 3 to another. The
coordinator's root holds the commit point; every other root that holds objects gets a copy of the
manifest and of the metadata object after the commit.

A root therefore holds a *part* of a version: the objects of one group, plus the metadata object
and the manifest. :func:`part_held` says which part a tier holds, from the objects present in it.

**Replicas** (docs/FORMAT.md, "Replicas"): with a replication factor F (the manifest's
``replicas``), the objects of each root group are also copied to the roots of F other groups, chosen
by :func:`replica_targets` from the groups' *failure domains* (the manifest's ``domains``: a rack, a
switch, by default the host name): never a group of the source's own domain while another domain
exists, and spread over the other domains. Without domains (or with one) the targets are groups
``i+1 … i+F`` (mod the number of groups; at most every other group). Within a target group the copy
of rank *r*'s object goes to one rank (:func:`replica_assignment`), which writes it under the
object's own name and then lists it in its record ``attempts/<a>/replicas.rNNNNN.json``. A root's
part is then its group's objects plus the replicas it holds (``local(part 1/2 + replica of part 2)``).

The writer (its replica exchange), the reader (re-replication after a restore, ``dcp/replicas.py``
``heal_plan``) and ``scrub`` (:func:`part_held`) all place and find copies through this module.
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


def domains(m: Manifest) -> list[str] | None:
    """The failure domain of each root group of ``m`` (aligned with :func:`groups`), as the writer
    recorded it (docs/FORMAT.md, "Replicas"); None when not recorded (one group, older manifests)."""
    d = m.domains
    if not d or not m.placement or len(d) != len(m.placement):
        return None
    return list(d)


def group_domains(groups_: list, domain_of: dict) -> list[str]:
    """The failure domain of each of ``groups_`` (tuples of ranks): its lowest rank's (the group's
    leader), from ``domain_of`` (``{rank: domain}``; a rank without one counts as ``""``)."""
    return [str(domain_of.get(min(g), "")) if g else "" for g in groups_]


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
    #: the failure domain of the group (docs/FORMAT.md, "Replicas"); None when not recorded
    domain: str | None = None

    @property
    def label(self) -> str:
        if self.whole:
            return ""
        return f"part {self.index}/{self.count}" + "".join(f" + replica of part {k}" for k in self.replica_of)

    def to_json(self) -> dict:
        out = {"index": self.index, "count": self.count, "ranks": list(self.ranks), "whole": self.whole}
        if self.replica_of:  # the parts of other groups this root holds as replicas
            out["replica_of"] = list(self.replica_of)
        if self.domain is not None:
            out["domain"] = self.domain
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
    doms = domains(m)
    for i, grp in enumerate(g, 1):
        objs = [by_rank[r] for r in grp if r in by_rank]
        if any(o.name in present and o.name not in replicas for o in objs):
            extra = [o for o in m.objects if o.name in replicas and o not in objs]
            of = tuple(sorted({j for j, gg in enumerate(g, 1) for o in extra if o.rank in gg}))
            return Part(i, len(g), grp, (m.metadata_object, *objs, *extra), False, of, tuple(o.name for o in extra),
                        None if doms is None else doms[i - 1])
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


def replica_targets(n_groups: int, factor: int, domains: list | None = None) -> list[list[int]]:
    """``targets[i]``: the (0-based) groups that hold replicas of group ``i``'s objects
    (docs/FORMAT.md, "Replicas").

    ``domains[i]``: the failure domain of group ``i`` (None, or a single domain for every group:
    each group is its own domain). The domains are taken in the order of their first group,
    ``D_0 … D_{m-1}``; group ``i`` is the ``k``-th group of ``D_a``. Its targets are, for ``f = 0, 1,
    …``, group ``(k + f // (m-1)) mod |D|`` of domain ``D = D_{(a + 1 + f mod (m-1)) mod m}``
    (repeats skipped), until F groups are chosen or every group of another domain is: the next
    domains in order, one group each, at the same position within its domain, so copies spread over
    the domains and over their groups, and never land in the source's own domain (F is capped at the
    number of groups in other domains). With one domain this is NVRx's "replication jump" of one root
    group: ``i+1 … i+F`` mod ``n_groups``; with one group there is nowhere to copy to."""
    doms = list(range(n_groups)) if domains is None or len(set(domains)) <= 1 else list(domains)
    if len(doms) != n_groups:
        raise ValueError(f"{len(doms)} domains for {n_groups} root groups")
    order: list = []
    members: dict = {}
    for i, d in enumerate(doms):
        if d not in members:
            members[d] = []
            order.append(d)
        members[d].append(i)
    pos = {d: a for a, d in enumerate(order)}
    index = {i: k for d in order for k, i in enumerate(members[d])}
    m = len(order)
    out = []
    for i in range(n_groups):
        a, k = pos[doms[i]], index[i]
        others = [order[(a + s) % m] for s in range(1, m)]
        want = min(max(0, int(factor)), sum(len(members[d]) for d in others))
        chosen: list[int] = []
        f = 0
        while len(chosen) < want:
            d = others[f % len(others)]
            g = members[d][(k + f // len(others)) % len(members[d])]
            if g not in chosen:
                chosen.append(g)
            f += 1
        out.append(chosen)
    return out


def replica_assignment(groups_: list, factor: int, owners: set | None = None,
                       domains: list | None = None) -> list[tuple[int, int]]:
    """``[(owner rank, receiver rank), ...]``: every replica to make. ``groups_``: the root groups
    (tuples of ranks, in rank order); ``owners``: the ranks that have an object (default: all);
    ``domains``: the groups' failure domains (:func:`replica_targets`). The owner at position ``j``
    of its group sends to member ``j mod |target|`` of each target group, so the copies spread over
    the target's ranks."""
    gs = [tuple(g) for g in groups_]
    out = []
    for i, targets in enumerate(replica_targets(len(gs), factor, domains)):
        for j, owner in enumerate(gs[i]):
            if owners is not None and owner not in owners:
                continue
            for t in targets:
                out.append((owner, gs[t][j % len(gs[t])]))
    return out


__all__ = ["Part", "domains", "group_domains", "groups", "is_split", "part_held", "replica_assignment", "replica_targets", "whole"]
