#!/usr/bin/env python
"""Load throughput of ckptstore vs DCP ``FileSystemReader`` (plain and +ZStandard), side by side.

    python benchmarks/load_bench.py [--mib 256,1024] [--worlds 1,2] [--reps 3] [--work DIR]
                                    [--kinds ...] [--out FILE.json] [--threads T]

For each state size (MiB **per rank**, half bf16 model weights and half fp32 optimizer-like
tensors) and each world size, every rank (``torch.multiprocessing`` spawn, gloo; one rank runs
without a process group, ``no_dist=True``) saves its state once with each configuration, then
``--reps`` times loads every configuration in a shuffled order (the same on every rank), each
load preceded by fsync + ``POSIX_FADV_DONTNEED`` of every file of that checkpoint (the page cache
is cold for every configuration alike; ``--warm`` keeps it warm for all instead). Ratios are
computed within a repetition and the median is reported.

Configurations (``--kinds``):

=============  =========================================================================
``all``        ckptstore: byte-group/zstd + XXH3 + AES-256-GCM (the default writer, a key)
``zstd``       ckptstore: byte-group/zstd + XXH3, no key
``enc``        ckptstore: ``compression="none"`` + XXH3 + AES-256-GCM
``xxh``        ckptstore: ``compression="none"`` + XXH3, no key (checksums stay on)
``dcp``        DCP ``FileSystemWriter`` / ``FileSystemReader``
``dcp-zstd``   DCP ``FileSystemWriter(_extensions=[ZStandard()])`` / ``FileSystemReader``
=============  =========================================================================

Threads: ckptstore's reader runs ``--threads`` (default its own default, cores /
``LOCAL_WORLD_SIZE`` + 1); DCP's ``FileSystemReader`` has no thread option in torch 2.13 and reads
in the calling thread. Row ``*-1t`` (``--one-thread``) loads ckptstore's ``all`` checkpoint at 1
thread for the one-thread-each comparison. Row ``all-numpy`` (``--numpy-row``) loads the same
checkpoint with the byte-group merge in numpy instead of the C module (``codec/_planes.c``), in the
same repetitions: what the one-pass merge is worth.

Per row: wall seconds (slowest rank, between barriers), GB/s of logical state (all ranks),
CPU-seconds per GB (user+sys of every rank, all threads), peak extra RSS during the load
(VmHWM reset before the load, minus the RSS before it: the state and its destination are already
resident), bit-exactness of every load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MiB = 1 << 20
GB = 1e9
KINDS = ("all", "zstd", "enc", "xxh", "dcp", "dcp-zstd")
LABELS = {
    "all": "ckptstore zstd+xxh3+AES-GCM",
    "zstd": "ckptstore zstd+xxh3, no key",
    "enc": "ckptstore none+xxh3+AES-GCM",
    "xxh": "ckptstore none+xxh3, no key",
    "all-1t": "ckptstore zstd+xxh3+AES-GCM, 1 thread",
    "all-numpy": "ckptstore zstd+xxh3+AES-GCM, numpy merge",
    "dcp": "DCP FileSystemReader",
    "dcp-zstd": "DCP FileSystemReader+ZStandard",
}


def make_state(per_rank: int, rank: int, world: int):
    """Half bf16 (LLM-shaped weights), half fp32 (the same shapes at half the count: an
    optimizer-like moment); with ``world > 1`` each tensor is a DTensor ``Shard(0)``."""
    import torch

    import bench_lib as B

    bf = B.make_state(per_rank * world // 2, world=world, rank=rank)["model"]
    g = torch.Generator().manual_seed(7 + rank)
    fp = {}
    for name, shape in B.llm_specs(per_rank * world // 4):
        shape = (shape[0] // world, *shape[1:])
        fp[name] = torch.randn(shape, generator=g, dtype=torch.float32).mul_(1e-3)
    sd = {"model": bf, "optim": {"exp_avg": fp}, "step": 1000}
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (world,))
        sd = B._map(sd, lambda v: DTensor.from_local(v, mesh, [Shard(0)], run_check=False)
                    if isinstance(v, torch.Tensor) else v)
    return sd


def writer(kind: str, path: str, threads: int):
    import bench_lib as B
    import ckptstore

    if kind == "all":
        return ckptstore.StorageWriter(path, key=B.BENCH_KEY, threads=threads)
    if kind == "zstd":
        return ckptstore.StorageWriter(path, threads=threads)
    if kind == "enc":
        return ckptstore.StorageWriter(path, key=B.BENCH_KEY, compression="none", threads=threads)
    if kind == "xxh":
        return ckptstore.StorageWriter(path, compression="none", threads=threads)
    return B.make_writer(kind, path, thread_count=threads)


def reader(kind: str, path: str, threads: int):
    import bench_lib as B
    import ckptstore

    if kind == "all-1t":
        return ckptstore.StorageReader(path, key=B.BENCH_KEY, threads=1)
    if kind in ("all", "enc", "all-numpy"):
        return ckptstore.StorageReader(path, key=B.BENCH_KEY, threads=threads)
    if kind in ("zstd", "xxh"):
        return ckptstore.StorageReader(path, threads=threads)
    return B.make_reader(kind, path)


def where(kind: str, base: str, world: int) -> tuple[str, str]:
    k = "all" if kind in ("all-1t", "all-numpy") else kind
    root = os.path.join(base, f"{k}-w{world}")
    return (root, "v1") if not k.startswith("dcp") else (root, root)


def _rank(rank: int, world: int, args: dict, out: dict) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    import bench_lib as B
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    threads = args["threads"] or B._ckpt_threads()
    nd = world == 1
    if not nd:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args["port"]))
        dist.init_process_group("gloo", rank=rank, world_size=world)

    def barrier():
        if not nd:
            dist.barrier()

    sd = make_state(args["mib"] * MiB, rank, world)
    dest = B._map(sd, lambda v: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0)
    kinds = list(args["kinds"])
    extra_rows = (["all-1t"] if args["one"] else []) + (["all-numpy"] if args["numpy"] else [])
    res = {k: {"s": [], "cpu": [], "rss_extra": [], "exact": []} for k in kinds + extra_rows}
    from ckptstore.codec import bytegroup

    native = bytegroup._native
    for k in kinds:
        root, cid = where(k, args["work"], world)
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        barrier()
        dcp.save(sd, checkpoint_id=cid, storage_writer=writer(k, root, threads), no_dist=nd)
        barrier()
    rng = random.Random(args["seed"])
    for rep in range(args["reps"]):
        order = list(res)
        rng.shuffle(order)
        for k in order:
            root, cid = where(k, args["work"], world)
            B._map(dest, lambda v: v.zero_() if isinstance(v, torch.Tensor) else v)
            if rank == 0 and not args["warm"]:
                B.evict(root)
            barrier()
            r = reader(k, root, threads)
            bytegroup._native = None if k == "all-numpy" else native
            before = B.rss()
            B.reset_hwm()
            c0 = B._cpu()
            t0 = time.perf_counter()
            dcp.load(dest, checkpoint_id=cid, storage_reader=r, no_dist=nd)
            dt = time.perf_counter() - t0
            cpu = B._cpu() - c0
            extra = B.hwm() - before
            barrier()
            wall = time.perf_counter() - t0
            ex = B.bit_exact(_local(sd), _local(dest))
            res[k]["s"].append(wall if not nd else dt)
            res[k]["cpu"].append(cpu)
            res[k]["rss_extra"].append(extra)
            res[k]["exact"].append(ex)
            del r
    out[rank] = res
    if not nd:
        dist.barrier()
        dist.destroy_process_group()


def _local(sd):
    import bench_lib as B

    return B._map(sd, lambda v: v.to_local() if hasattr(v, "to_local") else v) if isinstance(sd, dict) else sd


def _spawn_entry(rank, world, args, q):
    out = {}
    _rank(rank, world, args, out)
    q.put((rank, out[rank]))
    from ckptstore._groups import exit_process

    exit_process(0)


def run_world(world: int, args: dict) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_spawn_entry, args=(r, world, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(world):
        r, res = q.get()
        got[r] = res
    for p in procs:
        p.join()
    return got


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def summarise(world: int, mib: int, got: dict) -> list[dict]:
    kinds = list(got[0])
    reps = len(got[0][kinds[0]]["s"])
    n = mib * MiB * world
    wall = {k: [max(got[r][k]["s"][i] for r in got) for i in range(reps)] for k in kinds}
    cpu = {k: [sum(got[r][k]["cpu"][i] for r in got) for i in range(reps)] for k in kinds}
    rows = []
    for k in kinds:
        row = {
            "world": world, "mib_per_rank": mib, "kind": k, "label": LABELS[k],
            "gbps": n / med(wall[k]) / GB, "s_all": wall[k],
            "cpu_s_per_gb": med(cpu[k]) / (n / GB),
            "rss_extra_mib": max(max(got[r][k]["rss_extra"]) for r in got) / MiB,
            "exact": all(all(got[r][k]["exact"]) for r in got),
        }
        for peer in ("dcp", "dcp-zstd"):
            if peer in wall:
                row[f"x_{peer}"] = med([wp / wk for wk, wp in zip(wall[k], wall[peer])])
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| ranks | MiB/rank | configuration | GB/s | vs DCP | vs DCP+ZStd | CPU s/GB | peak extra RSS | exact |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['world']} | {r['mib_per_rank']} | {r['label']} | {r['gbps']:.2f} | {r.get('x_dcp', float('nan')):.2f}x "
                     f"| {r.get('x_dcp-zstd', float('nan')):.2f}x | {r['cpu_s_per_gb']:.2f} | {r['rss_extra_mib']:.0f} MiB "
                     f"| {'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", default="256,1024", help="state MiB per rank, comma list")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--threads", type=int, default=0, help="ckptstore reader/writer threads (default its own)")
    ap.add_argument("--one-thread", action="store_true", help="also load 'all' at 1 thread")
    ap.add_argument("--numpy-row", action="store_true", help="also load 'all' with the numpy byte-group merge")
    ap.add_argument("--warm", action="store_true", help="keep the page cache warm for every configuration")
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    os.environ.setdefault("CKPTBENCH_KEY", os.urandom(32).hex())  # one master key for every rank
    work = a.work or tempfile.mkdtemp(prefix="ckpt-loadbench-")
    os.makedirs(work, exist_ok=True)
    rows = []
    la0 = os.getloadavg()
    try:
        for mib in [int(x) for x in a.mib.split(",")]:
            for world in [int(x) for x in a.worlds.split(",")]:
                args = {"mib": mib, "reps": a.reps, "kinds": a.kinds.split(","), "threads": a.threads, "work": work,
                        "warm": a.warm, "one": a.one_thread, "numpy": a.numpy_row, "seed": a.seed, "port": 29500 + random.randrange(2000)}
                t = time.perf_counter()
                got = run_world(world, args)
                rs = summarise(world, mib, got)
                rows += rs
                print(table(rs), flush=True)
                print(f"  ({world} rank(s), {mib} MiB/rank: {time.perf_counter() - t:.0f} s; load average "
                      f"{os.getloadavg()[0]:.2f})", flush=True)
                for k in a.kinds.split(","):
                    shutil.rmtree(where(k, work, world)[0], ignore_errors=True)
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)
    la1 = os.getloadavg()
    print(table(rows))
    print(f"load average (1 min) at start {la0[0]:.2f}, at end {la1[0]:.2f}; {os.cpu_count()} cores; "
          f"page cache {'warm' if a.warm else 'evicted before every load'}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "loadavg": [la0, la1], "reps": a.reps, "warm": a.warm}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
