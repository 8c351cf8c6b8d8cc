"""Run a function on N real ``torch.distributed`` ranks (gloo on CPU) in spawned processes.

``run_ranks(fn, world_size, *args)`` returns the list of per-rank return values, or raises
:class:`RankFailure` with every failing rank's traceback. ``fn`` must be importable (a module-level
function) because ranks are spawned processes.
"""

from __future__ import annotations

import contextlib
import os
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


class RankFailure(AssertionError):
    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        super().__init__("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, env: dict, q) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        q.put((rank, "ok", out))
    except BaseException:
        q.put((rank, "err", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


@contextlib.contextmanager
def _spawn_env(env: dict):
    """Set ``env`` in this process while a rank is spawned, so the new interpreter starts with it."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_ranks(fn: Callable, world_size: int, *args: Any, env: dict | list | None = None, timeout: float = 240) -> list:
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = free_port()
    envs = env if isinstance(env, list) else [dict(env or {})] * world_size
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, envs[r], q), daemon=False) for r in range(world_size)]
    for r, p in enumerate(procs):
        with _spawn_env(envs[r]):  # e.g. PYTHONHASHSEED must be set when the interpreter starts
            p.start()
    for p in procs:
        p.join(timeout)
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    while not q.empty():
        r, status, val = q.get()
        (results if status == "ok" else failures)[r] = val
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            failures.setdefault(r, "timed out")
        elif r not in results and r not in failures:
            failures[r] = f"exited with code {p.exitcode} without reporting"
    if failures:
        raise RankFailure(failures)
    return [results[r] for r in range(world_size)]


def run_ranks_raw(fn: Callable, world_size: int, *args: Any, env: dict | None = None, timeout: float = 240) -> dict[int, int]:
    """Like run_ranks but tolerates killed ranks: returns {rank: exitcode}."""
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = free_port()
    envs = env if isinstance(env, list) else [dict(env or {})] * world_size
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, envs[r], q)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return {r: p.exitcode for r, p in enumerate(procs)}
