"""Writer records: who coordinates an attempt, so what a killed writer left is reclaimed before the
grace period (docs/FORMAT.md, Delete rule 15).

The coordinator of a save writes, into its root, before any rank of the job learns the attempt::

    versions/<v>/attempts/<attempt>/writer.json
        {"host": H, "boot_id": B, "pidns": N, "pid": P, "start": S, "version": V, "attempt": A}

``host`` is the host name, ``boot_id`` the kernel's ``/proc/sys/kernel/random/boot_id``, ``pidns``
the inode of ``/proc/self/ns/pid`` (the PID namespace), ``start`` the process start time
(``/proc/<pid>/stat`` field 22, clock ticks since boot). The coordinator removes the record once its
manifest is committed there (the manifest then protects the attempt), and the failure paths remove
it with the attempt (Delete rule 14). A record left behind means the coordinator died (or is still
saving).

**Provably dead** (:func:`verdict`): the record's host, boot id and PID namespace are this
process's, and ``/proc/<pid>/stat`` is gone, names a zombie, or holds another start time (the pid
was reused). Only the coordinator commits an attempt, so an attempt whose coordinator is provably
dead can never commit. Anything else — another host, another boot (a reboot and a second machine
with the same name cannot be told apart), another PID namespace (a container), an unreadable
record, a live process with the same pid and start time — *may live*: its attempt waits for the
grace period, as before.
"""

from __future__ import annotations

import functools
import json
import os
import socket

from ..errors import CkptStoreError, ObjectNotFoundError
from . import layout

DEAD = "dead"
ALIVE = "alive"
UNKNOWN = "unknown"


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _stat_fields(pid: int) -> tuple[str, int] | None:
    """``(state, start time)`` of process ``pid`` from ``/proc/<pid>/stat``; None when it is gone."""
    text = _read_text(f"/proc/{pid}/stat")
    if not text:
        return None
    rest = text.rpartition(")")[2].split()  # the command name may hold spaces and parentheses
    try:
        return rest[0], int(rest[19])  # fields 3 (state) and 22 (starttime)
    except (IndexError, ValueError):
        return None


@functools.lru_cache(maxsize=1)
def _here() -> dict:
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = None
    return {"host": socket.gethostname(), "boot_id": _read_text("/proc/sys/kernel/random/boot_id"), "pidns": pidns}


def identity(pid: int | None = None) -> dict | None:
    """The record of process ``pid`` (default: this one) as :func:`write` stores it; None where
    ``/proc`` cannot tell (not Linux)."""
    pid = os.getpid() if pid is None else pid
    st = _stat_fields(pid)
    here = _here()
    if st is None or here["boot_id"] is None or here["pidns"] is None:
        return None
    return {**here, "pid": pid, "start": st[1]}


def write(tier, version: str, attempt: str) -> bool:
    """Write this process's writer record for ``attempt`` of ``version`` into ``tier`` (a local root).
    False (nothing written) where ``/proc`` cannot identify the process: the attempt then waits for
    the grace period like any other."""
    me = identity()
    if me is None:
        return False
    body = {**me, "version": version, "attempt": attempt}
    tier.put(layout.object_key(version, layout.writer_record_name(attempt)), json.dumps(body, sort_keys=True).encode())
    return True


def remove(tier, version: str, attempt: str) -> None:
    """Remove the record (the attempt committed, or is being reclaimed). Never raises."""
    try:
        tier.delete(layout.object_key(version, layout.writer_record_name(attempt)))
    except (CkptStoreError, OSError):
        pass


def verdict(record: dict | None) -> str:
    """:data:`DEAD`, :data:`ALIVE` or :data:`UNKNOWN` for a writer record (module docstring)."""
    if not isinstance(record, dict):
        return UNKNOWN
    here = _here()
    if here["boot_id"] is None or here["pidns"] is None:
        return UNKNOWN
    if (record.get("host"), record.get("boot_id"), record.get("pidns")) != (here["host"], here["boot_id"], here["pidns"]):
        return UNKNOWN
    pid, start = record.get("pid"), record.get("start")
    if not isinstance(pid, int) or not isinstance(start, int) or isinstance(pid, bool) or pid <= 0:
        return UNKNOWN
    st = _stat_fields(pid)
    if st is None or st[0] in ("Z", "X") or st[1] != start:
        return DEAD
    return ALIVE


def read(tier, key: str) -> dict | None:
    """The record at ``key``, or None when it is gone or does not parse."""
    try:
        d = json.loads(tier.get(key))
    except (ObjectNotFoundError, ValueError, UnicodeDecodeError):
        return None
    return d if isinstance(d, dict) else None


def dead_attempts(tier, keys) -> dict[str, str]:
    """``{attempt dir prefix: why}`` of the writer records among ``keys`` whose writer is provably
    dead (``versions/<v>/attempts/<a>/``)."""
    out = {}
    for key in keys:
        if not layout.is_writer_record(key) or layout.attempt_of_key(key) is None:
            continue
        rec = read(tier, key)
        if verdict(rec) == DEAD:
            out[key.rsplit("/", 1)[0] + "/"] = (f"its coordinator (pid {rec.get('pid')} on {rec.get('host')}) is gone "
                                                 "(Delete rule 15)")
    return out


__all__ = ["ALIVE", "DEAD", "UNKNOWN", "dead_attempts", "identity", "read", "remove", "verdict", "write"]
