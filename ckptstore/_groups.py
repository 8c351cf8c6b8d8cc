"""The process groups ckptstore makes for itself: created and destroyed here, nowhere else; and the
clean exit of a rank process (:func:`exit_process`).

:func:`new_gloo_group` is ``dist.new_group(backend="gloo")`` (every rank of the default group, in
the same order) that survives ``torchrun --max-restarts`` in-place restarts.

Why plain ``new_group`` does not: torchrun's agent keeps one TCPStore for the whole job and hands
it to the workers of every restart attempt (the shared rendezvous store, pytorch/pytorch #128096;
the per-attempt isolation discussed in pytorch/pytorch #135712 does not apply to in-place restarts
in torch 2.13, ``DynamicRendezvousHandler.next_rendezvous`` builds the store once). ``new_group``
keys a group's rendezvous by its name, a counter (``"1"``, ``"2"``, ... in creation order), under
the default group's store, so every attempt uses the same keys, and the keys the dead attempt's
workers wrote are still there: gloo's ``connectFullMesh`` may read a dead worker's address before
the live peer overwrote it, and fails with "Connection refused" (or waits for the timeout).
Measured with a plain ``init_process_group("gloo")``: 1 of 3 attempts whose default group came up
(docs/TESTING.md, "In-place restarts").

Here the group's keys live under ``ckptstore/<nonce>/``, a random nonce rank 0 draws and broadcasts
over the default group on each creation: no attempt (and no second manager in one process) reads
another's keys. ``TORCHELASTIC_RESTART_COUNT`` would not do: it is counted per node agent and need
not agree across nodes (pytorch/pytorch #108158). The group is registered with torch like any
other (``dist.get_rank(pg)``, collectives with ``group=pg``, ``dist.destroy_process_group(pg)``);
that takes torch's private ``_new_process_group_helper`` (the function ``new_group`` calls), the
one torch-internal this module relies on.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import traceback
import uuid
from typing import NoReturn

import torch.distributed as dist

__all__ = ["new_gloo_group", "destroy_group", "exit_process"]


def new_gloo_group(timeout: datetime.timedelta | None = None) -> dist.ProcessGroup:
    """A gloo group of every rank of the default group, keyed by a nonce unique to this call.

    A collective: every rank calls it, in the same order relative to the other collectives on the
    default group (one ``broadcast_object_list``, then gloo's connect). ``timeout``: the group's
    timeout (default: ``torch.distributed.default_pg_timeout``, 30 minutes)."""
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        raise RuntimeError("new_gloo_group needs torch.distributed initialised (init_process_group)")
    box = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    nonce = box[0]
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = list(range(world))
    store = dist.PrefixStore(f"ckptstore/{nonce}", c10d._get_default_store())
    pg, _ = c10d._new_process_group_helper(
        world, rank, ranks, dist.Backend.GLOO, store, getattr(c10d, "GroupName", str)(f"ckptstore-{nonce}"),
        timeout=timeout or dist.default_pg_timeout, group_desc="ckptstore",
    )
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    return pg


def destroy_group(pg: dist.ProcessGroup | None) -> None:
    """Destroy ``pg`` (one :func:`new_gloo_group` made) if torch still knows it: a no-op for None, or
    when the caller's ``dist.destroy_process_group()`` already destroyed every group. Local (no
    collective); the group's gloo threads are joined once its last reference goes."""
    if pg is None or not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed import distributed_c10d as c10d

    if pg in c10d._world.pg_map:
        dist.destroy_process_group(pg)


def exit_process(code: int = 0) -> NoReturn:
    """End this rank process with exit status ``code`` without finalising the interpreter.

    torch 2.13's gloo worker threads may release a finished collective's tensors after the
    interpreter began to finalise; taking the GIL then ends the process with "terminate called
    without an active exception" (SIGABRT) or SIGSEGV, although the rank did its work
    (pytorch/pytorch #190489; docs/operations/troubleshooting.md). So this does what a normal exit does while
    the interpreter is fully alive: destroy every process group (``dist.destroy_process_group()``),
    wait for non-daemon threads (``threading._shutdown``, as ``sys.exit`` does), run the ``atexit``
    handlers (ckptstore's report of versions not uploaded among them), flush stdout and stderr;
    then ``os._exit(code)``. An error in these steps is printed and makes a zero ``code`` 1."""
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None and threading.current_thread() is threading.main_thread():
            shutdown()
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - still exit, never hang or finalise
        traceback.print_exc()
        code = code or 1
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001 - a closed stream
                pass
        os._exit(code)
