"""Order and identity of committed versions (docs/FORMAT.md, "Order" and "One name, one content").

Pure functions, no I/O; the catalogue, the restore choice, retention and gc all order and resolve
versions through them, so "newest" means the same everywhere.

* **Order.** Versions are ordered by ``step`` when the writer gave one, then by the commit sequence
  ``seq`` (a hybrid logical clock: the coordinator's wall clock in microseconds, but never lower than
  1 + the highest ``seq`` its job's roots held, so a save that saw an earlier one always sorts after
  it, whatever the hosts' clocks say), then by commit time and name. Versions without a step sort
  before versions with one. Commit times (``created``) order only versions that agree on both.
* **Identity.** Two copies of one version name (two tiers, two roots) may hold different attempts:
  an overwrite or a superseding save not yet copied everywhere, or a name committed by two jobs
  that did not see each other. The copy whose manifest *supersedes* the others' attempts wins; else
  the remote tier's copy (the store every node shares); else the copy with the highest commit
  sequence. Every other copy is *stale*: reported, never loaded.
"""

from __future__ import annotations

import datetime as _dt
from typing import Iterable, Sequence

#: a commit time more than this many seconds ahead of the reader's clock is flagged (clock skew)
FUTURE_SLACK_S = 300.0


def order_key(step: int | None, seq: int | None, created: str, version: str) -> tuple:
    """The sort key of a version (oldest first). ``created``: the manifest's ISO 8601 UTC string
    (fixed width, so strings compare like times)."""
    return (-1 if step is None else int(step), int(seq or 0), str(created), str(version))


def in_future(created: _dt.datetime, now: _dt.datetime | None = None) -> bool:
    """Whether a commit time lies further in the future than :data:`FUTURE_SLACK_S` (a skewed clock)."""
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return (created - now).total_seconds() > FUTURE_SLACK_S


def resolve(copies: Sequence[dict]) -> str:
    """The attempt that is *the* version among ``copies`` of one name.

    Each copy: ``{"attempt": str, "supersedes": iterable of attempts, "remote": bool, "seq": int|None,
    "created": str}``. See the module docstring for the rule.
    """
    attempts = {c["attempt"] for c in copies}
    if len(attempts) == 1:
        return next(iter(attempts))
    losers: set = set()
    for c in copies:
        losers.update(c.get("supersedes") or ())
    left = [c for c in copies if c["attempt"] not in losers] or list(copies)
    if len({c["attempt"] for c in left}) == 1:
        return left[0]["attempt"]
    remote = [c for c in left if c.get("remote")]
    if remote:
        return remote[0]["attempt"]
    best = max(left, key=lambda c: (int(c.get("seq") or 0), str(c.get("created") or ""), c["attempt"]))
    return best["attempt"]


def next_seq(hints: Iterable[int | None], now_us: int | None = None) -> int:
    """The commit sequence of a new commit: ``max(now, 1 + every hint)`` (a hybrid logical clock)."""
    if now_us is None:
        now_us = int(_dt.datetime.now(_dt.timezone.utc).timestamp() * 1_000_000)
    return max([now_us] + [int(h) + 1 for h in hints if h is not None])


__all__ = ["FUTURE_SLACK_S", "in_future", "next_seq", "order_key", "resolve"]
