"""Compact sets of one attempt's object names (docs/FORMAT.md, "Restore choice").

What a root holds of a version, and which objects a manifest names, travel between the ranks of a
load as rank runs instead of name lists, so their size does not grow with the job. An attempt's
shard objects are named ``attempts/<attempt>/rNNNNN.ckd`` (:func:`layout.shard_name`) and its
metadata object ``attempts/<attempt>/metadata.ckd``; a set of them is written ``[meta, runs,
extra]``:

* ``meta`` — 1 when the metadata object is in the set, else 0;
* ``runs`` — the ranks whose shard object is in the set, as a flat list of half-open intervals
  ``[start0, stop0, start1, stop1, ...]`` (sorted, disjoint, never adjacent);
* ``extra`` — every other name in the set, sorted (an object a writer named otherwise).

A root whose saving ranks were numbered consecutively (torchrun numbers one node's ranks so) holds
its group's part as one run; a whole version of W ranks is ``[1, [0, W], []]``.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Iterable, Iterator

from . import layout

__all__ = ["ObjSet", "runs_of"]


def runs_of(ranks: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted, merged half-open intervals covering ``ranks``."""
    out: list[list[int]] = []
    for r in sorted(set(ranks)):
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return [(a, b) for a, b in out]


def _merge(pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(pairs):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _minus(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Intervals of ``a`` not covered by ``b`` (both merged): one sweep."""
    out = []
    j = 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            if cur >= e:
                break
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


class ObjSet:
    """A set of the object names of one ``attempt`` (see the module docstring); immutable."""

    __slots__ = ("attempt", "meta", "runs", "extra", "_starts")

    def __init__(self, attempt: str, meta: bool = False, runs: Iterable[tuple[int, int]] = (), extra: Iterable[str] = ()):
        self.attempt = attempt
        self.meta = bool(meta)
        self.runs = _merge(runs)
        self.extra = frozenset(extra)
        self._starts = [a for a, _b in self.runs]

    # -- building ---------------------------------------------------------------------------------
    @classmethod
    def of_names(cls, attempt: str, names: Iterable[str]) -> "ObjSet":
        """The set of ``names`` (object names ``attempts/<attempt>/<file>``)."""
        meta = False
        ranks = []
        extra = []
        mname = layout.metadata_name(attempt)
        for n in names:
            if n == mname:
                meta = True
                continue
            r = cls.rank_of(attempt, n)
            if r is None:
                extra.append(n)
            else:
                ranks.append(r)
        return cls(attempt, meta, runs_of(ranks), extra)

    @staticmethod
    def rank_of(attempt: str, name: str) -> int | None:
        """The rank of the shard object ``name`` of ``attempt`` (its canonical name), else None."""
        head = f"{layout.attempt_dir(attempt)}/r"
        if not (name.startswith(head) and name.endswith(".ckd")):
            return None
        digits = name[len(head):-4]
        if not digits.isdigit():
            return None
        r = int(digits)
        return r if layout.shard_name(attempt, r) == name else None

    def to_json(self) -> list:
        return [int(self.meta), [x for ab in self.runs for x in ab], sorted(self.extra)]

    @classmethod
    def from_json(cls, attempt: str, d) -> "ObjSet":
        """The set ``[meta, runs, extra]`` of ``attempt``; ValueError when it is not one."""
        try:
            meta, flat, extra = d
            flat = [int(x) for x in flat]
            if len(flat) % 2 or any(x < 0 for x in flat) or not all(isinstance(n, str) for n in extra):
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(f"not an object set: {d!r}") from None
        return cls(attempt, bool(meta), zip(flat[0::2], flat[1::2]), extra)

    # -- questions ----------------------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        if self.meta and name == layout.metadata_name(self.attempt):
            return True
        r = self.rank_of(self.attempt, name)
        if r is None:
            return name in self.extra
        return self.has_rank(r)

    def has_rank(self, r: int) -> bool:
        i = bisect.bisect_right(self._starts, r) - 1
        return i >= 0 and r < self.runs[i][1]

    def __bool__(self) -> bool:
        return self.meta or bool(self.runs) or bool(self.extra)

    def __len__(self) -> int:
        return int(self.meta) + sum(b - a for a, b in self.runs) + len(self.extra)

    def __iter__(self) -> Iterator[str]:
        """The names, metadata object first, then shards in rank order, then the others."""
        if self.meta:
            yield layout.metadata_name(self.attempt)
        for a, b in self.runs:
            for r in range(a, b):
                yield layout.shard_name(self.attempt, r)
        yield from sorted(self.extra)

    def head(self, n: int) -> list[str]:
        """The first ``n`` names (for messages)."""
        return list(itertools.islice(iter(self), n))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjSet) and (self.attempt, self.meta, self.runs, self.extra) == (
            other.attempt, other.meta, other.runs, other.extra)

    def __repr__(self) -> str:
        return f"ObjSet({self.attempt!r}, meta={self.meta}, runs={self.runs}, extra={sorted(self.extra)})"

    # -- algebra ------------------------------------------------------------------------------------
    def minus(self, other: "ObjSet") -> "ObjSet":
        """The names of this set that ``other`` (of the same attempt) does not hold."""
        return ObjSet(self.attempt, self.meta and not other.meta, _minus(self.runs, other.runs), self.extra - other.extra)

    def without(self, names: Iterable[str]) -> "ObjSet":
        """This set less ``names`` (a few: copies that failed verification)."""
        return self.minus(ObjSet.of_names(self.attempt, names))

    @classmethod
    def union(cls, attempt: str, sets: Iterable["ObjSet"]) -> "ObjSet":
        sets = list(sets)
        return cls(attempt, any(s.meta for s in sets), itertools.chain.from_iterable(s.runs for s in sets),
                   frozenset().union(*(s.extra for s in sets)))
