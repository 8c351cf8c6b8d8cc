"""Leases: what a save in flight references of earlier versions (docs/FORMAT.md, "References",
Delete rule 13).

A manifest protects what it names only once it is committed; an incremental save references frames
of an earlier version (its *baseline*) long before that. So a save protects them itself, across
processes, with a lease file in the tier that holds them::

    leases/<attempt>.rNNNNN.json   {"version": V, "attempt": A, "holder": "r00003", "objects": [keys]}

* **The save** (each rank, in its root) writes its lease *before* it checks that its baseline is
  still committed there; without that, it references nothing (every item is written whole). Its lease
  goes when the save is committed in that root (its manifest then names the objects) or failed; a
  lease left by a killed process protects until it is older than the lease time (:data:`TTL`, at
  least the gc grace period) and is then deleted by ``gc``.
* **gc and drop** delete no object a live lease names: they read the leases after all their
  un-commits and before any deletion (:func:`ckptstore.gc.apply`), and plan with them too (the dry
  run shows why an object stays).

Why it is safe: gc un-commits the baseline before it reads the leases; the save writes its lease
before it reads the baseline's manifest. If gc's read misses the lease, the lease was written after
it, so the save's check came after the un-commit and found the baseline gone: the save references
nothing of it. Otherwise gc sees the lease and keeps the objects. The commit re-checks that every
referenced object is still there (docs/FORMAT.md, Save rule 11) against anything that ignores leases.

The remote commit of such a save holds a lease (``<attempt>.remote.json``) in the remote tier from
before it makes sure every referenced object is there until its manifest is committed, and checks
them again after the commit (uploading from the local root what is missing).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket

from ..errors import CkptStoreError, ObjectNotFoundError
from . import layout

log = logging.getLogger("ckptstore")

#: seconds a lease protects after it was written (its file's mtime); gc uses the longer of this and
#: its grace period. A save must finish within it, as within the grace period (docs/FORMAT.md, Delete
#: rule 6)
TTL = 3600.0


@dataclasses.dataclass(frozen=True)
class Lease:
    """One lease file: its ``key``, ``mtime`` (POSIX seconds), ``size``, the save it belongs to
    (``version``, ``attempt``, ``holder``) and the ``objects`` (keys) it protects."""

    key: str
    mtime: float
    size: int
    version: str
    attempt: str
    holder: str
    objects: tuple

    def describe(self) -> str:
        return f"leased by the save of {self.version!r} in flight (attempt {self.attempt}, {self.holder})"


def write(tier, version: str, attempt: str, holder: str, objects) -> str:
    """Write (or replace) the lease of ``holder`` for the save ``attempt`` of ``version`` on the
    object keys ``objects``; durable before it returns (local: temp file, fsync, rename)."""
    key = layout.lease_key(attempt, holder)
    body = {"version": version, "attempt": attempt, "holder": holder, "objects": sorted(set(objects)),
            "pid": os.getpid(), "host": socket.gethostname()}
    tier.put(key, json.dumps(body, sort_keys=True).encode())
    return key


def release(tier, attempt: str, holder: str | None = None) -> None:
    """Remove the leases of the save ``attempt`` (only ``holder``'s when given). Never raises: a
    lease left behind only protects until it expires."""
    try:
        if holder is not None:
            tier.delete(layout.lease_key(attempt, holder))
            return
        for info in list(tier.list(layout.lease_prefix(attempt))):
            tier.delete(info.key)
    except (CkptStoreError, OSError) as e:
        log.warning("ckptstore: could not remove the leases of save %s in %s (%s); they expire after %.0f s",
                    attempt, getattr(tier, "url", tier), e, TTL)


def read(tier) -> list[Lease]:
    """Every lease in ``tier`` (a file that does not parse protects nothing and is reported by its
    key: ``holder`` ``"?"``)."""
    out = []
    for info in tier.list(layout.LEASES + "/"):
        try:
            d = json.loads(tier.get(info.key))
            objs = d["objects"]
            if not isinstance(objs, list) or not all(isinstance(k, str) for k in objs):
                raise ValueError("objects")
            out.append(Lease(info.key, info.mtime, info.size, str(d.get("version")), str(d.get("attempt")),
                             str(d.get("holder")), tuple(objs)))
        except ObjectNotFoundError:
            continue  # released meanwhile
        except (ValueError, KeyError, TypeError):
            out.append(Lease(info.key, info.mtime, info.size, "?", "?", "?", ()))
    return out


def live(leases: list, now_ts: float, ttl: float) -> dict:
    """``{object key: [Lease, ...]}``: what the leases younger than ``ttl`` seconds protect."""
    out: dict = {}
    for lease in leases:
        if now_ts - lease.mtime < ttl:
            for k in lease.objects:
                out.setdefault(k, []).append(lease)
    return out


def ttl_for(grace: float) -> float:
    """How long a lease protects in a gc run with ``grace`` seconds of grace period."""
    return max(float(grace), TTL)


__all__ = ["Lease", "TTL", "live", "read", "release", "ttl_for", "write"]
