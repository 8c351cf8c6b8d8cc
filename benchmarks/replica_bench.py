"""What peer replicas cost and save (``StorageWriter(replicas=F)``, docs/FORMAT.md "Replicas").

    python benchmarks/replica_bench.py [--quick] [--mib 256] [--ranks 4] [--per-node 2] [--reps 3] [--out DIR]

Real gloo ranks (``ckptstore.testing.dist.run_ranks``, spawned), ``--ranks`` of them on
``--ranks / --per-node`` simulated nodes: the ranks of node k share the local root ``node<k>`` (a
node-local disk), and one loopback SeaweedFS (``ckptstore.testing.seaweed.SeaweedServer``) is the
remote tier of every configuration. Encrypted (one random master key per run). Ratios are measured
within one run; each repetition runs the configurations it compares in a shuffled order.

* **(a) restoring a replaced node**: the sharded ``--mib`` state (bf16 DTensors ``Shard(0)``) is
  saved once with ``replicas=1`` (store A) and once with ``replicas=0`` (store B), both with
  ``durability="remote"`` (uploaded and, for A, replicated before the save returns). Node 1's root is
  then wiped in both (an empty directory: a new machine). Each repetition loads the newest version
  (``dcp.load`` through ``StorageReader(root, remote=...)``) from A — node 1's ranks get their part
  from node 0's replicas through the peer fetch, no S3 request — and from B — node 1's ranks read it
  from S3. Time: the collective load, barrier to barrier (the slowest rank), page cache of the roots
  and of SeaweedFS's data evicted before each. Every load is checked bit-exact and its read counters
  (``reader.stats``: ``remote_reads`` = S3 GETs, ``peer_bytes``) are summed over the ranks. A third
  configuration, interleaved with the two, loads A with node 1's root put back (every rank from its
  own root): the "extra" row is each restore's time minus that one, i.e. what getting node 1's part
  from elsewhere costs. On loopback S3 has no network cost (SeaweedFS shares the cores), so a fourth
  configuration loads B through ``benchmarks/link_proxy.py`` limiting the S3 downloads to
  ``--link-rate`` bytes/s (100 MB/s: one node's share of an S3 link); the peer copies stay on
  loopback gloo (in a cluster: the inter-node network, usually much faster than a node's S3 share).
* **(b) training while copies run**: a step loop on every rank — ``--matmuls`` fp32 matmuls of
  ``--dim`` on one thread, then an ``all_reduce`` of a ``--grad-mib`` gradient (the job's gloo group) —
  with ``CheckpointManager(..., interval_steps=--every, durability="local", replicas=F)`` saving the
  ``--step-mib`` state every ``--every`` steps, F = 1 and F = 0 in the same job. ``durability="local"``:
  the save returns at staging, the local write and (F = 1) the copies to the other node run in the
  background. Reported: the mean step time (the step's compute and all-reduce, not the time blocked in
  ``mgr.save``) over the steps during which this rank's replica exchange ran (F = 1), against the same
  step numbers of the F = 0 loop (where only the local write runs then); the mean over every step
  after the first save; and (info) the time blocked in ``mgr.save``, a loop without saves, and how
  long each exchange took.
* **(c) bytes on disk per node**: every file under each node's root after the saves of (a), F = 1
  (store A) against F = 0 (store B).

Prints a table and writes ``replica_bench.json`` into ``--out``. Exit status 1 when a load was not
bit-exact or a replica restore made an S3 GET.
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
sys.path.insert(0, HERE)  # bench_lib, and this module for the spawned ranks
os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])

from link_proxy import LinkProxy  # noqa: E402
import bench_lib as B  # noqa: E402  (drops CKPTSTORE_KEY*, sets torch threads, draws the master key)

MiB = B.MiB


def node_root(base: str, rank: int, per_node: int) -> str:
    return os.path.join(base, f"node{rank // per_node}")


def _locals(sd) -> dict:
    """Every tensor of ``sd`` as this rank's local shard."""
    return {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in B.tensors(sd).items()}


