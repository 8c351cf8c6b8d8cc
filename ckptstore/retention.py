"""Retention: small, pure, composable policies over committed versions.

A *rule* looks at the committed versions of one tier (:class:`~ckptstore.VersionRecord`, oldest →
newest) and the current time, and names the versions it keeps, each with a reason. A version is
kept if **any** rule keeps it; every reason is listed (borg's ``prune --list`` idea), so
``ckptstore gc --dry-run`` can say why each survivor survives. Rules never have side effects;
:func:`evaluate` turns rules into :class:`Decision` s; :mod:`ckptstore.gc` acts on them. This module
does no I/O and imports nothing that does.

Rules (all frozen dataclasses, so a policy pickles into ``AsyncCheckpointerType.PROCESS`` savers):

=====================================  ==========================================================
``KeepLast(n)``                        the ``n`` newest versions
``KeepEverySteps(n)``                  per bucket of ``n`` training steps (``step // n``), the
                                       first version saved in it (at or after each multiple of
                                       ``n``); versions without a step are not kept by it
``KeepWithin(seconds)``                versions committed within the duration before ``now``
                                       (:func:`parse_duration`: ``"7d"``, ``"12h"``, ``"1d12h"``)
``KeepBest(n, metric, mode)``          the ``n`` best versions by the number
                                       ``user_metadata[metric]`` (``mode="min"`` or ``"max"``;
                                       dotted names reach into nested dicts; ties → newer wins)
=====================================  ==========================================================

Built in, always on (not rules one can leave out):

* **pinned** versions (``ckptstore pin``) are always kept;
* the **newest committed** version of the tier is never deleted, and neither is the newest version
  not marked damaged, nor the newest version neither marked damaged nor recorded as holding NaN/Inf
  (what ``Store.latest()`` returns and a restore loads by default: docs/FORMAT.md, "Restore choice");
* **no rule at all keeps everything** (``gc`` then only removes garbage).

Rules choose among *loadable* versions: a version marked damaged by ``ckptstore scrub`` takes no
``keep-last``/``keep-best``/... slot and is kept only when pinned or the newest committed.

A :class:`RetentionPolicy` holds rules for every tier plus extra rules per tier (``"local"``,
``"remote"``); a tier's rules are the general ones **plus** its own (adding rules only keeps more),
e.g. local keeps 2, remote keeps 20 and one version every 10,000 steps::

    RetentionPolicy(per_tier={"local": [KeepLast(2)],
                              "remote": [KeepLast(20), KeepEverySteps(10_000)]})

What other tiers protect (pins travel; a local version waits for its upload) is decided by
:func:`across_tiers`, the one place that rule lives. Automatic retention after a commit:
:func:`ckptstore.gc.apply_after_commit`.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import re
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol, Sequence

if TYPE_CHECKING:  # records only: this module imports nothing that does I/O
    from .manifest.catalogue import VersionRecord

__all__ = [
    "Rule",
    "KeepLast",
    "KeepEverySteps",
    "KeepWithin",
    "KeepBest",
    "Decision",
    "RetentionPolicy",
    "evaluate",
    "parse_duration",
    "format_duration",
    "rules_from_options",
    "across_tiers",
]

# -- durations -------------------------------------------------------------------------------------
_UNITS = {"w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")


def parse_duration(text: str | int | float) -> float:
    """Seconds in ``text``: ``"7d"``, ``"12h"``, ``"1d12h"``, ``"90m"``, ``"30s"``, ``"2w"``, ``"0"``.

    A bare number is seconds. Raises :class:`ValueError` for anything else.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0 or not math.isfinite(text):
            raise ValueError(f"duration must be a non-negative number of seconds, got {text!r}")
        return float(text)
    s = str(text).strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", s):
        return float(s)
    pos = 0
    total = 0.0
    for m in _DURATION.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(s) or not s:
        raise ValueError(f"not a duration: {text!r} (use e.g. 7d, 12h, 1d12h, 90m, 30s, 2w)")
    return total


