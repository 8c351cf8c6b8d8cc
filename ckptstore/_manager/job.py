"""The job a :class:`ckptstore.CheckpointManager` saves for: its own process group, and whether the
job is still whole.

- **Its own process group.** DCP runs planning collectives (gather/scatter/all-reduce) for every
  save and load. The manager creates one gloo group (on every rank, in ``__init__``:
  :func:`ckptstore._groups.new_gloo_group`, ``dist.new_group(backend="gloo")`` keyed so that it
  survives ``torchrun --max-restarts`` in-place restarts) and passes it as ``process_group=`` to
  every save and load, so the trainer's collectives on the default group can never interleave with
  them. :meth:`~ckptstore.CheckpointManager.close` destroys it.
- **Only the whole job commits** (docs/FORMAT.md, Save rules 6-7). The writer is set up with the
  job's world size and refuses to plan or commit a save with any other number of ranks. A save
  that fails because a collective of DCP failed — a peer died (gloo's ``RuntimeError: Connection
  closed by peer``, ``torch.distributed.DistError``), the process group was destroyed
  (``ValueError: Group ... is not registered``), or anything else DCP raises outside its per-rank
  ``CheckpointException`` — *breaks* the manager: that save and every later ``save()``, ``wait()``,
  ``latest()`` and ``restore()`` raise :class:`~ckptstore.errors.JobBrokenError` at once (queued
  saves fail without running; nothing hangs, nothing is committed by the survivors). A save that
  failed with ckptstore errors reported by the ranks (disk full, ``VersionExistsError``) does not
  break it. The manager also checks before each save that its process group still exists.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import re
import threading

import torch.distributed as dist

from .._groups import destroy_group, new_gloo_group
from ..errors import CkptStoreError, JobBrokenError

log = logging.getLogger("ckptstore")


def dist_running() -> bool:
    """torch.distributed is available and initialised in this process."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """The number of ranks of the default group (1 outside a distributed job)."""
    return dist.get_world_size() if dist_running() else 1


class Job:
    """This rank's view of the job: ``rank``, ``world`` (the number of ranks at construction: asking
    torch.distributed fails once the group is destroyed), ``pg`` (the manager's gloo group; None
    outside a distributed job or once closed) and ``broken`` (why the job lost ranks, or None).

    Construct it on every rank at the same point (it creates the group). ``timeout_s``: the group's
    timeout (default torch's, 30 minutes; under torchft below the trainer's, docs/FORMAT.md Save rule 9)."""

    def __init__(self, timeout_s: float | None = None) -> None:
        self.timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        self.dist = dist_running()
        self.rank = dist.get_rank() if self.dist else 0
        self.world = world_size()
        # every rank creates the group here, in the same order: DCP's collectives run on it only;
        # keyed per creation, so that it comes up after torchrun's in-place restarts (_groups.py)
        self.pg = new_gloo_group(self.timeout) if self.dist else None
        self.broken: str | None = None
        self._lock = threading.Lock()

    def group_world(self) -> int:
        """The number of ranks of the manager's group now (1 outside a distributed job)."""
        return dist.get_world_size(self.pg) if self.dist else 1

    # -- a broken job (docs/FORMAT.md, Save rule 6) ------------------------------------------------
    @staticmethod
    def broken_message(why: str) -> str:
        """What :class:`JobBrokenError` says: the job lost ranks and what to do, once, then the cause once."""
        return ("the job lost ranks. Restart the whole job: it resumes from the newest version all ranks committed "
                f"(this manager refuses every further save and restore, so no rank commits without its peers). Cause: {why}")

    def lose(self, why: str) -> None:
        """Mark the job broken (the first reason stays). Said by the :class:`JobBrokenError` the next
        ``save()``, ``wait()`` or ``close()`` raises, not logged apart: one message per rank."""
        with self._lock:
            if self.broken is None:
                self.broken = why
                log.debug("ckptstore: the job lost ranks: %s", why)

    def check(self) -> None:
        """Raise :class:`JobBrokenError` when the job is broken, or when the manager's process group
        (or torch.distributed itself) is gone — DCP would otherwise save on this rank alone."""
        if self.broken is None and self.dist and not group_alive(self.pg):
            self.lose("the CheckpointManager's process group was destroyed (torch.distributed.destroy_process_group)")
        if self.broken is not None:
            raise JobBrokenError(self.broken_message(self.broken))

    def guarded(self, fn, *args):
        """``fn(*args)`` (collectives on the manager's group); a failed collective breaks the job."""
        try:
            return fn(*args)
        except Exception as e:
            if group_failure(e):
                self.lose(f"a collective of a restore failed: {short_cause(e)}")
                raise JobBrokenError(self.broken_message(self.broken)) from e
            raise

    @contextlib.contextmanager
    def group(self):
        """Around a restore or ``latest()``: the manager's group, or after :meth:`close` destroyed it,
        one made for the call (every rank makes the call) and destroyed at its end."""
        if self.pg is not None or not self.dist:
            yield
            return
        self.pg = new_gloo_group(self.timeout)
        try:
            yield
        finally:
            pg, self.pg = self.pg, None
            destroy_group(pg)

    def close(self) -> None:
        """Destroy the manager's group (local, no collective: _groups.py)."""
        pg, self.pg = self.pg, None
        destroy_group(pg)


def group_failure(e: BaseException) -> bool:
    """Did a save (or restore) fail because the job lost ranks? DCP reports a rank's own failure
    (a ckptstore error, a planner error) to every rank as ``CheckpointException``; anything else it
    raises comes from a collective that failed — gloo's ``RuntimeError`` ("Connection closed by
    peer"), ``torch.distributed.DistError`` and subclasses, ``ValueError`` ("Group ... is not
    registered") — after which the ranks no longer agree on where they are."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, JobBrokenError):
        return True
    if isinstance(e, CheckpointException):
        return any(isinstance(f[0] if isinstance(f, tuple) else f, JobBrokenError) for f in e.failures.values())
    if isinstance(e, CkptStoreError):
        return False
    return isinstance(e, Exception)


#: the source location gloo puts before its messages (``[/__w/pytorch/.../pair.cc:537] ``)
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def short_cause(e: BaseException) -> str:
    """``Type: message`` of a collective's failure in one short line: gloo's source location and its
    advice after the first sentence ("This is typically caused by a remote worker hanging …") cut,
    a ``JobBrokenError``'s own cause taken as it is, at most 300 characters."""
    if isinstance(e, JobBrokenError):
        text = str(e)
        return text.split("Cause: ", 1)[1] if "Cause: " in text else text
    lines = str(e).strip().splitlines()
    text = _SOURCE_PREFIX.sub("", lines[0] if lines else "")
    cut = text.find(". ")
    if cut != -1 and cut + 2 < len(text):
        text = text[:cut]
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def group_alive(pg) -> bool:
    """The process group ``pg`` (and torch.distributed) still exist in this process."""
    if not dist_running():
        return False
    try:
        dist.get_rank(pg)  # "Group ... is not registered" once destroyed (get_world_size does not check)
    except (ValueError, RuntimeError):
        return False
    return True
