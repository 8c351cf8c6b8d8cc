"""Per-rank bodies of tests/test_rank_teardown.py's exit tests (module-level: spawned ranks import them)."""

from __future__ import annotations

import atexit
import os
import signal


def _say_at_exit(rank: int) -> None:
    print(f"atexit ran on rank {rank}", end="")  # no newline, no flush: the runner must flush


def report_raise(rank, world, tag):
    """Rank 0 prints (unflushed), registers an atexit handler and returns; rank 1 raises."""
    print(f"{tag}: rank {rank} printed", end="")
    atexit.register(_say_at_exit, rank)
    if rank == 1:
        raise ValueError(f"{tag}: rank 1 failed on purpose")
    return f"{tag}: rank {rank} result"


def _abort() -> None:
    os.kill(os.getpid(), signal.SIGABRT)


def killed_or_aborted(rank, world):
    """Rank 0 returns; rank 1 is SIGKILLed before returning; rank 2 returns, then dies by SIGABRT at exit.

    A barrier first: gloo connects its full mesh lazily per pair, and a rank killed before its peers
    connected to it fails them too ("Connection closed by peer")."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 2:
        atexit.register(_abort)
    return rank


def big_results(rank, world, nbytes):
    """A result far over a pipe's buffer (64 KiB), a tensor, and an object that cannot be pickled on rank 1."""
    import threading

    import torch

    if rank == 1:
        return threading.Lock()
    return {"blob": bytes(range(256)) * (nbytes // 256), "t": torch.arange(nbytes // 4, dtype=torch.int32)}