def format_duration(seconds: float) -> str:
    """``5400`` → ``"1h30m"``; sub-second parts are dropped; negative values get a ``-``."""
    if seconds < 0:
        return "-" + format_duration(-seconds)
    s = int(seconds)
    if s == 0:
        return "0s"
    out = []
    for unit in ("d", "h", "m", "s"):
        n, s = divmod(s, _UNITS[unit])
        if n:
            out.append(f"{n}{unit}")
    return "".join(out)


# -- rules -------------------------------------------------------------------------------------------
class Rule(Protocol):
    """A retention rule: ``keeps(versions, now)`` → ``{version: reason}`` for the versions it keeps.

    ``versions`` are loadable committed versions of one tier, oldest → newest; ``now`` is an aware
    UTC datetime. Must be pure (no I/O, no clock) and picklable.
    """

    def keeps(self, versions: Sequence[VersionRecord], now: _dt.datetime) -> dict[str, str]: ...

    def describe(self) -> str: ...

    def to_json(self) -> dict: ...


def _ordinal(i: int) -> str:
    if 10 <= i % 100 <= 20:
        suf = "th"
    else:
        suf = {1: "st", 2: "nd", 3: "rd"}.get(i % 10, "th")
    return f"{i}{suf}"


@dataclasses.dataclass(frozen=True)
class KeepLast:
    """Keep the ``n`` newest versions."""

    n: int

    def __post_init__(self):
        _check_count(self.n, "keep-last")

    def keeps(self, versions, now):
        sel = list(versions)[-self.n :] if self.n else []
        return {r.version: f"{self.describe()}: {_ordinal(len(sel) - i)} newest" for i, r in enumerate(sel)}

    def describe(self) -> str:
        return f"keep-last {self.n}"

    def to_json(self) -> dict:
        return {"rule": "keep-last", "n": self.n}


@dataclasses.dataclass(frozen=True)
class KeepEverySteps:
    """Keep, for each bucket of ``n`` steps (``step // n``), the first version saved in it."""

    n: int

    def __post_init__(self):
        _check_count(self.n, "keep-every-steps", minimum=1)

    def keeps(self, versions, now):
        first: dict[int, VersionRecord] = {}
        for r in versions:
            if r.step is None:
                continue
            b = r.step // self.n
            cur = first.get(b)
            if cur is None or (r.step, r.created, r.version) < (cur.step, cur.created, cur.version):
                first[b] = r
        return {
            r.version: f"{self.describe()}: first version at or after step {b * self.n} (step {r.step})"
            for b, r in first.items()
        }

    def describe(self) -> str:
        return f"keep-every-steps {self.n}"

    def to_json(self) -> dict:
        return {"rule": "keep-every-steps", "n": self.n}


@dataclasses.dataclass(frozen=True)
class KeepWithin:
    """Keep versions committed at most ``seconds`` before ``now`` (or after it: clock skew)."""

    seconds: float

    def __post_init__(self):
        if not isinstance(self.seconds, (int, float)) or self.seconds < 0 or not math.isfinite(self.seconds):
            raise ValueError(f"keep-within needs a non-negative duration, got {self.seconds!r}")

    def keeps(self, versions, now):
        out = {}
        for r in versions:
            age = (now - r.created).total_seconds()
            if age <= self.seconds:
                out[r.version] = f"{self.describe()}: committed {format_duration(age)} ago"
        return out

    def describe(self) -> str:
        return f"keep-within {format_duration(self.seconds)}"

    def to_json(self) -> dict:
        return {"rule": "keep-within", "seconds": self.seconds}