def _exact(a, b) -> bool:
    la, lb = _locals(a), _locals(b)
    return la.keys() == lb.keys() and all(torch_equal(la[k], lb[k]) for k in la)


def torch_equal(x, y) -> bool:
    import torch

    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.int16), y.view(torch.int16))


def _evict_all(paths: list[str]) -> None:
    for p in paths:
        if os.path.exists(p):
            try:
                B.evict(p)
            except OSError:  # a file SeaweedFS replaced meanwhile
                pass


# -- (a) and (c): one job ------------------------------------------------------------------------
def restore_rank(rank: int, world: int, work: str, urls: dict, mib: int, per_node: int, reps: int,
                 seaweed_data: str, link_endpoint: str | None) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckptstore

    nodes = world // per_node
    sd = B.sharded_state(mib * MiB, rank, world)
    out: dict = {"rank": rank, "save_s": {}}
    for F in (1, 0):  # warm-up (first allocations, the replicas' gloo group): not timed
        w = ckptstore.StorageWriter(node_root(os.path.join(work, f"warm{F}"), rank, per_node), key=B.BENCH_KEY, replicas=F)
        dcp.save(sd, checkpoint_id="v1", storage_writer=w)
        w.close()
    dist.barrier()
    if rank == 0:
        for F in (1, 0):
            shutil.rmtree(os.path.join(work, f"warm{F}"), ignore_errors=True)
    for tag, F in (("a", 1), ("b", 0)):
        root = node_root(os.path.join(work, tag), rank, per_node)
        w = ckptstore.StorageWriter(root, remote=urls[tag], key=B.BENCH_KEY, replicas=F, durability="remote")
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(sd, checkpoint_id="v1", storage_writer=w)
        w.close()
        dist.barrier()
        out["save_s"][tag] = time.perf_counter() - t0
    if rank == 0:
        out["du"] = {tag: [B.du(os.path.join(work, tag, f"node{n}")) for n in range(nodes)] for tag in ("a", "b")}
        out["logical_bytes"] = B.state_bytes(sd)  # DTensor numel is global: the whole state

    dest = B.empty_like_state(sd)

    def load(tag: str, endpoint: str | None = None) -> dict:
        for v in B.tensors(dest).values():
            v.zero_()
        dist.barrier()
        if rank == 0:
            _evict_all([os.path.join(work, tag), seaweed_data])
        dist.barrier()
        r = ckptstore.StorageReader(node_root(os.path.join(work, tag), rank, per_node), remote=urls[tag], key=B.BENCH_KEY,
                                    **({"endpoint_url": endpoint} if endpoint else {}))
        t0 = time.perf_counter()
        dcp.load(dest, storage_reader=r)  # the newest version every rank can load
        dist.barrier()
        dt = time.perf_counter() - t0
        return {"s": dt, "exact": _exact(sd, dest), "remote_reads": r.stats["remote_reads"],
                "peer_bytes": r.stats["peer_bytes"], "version": r.version}

    node1 = {tag: os.path.join(work, tag, "node1") for tag in ("a", "b")}
    backup = os.path.join(work, "a-node1-backup")
    dist.barrier()
    if rank == 0:  # node 1 is replaced: a new machine, its disk empty (store A: kept aside for the intact loads)
        shutil.copytree(node1["a"], backup)
        for tag in ("a", "b"):
            shutil.rmtree(node1[tag])
            os.makedirs(node1[tag])
    dist.barrier()
    configs = [("intact", "a"), ("replica", "a"), ("s3", "b")] + ([("s3link", "b")] if link_endpoint else [])
    for name, _tag in configs:
        out[name] = []
    for i in range(reps):
        order = list(configs)
        random.Random(1000 + i).shuffle(order)  # the same order on every rank
        for name, tag in order:
            if rank == 0 and tag == "a":  # node 1's root of store A: back for "intact", empty for "replica"
                shutil.rmtree(node1["a"])
                if name == "intact":
                    shutil.copytree(backup, node1["a"])
                else:
                    os.makedirs(node1["a"])
            out[name].append(load(tag, link_endpoint if name == "s3link" else None))
    return out


