"""Run a function on N real ``torch.distributed`` ranks (gloo on CPU) in separate processes.

The one rank runner of the tests:

* :class:`Ranks` starts one job (``fn(rank, world_size, *args)`` on every rank) and
  :meth:`Ranks.wait` returns ``{rank: exitcode}``, killing ranks once ``timeout`` seconds pass
  with no rank exiting;
  :attr:`Ranks.results` then holds ``{rank: ("ok", value) | ("err", traceback)}`` for the ranks
  that reported.
* :func:`run_ranks` returns the per-rank return values, or raises :class:`RankFailure` with every
  failing rank's traceback; :func:`run_ranks_raw` tolerates killed ranks and returns the exit codes.

Ranks are ``spawn``-ed by default (a fresh interpreter each). ``start_method="forkserver"`` forks
them from a server that has ``preload`` imported already: ~1 s per job instead of ~5-15 s of
interpreter start and imports on a 2-core machine. Either way each rank gets this process's current
environment (so S3 settings made by fixtures reach it, minus any armed ``CKPTSTORE_FAULT``) plus its
``env``, and ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*``. ``fn`` must be importable (a
module-level function). ``faulthandler`` is on in every rank, so a rank killed by a signal
(SIGSEGV, SIGABRT) prints every thread's Python stack to stderr.

A rank reports its result (or its exception's traceback) by writing it, pickled with the standard
:mod:`pickle` (tensors by value, not through torch's shared-memory reductions, whose files are gone
once the rank exits), into a file of its own in a temporary directory (written whole, then renamed:
a rank killed mid-write leaves no partial report), so a result of any size neither blocks the rank
in a pipe nor leaves the parent waiting for the rest of a message. It then leaves through
:func:`ckptstore._groups.exit_process`: every process group destroyed, ``atexit`` handlers run,
streams flushed, ``os._exit`` (0 after a result, 1 after an exception) with no interpreter
finalisation, where torch 2.13's gloo threads could abort a rank that did its work
(pytorch/pytorch #190489). A rank that dies before reporting still fails :func:`run_ranks`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as _mp
from multiprocessing.connection import wait as _wait_any
import os
import pickle
import shutil
import socket
import tempfile
import traceback
from typing import Any, Callable, Sequence

__all__ = ["Ranks", "RankFailure", "run_ranks", "run_ranks_raw", "free_port", "context"]

_DROP = ("CKPTSTORE_FAULT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_contexts: dict = {}


class RankFailure(AssertionError):
    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        super().__init__("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def context(start_method: str = "spawn", preload: Sequence[str] = ()):
    """The multiprocessing context for ``start_method`` (a forkserver preloads ``preload`` once)."""
    ctx = _contexts.get(start_method)
    if ctx is None:
        ctx = _contexts[start_method] = _mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(list(preload))
    return ctx


def _report(out_dir: str, rank: int, status: str, value: Any) -> bool:
    """Write ``(status, value)`` as ``out_dir/rank<r>.pkl`` (temp file, fsync-free rename); a value
    that cannot be pickled is reported as an error instead. Returns whether ``status`` was reported."""
    try:
        data = pickle.dumps((status, value), protocol=pickle.HIGHEST_PROTOCOL)
        ok = True
    except BaseException as e:  # noqa: BLE001 - reported as the rank's failure
        data = pickle.dumps(("err", f"the rank's result could not be pickled ({type(e).__name__}: {e}); "
                                    f"return plain values (tensors are fine): {type(value).__name__}"))
        ok = False
    tmp = os.path.join(out_dir, f".rank{rank}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.pkl"))
    return ok


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, env: dict, out_dir: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    faulthandler.enable(all_threads=True)
    import torch
    import torch.distributed as dist

    from .._groups import exit_process

    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        if not _report(out_dir, rank, "ok", out):
            code = 1
    except BaseException:
        code = 1
        _report(out_dir, rank, "err", traceback.format_exc())
    # the result is in its file: destroy the groups, run atexit, flush, os._exit; a gloo thread can
    # abort a finalising interpreter (pytorch/pytorch #190489)
    exit_process(code)


@contextlib.contextmanager
def patched_environ(env: dict):
    """Set ``env`` in ``os.environ`` for the ``with`` block, then restore what was there.

    Used while a rank is spawned (so the new interpreter starts with it, e.g. ``PYTHONHASHSEED``) and
    by the demo's ``--seaweedfs`` (its workers find the server through the boto3 chain)."""
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


