"""What hides a background burst of CPU from the step-time tail of a job whose training fills every
core (ckptstore/_pace.py; docs/DEMO.md, "The tier in the step-time tail").

WORLD gloo ranks (default 6) on this machine's cores each train a small model, a synchronised step
(its gradients all-reduced) of ~20 ms on 2 cores; every 100th step each rank hands BURST_MS of
pure-Python CPU work (default 15, what a small DCP save's bookkeeping costs a rank here) to a
background worker, the way a checkpoint save is handed to its thread. Modes:

* ``none``: no burst (the baseline);
* ``thread``, ``thread-nice19``, ``thread-idle``: a thread of the training process at nice 0, at nice 19,
  under ``SCHED_IDLE``;
* ``proc-nice19``, ``proc-idle``: a process of its own (no GIL shared with training), nice 19 / ``SCHED_IDLE``;
* ``paced``: a nice-19 thread paced by ckptstore's own :class:`ckptstore._pace.Pacer` at ``--duty``
  (default 0.02, the torchft tier's), the burst passing a pace point every 0.2 ms of its CPU.

Printed per run: step p50 and p99 (ms, steps after the first 100, every rank), p99 ÷ p50, and the
excess of the 6 and of the 40 steps after each burst over the median (ms, rank 0); then per mode the
median of its runs and its p99 ÷ p50 against ``none``'s. Runs alternate modes (``--reps`` rounds).

    python benchmarks/pace_bench.py [--steps 3000] [--burst-ms 15] [--reps 2] [--modes none,thread-nice19,proc-nice19,paced]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("none", "thread", "thread-nice19", "thread-idle", "proc-nice19", "proc-idle", "paced")


def _busy(ms: float, point=None) -> None:
    """``ms`` of this thread's CPU in pure Python; ``point()`` every 0.2 ms of it when given."""
    end = time.thread_time() + ms / 1e3
    x = 0
    while True:
        now = time.thread_time()
        if now >= end:
            return
        stop = min(end, now + 0.0002)
        while time.thread_time() < stop:
            for i in range(200):
                x += i * i
        if point is not None:
            point()


def _worker(conn, idle: bool) -> None:  # a process of its own
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    if idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        ms = conn.recv()
        if ms is None:
            return
        _busy(ms)


def rank_main(mode: str, steps: int, burst_ms: float, duty: float, out: str) -> None:
    import datetime as dt
    import multiprocessing as mp
    import queue
    import threading

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=120))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])
    opt = torch.optim.Adam(model.parameters())
    hand = None
    if mode.startswith("thread") or mode == "paced":
        q: queue.Queue = queue.Queue()

        def run():
            tid = threading.get_native_id()
            if mode in ("thread-nice19", "paced"):
                os.setpriority(os.PRIO_PROCESS, tid, 19)
            if mode == "thread-idle":
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            point = None
            if mode == "paced":
                from ckptstore import _pace

                pacer = _pace.Pacer(duty)
                _pace.install(pacer)
                point = _pace.point
            while True:
                ms = q.get()
                if point is not None:
                    pacer.start()
                _busy(ms, point)

        threading.Thread(target=run, daemon=True).start()
        hand = q.put
    elif mode.startswith("proc"):
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        ctx.Process(target=_worker, args=(b, mode == "proc-idle"), daemon=True).start()
        hand = a.send
    dts = []
    t = time.perf_counter()
    for s in range(1, steps + 1):
        x = torch.randn(8, 16)
        for _ in range(2):
            model(x).sum().backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters()])
        dist.all_reduce(g)
        opt.step()
        opt.zero_grad()
        if s % 100 == 0 and hand is not None:
            hand(burst_ms)
        now = time.perf_counter()
        dts.append(now - t)
        t = now
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, dts[100:])
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"all": [d for r in every for d in r], "rank0": dts}, f)
    dist.barrier()
    os._exit(0)


def one(mode: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "dts.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(HERE))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world}",
               os.path.abspath(__file__), "--rank-main", mode, str(args.steps), str(args.burst_ms), str(args.duty), out]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
        with open(out) as f:
            d = json.load(f)
    dts, r0 = d["all"], d["rank0"]
    med = statistics.median(dts)
    p99 = statistics.quantiles(dts, n=100)[98]
    med0 = statistics.median(r0[100:])
    bursts = range(200, args.steps - 41, 100)  # the step index of each burst (0-based: step s at s-1)
    ex6 = statistics.mean(sum(r0[b + k] - med0 for k in range(6)) for b in bursts)
    ex40 = statistics.mean(sum(r0[b + k] - med0 for k in range(40)) for b in bursts)
    return {"mode": mode, "p50_ms": med * 1e3, "p99_ms": p99 * 1e3, "p99_p50": p99 / med,
            "excess6_ms": ex6 * 1e3, "excess40_ms": ex40 * 1e3}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        m, steps, burst, duty, out = sys.argv[2:7]
        rank_main(m, int(steps), float(burst), float(duty), out)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--burst-ms", type=float, default=15.0)
    ap.add_argument("--duty", type=float, default=0.02)
    ap.add_argument("--world", type=int, default=6)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--modes", default="none,thread-nice19,proc-nice19,paced")
    args = ap.parse_args()
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}; choose from {', '.join(MODES)}")
    runs: dict[str, list] = {m: [] for m in modes}
    print(f"{args.world} ranks, {args.steps} steps, a {args.burst_ms} ms burst per rank every 100 steps, "
          f"{os.cpu_count()} cores", flush=True)
    for rep in range(args.reps):
        for m in (modes if rep % 2 == 0 else modes[::-1]):
            r = one(m, args)
            runs[m].append(r)
            print(f"  {m:14s} p50 {r['p50_ms']:6.1f}  p99 {r['p99_ms']:6.1f} ms  p99/p50 {r['p99_p50']:.2f}  "
                  f"excess 6 steps {r['excess6_ms']:6.1f}  40 steps {r['excess40_ms']:6.1f} ms", flush=True)
    base = statistics.median(r["p99_p50"] for r in runs[modes[0]]) if modes[0] == "none" else None
    print("medians of the runs:")
    for m in modes:
        rr = runs[m]
        q = statistics.median(r["p99_p50"] for r in rr)
        vs = f"  (x {q / base:.2f} none's)" if base else ""
        print(f"  {m:14s} p99/p50 {q:.2f}{vs}  excess 6 steps {statistics.median(r['excess6_ms'] for r in rr):6.1f} ms  "
              f"40 steps {statistics.median(r['excess40_ms'] for r in rr):6.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
