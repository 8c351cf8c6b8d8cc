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

from ..errors import JobBrokenError

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


class Guard:
    """Only the whole job commits (docs/FORMAT.md, Save rules 6-7), for one writer and its stages.

    ``cfg``: the writer's settings (their ``world_size``). A writer pickled for DCP's checkpoint
    subprocess (``AsyncCheckpointerType.PROCESS``) carries a copy of its guard that knows its trainer
    (recorded at pickling, in the trainer) and runs ``in_subprocess``."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.in_subprocess = False  # this copy runs in DCP's checkpoint subprocess
        self.trainer: Identity | None = None  # (pid, start time) of the process that pickled this copy
        self.trainer_is_parent = False

    def __getstate__(self):
        s = self.__dict__.copy()
        if not self.in_subprocess:  # the copy commits only while this process lives (Save rule 7)
            s["trainer"] = identity()
        s["in_subprocess"] = True
        return s

    def attach(self, own_group: bool) -> None:
        """In DCP's checkpoint subprocess, once unpickled: exit when the trainer is gone (:func:`watch`);
        with ``own_group``, leave the trainer's process group (torchrun signals a worker's whole group
        with ``os.killpg``, and a save in flight must be able to finish after a preemption signal)."""
        if self.trainer is None:
            return
        self.trainer_is_parent = os.getppid() == self.trainer[0]
        watch(self.trainer)  # exits this process once the trainer is gone
        try:
            if own_group and os.getpgid(0) == os.getpgid(self.trainer[0]):
                os.setpgid(0, 0)
        except OSError as e:  # a session leader cannot (the signal then reaches it too); a trainer gone
            log.debug("ckptstore: checkpoint subprocess stays in its trainer's process group: %s", e)

    def check_trainer(self, what: str) -> None:
        """Raise :class:`JobBrokenError` when this copy runs in DCP's checkpoint subprocess and its
        trainer is gone (docs/FORMAT.md, Save rule 7); called right before ``what`` commits."""
        if self.trainer is None or alive(self.trainer, parent_is_it=self.trainer_is_parent):
            return
        raise JobBrokenError(
            f"DCP's checkpoint subprocess (pid {os.getpid()}) outlived its trainer (pid {self.trainer[0]}): "
            f"refusing {what}; nothing is committed. Restart the job; it resumes from the newest committed version"
        )

    def check_world(self, n: int, what: str) -> None:
        """Raise :class:`JobBrokenError` unless ``n`` ranks is the job's ``world_size`` (Save rule 6)."""
        world = self.cfg.world_size
        if world is None or n == world:
            return
        raise JobBrokenError(
            f"{what} has {n} rank(s) but this writer was set up for a job of {world} "
            f"(StorageWriter(world_size={world})): only the whole job commits, a rank that outlived its "
            "peers never commits alone; nothing was committed. Restart the whole job (or pass world_size= for a "
            "save by fewer ranks on purpose)"
        )
