"""The cost of counting NaN/Inf values while a save encodes (``StorageWriter(count_nonfinite=...)``,
``ckptstore/codec/numerics.py``; docs/FORMAT.md "Manifest": ``nonfinite``).

A 256 MiB bf16 state (``bench_lib.make_state``: LLM-shaped, N(0, 0.02)) is saved with one
single-process ``dcp.save`` per configuration and repetition, counting on and off, for two writer
set-ups:

* ``ckpt-on``: the default pipeline (byte-group/zstd, XXH3, AES-256-GCM) — what a job runs;
* ``ckpt-off``: ``compression="none"``, no key (only XXH3 left) — the worst case for the count's
  share, since the encoder then does almost nothing else with the bytes.

The configurations run interleaved within every repetition, in a shuffled order; each repetition's
ratio (count on / count off, wall seconds and CPU seconds of the process) is computed within it, and
the median over repetitions is printed (the machine is shared: never compare absolute times across
runs). Also printed: the count alone over the whole state on one thread (GB/s), and a save of the
same state holding NaN in every tensor (the exact-count path).

    python benchmarks/nonfinite_bench.py [--mib 256] [--reps 7] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench_lib  # noqa: E402  (sets torch's intra-op threads like the other benchmarks)
import torch  # noqa: E402


def count_alone(sd: dict) -> float:
    """Seconds to count every tensor of ``sd`` on the calling thread (no encoding)."""
    from ckptstore.codec.numerics import count_nonfinite, rule_for

    ts = list(bench_lib.tensors(sd).values())
    t0 = time.perf_counter()
    n = 0
    for t in ts:
        n += count_nonfinite(t.view(torch.uint8).numpy(), rule_for(str(t.dtype).removeprefix("torch.")))
    dt = time.perf_counter() - t0
    assert n == sum(int((~torch.isfinite(t)).sum()) for t in ts)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    args = ap.parse_args()
    os.environ.pop("CKPTSTORE_KEY", None)
    os.environ.pop("CKPTSTORE_KEY_FILE", None)
    work = tempfile.mkdtemp(prefix="nonfinite-bench-", dir=args.work)
    sd = bench_lib.make_state(args.mib << 20)
    nbytes = bench_lib.state_bytes(sd)
    kinds = ("ckpt-on", "ckpt-off")
    raw: dict = {f"{k}/{c}": [] for k in kinds for c in ("count", "nocount")}
    try:
        for _ in range(2):  # warm-up: page cache, allocator, thread pools
            for k in kinds:
                bench_lib.save_once(k, sd, work, "warm", count_nonfinite=True)
        for rep in range(args.reps):
            runs = [(k, c) for k in kinds for c in (True, False)]
            random.Random(rep).shuffle(runs)
            for k, c in runs:
                r = bench_lib.save_once(k, sd, work, "rep", count_nonfinite=c)
                raw[f"{k}/{'count' if c else 'nocount'}"].append({"seconds": r["seconds"], "cpu": r["cpu"]})
                shutil.rmtree(r["root"], ignore_errors=True)
        alone = min(count_alone(sd) for _ in range(5))
        poisoned = {"model": {n: t.clone() for n, t in sd["model"].items()}, "step": 1000}
        for t in poisoned["model"].values():
            t.view(-1)[:: 997] = float("nan")  # every tensor: the exact path in every frame
        bad = []  # (count on, count off) seconds per repetition, in a shuffled order
        log = logging.getLogger("ckptstore")
        level, log.level = log.level, logging.ERROR  # the commit's NaN warning, once per save
        try:
            for rep in range(args.reps):
                secs = {}
                for c in random.Random(100 + rep).sample([True, False], 2):
                    r = bench_lib.save_once("ckpt-on", poisoned, work, "nan", count_nonfinite=c)
                    secs[c] = r["seconds"]
                    shutil.rmtree(r["root"], ignore_errors=True)
                bad.append((secs[True], secs[False]))
        finally:
            log.level = level
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def ratios(k: str, field: str) -> list[float]:
        return [a[field] / b[field] for a, b in zip(raw[f"{k}/count"], raw[f"{k}/nocount"])]

    rows = []
    for k in kinds:
        rw, rc = ratios(k, "seconds"), ratios(k, "cpu")
        rows.append({"writer": k, "label": bench_lib.LABELS[k], "ratio_wall_median": statistics.median(rw),
                     "ratio_wall_min": min(rw), "ratio_wall_max": max(rw), "ratio_cpu_median": statistics.median(rc),
                     "count_s_median": statistics.median(x["seconds"] for x in raw[f"{k}/count"]),
                     "nocount_s_median": statistics.median(x["seconds"] for x in raw[f"{k}/nocount"])})
    bad_ratio = statistics.median(on / off for on, off in bad)
    load = os.getloadavg()[0]
    print(f"state: {nbytes / 2**20:.0f} MiB bf16, {len(bench_lib.tensors(sd))} tensors; {args.reps} interleaved reps; "
          f"threads={bench_lib.THREADS}; load average {load:.1f} on {os.cpu_count()} cores")
    print(f"{'writer':<34} {'save s (count)':>14} {'save s (off)':>12} {'ratio wall':>22} {'ratio CPU':>10}")
    for r in rows:
        print(f"{r['label']:<34} {r['count_s_median']:>14.3f} {r['nocount_s_median']:>12.3f} "
              f"{r['ratio_wall_median']:>8.3f} ({r['ratio_wall_min']:.3f}-{r['ratio_wall_max']:.3f}) "
              f"{r['ratio_cpu_median']:>10.3f}")
    cpu_on = statistics.median(x["cpu"] for x in raw["ckpt-on/nocount"])
    print(f"count alone (one thread, whole state): {alone:.3f} s = {nbytes / alone / 1e9:.1f} GB/s "
          f"= {alone / cpu_on:.1%} of a default save's CPU time ({cpu_on:.3f} CPU-s)")
    print(f"a state with NaN in every tensor (exact count in every frame), ckpt-on: ratio {bad_ratio:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "raw": raw, "count_alone_s": alone, "nan_state_ratio": bad_ratio,
                       "nan_state_raw": bad, "bytes": nbytes, "reps": args.reps, "threads": bench_lib.THREADS, "load": load}, f, indent=1)


if __name__ == "__main__":
    main()
