#!/usr/bin/env python
"""ckptstore benchmarks: one command, ratios against PyTorch DCP's own storage layer.

    python benchmarks/run.py [--quick] [--out bench-results/] [--sections 1,2,3,...]

Sections (each compares ckptstore with a peer measured in the same run, interleaved, and states
a goal that is printed as met / NOT MET):

  1  save throughput      ckptstore (zstd/byte-group + xxh3 + AES-GCM; and everything off) vs
                          DCP FileSystemWriter plain and with _extensions=[ZStandard()]
  2  load throughput      the same four, each checkpoint evicted from the page cache first;
                          loaded values checked bit-exact
  3  async_save           time blocked inside dcp.async_save vs one plain host copy of the state;
                          RSS after each of 30 consecutive async saves;
                          CheckpointManager.save blocking beside the raw async_save
  4  peak RSS             of one save, in a fresh process
  5  scaling              1/2/4 ranks (spawn + gloo, DTensor Shard(0)); simulated 64..1,024-rank
                          commit (finish(): metadata object + manifest)
  6  size ratio           per codec, on the bf16 state (and real weights from codec_ratio.py)
  7  S3                   time-to-durable and load vs s3torchconnector (needs
                          ckptstore.testing.seaweed + s3torchconnector; skipped otherwise)

Outputs in --out: results.json (every raw measurement, the goals, machine/commit info),
throughput.png, rss_async.png, rss_peak.png, codec_ratio.png, scaling.png, profiles/ (py-spy
raw stacks of goals not met). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
if "--torch-threads" in sys.argv[:-1]:  # must be known before bench_lib imports torch
    os.environ["CKPTBENCH_TORCH_THREADS"] = sys.argv[sys.argv.index("--torch-threads") + 1]

import bench_lib as B  # noqa: E402  (imports torch, sets the shared benchmark key)
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

MiB = B.MiB


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def fmt_x(r: float, goal: float) -> str:
    """A ratio with 2 decimals, or 3 when 2 would round onto the goal's threshold."""
    return f"{r:.3f}x" if abs(r - goal) < 0.005 else f"{r:.2f}x"