class Ranks:
    """One job: ``fn(rank, world_size, *args)`` on ``world_size`` ranks; see the module docstring."""

    def __init__(self, fn: Callable, world_size: int, *args: Any, env: dict | list | None = None,
                 start_method: str = "spawn", preload: Sequence[str] = ()):
        ctx = context(start_method, preload)
        self.dir = tempfile.mkdtemp(prefix="ckptstore-ranks-")
        port = free_port()
        envs = env if isinstance(env, list) else [dict(env or {})] * world_size
        base = {k: v for k, v in os.environ.items() if k not in _DROP}
        self.procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, {**base, **envs[r]}, self.dir))
                      for r in range(world_size)]
        for r, p in enumerate(self.procs):
            with patched_environ(envs[r]):  # e.g. PYTHONHASHSEED must be set when a spawned interpreter starts
                p.start()
        self.results: dict[int, tuple[str, Any]] = {}

    def wait(self, timeout: float = 240) -> dict[int, int]:
        """Join every rank; returns ``{rank: exitcode}``. Ranks still alive once ``timeout``
        seconds pass with no rank exiting are killed (and listed in :attr:`timed_out`)."""
        alive = {p.sentinel: p for p in self.procs}
        while alive:
            ready = _wait_any(list(alive), timeout=timeout)
            if not ready:
                break
            for s in ready:
                alive.pop(s).join()
        self.timed_out = {r for r, p in enumerate(self.procs) if p.is_alive()}
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
        self._read_reports()
        return {r: p.exitcode for r, p in enumerate(self.procs)}

    def _read_reports(self) -> None:
        """The reports the ranks wrote (a rank that died first wrote none), then the directory goes."""
        for r in range(len(self.procs)):
            path = os.path.join(self.dir, f"rank{r}.pkl")
            try:
                with open(path, "rb") as f:
                    self.results[r] = pickle.load(f)  # written by our own rank process
            except FileNotFoundError:
                pass
            except Exception as e:  # noqa: BLE001 - a report that does not load is the rank's failure
                self.results[r] = ("err", f"its report could not be read ({type(e).__name__}: {e})")
        shutil.rmtree(self.dir, ignore_errors=True)


def run_ranks(fn: Callable, world_size: int, *args: Any, env: dict | list | None = None, timeout: float = 240,
              start_method: str = "spawn", preload: Sequence[str] = ()) -> list:
    """Every rank's return value, in rank order; :class:`RankFailure` if any rank failed."""
    job = Ranks(fn, world_size, *args, env=env, start_method=start_method, preload=preload)
    codes = job.wait(timeout)
    failures = {r: val for r, (status, val) in job.results.items() if status != "ok"}
    for r, code in codes.items():
        if r in job.timed_out:
            failures.setdefault(r, f"timed out ({timeout:.0f} s without a rank exiting)")
        elif r not in job.results:
            failures[r] = f"exited with code {code} without reporting"
        elif code != 0:  # e.g. killed by SIGABRT while tearing down after fn returned
            failures.setdefault(r, f"returned, then exited with code {code}")
    if failures:
        raise RankFailure(failures)
    return [job.results[r][1] for r in range(world_size)]


def run_ranks_raw(fn: Callable, world_size: int, *args: Any, env: dict | list | None = None, timeout: float = 240,
                  start_method: str = "spawn", preload: Sequence[str] = ()) -> dict[int, int]:
    """Like :func:`run_ranks` but tolerates killed ranks: returns ``{rank: exitcode}``."""
    return Ranks(fn, world_size, *args, env=env, start_method=start_method, preload=preload).wait(timeout)
