"""Rank bodies for the "only the whole job commits" tests (tests/test_whole_job.py).

Module-level so that spawned ranks (``ckptstore.testing.dist``) can import them.
"""

from __future__ import annotations

import os
import time
import traceback

import torch

import ckptstore


class Loader:
    """A per-rank data loader position (``state_dict``/``load_state_dict``)."""

    def __init__(self, rank: int):
        self.pos = 1000 * rank

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, sd):
        self.pos = sd["pos"]


def _state(rank: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return {"model": model, "optim": opt, "data": Loader(rank)}


def _err(e: BaseException) -> tuple:
    return (type(e).__name__, str(e)[:6000])


def survivor(rank, world, root, steps, opts):
    """Save every step with ``CheckpointManager(interval_steps=1)``; rank 0 is expected to die at a
    fault point (``CKPTSTORE_FAULT``); the survivor keeps calling ``save``/``wait`` and reports
    ``[(step, "ok" | (error type, message), seconds)]``."""
    state = _state(rank)
    mgr = ckptstore.CheckpointManager(root, state, interval_steps=1, per_rank_keys=("data",), **opts)
    out = []
    for step in range(1, steps + 1):
        state["data"].pos += 1
        t0 = time.monotonic()
        try:
            mgr.save(step)
            mgr.wait()
            out.append((step, "ok", time.monotonic() - t0))
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            out.append((step, _err(e), time.monotonic() - t0))
    t0 = time.monotonic()
    try:
        mgr.close()
        out.append(("close", "ok", time.monotonic() - t0))
    except BaseException as e:  # noqa: BLE001
        out.append(("close", _err(e), time.monotonic() - t0))
    return out


def trainer(rank, world, root, steps, opts):
    """A training loop: an all-reduce on the default group per step (the trainer's own collective),
    then ``save(step)`` without waiting; an error propagates (the runner then destroys the process
    groups, as a trainer's ``finally: dist.destroy_process_group()`` does)."""
    import torch.distributed as dist

    state = _state(rank)
    mgr = ckptstore.CheckpointManager(root, state, interval_steps=1, per_rank_keys=("data",),
                                      **{k: v for k, v in opts.items() if k != "linger"})
    try:
        for step in range(1, steps + 1):
            state["data"].pos += 1
            t = torch.ones(4)
            dist.all_reduce(t)
            mgr.save(step)
        mgr.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        time.sleep(opts.get("linger", 0))  # the trainer's own clean-up after the failure
    return "done"


# ---- a slow S3 link -------------------------------------------------------------------------------
class DelayProxy:
    """A loopback TCP proxy in a thread of the test process that holds each request for ``delay``
    seconds: the first bytes a client sends after the server last answered (a new request on a
    kept-alive connection, or its body after ``100 Continue``) wait ``delay`` before they are
    forwarded. ``delay`` may be changed at any time; ``url`` is the endpoint to give boto3."""

    def __init__(self, target_url: str, delay: float = 0.0):
        import asyncio
        import threading
        import urllib.parse

        u = urllib.parse.urlsplit(target_url)
        self._host, self._port = u.hostname, u.port
        self.delay = delay
        self.requests = 0
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, ready) -> None:
        import asyncio

        asyncio.set_event_loop(self._loop)

        async def start():
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    async def _handle(self, cr, cw) -> None:
        import asyncio

        try:
            sr, sw = await asyncio.open_connection(self._host, self._port)
        except OSError:
            cw.close()
            return
        fresh = [True]

        async def up():
            try:
                while data := await cr.read(64 << 10):
                    if fresh[0]:
                        fresh[0] = False
                        self.requests += 1
                        if self.delay:
                            await asyncio.sleep(self.delay)
                    sw.write(data)
                    await sw.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                sw.close()

        async def down():
            try:
                while data := await sr.read(64 << 10):
                    fresh[0] = True
                    cw.write(data)
                    await cw.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                cw.close()

        await asyncio.gather(up(), down())

    def close(self) -> None:
        import asyncio

        async def shutdown():
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