def fmt_s(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


class Run:
    """Holds the options, the state, the raw results and the goal rows of one benchmark run."""

    def __init__(self, args):
        self.args = args
        self.quick = args.quick
        self.out = os.path.abspath(args.out)
        os.makedirs(self.out, exist_ok=True)
        self.work = tempfile.mkdtemp(prefix="ckptbench-", dir=args.work)
        self.mib = args.mib or (128 if self.quick else 512)
        self.reps = args.reps or (3 if self.quick else 5)
        self.rng = random.Random(args.seed)
        self.results: dict[str, Any] = {}
        self.rows: list[dict] = []
        self.sd: dict | None = None
        self.n = 0

    # one row of the final table; met: True / False / None (information only)
    def row(self, rid, what, ckpt, peer, ratio, goal, met, section, **extra):
        r = {"id": rid, "what": what, "ckptstore": ckpt, "peer": peer, "ratio": ratio, "goal": goal, "met": met, "section": section}
        r.update(extra)
        self.rows.append(r)
        status = {True: "met", False: "NOT MET", None: ""}[met]
        print(f"    [{rid}] {what}: {ckpt} | {peer} | {ratio} {goal} {status}", flush=True)
        return r

    def state(self):
        if self.sd is None:
            t0 = time.perf_counter()
            self.sd = B.make_state(self.mib * MiB)
            self.n = B.state_bytes(self.sd)
            print(f"  state: {self.n / MiB:.0f} MiB bf16 in {len(B.tensors(self.sd))} "
                  f"tensors ({time.perf_counter() - t0:.1f} s to build)", flush=True)
        return self.sd


# -------------------------------------------------------------------------------------------------
# 1 + 2: save and load throughput
# -------------------------------------------------------------------------------------------------
def sec_save_load(run: Run) -> None:
    sd = run.state()
    n = run.n
    kinds = list(B.KINDS)
    per = {k: {"save_s": [], "save_cpu": [], "load_s": [], "load_cpu": [], "stored": [], "exact": []} for k in kinds}
    # DCP's FileSystemReader has no thread option: the like-for-like load is ckptstore at 1 thread
    one = {"load_s": [], "load_cpu": [], "exact": []}
    dest = B.empty_like_state(sd)
    for rep in range(run.reps):
        order = kinds[:]
        run.rng.shuffle(order)
        saved = {}
        for k in order:
            r = B.save_once(k, sd, run.work, f"r{rep}")
            saved[k] = r
            per[k]["save_s"].append(r["seconds"])
            per[k]["save_cpu"].append(r["cpu"])
            per[k]["stored"].append(r["stored"])
        run.rng.shuffle(order)
        for k in order:
            B.zero_(dest)
            r = B.load_once(k, saved[k]["root"], saved[k]["cid"], dest)
            per[k]["load_s"].append(r["seconds"])
            per[k]["load_cpu"].append(r["cpu"])
            per[k]["exact"].append(B.bit_exact(sd, dest))
        B.zero_(dest)
        r = B.load_once("ckpt-on", saved["ckpt-on"]["root"], saved["ckpt-on"]["cid"], dest, threads=1)
        one["load_s"].append(r["seconds"])
        one["load_cpu"].append(r["cpu"])
        one["exact"].append(B.bit_exact(sd, dest))
        for r in saved.values():
            shutil.rmtree(r["root"], ignore_errors=True)
        print(f"  rep {rep + 1}/{run.reps}: " + ", ".join(
            f"{k} save {n / per[k]['save_s'][-1] / B.GB:.2f} load {n / per[k]['load_s'][-1] / B.GB:.2f} GB/s" for k in kinds), flush=True)
    summary = {}
    for k in kinds:
        p = per[k]
        summary[k] = {
            "label": B.LABELS[k],
            "save_gbps": n / med(p["save_s"]) / B.GB, "load_gbps": n / med(p["load_s"]) / B.GB,
            "save_gbps_all": [n / s / B.GB for s in p["save_s"]], "load_gbps_all": [n / s / B.GB for s in p["load_s"]],
            "save_cpu_s_per_gb": med(p["save_cpu"]) / (n / B.GB), "load_cpu_s_per_gb": med(p["load_cpu"]) / (n / B.GB),
            "stored_ratio": med(p["stored"]) / n, "bit_exact": all(p["exact"]), **p,
        }
    run.results["save_load"] = {"state_bytes": n, "reps": run.reps, "per_kind": summary, "threads": B.THREADS,
                                "ckpt_on_load_1_thread": one,
                                "page_cache": "evicted (fsync + POSIX_FADV_DONTNEED on every file) before each load; "
                                              "os.sync() before each save; both writers fsync (ckptstore always, "
                                              "FileSystemWriter sync_files=True default)"}

    def ratio(op, a, b):  # median over reps of a's throughput / b's, measured in the same rep
        return med([sb / sa for sa, sb in zip(per[a][op], per[b][op])])

    def gb(k, op):
        return f"{summary[k][op + '_gbps']:.2f} GB/s"

    T = B.THREADS
    thr = {"save": f"{T} threads each (DCP thread_count={T})",
           "load": f"ckptstore {T} threads; DCP FileSystemReader 1 (no thread option)"}
    for op, sec, lo in (("save", "1", "save"), ("load", "2", "load")):
        s_ = op + "_s"
        r1 = ratio(s_, "ckpt-on", "dcp-zstd")
        r2 = ratio(s_, "ckpt-on", "dcp")
        r3 = ratio(s_, "ckpt-off", "dcp")
        g2 = 0.9 if op == "load" else 0.8
        run.row(f"{sec}a", f"{lo}: ckptstore on vs DCP+ZStandard, {thr[op]}", gb("ckpt-on", op), gb("dcp-zstd", op) + " DCP+ZStd",
                fmt_x(r1, 2.0), ">= 2.00x", r1 >= 2.0, sec)
        run.row(f"{sec}b", f"{lo}: ckptstore on vs DCP plain, {thr[op]}", gb("ckpt-on", op), gb("dcp", op) + " DCP",
                fmt_x(r2, g2), f">= {g2:.2f}x", r2 >= g2, sec)
        run.row(f"{sec}c", f"{lo}: ckptstore off vs DCP plain", gb("ckpt-off", op), gb("dcp", op) + " DCP",
                f"{r3:.2f}x", "(info)", None, sec)
        cpu = {k: summary[k][op + "_cpu_s_per_gb"] for k in kinds}
        run.row(f"{sec}{'d' if op == 'save' else 'e'}", f"{lo}: CPU-seconds per GB (all threads), on vs DCP+ZStandard",
                f"{cpu['ckpt-on']:.2f} s/GB", f"{cpu['dcp-zstd']:.2f} s/GB DCP+ZStd, {cpu['dcp']:.2f} DCP",
                f"{cpu['ckpt-on'] / cpu['dcp-zstd']:.2f}x", "(info)", None, sec)
        summary["ratios_" + op] = {"on/dcp-zstd": r1, "on/dcp": r2, "off/dcp": r3}
    r1t = med([sb / sa for sa, sb in zip(one["load_s"], per["dcp"]["load_s"])])
    run.row("2f", "load: ckptstore on at 1 thread vs DCP plain (1 thread each); a ckptstore load also checks XXH3 "
            "of every frame, AES-GCM-decrypts, undoes byte-grouping + zstd", f"{n / med(one['load_s']) / B.GB:.2f} GB/s",
            gb("dcp", "load") + " DCP", f"{r1t:.2f}x", "(info)", None, "2")
    ok = all(summary[k]["bit_exact"] for k in kinds) and all(one["exact"])
    run.row("2d", "load: values bit-exact (all kinds, all reps)", "yes" if summary["ckpt-on"]["bit_exact"] else "NO",
            "yes" if all(summary[k]["bit_exact"] for k in ("dcp", "dcp-zstd")) else "NO", "", "exact", ok, "2")


# -------------------------------------------------------------------------------------------------
# 3: async_save blocking time and RSS over consecutive saves
# -------------------------------------------------------------------------------------------------
def _async_result(fut):
    f = getattr(fut, "upload_completion", fut)
    return f.result()


def sec_async(run: Run) -> None:
    import ckptstore
    from ckptstore.manifest import layout

    sd = run.state()
    n = run.n
    tensors = B.tensors(sd)
    N = run.args.async_saves
    root = os.path.join(run.work, "async-ckpt")
    shutil.rmtree(root, ignore_errors=True)
    writer = ckptstore.StorageWriter(root, key=B.BENCH_KEY)
    prealloc = {k: torch.empty_like(v) for k, v in tensors.items()}
    for k, v in tensors.items():  # fault the buffers in: a steady-state copy, not a first touch
        prealloc[k].copy_(v)
    clone_s, pre_s, block_s, rss_mib, save_s = [], [], [], [], []
    gc.collect()
    rss0 = B.rss()
    for i in range(N):
        t0 = time.perf_counter()
        c = {k: v.clone() for k, v in tensors.items()}
        clone_s.append(time.perf_counter() - t0)
        del c
        t0 = time.perf_counter()
        for k, v in tensors.items():
            prealloc[k].copy_(v)
        pre_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=f"a{i}", storage_writer=writer, no_dist=True)
        block_s.append(time.perf_counter() - t0)
        _async_result(fut)
        save_s.append(time.perf_counter() - t0)
        rss_mib.append(B.rss() / MiB)
        if i:
            shutil.rmtree(os.path.join(root, layout.version_dir(f"a{i - 1}")), ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    # the peer: DCP FileSystemWriter is its own (BlockingAsyncStager) stager: a fresh CPU copy per save
    M = run.args.peer_async_saves
    p_block, p_rss = [], []
    for i in range(M):
        path = os.path.join(run.work, f"async-dcp-{i}")
        w = B.make_writer("dcp", path)
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=path, storage_writer=w, no_dist=True)
        p_block.append(time.perf_counter() - t0)
        _async_result(fut)
        p_rss.append(B.rss() / MiB)
        shutil.rmtree(path, ignore_errors=True)
    # the training-loop API on the same state: CheckpointManager.save (its own queue and staging),
    # each save waited for before the next, as in the raw loop above
    mroot = os.path.join(run.work, "async-mgr")
    shutil.rmtree(mroot, ignore_errors=True)
    mgr = ckptstore.CheckpointManager(mroot, key=B.BENCH_KEY, interval_steps=1, save_rng=False)
    m_block = []
    try:
        for i in range(N):
            t0 = time.perf_counter()
            mgr.save(i + 1, sd)
            m_block.append(time.perf_counter() - t0)
            mgr.wait()
            if i:
                shutil.rmtree(os.path.join(mroot, layout.version_dir(mgr.version_name(i))), ignore_errors=True)
    finally:
        mgr.close()
        shutil.rmtree(mroot, ignore_errors=True)
    steady = [b / p for b, p in zip(block_s[1:], pre_s[1:])]
    r_pre = med(steady)
    r_clone = med([b / c for b, c in zip(block_s[1:], clone_s[1:])])
    growth = rss_mib[-1] - rss_mib[1] if N > 2 else float("nan")
    xs = list(range(2, N + 1))
    ys = rss_mib[1:]
    slope = _slope(xs, ys)
    # leak test: the peak of the second half of saves 2..N against the peak of the first half. Freed
    # encoder buffers stay in per-thread malloc arenas, so RSS oscillates up to a plateau in the
    # first saves; a leak keeps raising the peak, a plateau does not.
    half = len(ys) // 2
    plateau = max(ys[half:]) - max(ys[:half]) if len(ys) >= 2 else float("nan")
    limit = 32.0
    run.results["async"] = {
        "saves": N, "block_s": block_s, "clone_s": clone_s, "prealloc_copy_s": pre_s, "save_total_s": save_s,
        "rss_mib": rss_mib, "rss_before_mib": rss0 / MiB, "growth_2_to_N_mib": growth, "slope_mib_per_save": slope,
        "peak_growth_mib": plateau,
        "ratio_block_vs_prealloc": r_pre, "ratio_block_vs_clone": r_clone,
        "first_block_s": block_s[0], "last_reused_bytes": writer._stager.last_reused,
        "peer": {"label": "DCP FileSystemWriter (BlockingAsyncStager)", "block_s": p_block, "rss_mib": p_rss},
        "manager_block_s": m_block,
    }
    run.row("3a", "async_save blocking vs copy into preallocated buffers (saves 2..N)", fmt_s(med(block_s[1:])),
            f"{fmt_s(med(pre_s))} copy_; DCP async_save {fmt_s(med(p_block))}", fmt_x(r_pre, 1.2), "<= 1.20x", r_pre <= 1.2, "3")
    run.row("3b", "async_save blocking vs {k: v.clone()} (saves 2..N)", fmt_s(med(block_s[1:])), f"{fmt_s(med(clone_s))} clone",
            f"{r_clone:.2f}x", "(info)", None, "3")
    run.row("3c", "first async_save (allocates its buffers) vs clone", fmt_s(block_s[0]), f"{fmt_s(clone_s[0])} clone",
            f"{block_s[0] / clone_s[0]:.2f}x", "(info)", None, "3")
    r_mgr = med(m_block[1:]) / med(block_s[1:]) if N > 1 else float("nan")
    run.row("3e", "CheckpointManager.save blocking vs raw dcp.async_save, same writer options (saves 2..N)",
            fmt_s(med(m_block[1:])), f"raw async_save {fmt_s(med(block_s[1:]))}", f"{r_mgr:.2f}x", "(info)", None, "3")
    k = 1 + half
    run.row("3d", f"RSS over {N} async saves: peak of saves {k + 1}-{N} minus peak of 2-{k}",
            f"{plateau:+.1f} MiB (last-second {growth:+.0f})",
            f"DCP {max(p_rss[1:]) - p_rss[1]:+.1f} MiB over saves 2-{M}" if M > 2 else "", "", f"<= {limit:.0f} MiB",
            plateau <= limit, "3")


