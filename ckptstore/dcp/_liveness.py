"""Is the trainer that handed a save to DCP's checkpoint subprocess still alive? (docs/FORMAT.md,
Save rule 7: a checkpoint subprocess that outlives its trainer commits nothing.)

``AsyncCheckpointerType.PROCESS`` runs every save in a subprocess that torch starts once per trainer
(``torch.distributed.checkpoint._async_process_executor``, ``daemon=True``). A daemon child is
terminated only when its parent exits normally; a SIGKILLed trainer leaves it running, and it would
finish — commit — the save it was given. The writer records its trainer when it is pickled for the
subprocess (:func:`identity`, in the trainer); its copy in the subprocess checks :func:`alive` right
before anything that commits, and :func:`watch` exits the subprocess as soon as the trainer is gone.

A process is identified by its pid and, on Linux, its start time (``/proc/PID/stat`` field 22, clock
ticks since boot), so a pid reused by another process does not count as the trainer; a zombie (killed,
not yet reaped) is dead. Elsewhere: the subprocess's parent is the trainer (torch spawns it from the
trainer), so a changed ``os.getppid()`` means the trainer is gone; on other POSIX systems, where the
parent is not the trainer, ``os.kill(pid, 0)``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("ckptstore")

POLL_S = 0.2  # seconds between two checks of the watcher

Identity = tuple  # (pid, start time or None)


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) from ``/proc/PID/stat``; None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw.rpartition(")")[2].split()  # the command name (field 2) may hold spaces and parentheses
    return fields[0], fields[19]


def _has_proc() -> bool:
    return sys.platform.startswith("linux") and os.path.exists("/proc/self/stat")


def identity() -> Identity:
    """This process: ``(pid, start time)`` (start time None where ``/proc`` is not available)."""
    pid = os.getpid()
    st = _stat(pid) if _has_proc() else None
    return (pid, st[1] if st is not None else None)


def alive(ident: Identity, *, parent_is_it: bool = False) -> bool:
    """Whether the process ``ident`` (from :func:`identity`) still runs. ``parent_is_it``: it was
    this process's parent when the check was set up (the fallback without ``/proc``)."""
    pid, start = ident
    if pid == os.getpid():
        return True
    if start is not None and _has_proc():
        st = _stat(pid)
        return st is not None and st[0] not in ("Z", "X") and st[1] == start
    if parent_is_it:
        return os.getppid() == pid
    if os.name != "posix":  # os.kill(pid, 0) would terminate the process on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_watched: set = set()
_watch_lock = threading.Lock()


def watch(ident: Identity) -> None:
    """Exit this process (``os._exit(1)``, nothing flushed, nothing committed) within :data:`POLL_S`
    seconds of the process ``ident`` dying; one watcher thread per watched process."""
    if ident[0] == os.getpid():
        return
    with _watch_lock:
        if ident in _watched:
            return
        _watched.add(ident)
    parent_is_it = os.getppid() == ident[0]
    threading.Thread(target=_watch, args=(ident, parent_is_it), name="ckptstore-trainer-watch", daemon=True).start()


def _watch(ident: Identity, parent_is_it: bool) -> None:
    ev = threading.Event()
    while alive(ident, parent_is_it=parent_is_it):
        ev.wait(POLL_S)
    msg = (f"ckptstore: the trainer (pid {ident[0]}) of this checkpoint subprocess (pid {os.getpid()}) is gone; "
           "exiting without committing the save in progress (its objects are garbage for 'ckptstore gc')")
    try:
        log.error(msg)  # logging's last-resort handler prints it when none is configured
    finally:
        os._exit(1)