# -- (b): one job --------------------------------------------------------------------------------
def steps_rank(rank: int, world: int, work: str, mib: int, per_node: int, reps: int, steps: int, every: int,
               dim: int, matmuls: int, grad_mib: int) -> dict:
    import torch
    import torch.distributed as dist

    import ckptstore

    sd = B.sharded_state(mib * MiB, rank, world)
    g = torch.Generator().manual_seed(rank)
    a = torch.randn(dim, dim, generator=g)
    b = torch.randn(dim, dim, generator=g)
    grad = torch.randn(grad_mib * MiB // 4, generator=g)

    def step() -> None:
        c = a
        for _ in range(matmuls):
            c = torch.mm(c, b)
            c.div_(c.abs().max())  # keep the values finite
        dist.all_reduce(grad)
        grad.div_(world)

    def loop(mgr) -> dict:
        times, blocked, copies, local = [], [], [], []
        if mgr is not None and mgr._writer._replicator is not None:
            rep = mgr._writer._replicator
            orig = rep._save

            def timed(*args):  # the replica exchange of one version, on the replicator's thread
                c0 = time.perf_counter()
                try:
                    return orig(*args)
                finally:
                    copies.append((c0, time.perf_counter()))

            rep._save = timed
        dist.barrier()
        cpu0 = time.process_time()  # every thread of this rank: training, writer, copies
        for s in range(1, steps + 1):
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            times.append((t0, t1))
            if mgr is not None and mgr.save(s):
                blocked.append(time.perf_counter() - t1)
                local.append(time.perf_counter())
        if mgr is not None:
            mgr.close()  # waits for the last copies
        cpu = time.process_time() - cpu0
        dist.barrier()
        stats = None if mgr is None or mgr._writer._replicator is None else dict(mgr._writer._replicator.stats)
        return {"steps": times, "blocked": blocked, "copies": copies, "replica_stats": stats, "cpu_s": cpu}

    out: dict = {"rank": rank, "nosave": loop(None), "F1": [], "F0": []}
    for i in range(reps):
        for F in ((1, 0) if i % 2 == 0 else (0, 1)):
            root = node_root(os.path.join(work, f"steps-{i}-F{F}"), rank, per_node)
            mgr = ckptstore.CheckpointManager(root, {"model": sd["model"]}, key=B.BENCH_KEY, interval_steps=every,
                                              durability="local", replicas=F, save_rng=False)
            out[f"F{F}"].append(loop(mgr))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(os.path.join(work, f"steps-{i}-F{F}"), ignore_errors=True)
            dist.barrier()
    return out


# -- summary -------------------------------------------------------------------------------------
def _med(xs):
    return statistics.median(xs) if xs else float("nan")


def summarise_steps(per_rank: list[dict], every: int) -> dict:
    """Mean step times (s): during this rank's copies (F = 1) vs the same steps of F = 0; every step
    after the first save; per repetition, averaged over the ranks, then the median over repetitions."""
    reps = len(per_rank[0]["F1"])
    during, same_f0, all1, all0, frac, blocked1, blocked0, exch = [], [], [], [], [], [], [], []
    for i in range(reps):
        d1, d0, a1, a0, fr, b1, b0 = [], [], [], [], [], [], []
        for o in per_rank:
            r1, r0 = o["F1"][i], o["F0"][i]
            busy = [k for k, (t0, t1) in enumerate(r1["steps"]) if any(c0 < t1 and t0 < c1 for c0, c1 in r1["copies"])]
            dur = lambda r, ks: [r["steps"][k][1] - r["steps"][k][0] for k in ks]  # noqa: E731
            after = list(range(every, len(r1["steps"])))
            if busy:
                d1.append(statistics.mean(dur(r1, busy)))
                d0.append(statistics.mean(dur(r0, busy)))
            a1.append(statistics.mean(dur(r1, after)))
            a0.append(statistics.mean(dur(r0, after)))
            fr.append(len(busy) / len(after))
            b1.append(statistics.mean(r1["blocked"]))
            b0.append(statistics.mean(r0["blocked"]))
            exch += [c1 - c0 for c0, c1 in r1["copies"]]
        if d1:
            during.append(statistics.mean(d1))
            same_f0.append(statistics.mean(d0))
        all1.append(statistics.mean(a1))
        all0.append(statistics.mean(a0))
        frac.append(statistics.mean(fr))
        blocked1.append(statistics.mean(b1))
        blocked0.append(statistics.mean(b0))
    nosave = statistics.mean(statistics.mean(t1 - t0 for t0, t1 in o["nosave"]["steps"][every:]) for o in per_rank)
    ratios_during = [x / y for x, y in zip(during, same_f0)]
    ratios_all = [x / y for x, y in zip(all1, all0)]
    sent = sum(o["F1"][0]["replica_stats"]["sent_bytes"] for o in per_rank if o["F1"][0]["replica_stats"])
    # CPU-seconds of a whole loop per rank (mean over ranks), per repetition: the stable figure on a shared machine
    cpu1 = [statistics.mean(o["F1"][i]["cpu_s"] for o in per_rank) for i in range(reps)]
    cpu0 = [statistics.mean(o["F0"][i]["cpu_s"] for o in per_rank) for i in range(reps)]
    saves = len(per_rank[0]["F1"][0]["blocked"])
    return {"during_F1_s": during, "same_steps_F0_s": same_f0, "ratio_during": ratios_during,
            "all_F1_s": all1, "all_F0_s": all0, "ratio_all": ratios_all, "busy_fraction": frac,
            "blocked_F1_s": blocked1, "blocked_F0_s": blocked0, "nosave_s": nosave,
            "exchange_s": exch, "sent_bytes_rep0": sent, "cpu_F1_s": cpu1, "cpu_F0_s": cpu0, "saves": saves,
            "copy_cpu_per_save_s": [(a - b) / saves for a, b in zip(cpu1, cpu0)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB restore state, 32 MiB step state, 1 repetition")
    ap.add_argument("--mib", type=int, default=None, help="state of (a)/(c), MiB over all ranks (default 256)")
    ap.add_argument("--step-mib", type=int, default=None, help="state saved by the step loop of (b) (default 64)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--reps", type=int, default=None, help="(b): repetitions of the step loops (default 3, --quick 1)")
    ap.add_argument("--load-reps", type=int, default=None, help="(a): repetitions of the loads (default 7, --quick 2)")
    ap.add_argument("--every", type=int, default=10, help="(b): save every N steps")
    ap.add_argument("--saves", type=int, default=5, help="(b): saves per loop")
    ap.add_argument("--dim", type=int, default=384, help="(b): matmul size")
    ap.add_argument("--matmuls", type=int, default=6, help="(b): matmuls per step")
    ap.add_argument("--grad-mib", type=int, default=4, help="(b): all-reduced bytes per step, MiB")
    ap.add_argument("--link-rate", type=float, default=float(os.environ.get("CKPTBENCH_LINK_RATE", 100e6)),
                    help="(a): also restore B from S3 through benchmarks/link_proxy.py limiting downloads to this "
                         "many bytes/s (default 100e6, CKPTBENCH_LINK_RATE; 0: skip)")
    ap.add_argument("--sections", default="a,b", help="a (restore, with c) and/or b (steps)")
    ap.add_argument("--out", default="bench-results", help="directory for replica_bench.json")
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one, removed)")
    args = ap.parse_args()
    mib = args.mib or (64 if args.quick else 256)
    step_mib = args.step_mib or (32 if args.quick else 64)
    reps = args.reps or (1 if args.quick else 3)
    load_reps = args.load_reps or (2 if args.quick else 7)
    if args.ranks % args.per_node or args.ranks // args.per_node < 2:
        ap.error("--ranks must be a multiple of --per-node, with at least 2 nodes")
    sections = set(args.sections.split(","))

    from ckptstore.testing.dist import run_ranks
    from ckptstore.testing.seaweed import SeaweedServer

    import replica_bench as me  # the ranks import the functions from this module by name

    work = args.work or tempfile.mkdtemp(prefix="replica-bench-")
    os.makedirs(work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    load0 = os.getloadavg()[0]
    res: dict = {"meta": {"ranks": args.ranks, "per_node": args.per_node, "mib": mib, "step_mib": step_mib, "reps": reps,
                          "load_reps": load_reps,
                          "cores": os.cpu_count(), "loadavg_start": load0, "date": time.strftime("%Y-%m-%d %H:%M")}}
    rows: list[tuple[str, str, str, str, str]] = []
    bad: list[str] = []
    t_start = time.time()
    try:
        if "a" in sections:
            with SeaweedServer(os.path.join(work, "seaweed")) as sw:
                bucket = sw.create_bucket("replicabench")
                os.environ.update(sw.env)
                urls = {"a": f"s3://{bucket}/a", "b": f"s3://{bucket}/b"}
                proxy = LinkProxy(sw.endpoint, args.link_rate, "down") if args.link_rate else None
                try:
                    outs = run_ranks(me.restore_rank, args.ranks, os.path.join(work, "restore"), urls, mib, args.per_node,
                                     load_reps, sw.data_dir, proxy and proxy.endpoint, timeout=1800)
                finally:
                    if proxy is not None:
                        proxy.close()
            res["restore"] = outs
            o0 = outs[0]

            def agg(name):
                secs = [o0[name][i]["s"] for i in range(load_reps)]
                gets = [sum(o[name][i]["remote_reads"] for o in outs) for i in range(load_reps)]
                peer = [sum(o[name][i]["peer_bytes"] for o in outs) for i in range(load_reps)]
                exact = all(o[name][i]["exact"] for o in outs for i in range(load_reps))
                return secs, gets, peer, exact

            rs, rg, rp, rx = agg("replica")
            ss, sg, sp, sx = agg("s3")
            is_, ig, ip, ix = agg("intact")
            ratio = [a / b for a, b in zip(rs, ss)]
            logical = o0["logical_bytes"]
            rows.append(("a", f"restore, node 1 replaced ({logical / MiB:.0f} MiB state, {args.ranks} ranks): "
                              "from replicas vs from S3 (s)", f"{_med(rs):.2f}", f"{_med(ss):.2f}",
                         f"{_med(ratio):.2f}x"))
            ex_r, ex_s = _med([a - c for a, c in zip(rs, is_)]), _med([b - c for b, c in zip(ss, is_)])
            extra = ex_r / ex_s if ex_s > 0.05 else None  # a ratio of two noise-sized differences means nothing
            if args.link_rate:
                ls, lg, _lp, lx = agg("s3link")
                sx = sx and lx
                rows.append(("a", f"  from S3 through a {args.link_rate / 1e6:.0f} MB/s download link (s)", f"{_med(rs):.2f}",
                             f"{_med(ls):.2f}", f"{_med([a / b for a, b in zip(rs, ls)]):.2f}x"))
                res["restore_summary_link"] = {"s3link_s": ls, "s3link_gets": lg, "rate": args.link_rate}
            rows.append(("a", "  extra time over an intact restore (s, median of per-repetition differences)",
                         f"{ex_r:.2f}", f"{ex_s:.2f}", "-" if extra is None else f"{extra:.2f}x"))
            rows.append(("a", "  S3 GETs of the restore (all ranks)", f"{max(rg)}", f"{min(sg)}", ""))
            rows.append(("a", "  bytes from peers (MiB, all ranks)", f"{_med(rp) / MiB:.1f}", f"{_med(sp) / MiB:.1f}", ""))
            rows.append(("a", "  (info) every root intact, own roots only (s)", f"{_med(is_):.2f}", "", ""))
            rows.append(("a", f"  (info) F=1/F=0 per repetition: {' '.join(f'{x:.2f}' for x in ratio)}", "", "", ""))
            saves = o0["save_s"]
            rows.append(("a", "  (info) save until durable=remote (s; F=1 also replicated)", f"{saves['a']:.2f}",
                         f"{saves['b']:.2f}", f"{saves['a'] / saves['b']:.2f}x"))
            for n, (x, y) in enumerate(zip(o0["du"]["a"], o0["du"]["b"])):
                rows.append(("c", f"bytes on disk, node {n} (MiB)", f"{x / MiB:.1f}", f"{y / MiB:.1f}", f"{x / y:.2f}x"))
            res["restore_summary"] = {"replica_s": rs, "s3_s": ss, "ratio": ratio, "extra_ratio": extra,
                                      "replica_gets": rg, "s3_gets": sg,
                                      "replica_peer_bytes": rp, "s3_peer_bytes": sp, "intact_s": is_, "du": o0["du"]}
            if not (rx and sx and ix):
                bad.append("a load was not bit-exact")
            if any(rg):
                bad.append(f"a restore from replicas made S3 GETs: {rg}")
        if "b" in sections:
            steps = args.every * (args.saves + 1)
            outs = run_ranks(me.steps_rank, args.ranks, os.path.join(work, "steps"), step_mib, args.per_node, reps,
                             steps, args.every, args.dim, args.matmuls, args.grad_mib, timeout=1800)
            sm = summarise_steps(outs, args.every)
            res["steps_summary"] = sm
            res["steps"] = [{k: v for k, v in o.items()} for o in outs]
            ms = 1e3
            rows.append(("b", f"step time while copies run ({step_mib} MiB state, save every {args.every}, "
                              "durability=local; ms)", f"{_med(sm['during_F1_s']) * ms:.1f}",
                         f"{_med(sm['same_steps_F0_s']) * ms:.1f}", f"{_med(sm['ratio_during']):.2f}x"))
            rows.append(("b", "  step time, every step after the first save (ms)", f"{_med(sm['all_F1_s']) * ms:.1f}",
                         f"{_med(sm['all_F0_s']) * ms:.1f}", f"{_med(sm['ratio_all']):.2f}x"))
            rows.append(("b", "  CPU-s per rank of a whole loop (all threads)", f"{_med(sm['cpu_F1_s']):.2f}",
                         f"{_med(sm['cpu_F0_s']):.2f}", f"{_med([a / b for a, b in zip(sm['cpu_F1_s'], sm['cpu_F0_s'])]):.2f}x"))
            per_rank_sent = sm["sent_bytes_rep0"] / args.ranks / sm["saves"]
            rows.append(("b", f"  (info) replication CPU-s per rank and save ({per_rank_sent / MiB:.1f} MiB sent and "
                              "as much received)", f"{_med(sm['copy_cpu_per_save_s']):.3f}", "", ""))
            rows.append(("b", "  (info) share of steps with copies in flight", f"{_med(sm['busy_fraction']):.0%}", "", ""))
            rows.append(("b", "  (info) one replica exchange (s, median)", f"{_med(sm['exchange_s']):.2f}", "", ""))
            rows.append(("b", "  (info) blocked in mgr.save (ms)", f"{_med(sm['blocked_F1_s']) * ms:.1f}",
                         f"{_med(sm['blocked_F0_s']) * ms:.1f}", ""))
            rows.append(("b", "  (info) step time without saves (ms)", f"{sm['nosave_s'] * ms:.1f}", "", ""))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    res["meta"]["loadavg_end"] = os.getloadavg()[0]
    res["meta"]["seconds"] = time.time() - t_start
    res["rows"] = rows

    w = max(len(r[1]) for r in rows) if rows else 20
    print(f"peer replicas: {args.ranks} ranks on {args.ranks // args.per_node} simulated nodes, {os.cpu_count()} cores, "
          f"{load_reps} load / {reps} step-loop rep(s), load average {load0:.1f} -> {res['meta']['loadavg_end']:.1f}, "
          f"{res['meta']['seconds']:.0f} s")
    print(f"{'':2} {'measure':<{w}}  {'F=1':>9}  {'F=0':>9}  {'F=1/F=0':>8}")
    for sec, name, x, y, r in rows:
        print(f"{sec:2} {name:<{w}}  {x:>9}  {y:>9}  {r:>8}")
    with open(os.path.join(args.out, "replica_bench.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    for b in bad:
        print(f"FAILED: {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