def _slope(xs, ys):
    if len(xs) < 2:
        return float("nan")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")


# -------------------------------------------------------------------------------------------------
# 4: peak RSS of one save, each kind in a fresh process
# -------------------------------------------------------------------------------------------------
def _subprocess_json(argv: list, timeout: float) -> dict:
    p = subprocess.run([sys.executable, os.path.join(HERE, "bench_lib.py"), *argv], capture_output=True, text=True,
                       timeout=timeout, env=dict(os.environ))
    if p.returncode != 0:
        raise RuntimeError(f"bench_lib.py {' '.join(argv)} failed:\n{p.stderr[-3000:]}")
    return json.loads(next(line for line in reversed(p.stdout.splitlines()) if line.startswith("{")))


def sec_peak(run: Run) -> None:
    out = {}
    for k in (("ckpt-on", "dcp") if run.quick else B.KINDS):
        out[k] = _subprocess_json(["peak", k, str(run.mib), run.work], 300)
        r = out[k]
        print(f"  {k}: baseline {r['baseline_rss'] / MiB:.0f} MiB, with state {r['rss_with_state'] / MiB:.0f} MiB, "
              f"peak {r['peak_rss'] / MiB:.0f} MiB (sampled {r['peak_sampled'] / MiB:.0f}, VmHWM {r['vmhwm'] / MiB:.0f})", flush=True)
    run.results["peak_rss"] = out
    c = out["ckpt-on"]
    state = c["state_bytes"]
    limit = state * 1.1 + 256 * MiB
    used = c["peak_rss"] - c["baseline_rss"]
    extra = c["peak_rss"] - c["rss_with_state"]
    peers = ", ".join(f"{lbl} +{(out[k]['peak_rss'] - out[k]['rss_with_state']) / MiB:.0f}"
                      for k, lbl in (("dcp", "DCP"), ("dcp-zstd", "DCP+ZStd"), ("ckpt-off", "off")) if k in out)
    run.row("4", "peak RSS of a save minus runtime baseline (state + save overhead)",
            f"{used / MiB:.0f} MiB (save adds {extra / MiB:.0f})", f"save adds MiB: {peers}",
            f"{used / limit:.2f} of limit", f"<= 1.1 x state + 256 MiB = {limit / MiB:.0f} MiB", used <= limit, "4",
            absolute_peak_mib=c["peak_rss"] / MiB, baseline_mib=c["baseline_rss"] / MiB)