@dataclasses.dataclass(frozen=True)
class KeepBest:
    """Keep the ``n`` versions with the lowest (``mode="min"``) or highest (``"max"``) ``metric``.

    ``metric`` names a number in the version's user metadata; ``"eval.loss"`` reads
    ``user["eval"]["loss"]``. Versions without a finite number there are not kept by this rule.
    """

    n: int
    metric: str
    mode: str = "min"

    def __post_init__(self):
        _check_count(self.n, "keep-best")
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError("keep-best needs a metric name (a key of the version's user metadata)")
        if self.mode not in ("min", "max"):
            raise ValueError(f"keep-best mode must be 'min' or 'max', got {self.mode!r}")

    def value(self, r: VersionRecord) -> float | None:
        return metric_value(r.user, self.metric)

    def keeps(self, versions, now):
        scored = [(v, i, r) for i, r in enumerate(versions) if (v := self.value(r)) is not None]
        sign = 1 if self.mode == "min" else -1
        # best first; among equal values the newer version (higher index) wins
        scored.sort(key=lambda t: (sign * t[0], -t[1]))
        return {
            r.version: f"{self.describe()}: {self.metric}={v:g}, {_ordinal(k + 1)} best"
            for k, (v, _i, r) in enumerate(scored[: self.n])
        }

    def describe(self) -> str:
        return f"keep-best {self.n} by {self.mode} {self.metric}"

    def to_json(self) -> dict:
        return {"rule": "keep-best", "n": self.n, "metric": self.metric, "mode": self.mode}


def metric_value(user: Any, metric: str) -> float | None:
    """The finite number at ``metric`` (dotted path) in ``user``, or None."""
    cur = user
    if isinstance(cur, dict) and metric in cur:
        cur = cur[metric]
    else:
        for part in metric.split("."):
            if not isinstance(cur, dict) or part not in cur:
                return None
            cur = cur[part]
    if isinstance(cur, bool) or not isinstance(cur, (int, float)):
        return None
    v = float(cur)
    return v if math.isfinite(v) else None


def _check_count(n: Any, what: str, minimum: int = 0) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < minimum:
        raise ValueError(f"{what} needs an integer >= {minimum}, got {n!r}")


_RULES = {"keep-last": KeepLast, "keep-every-steps": KeepEverySteps, "keep-within": KeepWithin, "keep-best": KeepBest}


def rule_from_json(d: Mapping) -> Rule:
    d = dict(d)
    cls = _RULES.get(d.pop("rule", None))
    if cls is None:
        raise ValueError(f"unknown retention rule {d!r}")
    return cls(**d)


# -- decisions ---------------------------------------------------------------------------------------
REASON_NEWEST = "newest committed version (never deleted)"
REASON_LOADABLE = "newest version not marked damaged (what latest() loads)"
REASON_FINITE = "newest version without NaN/Inf values (what latest() returns and a restore loads)"
REASON_PINNED = "pinned"
REASON_NO_RULES = "no retention rule given (everything is kept)"


@dataclasses.dataclass(frozen=True)
class Decision:
    """Keep or delete one committed version of one tier, and why (``reasons``, never empty)."""

    version: str
    keep: bool
    reasons: tuple[str, ...]
    created: _dt.datetime
    step: int | None
    attempt: str
    pinned: bool
    damaged: bool

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "keep": self.keep,
            "reasons": list(self.reasons),
            "created": self.created.isoformat().replace("+00:00", "Z"),
            "step": self.step,
            "attempt": self.attempt,
            "pinned": self.pinned,
            "damaged": self.damaged,
        }


