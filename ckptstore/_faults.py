"""Named fault points for crash-consistency tests.

Arm with the environment variable ``CKPTSTORE_FAULT`` = ``POINT[:N][@RANK]``, read once, at the
first fault point the process passes: the process SIGKILLs itself the N-th time (default 1st) it
passes ``POINT`` — only on rank RANK when given (rank from the ``RANK`` env). ``POINT`` may end in
``*`` to match a prefix. Unarmed, :func:`point` costs one global lookup and a comparison.

Points: ``write.frame`` (each frame appended to a shard), ``write.commit`` (before a shard's fsync),
``local.fsync``, ``write.metadata`` (DCP metadata object), ``local.tmp_write`` (manifest temp file),
``commit.manifest`` (before the manifest link/conditional PUT), ``commit.after_manifest``,
``local.link``, ``local.replace``, ``local.replace_if_match``, the remote tiers' own (``<tier>.part``,
``<tier>.put_if_absent``, ``s3.replace_if_match``, …: each tier package's docstring), ``remote.supersede`` (before a
superseding remote commit's conditional replace),
``upload.object`` (a rank starts uploading its object), ``remote.manifest``, ``copy.manifest`` (a
root without the commit point is about to receive its manifest copy), ``gc.uncommit``, ``gc.delete``, ``scrub.repair``.
"""

from __future__ import annotations

import os
import signal

_UNREAD = object()
_armed = _UNREAD
_count = 0


def _read():
    spec = os.environ.get("CKPTSTORE_FAULT")
    if not spec:
        return None
    spec, _, rank = spec.partition("@")
    name, _, n = spec.partition(":")
    if rank and rank != os.environ.get("RANK", "0"):
        return None
    return (name, int(n or 1))


def point(name: str) -> None:
    """Pass a named fault point; kills the process here when armed for it."""
    global _armed
    if _armed is None:
        return
    if _armed is _UNREAD:
        _armed = _read()
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
