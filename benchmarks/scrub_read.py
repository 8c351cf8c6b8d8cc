"""Scrub throughput vs a plain sequential read of the same object files.

    python benchmarks/scrub_read.py DIR [--mib 512] [--reps 3] [--jobs 1,0] [--cold]

Saves ``--mib`` MiB of bf16 tensors (random normal, default compression "auto") into the local
store ``DIR`` once (reused when ``DIR`` already holds version ``bench``), then, ``--reps`` times
each, interleaved: a plain read of every stored object file (``f.read(8 MiB)`` in a Python loop,
one file after another; the ratios are against it), ``cat`` of the same files to ``/dev/null``, and
``ckptstore.scrub.scrub(..., jobs=J)`` for each ``J`` of ``--jobs`` (0 = the default). Prints wall
seconds, CPU seconds (user+sys of this process, all threads, and of ``cat``) and MB/s of each run,
and the medians. The page cache is warm for every run alike (run 0 warms it);
with ``--cold`` the object files are evicted from it (``POSIX_FADV_DONTNEED`` on our own files,
no root needed) before every run instead, so every run reads the disk.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

warnings.filterwarnings("ignore")
for _v in ("CKPTSTORE_KEY", "CKPTSTORE_KEY_FILE"):
    os.environ.pop(_v, None)

MiB = 1 << 20


def cpu() -> float:
    """user+sys seconds of this process and its waited-for children (``cat``)."""
    usage = map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return sum(r.ru_utime + r.ru_stime for r in usage)


def prepare(root: str, mib: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptstore

    if os.path.isdir(root) and ckptstore.Store(root).versions():
        return
    g = torch.Generator().manual_seed(0)
    n_tensors = 16
    per = mib * MiB // 2 // n_tensors
    sd = {f"layer{i}.weight": torch.randn(per, generator=g).to(torch.bfloat16) for i in range(n_tensors)}
    t = time.perf_counter()
    dcp.save(sd, checkpoint_id="bench", storage_writer=ckptstore.StorageWriter(root))
    print(f"saved {mib} MiB bf16 in {time.perf_counter() - t:.1f} s", flush=True)


def object_files(root: str) -> list[str]:
    out = []
    for d, _dn, fns in os.walk(os.path.join(root, "versions")):
        out += [os.path.join(d, f) for f in fns if f.endswith(".ckd")]
    return sorted(out)


def evict(files) -> None:
    from bench_lib import evict as evict_path  # the one eviction every benchmark uses

    for p in files:
        evict_path(p)


def plain_read(files) -> int:
    n = 0
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while True:
                b = f.read(8 * MiB)
                if not b:
                    break
                n += len(b)
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--jobs", default="1,0")
    ap.add_argument("--cold", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import ckptstore
    from ckptstore import scrub as S

    prepare(a.dir, a.mib)
    files = object_files(a.dir)
    total = sum(os.path.getsize(p) for p in files)
    print(f"{len(files)} object files, {total / MiB:.1f} MiB stored; default jobs = {S.default_jobs()}", flush=True)
    plain_read(files)  # warm the page cache for every run alike
    runs: dict[str, list[tuple[float, float]]] = {}

    def timed(name, fn):
        if a.cold:
            evict(files)
        c0, t0 = cpu(), time.perf_counter()
        fn()
        wall, cs = time.perf_counter() - t0, cpu() - c0
        runs.setdefault(name, []).append((wall, cs))
        print(f"  {name:<14} wall {wall:6.3f} s  cpu {cs:6.3f} s  {total / wall / 1e6:8.1f} MB/s", flush=True)

    jobs = [int(j) for j in a.jobs.split(",")]
    for rep in range(a.reps):
        print(f"rep {rep + 1}", flush=True)
        timed("plain-read", lambda: plain_read(files))
        timed("cat", lambda: subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True))
        for j in jobs:
            def one(j=j):
                rep_ = S.scrub(ckptstore.Store(a.dir), jobs=j or None)
                assert rep_.exit_code == 0, rep_.to_json()
            timed(f"scrub-jobs={j or 'default'}", one)
    base = statistics.median(w for w, _c in runs["plain-read"])
    print("medians:")
    for name, rs in runs.items():
        w = statistics.median(x for x, _ in rs)
        c = statistics.median(x for _, x in rs)
        print(f"  {name:<22} wall {w:6.3f} s  cpu {c:6.3f} s  {total / w / 1e6:8.1f} MB/s  "
              f"{base / w:5.2f}x plain read (wall)")


if __name__ == "__main__":
    main()