def evaluate(
    versions: Iterable[VersionRecord],
    rules: Sequence[Rule],
    now: _dt.datetime,
    *,
    protect: Mapping[str, str] | None = None,
) -> list[Decision]:
    """Decide, for the committed versions of one tier, which to keep and why. Pure.

    ``versions`` in any order (sorted here, oldest → newest by :attr:`VersionRecord.order`: step,
    commit sequence, commit time, name — so a skewed clock never makes the last save deletable); ``rules``
    as above (empty: keep everything); ``now`` an aware datetime; ``protect``: extra
    ``{version: reason}`` to keep unconditionally. Returns one :class:`Decision` per version,
    oldest → newest.
    """
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware (UTC)")
    recs = sorted(versions, key=lambda r: r.order)  # step, commit sequence: never a clock (docs/FORMAT.md, "Order")
    reasons: dict[str, list[str]] = {r.version: [] for r in recs}
    if recs:
        reasons[recs[-1].version].append(REASON_NEWEST)
    loadable = [r for r in recs if not r.damaged]
    if loadable and loadable[-1] is not recs[-1]:
        reasons[loadable[-1].version].append(REASON_LOADABLE)
    finite = [r for r in loadable if not r.nonfinite]  # the restore point after NaN/Inf saves
    if finite and finite[-1] is not recs[-1] and finite[-1] is not loadable[-1]:
        reasons[finite[-1].version].append(REASON_FINITE)
    for r in recs:
        if r.pinned:
            reasons[r.version].append(REASON_PINNED)
    for v, why in (protect or {}).items():
        if v in reasons:
            reasons[v].append(why)
    if not rules:
        for r in recs:
            reasons[r.version].append(REASON_NO_RULES)
    for rule in rules:
        for v, why in rule.keeps(loadable, now).items():
            reasons[v].append(why)
    names = ", ".join(r.describe() for r in rules)
    out = []
    for r in recs:
        why = reasons[r.version]
        keep = bool(why)
        if not keep:
            if r.damaged:
                why = [f"marked damaged, and rules keep only loadable versions ({names})"]
            else:
                why = [f"not kept by any rule ({names})"]
        out.append(Decision(r.version, keep, tuple(why), r.created, r.step, r.attempt, r.pinned, r.damaged))
    return out


# -- policy ------------------------------------------------------------------------------------------
def _tuple(rules: Iterable[Rule] | None) -> tuple:
    rules = tuple(rules or ())
    for r in rules:
        if not callable(getattr(r, "keeps", None)):
            raise TypeError(f"not a retention rule: {r!r}")
    return rules


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    """Rules for every tier (``rules``) plus extra rules per tier (``per_tier``).

    The rules of tier ``t`` are ``rules + per_tier[t]``. A policy with no rule for a tier keeps
    everything there. Picklable; comparable.
    """

    rules: tuple = ()
    per_tier: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    #: a regular expression (``re.fullmatch``) of the version names the policy governs; the others are
    #: kept, and the newest-version protection applies per scope. None: every version.
    #: ``CheckpointManager`` sets it to the names it saves (``prefix=``/``version_format=``).
    match: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "rules", _tuple(self.rules))
        if self.match is not None:
            re.compile(self.match)
        per = {}
        for t, rs in dict(self.per_tier or {}).items():
            if t not in ("local", "remote"):
                raise ValueError(f"retention tier must be 'local' or 'remote', got {t!r}")
            if rs:
                per[t] = _tuple(rs)
        object.__setattr__(self, "per_tier", per)

    def rules_for(self, tier: str) -> tuple:
        return self.rules + tuple(self.per_tier.get(tier, ()))

    def is_empty(self) -> bool:
        return not self.rules and not any(self.per_tier.values())

    def in_scope(self, version: str) -> bool:
        return self.match is None or re.fullmatch(self.match, version) is not None

    def decide(self, tier: str, versions: Iterable[VersionRecord], now: _dt.datetime, **kw) -> list[Decision]:
        """:func:`evaluate` over the versions in scope (:attr:`match`); the others are kept."""
        versions = list(versions)
        inside = [r for r in versions if self.in_scope(r.version)]
        out = evaluate(inside, self.rules_for(tier), now, **kw)
        if len(inside) < len(versions):
            why = (f"outside this policy's scope (names matching {self.match!r})",)
            out += [Decision(r.version, True, why, r.created, r.step, r.attempt, r.pinned, r.damaged)
                    for r in versions if not self.in_scope(r.version)]
            order = {r.version: r.order for r in versions}
            out.sort(key=lambda d: order[d.version])
        return out

    def describe(self, tier: str | None = None) -> str:
        if tier is not None:
            rs = self.rules_for(tier)
            return ", ".join(r.describe() for r in rs) if rs else "keep everything (no rule)"
        parts = []
        if self.rules:
            parts.append("all tiers: " + ", ".join(r.describe() for r in self.rules))
        for t, rs in sorted(self.per_tier.items()):
            parts.append(f"{t}: " + ", ".join(r.describe() for r in rs))
        return "; ".join(parts) or "keep everything (no rule)"

    def to_json(self) -> dict:
        return {
            "rules": [r.to_json() for r in self.rules],
            "per_tier": {t: [r.to_json() for r in rs] for t, rs in sorted(self.per_tier.items())},
            **({} if self.match is None else {"match": self.match}),
        }

    @classmethod
    def from_json(cls, d: Mapping) -> "RetentionPolicy":
        return cls(
            rules=[rule_from_json(r) for r in d.get("rules", [])],
            per_tier={t: [rule_from_json(r) for r in rs] for t, rs in d.get("per_tier", {}).items()},
            match=d.get("match"),
        )


