"""Named fault points for crash-consistency tests.

Arm with the environment variable ``CKPTSTORE_FAULT`` = ``POINT[:N][@RANK]`` (read once at import):
the process SIGKILLs itself the N-th time (default 1st) it passes ``POINT`` — only on rank RANK
when given (rank from ``RANK`` env). ``POINT`` may end in ``*`` to match a prefix.
Unarmed, :func:`point` is a single global lookup and return.
"""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("CKPTSTORE_FAULT") or None
_armed = None
_count = 0

if _SPEC:
    spec, _, rank = _SPEC.partition("@")
    name, _, n = spec.partition(":")
    if not rank or rank == os.environ.get("RANK", "0"):
        _armed = (name, int(n or 1))


def point(name: str) -> None:
    """Pass a named fault point; kills the process here when armed for it."""
    if _armed is None:
        return
    _hit(name)


def _hit(name: str) -> None:
    global _count
    target, nth = _armed
    if name == target or (target.endswith("*") and name.startswith(target[:-1])):
        _count += 1
        if _count >= nth:
            os.kill(os.getpid(), signal.SIGKILL)