# ---- kind: a checkpoint subprocess that outlives its trainer -------------------------------------------
def _touch(path: str, text: str = "") -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _wait_file(path: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.02)


def killed_during_upload(rank, world, root, scratch, opts):
    """``save(10)`` and wait (committed in both tiers), report, wait for ``scratch/go``, ``save(20)``,
    report that it returned (with the checkpoint subprocess's pid, PROCESS), then sleep until the
    test SIGKILLs this trainer."""
    state = _state(rank)
    mgr = ckptstore.CheckpointManager(root, state, interval_steps=10, per_rank_keys=("data",), **opts)
    mgr.save(10)
    mgr.wait()
    _touch(os.path.join(scratch, f"saved10.r{rank}"))
    _wait_file(os.path.join(scratch, "go"))
    state["data"].pos += 1
    mgr.save(20)
    sub = None
    if opts.get("executor") == "process":
        from torch.distributed.checkpoint import _async_process_executor as ape

        sub = ape._CHECKPOINT_PROCESS._save_process.pid
    _touch(os.path.join(scratch, f"saving20.r{rank}"), str(sub or ""))
    time.sleep(600)


# ---- kind: a process group destroyed under the manager / writer ----------------------------------------
def destroyed_group(rank, world, root):
    """``save(1)`` through a manager; then the trainer destroys the process groups (as a
    ``finally: dist.destroy_process_group()`` after a failure does) and calls ``save(2)`` on the
    manager and a plain ``dcp.save`` through a ``StorageWriter`` built while the job was whole."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state = _state(rank)
    mgr = ckptstore.CheckpointManager(root, state, interval_steps=1, per_rank_keys=("data",))
    w = ckptstore.StorageWriter(os.path.join(root, "plain"))
    mgr.save(1)
    mgr.wait()
    dcp.save({f"x{rank}": torch.arange(4) + rank}, checkpoint_id="whole", storage_writer=w)
    dist.destroy_process_group()
    out = {}
    for name, call in (("save", lambda: mgr.save(2)), ("wait", mgr.wait), ("restore", mgr.restore),
                       ("plain", lambda: dcp.save({f"x{rank}": torch.arange(4) + rank}, checkpoint_id=f"alone-r{rank}",
                                                  storage_writer=w))):
        try:
            call()
            out[name] = "ok"
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            out[name] = _err(_inner(e))
    try:
        mgr.wait()
    except BaseException:  # noqa: BLE001
        pass
    return out


def _inner(e: BaseException) -> BaseException:
    """The first per-rank error inside DCP's ``CheckpointException``, else ``e``."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        for f in e.failures.values():
            return f[0] if isinstance(f, tuple) else f
    return e


def own_errors_do_not_break(rank, world, root):
    """A failure reported by every rank (``VersionExistsError``: step-1 saved again) leaves the
    manager usable: the next save commits with both ranks."""
    state = _state(rank)
    mgr = ckptstore.CheckpointManager(root, state, interval_steps=1, per_rank_keys=("data",))
    mgr.save(1)
    mgr.wait()
    out = {}
    mgr.save(1)
    try:
        mgr.wait()
        out["again"] = "ok"
    except BaseException as e:  # noqa: BLE001
        out["again"] = _err(e)
    mgr.save(2)
    mgr.wait()
    out["next"] = "ok"
    out["latest"] = mgr.latest()
    mgr.close()
    return out


def wrong_world(rank, world, root):
    """A writer set up for 2 ranks used by a job of ``world`` ranks: the coordinator's plan check."""
    import torch.distributed.checkpoint as dcp

    w = ckptstore.StorageWriter(root, world_size=2)
    try:
        dcp.save({f"x{rank}": torch.arange(4)}, checkpoint_id="v", storage_writer=w)
        return "ok"
    except BaseException as e:  # noqa: BLE001
        return _err(_inner(e))