# -------------------------------------------------------------------------------------------------
# 5: scaling over ranks, and the simulated 1,024-rank commit
# -------------------------------------------------------------------------------------------------
def sec_scaling(run: Run) -> None:
    from ckptstore.testing.dist import run_ranks

    total = (run.mib // 2) * MiB if not run.quick else 64 * MiB
    worlds = [int(w) for w in run.args.worlds.split(",")]
    kinds = ["ckpt-on", "dcp"]
    reps = 1 if run.quick else 2
    res = {}
    for w in worlds:
        t0 = time.perf_counter()
        per_rank = run_ranks(B.rank_save, w, total, run.work, kinds, reps, timeout=600)
        times = {k: [max(pr[k][i] for pr in per_rank) for i in range(reps)] for k in kinds}
        res[w] = {k: {"seconds": times[k], "s_per_gb": med(times[k]) / (total / B.GB)} for k in kinds}
        print(f"  {w} rank(s): " + ", ".join(f"{k} {res[w][k]['s_per_gb']:.2f} s/GB" for k in kinds)
              + f"  ({time.perf_counter() - t0:.0f} s incl. spawn)", flush=True)
    run.results["scaling"] = {"total_bytes": total, "cpus": os.cpu_count(), "threads_per_rank": _threads(), "worlds": res}
    base = res[worlds[0]]
    for w in worlds[1:]:
        c = res[w]["ckpt-on"]["s_per_gb"]
        d = res[w]["dcp"]["s_per_gb"]
        run.row(f"5a.{w}", f"save time per GB, {w} ranks vs 1 (ckptstore on; {os.cpu_count()} cores)",
                f"{c:.2f} s/GB ({base['ckpt-on']['s_per_gb'] / c:.2f}x of 1-rank speed)",
                f"DCP {d:.2f} s/GB ({base['dcp']['s_per_gb'] / d:.2f}x)", f"{c / d:.2f}x DCP's time", "(info)", None, "5")

    # simulated commit
    # (tensors per rank, simulated rank counts); --quick skips the costly 291-tensor layout (~1 min)
    plan = [(16, (64, 256, 1024))] + ([] if run.quick else [(291, (256, 1024))])
    fin = []
    for items, sizes in plan:
        for r in sizes:
            for k in ("ckpt-on", "dcp"):
                # the small layout is cheap: median of 3 (interleaved with the peer); the big one once
                runs = [B.synthetic_finish(r, items, run.work, k) for _ in range(3 if items == 16 else 1)]
                f = dict(runs[0], seconds=med([x["seconds"] for x in runs]), seconds_all=[x["seconds"] for x in runs])
                fin.append(f)
                print(f"  finish {k} {r} ranks x {items} tensors: {fmt_s(f['seconds'])}, manifest {f['manifest_bytes'] / 1024:.0f} KiB, "
                      f"metadata {f['metadata_bytes'] / 1024:.0f} KiB", flush=True)
    run.results["finish"] = fin

    def get(k, r, items):
        return next(f for f in fin if f["kind"] == k and f["ranks"] == r and f["items_per_rank"] == items)

    for items, tag in ((16, "5b"), (291, "5c")):
        if run.quick and items == 291:
            run.row(tag, "commit (finish) at 1,024 ranks x 291 tensors/rank", "skipped in --quick", "", "", "< 1 s", None, "5")
            continue
        c, d = get("ckpt-on", 1024, items), get("dcp", 1024, items)
        what = (f"commit (finish) at 1,024 ranks x {items} tensors/rank"
                + (" (Llama-7B-like FSDP layout)" if items == 291 else ""))
        run.row(tag, what, fmt_s(c["seconds"]), f"DCP finish {fmt_s(d['seconds'])}", f"{c['seconds'] / d['seconds']:.2f}x DCP",
                "< 1 s", c["seconds"] < 1.0, "5")
    m64, m1024 = get("ckpt-on", 64, 16), get("ckpt-on", 1024, 16)
    per64, per1024 = m64["manifest_bytes"] / 64, m1024["manifest_bytes"] / 1024
    lin = per1024 / per64
    run.row("5d", "manifest bytes per rank, 1,024 vs 64 ranks (linear = 1.0)", f"{per1024:.0f} B/rank",
            f"{per64:.0f} B/rank at 64", f"{lin:.2f}x", "0.9 .. 1.1x", 0.9 <= lin <= 1.1, "5")
    t_lin = get("ckpt-on", 1024, 16)["seconds"] / get("ckpt-on", 256, 16)["seconds"]
    run.row("5e", "finish time 1,024 vs 256 ranks (16 tensors/rank; linear = 4x)", fmt_s(get("ckpt-on", 1024, 16)["seconds"]),
            fmt_s(get("ckpt-on", 256, 16)["seconds"]) + " at 256", f"{t_lin:.2f}x", "(info)", None, "5")


def _threads() -> int:
    from ckptstore.codec.stages import env_threads

    return env_threads()


# -------------------------------------------------------------------------------------------------
# 6: size ratio per codec
# -------------------------------------------------------------------------------------------------
def sec_codecs(run: Run) -> None:
    sd = run.state()
    tensors = list(B.tensors(sd).values())
    sample = run.args.codec_sample_mib * MiB
    table = B.codec_table(tensors, sample)
    res = {"bf16_state": table}
    print("  bf16 state (" + ", ".join(f"{r['codec']} {r['ratio']:.3f}" for r in table) + ")", flush=True)
    real, why = B.real_weights()
    if real is None:
        print(f"  real weights: skipped ({why})", flush=True)
        res["real_weights"] = {"skipped": why}
    else:
        name, rtensors = real
        t = B.codec_table(rtensors, sample)
        res["real_weights"] = {"source": name, "table": t}
        print(f"  {name} (" + ", ".join(f"{r['codec']} {r['ratio']:.3f}" for r in t) + ")", flush=True)
    sl = run.results.get("save_load", {}).get("per_kind")
    if sl:
        res["stored_full_state"] = {k: sl[k]["stored_ratio"] for k in B.KINDS}
    run.results["codecs"] = res
    by = {r["codec"]: r for r in table}
    ck = by.get("ckptstore auto+AES-GCM")
    zs = by.get("zstd-3 (DCP ZStandard)")
    if sl:
        a, b = sl["ckpt-on"]["stored_ratio"], sl["dcp-zstd"]["stored_ratio"]
        src = "whole saved state (du)"
    else:
        a, b = ck["ratio"], zs["ratio"]
        src = "sample"
    run.row("6a", f"stored/logical size, bf16 state ({src})", f"{a:.3f}", f"{b:.3f} DCP+ZStd", f"{a / b:.2f}x",
            "<= 1.00x", a <= b, "6")
    for i, r in enumerate(table, 1):
        run.row(f"6c{i}", f"codec {r['codec']}: ratio; 1-thread enc / dec", f"{r['ratio']:.3f}",
                f"{r['enc_gbps']:.2f} / {r['dec_gbps']:.2f} GB/s", "", "(info)", None, "6")
    if real is not None:
        rb = {r["codec"]: r for r in res["real_weights"]["table"]}
        a, b = rb["ckptstore auto+AES-GCM"]["ratio"], rb["zstd-3 (DCP ZStandard)"]["ratio"]
        run.row("6b", f"stored/logical size, {res['real_weights']['source']}", f"{a:.3f}", f"{b:.3f} zstd-3",
                f"{a / b:.2f}x", "<= 1.00x", a <= b, "6")


# -------------------------------------------------------------------------------------------------
# 7: S3 (enabled once ckptstore.testing.seaweed and the remote tier exist)
# -------------------------------------------------------------------------------------------------
def sec_s3(run: Run) -> None:
    import s3_bench

    res = s3_bench.run_section(run, B)
    run.results["s3"] = res
    if res.get("skipped"):
        print(f"  skipped: {res['skipped']}", flush=True)
        run.row("7", "S3: time-to-durable and load vs s3torchconnector", "skipped", "", "", res["skipped"][:60], None, "7")


# -------------------------------------------------------------------------------------------------
# profiles of goals not met
# -------------------------------------------------------------------------------------------------
def profile_unmet(run: Run) -> None:
    import bench_profile as P

    unmet = {r["section"] for r in run.rows if r["met"] is False}
    prof_dir = os.path.join(run.out, "profiles")
    os.makedirs(prof_dir, exist_ok=True)
    out = {}
    mib = min(run.mib, 256)
    reps = "2" if run.quick else "3"
    lib = [sys.executable, os.path.join(HERE, "bench_lib.py")]
    jobs = []
    if "1" in unmet:
        jobs.append(("save", ["work", "save", "ckpt-on", str(mib), run.work, reps]))
    if "2" in unmet:
        jobs.append(("load", ["work", "load", "ckpt-on", str(mib), run.work, reps]))
    for name, argv in jobs:
        print(f"\n  profiling ckptstore {name} ({mib} MiB x {reps}, after a warm-up) ...", flush=True)
        if name == "load":  # the checkpoint comes from another process, so only loading is sampled
            _subprocess_json(["work", "prep-load", "ckpt-on", str(mib), run.work, "1"], 600)
        out[name] = P.profile_subprocess(name, [*lib, *argv], prof_dir, gil=not (run.args.no_gil_profile or run.quick))
        print(P.render(out[name]), flush=True)
    if "3" in unmet and run.results.get("async", {}).get("ratio_block_vs_prealloc", 0) > 1.2:
        print("\n  profiling the dcp.async_save call (main thread, cProfile) ...", flush=True)
        out["async_save"] = P.cprofile_region(lambda prof: _async_once(run, prof), prof_dir, "async_save")
        print(P.render(out["async_save"]), flush=True)
    if "5" in unmet and any(r["id"] in ("5b", "5c") and r["met"] is False for r in run.rows):
        print(f"\n  profiling finish() at {256 if run.quick else 1024} ranks x 291 tensors (cProfile) ...", flush=True)
        out["finish"] = P.cprofile_region(lambda prof: _finish_profiled(run, prof), prof_dir, "finish")
        print(P.render(out["finish"]), flush=True)
    if {"3", "4"} & unmet and not out.get("async_save"):
        out["memory_note"] = "RSS goals are not CPU profiles: see rss_async.png / rss_peak.png and results.json timelines"
    run.results["profiles"] = out


def _async_once(run: Run, prof) -> None:
    """Three async saves; the profiler runs only inside the dcp.async_save calls 2 and 3."""
    import ckptstore

    root = os.path.join(run.work, "async-prof")
    shutil.rmtree(root, ignore_errors=True)
    w = ckptstore.StorageWriter(root, key=B.BENCH_KEY)
    for i in range(3):
        if i:
            prof.enable()
        fut = dcp.async_save(run.state(), checkpoint_id=f"p{i}", storage_writer=w, no_dist=True)
        prof.disable()
        _async_result(fut)
    shutil.rmtree(root, ignore_errors=True)


def _finish_profiled(run: Run, prof) -> None:
    """The synthetic 1,024-rank commit with the profiler on inside StorageWriter.finish only."""
    from ckptstore.dcp import writer as wmod

    orig = wmod.StorageWriter.finish

    def finish(self, *a, **k):
        prof.enable()
        try:
            return orig(self, *a, **k)
        finally:
            prof.disable()

    wmod.StorageWriter.finish = finish
    try:
        B.synthetic_finish(256 if run.quick else 1024, 291, run.work, "ckpt-on")
    finally:
        wmod.StorageWriter.finish = orig


# -------------------------------------------------------------------------------------------------
# report
# -------------------------------------------------------------------------------------------------
def print_table(run: Run) -> str:
    cols = [("#", "id"), ("comparison", "what"), ("ckptstore", "ckptstore"), ("peer (absolute)", "peer"),
            ("ratio", "ratio"), ("goal", "goal"), ("", "met")]
    rows = []
    for r in run.rows:
        rows.append([str(r[k]) if k != "met" else {True: "met", False: "NOT MET", None: ""}[r[k]] for _h, k in cols])
    widths = [max(len(h), *(len(x[i]) for x in rows)) if rows else len(h) for i, (h, _k) in enumerate(cols)]
    caps = [5, 62, 34, 44, 16, 30, 7]
    widths = [min(w, c) for w, c in zip(widths, caps)]
    line = lambda cells: " ".join(c[:w].ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [line([h for h, _k in cols]), " ".join("-" * w for w in widths)]
    out += [line(x) for x in rows]
    met = sum(r["met"] is True for r in run.rows)
    total = sum(r["met"] is not None for r in run.rows)
    out.append(f"\ngoals met: {met}/{total}")
    return "\n".join(out)


def meta(run: Run) -> dict:
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:
            return ""

    import ckptstore

    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": "quick" if run.quick else "full", "state_mib": run.mib, "reps": run.reps,
        "python": platform.python_version(), "torch": torch.__version__, "ckptstore": ckptstore.__version__,
        "cpus": os.cpu_count(), "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "ckptstore_path": os.path.dirname(ckptstore.__file__),
        "ckptstore_threads": _threads(), "torch_threads": B.TORCH_THREADS, "git_head": git("rev-parse", "--short", "HEAD"),
        "ckptstore_uncommitted": git("status", "--porcelain", "--", "ckptstore").splitlines(),
        "work_dir": run.work, "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "note": "ratios are medians over repetitions interleaved in one run; absolute figures are this machine's, this run's",
    }


SECTIONS: dict[str, tuple[str, Callable]] = {
    "1": ("save + load throughput (sections 1 and 2)", sec_save_load),
    "3": ("async_save blocking time and RSS", sec_async),
    "4": ("peak RSS of one save", sec_peak),
    "5": ("scaling over ranks and the simulated 1,024-rank commit", sec_scaling),
    "6": ("size ratio per codec", sec_codecs),
    "7": ("S3 vs s3torchconnector", sec_s3),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See benchmarks/README.md for what each section measures and how.")
    ap.add_argument("--quick", action="store_true", help="128 MiB state, fewer repetitions (< 3 min)")
    ap.add_argument("--out", default="bench-results", help="output directory (default bench-results/)")
    ap.add_argument("--sections", default="1,3,4,5,6,7", help="comma list of sections (2 runs with 1); default all")
    ap.add_argument("--mib", type=int, default=0, help="state size in MiB (default 512, --quick 128)")
    ap.add_argument("--reps", type=int, default=0, help="repetitions of each save/load (default 5, --quick 3)")
    ap.add_argument("--async-saves", type=int, default=30, help="consecutive async saves for the RSS series")
    ap.add_argument("--peer-async-saves", type=int, default=0, help="DCP async saves (default 10, --quick 5)")
    ap.add_argument("--worlds", default="1,2,4", help="rank counts for the scaling run")
    ap.add_argument("--codec-sample-mib", type=int, default=0, help="bytes per codec measurement (default 64, quick 32)")
    ap.add_argument("--work", default=None, help="scratch directory for checkpoints (default: a temp dir)")
    ap.add_argument("--no-profile", action="store_true", help="do not profile goals that are not met")
    ap.add_argument("--no-gil-profile", action="store_true", help="skip the py-spy --gil pass")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads for every configuration (default 1; see README)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.peer_async_saves = args.peer_async_saves or (5 if args.quick else 10)
    args.codec_sample_mib = args.codec_sample_mib or (32 if args.quick else 64)
    run = Run(args)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    wanted = ["1" if s == "2" else s for s in wanted]
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    print(f"ckptstore benchmarks ({'quick' if run.quick else 'full'}): state {run.mib} MiB bf16, {run.reps} reps, "
          f"{os.cpu_count()} cores, ckptstore threads {_threads()}, torch threads {B.TORCH_THREADS}, work dir {run.work}", flush=True)
    errors = {}
    timings = {}
    try:
        for sid, (title, fn) in SECTIONS.items():
            if sid not in wanted:
                continue
            print(f"\n== {sid}: {title}", flush=True)
            t0 = time.perf_counter()
            try:
                fn(run)
            except Exception as e:  # one broken section must not lose the others
                errors[sid] = traceback.format_exc()
                print(f"  section {sid} FAILED: {e!r}\n{errors[sid]}", flush=True)
                run.row(sid, f"{title}: FAILED", repr(e)[:60], "", "", "", False, sid)
            timings[sid] = time.perf_counter() - t0
            print(f"  ({timings[sid]:.0f} s)", flush=True)
        if not args.no_profile and any(r["met"] is False for r in run.rows):
            print("\n== profiles of goals not met", flush=True)
            t0 = time.perf_counter()
            try:
                profile_unmet(run)
            except Exception as e:
                errors["profile"] = traceback.format_exc()
                print(f"  profiling FAILED: {e!r}\n{errors['profile']}", flush=True)
            timings["profile"] = time.perf_counter() - t0
    finally:
        shutil.rmtree(run.work, ignore_errors=True)
    table = print_table(run)
    print("\n" + "=" * 100)
    print(f"ckptstore vs DCP — {'quick' if run.quick else 'full'} run, state {run.n / MiB:.0f} MiB bf16, "
          f"{run.reps} interleaved reps (medians), {os.cpu_count()} cores")
    print("=" * 100)
    print(table)
    run.results["meta"] = meta(run)
    load1 = os.getloadavg()
    run.results["meta"]["loadavg_start_end"] = [load0, load1]
    if max(load0[0], load1[0]) > (os.cpu_count() or 1):
        print(f"\nWARNING: the machine was busy (1-min load average {load0[0]:.1f} at start, {load1[0]:.1f} at end, "
              f"{os.cpu_count()} cores): multi-threaded configurations are penalised; rerun when it is quiet")
    run.results["meta"]["seconds"] = {**timings, "total": time.perf_counter() - t_start}
    run.results["goals"] = run.rows
    run.results["errors"] = errors
    run.results["table"] = table
    with open(os.path.join(run.out, "results.json"), "w") as f:
        json.dump(run.results, f, indent=1, default=_json_default)
    try:
        import bench_plots

        made = bench_plots.make_all(run.results, run.out)
        print(f"\nplots: {', '.join(made)}")
    except Exception as e:
        print(f"\nplots FAILED: {e!r}")
        traceback.print_exc()
    print(f"results: {os.path.join(run.out, 'results.json')}  (total {time.perf_counter() - t_start:.0f} s)")
    return 1 if errors else 0


def _json_default(o):
    if isinstance(o, float) and o != o:
        return None
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


if __name__ == "__main__":
    sys.exit(main())
