"""Per-rank body of the in-place restart test (tests/test_restarts.py): ``torchrun --max-restarts=N``.

``python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=N tests/restart_ranks.py
OUT ROOT N``. Every attempt (``TORCHELASTIC_RESTART_COUNT`` = 0 .. N) creates a
``ckptstore.CheckpointManager`` (its own gloo group), restores (collectives on that group), saves
step ``attempt + 1`` and waits for the commit; on every attempt but the last one rank then SIGKILLs
itself, torchrun ends the other worker and starts both again in place, on the same agent store. One
JSON line per event goes to ``OUT/rank<R>.jsonl``: ``start`` (the pid), ``manager`` (the group came up, or ``error``),
``resumed`` (the restored step), ``saved``, ``kill``, ``done``.

The default group is brought up under a per-attempt store prefix (as ckptstore's demo does), so that
its own connect never fails, and then registered with the store a plain ``init_process_group("gloo")``
registers (``PrefixStore("default_pg", agent store)``, the same every attempt): groups made with
``dist.new_group`` then key their rendezvous exactly as under a plain init (ckptstore/_groups.py says
why that fails across restarts). Only the manager's group is measured.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def main(out: str, root: str, last: int) -> int:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def rec(event: str, **kw) -> None:
        with open(os.path.join(out, f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"rank": rank, "attempt": attempt, "event": event, "t": time.time(), **kw}) + "\n")

    rec("start", pid=os.getpid())  # the test kills what is left of a job that ran past its timeout
    torch.set_num_threads(1)
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"restart-test/attempt-{attempt}", agent), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    default = c10d._get_default_group()
    c10d._world.pg_map[default] = ("gloo", dist.PrefixStore("default_pg", agent))  # as plain init registers

    import ckptstore

    state = {"w": torch.zeros(8), "meta": {"attempt": -1}}
    try:
        mgr = ckptstore.CheckpointManager(root, state, interval_steps=1)
        step = mgr.restore()  # collectives on the manager's group
    except Exception as e:  # noqa: BLE001 - the measurement: the group did not come up
        rec("manager", error=f"{type(e).__name__}: {e}"[:400])
        return 3
    rec("manager")
    rec("resumed", step=step, w=state["w"].tolist(), meta=state["meta"])
    state["w"] = torch.full((8,), float(attempt + 1))
    state["meta"] = {"attempt": attempt}
    mgr.save(attempt + 1)
    mgr.wait()
    rec("saved", step=attempt + 1)
    if attempt < last:
        if rank == attempt % world:
            rec("kill")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)  # torchrun ends this worker once its peer died
        return 4
    mgr.close()
    dist.barrier()
    rec("done")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from ckptstore._groups import exit_process

    exit_process(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))  # pytorch/pytorch #190489


def open_close_managers(rank: int, world: int, root: str, n: int) -> dict:
    """``n`` managers made, used (a save and a restore) and closed one after another on this rank
    (for ``run_ranks``): the open file descriptors (the groups' gloo sockets) after the first and
    after the last, and whether a restore after ``close()`` still works."""
    import ckptstore

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    counts = []
    for i in range(n):
        state = {"w": torch.full((4,), float(i))}
        mgr = ckptstore.CheckpointManager(os.path.join(root, str(i)), state)
        mgr.save(1)
        mgr.close()
        counts.append(fds())
    state["w"].zero_()
    step = mgr.restore()  # after close(): on a group made for the call
    return {"first": counts[0], "last": counts[-1], "restored": step, "w": state["w"].tolist(),
            "groups": len(c10d._world.pg_map)}
