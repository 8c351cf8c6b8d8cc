#!/usr/bin/env python
"""GPU state: ``dcp.async_save`` blocking time and ``dcp.load`` into GPU tensors, ckptstore vs DCP.

    python benchmarks/cuda_staging.py [--gib 1] [--reps 3] [--work DIR] [--out FILE.json]

Needs a CUDA device. The state lives on the GPU: ``--gib`` GiB of bf16 weights (8 LLM-shaped
matrices) and their two fp32 Adam moments (``5 x --gib`` GiB in all), one process, ``no_dist``.
Per repetition, in alternating order:

* **save**: ``dcp.async_save`` with ``ckptstore.StorageWriter(root, key=...)`` (byte-group/zstd,
  XXH3, AES-256-GCM; ckptstore's stager: pinned host buffers kept between saves), with DCP's
  ``FileSystemWriter`` (its default stager: fresh host copies per save) and with DCP's
  ``FileSystemWriter(cache_staged_state_dict=True)`` (``dcp-cached``: pinned copies kept). One
  writer per kind for all its saves, as a training loop holds it. *blocked* = seconds inside ``async_save`` (what the
  training loop waits); *total* = until the future's result (``close()`` included for ckptstore).
  The first save of each is a warm-up (pinned buffers allocated) and not counted.
* **load**: ``dcp.load`` into zeroed GPU tensors of the same shapes, ckptstore
  ``StorageReader`` vs DCP ``FileSystemReader``; the page cache is left warm for both (the GPU
  machine's sandbox may refuse ``POSIX_FADV_DONTNEED``), values checked bit-exact on the GPU.

Prints a table of medians and the ratios ckptstore / DCP (blocked: lower is better; load GB/s:
higher is better).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import ckptstore  # noqa: E402

KEY = bytes(range(32))
GiB = 1 << 30


def make_state(gib: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = int(gib * GiB) // 2 // 4096 // 8
    w = {f"layers.{i}.weight": torch.randn(rows, 4096, device="cuda", generator=g).mul_(0.02).to(torch.bfloat16) for i in range(8)}
    m1 = {k: torch.randn(v.shape, device="cuda", generator=g).mul_(1e-3) for k, v in w.items()}
    m2 = {k: torch.rand(v.shape, device="cuda", generator=g).mul_(1e-6) for k, v in w.items()}
    return {"model": w, "optim": {"exp_avg": m1, "exp_avg_sq": m2}, "step": 1}


def nbytes(sd) -> int:
    if isinstance(sd, dict):
        return sum(nbytes(v) for v in sd.values())
    return sd.numel() * sd.element_size() if isinstance(sd, torch.Tensor) else 0


def zeros_like(sd):
    if isinstance(sd, dict):
        return {k: zeros_like(v) for k, v in sd.items()}
    return torch.zeros_like(sd) if isinstance(sd, torch.Tensor) else 0


def equal(a, b) -> bool:
    if isinstance(a, dict):
        return all(equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
    return a == b


def make_writer(kind: str, root: str):
    if kind == "ckptstore":
        return ckptstore.StorageWriter(root, key=KEY)
    return dcp.FileSystemWriter(os.path.join(root, "warm"), cache_staged_state_dict=kind == "dcp-cached")


def save(kind: str, w, sd: dict, root: str, cid: str) -> tuple[float, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fut = dcp.async_save(sd, checkpoint_id=cid if kind == "ckptstore" else os.path.join(root, cid), storage_writer=w, no_dist=True)
    blocked = time.perf_counter() - t0
    for t in sd["model"].values():  # the next step's kernels, queued at once
        t.add_(0)
    fut.result()
    return blocked, time.perf_counter() - t0


def load(kind: str, dest: dict, root: str, cid: str) -> float:
    r = ckptstore.StorageReader(root, key=KEY) if kind == "ckptstore" else dcp.FileSystemReader(os.path.join(root, cid))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dcp.load(dest, checkpoint_id=cid if kind == "ckptstore" else os.path.join(root, cid), storage_reader=r, no_dist=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of bf16 weights (the state is 5x that)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_staging.py: no CUDA device", file=sys.stderr)
        return 2
    from ckptstore.codec import bytegroup

    work = a.work or tempfile.mkdtemp(prefix="ckpt-cuda-")
    sd = make_state(a.gib)
    n = nbytes(sd)
    kinds = ("ckptstore", "dcp", "dcp-cached")
    res = {k: {"blocked": [], "total": [], "load": [], "exact": []} for k in kinds}
    writers = {}
    try:
        for k in kinds:  # one writer per kind for every save, as a training loop holds it; a warm-up save each
            root = os.path.join(work, k)
            writers[k] = make_writer(k, root)
            save(k, writers[k], sd, root, "warm")
        for rep in range(a.reps):
            order = kinds if rep % 2 == 0 else kinds[::-1]
            for k in order:
                root = os.path.join(work, k)
                cid = f"v{rep}"
                b, t = save(k, writers[k], sd, root, cid)
                dest = zeros_like(sd)
                lt = load(k, dest, root, cid)
                res[k]["blocked"].append(b)
                res[k]["total"].append(t)
                res[k]["load"].append(lt)
                res[k]["exact"].append(equal(sd, dest))
                del dest
                if k != "ckptstore":  # disk: DCP's copies are full size
                    shutil.rmtree(os.path.join(root, cid), ignore_errors=True)
    finally:
        writers.get("ckptstore") and writers["ckptstore"].close()
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)
    med = {k: {m: statistics.median(v) for m, v in r.items() if m != "exact"} for k, r in res.items()}
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, {os.cpu_count()} cores; state {n / GiB:.2f} GiB "
          f"on the GPU; {a.reps} reps (medians); ckptstore byte-group kernels: {'C' if bytegroup.NATIVE else 'numpy'}")
    print("| writer/reader | async_save blocked s | save total s | load s | load GB/s | exact |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k in kinds:
        m = med[k]
        print(f"| {k} | {m['blocked']:.3f} | {m['total']:.2f} | {m['load']:.2f} | {n / m['load'] / 1e9:.2f} | "
              f"{'yes' if all(res[k]['exact']) else 'NO'} |")
    for peer in ("dcp", "dcp-cached"):
        rb = med["ckptstore"]["blocked"] / med[peer]["blocked"]
        rl = med[peer]["load"] / med["ckptstore"]["load"]
        print(f"vs {peer}: blocked ckptstore / {peer} = {rb:.2f}x (lower is better); load speed ckptstore / {peer} = {rl:.2f}x")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"bytes": n, "reps": a.reps, "raw": res, "median": med, "native": bytegroup.NATIVE,
                       "device": torch.cuda.get_device_name(), "torch": torch.__version__}, f, indent=1)
    return 0 if all(all(r["exact"]) for r in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
