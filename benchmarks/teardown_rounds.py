"""How often a rank dies at exit after it returned (pytorch/pytorch #190489), on saturated cores.

    python benchmarks/teardown_rounds.py [--rounds 50] [--reader ckptstore|dcp] [--busy N] [--work DIR]

Each round: a 2-rank save of a sharded state (``tests/dcp_ranks.py``: DTensors, a bf16 tensor
over several frames, non-tensor state) into a fresh root, then a 3-rank load of it followed at once
by ``dist.destroy_process_group()`` (``load_then_destroy``), each job on spawned gloo ranks through
``ckptstore.testing.dist.Ranks`` (the rank runner of the tests, benchmarks and demo). ``--reader
dcp`` does the same through DCP's own ``FileSystemWriter`` / ``FileSystemReader``. While the rounds
run, ``--busy`` processes (default: one per core) spin in a busy loop, so the ranks' teardown
competes for the cores as in a loaded test run.

A rank counts as **died after returning** when it reported its result and then exited by a signal
or with a non-zero code (the race: a gloo worker thread releases a finished collective's tensors
while Python finalises: "terminate called without an active exception", SIGABRT, or SIGSEGV). A rank
that failed before reporting counts as **failed**. Prints one line per round and the totals; exit
status 1 when any rank died after returning or failed. Run it under ``nice`` on a shared machine:
the busy loops inherit the priority, so they compete with the ranks only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # dcp_ranks, importable by the spawned ranks too
os.environ["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "..", "tests"), os.environ.get("PYTHONPATH", "")])


def fs_save_sharded(rank, world, root, version, seed):
    """``dcp_ranks.save_sharded`` through DCP's ``FileSystemWriter``."""
    import torch.distributed.checkpoint as dcp

    import dcp_ranks

    dcp.save(dcp_ranks.sharded_state(world, seed), storage_writer=dcp.FileSystemWriter(os.path.join(root, version)))
    return True


def fs_load_then_destroy(rank, world, root, version, seed):
    """``dcp_ranks.load_then_destroy`` through DCP's ``FileSystemReader``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import dcp_ranks

    full = dcp_ranks.full_state(seed)
    sd = dcp_ranks.sharded_state(world, seed, blank=True)
    dcp.load(sd, storage_reader=dcp.FileSystemReader(os.path.join(root, version)))
    good = torch.equal(sd["dt"].full_tensor(), full["w"])
    dist.destroy_process_group()
    return good, []


def classify(job, codes: dict) -> tuple[list, list]:
    died, failed = [], []
    for r, code in sorted(codes.items()):
        status = job.results.get(r, (None,))[0]
        if status == "ok" and code != 0:
            died.append((r, code))
        elif status != "ok":
            failed.append((r, code, str(job.results.get(r, ("", "no report"))[1])[-300:]))
    return died, failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--reader", choices=("ckptstore", "dcp"), default="ckptstore")
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="busy-loop processes (default: one per core)")
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    args = ap.parse_args()

    import dcp_ranks

    import ckptstore
    from ckptstore.testing.dist import Ranks

    if args.reader == "dcp":
        save, load = fs_save_sharded, fs_load_then_destroy
    else:
        save, load = dcp_ranks.save_sharded, dcp_ranks.load_then_destroy
    print(f"ckptstore from {os.path.dirname(ckptstore.__file__)}; reader {args.reader}; {args.busy} busy loop(s)", flush=True)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    work = tempfile.TemporaryDirectory(dir=args.work)
    totals = {"save": [0, 0], "load": [0, 0]}  # phase: [rounds with a rank died after returning, with a failed rank]
    t0 = time.monotonic()
    try:
        for i in range(args.rounds):
            root = os.path.join(work.name, f"r{i}")
            line = [f"round {i + 1:3d}/{args.rounds}"]
            for phase, fn, world in (("save", save, 2), ("load", load, 3)):
                job = Ranks(fn, world, root, "v1", 11)
                codes = job.wait(300)
                died, failed = classify(job, codes)
                totals[phase][0] += bool(died)
                totals[phase][1] += bool(failed)
                line.append(f"{phase}: codes {[codes[r] for r in range(world)]}"
                            + (f" DIED AFTER RETURNING {died}" if died else "") + (f" FAILED {failed}" if failed else ""))
                if failed:
                    break
            print("  ".join(line), flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
        work.cleanup()
    n = args.rounds
    print(f"\n{n} rounds in {time.monotonic() - t0:.0f} s; rounds with a rank that died after returning: "
          f"save {totals['save'][0]}/{n}, load {totals['load'][0]}/{n}; "
          f"rounds with a failed rank: save {totals['save'][1]}, load {totals['load'][1]}", flush=True)
    return 1 if any(v for t in totals.values() for v in t) else 0


if __name__ == "__main__":
    sys.exit(main())