def rules_from_options(
    *,
    keep_last: int | None = None,
    keep_every_steps: int | None = None,
    keep_within: str | float | None = None,
    keep_best: int | None = None,
    metric: str | None = None,
    mode: str = "min",
) -> tuple:
    """Rules from CLI-style options (None = not given). Raises :class:`ValueError` when invalid."""
    rules: list = []
    if keep_last is not None:
        rules.append(KeepLast(keep_last))
    if keep_every_steps is not None:
        rules.append(KeepEverySteps(keep_every_steps))
    if keep_within is not None:
        rules.append(KeepWithin(parse_duration(keep_within)))
    if keep_best is not None:
        if not metric:
            raise ValueError("--keep-best needs --metric NAME (a key of the versions' user metadata)")
        rules.append(KeepBest(keep_best, metric, mode))
    return tuple(rules)


# -- the cross-tier rule -------------------------------------------------------------------------------
def _pending_reason(remote: str) -> str:
    return f"not yet committed in the {remote} tier (its upload may be pending)"


#: how many of the local versions not committed remotely (and not uploading) the local tier keeps
#: beyond its policy, newest first (docs/FORMAT.md, Delete rule 8): the newest is what an upload after
#: an outage sends, one more covers a commit that overtook it. Unbounded, a long outage (or a host
#: whose requests the remote tier refuses) kept every save until the root was full, and every save failed from
#: then on (the chaos run, docs/DEMO.md)
PENDING_KEPT = 2


def across_tiers(
    tier: str,
    versions: Sequence[VersionRecord],
    others: Mapping[str, Sequence[VersionRecord] | None],
    *,
    in_flight: Iterable[str] = (),
) -> tuple[list[VersionRecord], dict[str, str]]:
    """What the other tiers protect in ``tier`` (docs/FORMAT.md, Delete rules 3 and 7). Pure.

    ``versions``: the committed versions of ``tier``; ``others``: the committed versions of the
    other tiers by name (None: that tier's catalogue could not be read); ``in_flight``: versions
    whose upload to the remote tier is known to be running. Returns ``(versions, protect)``:

    * a pin travels: a version pinned in any tier comes back marked ``pinned`` here;
    * in the ``local`` tier only, a version not committed in the ``remote`` tier is kept
      (``protect = {version: reason}``, for :func:`evaluate`) when its upload is in flight, or when
      it is one of the :data:`PENDING_KEPT` newest of those newer than every remote commit (an
      upload reads the local copy) — of all of them while the remote catalogue is unknown. An
      older one is not (the remote tier dropped it by its own rules), nor one below those newest:
      a long outage costs the remote tier the versions the local policy no longer keeps, never the
      local disk.

    Nothing protects a remote version: an absent or empty local tier keeps nothing there.
    """
    pinned = {r.version for recs in others.values() if recs for r in recs if r.pinned}
    out = [dataclasses.replace(r, pinned=True) if r.version in pinned and not r.pinned else r for r in versions]
    protect: dict[str, str] = {}
    if tier == "local" and "remote" in others:
        remote = others["remote"]
        flying = set(in_flight)
        there = None if remote is None else {r.version for r in remote}
        newest = None if not remote else max(r.order for r in remote)
        pending = []
        for r in out:
            if there is not None and r.version in there:
                continue
            if r.version in flying:
                protect[r.version] = _pending_reason("remote")
            elif there is None or newest is None or r.order > newest:
                pending.append(r)
        for r in sorted(pending, key=lambda r: r.order)[-PENDING_KEPT:]:
            protect[r.version] = _pending_reason("remote")
    return out, protect
