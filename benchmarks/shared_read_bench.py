"""Read once, verify, relay (docs/FORMAT.md, Read rule 11): what an S3-only restore downloads as the
job grows, and what the plan costs per rank.

    python benchmarks/shared_read_bench.py [--ranks 2,4,8] [--sim 16,1024,4096,16384] [--no-s3] [--out DIR]

* **(a) GET bytes of an S3-only restore** (real gloo ranks, ``ckptstore.testing.dist.run_ranks``;
  one loopback SeaweedFS behind ``tests/counting_proxy.py``, which counts requests and the body bytes
  of their answers): the state of ``tests/shared_read_ranks.py`` — a 1 MiB replicated fp32 weight
  (DDP: every rank holds it, DCP stores one copy), DTensors sharded on dim 0 (1 MiB fp32, 64 KiB
  bf16), a non-tensor entry — is saved by N ranks (each its own root, ``durability="remote"``), then
  loaded by N ranks whose roots are all empty, and by N ranks from the 2-rank save (resharded). Every
  load is checked bit-exact. Reported: the GET bytes of each restore (stored objects, and all GETs
  with manifests and listings), the stored bytes, and the ratio to 2 ranks (goal: ≤ 1.3).
* **(b) the plan at scale** (no processes): ``ckptstore.dcp._peers.plan`` — the coordinator's step in
  ``prepare_global_plan`` — on the restore choice's real ``View`` of an S3-only restore of N ranks,
  each loading a Llama-like state: 100 replicated items of 1 frame (DDP's replicated part, stored in
  the objects of 8 ranks as DCP's dedup spreads them) and 191 sharded items of its own (1 frame each).
  Reported per N: the coordinator's time (linear in ranks × items, as DCP's own global planning;
  for scale, the time DCP's coordinator spends only unpickling the N gathered ``LoadPlan``s of the
  same items), the largest pickled ``ExchangePlan`` one rank is sent, and the pickled ``LoadPlan`` DCP
  itself scatters to each rank for the same items (its own planning cost): the first must not grow
  with N (goals: ≤ the second, and within 10 % from the smallest N to the largest).

Prints a table and writes ``shared_read_bench.json`` into ``--out``. Exit status 1 when a load was not
bit-exact or a goal was missed.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
import types
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def s3_rows(worlds: list[int]) -> tuple[list, bool]:
    import ckptstore
    from ckptstore.testing.dist import patched_environ, run_ranks
    from ckptstore.testing.seaweed import SeaweedServer
    from counting_proxy import CountingProxy
    import shared_read_ranks as sr

    fast = dict(start_method="forkserver", preload=sr.PRELOAD)
    tmp = tempfile.mkdtemp(prefix="shared-read-bench-")
    sw = SeaweedServer(os.path.join(tmp, "seaweed"), buckets=("ckpt-bench",))
    sw.start()
    rows, ok = [], True
    try:
        proxy = CountingProxy(sw.endpoint)
        env = {**sw.env, "AWS_ENDPOINT_URL": proxy.endpoint, "AWS_CONFIG_FILE": os.devnull,
               "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_EC2_METADATA_DISABLED": "true"}
        url = f"s3://ckpt-bench/b-{uuid.uuid4().hex[:8]}/"
        for w in sorted(set(worlds) | {2}):
            run_ranks(sr.save, w, tmp, url, f"v{w}", env=env, timeout=600, **fast)
        with patched_environ(env):
            st = ckptstore.Store(None, remote=url)
            stored = {w: sum(o.size for o in st.manifest(f"v{w}").manifest.all_objects()) for w in sorted(set(worlds) | {2})}
        base = None
        runs = [(w, f"v{w}", f"{w} → {w}") for w in sorted(set(worlds) | {2})]
        runs += [(w, "v2", f"2 → {w}") for w in sorted(worlds) if w != 2]
        for w, version, what in runs:
            if True:
                proxy.reset()
                t0 = time.monotonic()
                outs = run_ranks(sr.load, w, tmp, url, version, 0, f"b{w}", env=env, timeout=600, **fast)
                secs = time.monotonic() - t0
                c = proxy.summary()
                exact = all(all(o["ok"].values()) for o in outs)
                ok &= exact
                if base is None:
                    base = c["get_bytes"]
                rows.append({"restore": what, "ranks": w, "object_get_bytes": c["object_get_bytes"],
                             "get_bytes": c["get_bytes"], "stored": stored[int(version[1:])],
                             "ratio_to_2": c["get_bytes"] / base, "bit_exact": exact, "seconds": secs,
                             "peer_bytes_max": max(o["stats"]["peer_bytes"] for o in outs),
                             "peer_sent_bytes_max": max(o["stats"].get("peer_sent_bytes", 0) for o in outs)})
        proxy.close()
    finally:
        sw.stop()
    ok &= all(r["ratio_to_2"] <= 1.3 for r in rows)
    return rows, ok


def sim_rows(worlds: list[int], replicated: int = 100, sharded: int = 191, frame: int = 2 << 20) -> tuple[list, bool]:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from ckptstore.choice import View
    from ckptstore.codec import FrameRef
    from ckptstore.dcp import _peers
    from ckptstore.manifest.objsets import ObjSet

    att = "20260101T000000-000000000000-00001"
    rows, ok = [], True
    for n in worlds:
        job = {"ranks": [[i, None] for i in range(n)], "roots": [], "manifests": {}}  # no rank has a root
        objs = [f"attempts/{att}/r{i:05d}.ckd" for i in range(n)]
        v = View("v", att, job, True, objects=ObjSet(att, True, [(0, n)]))
        holders = min(8, n)  # DCP's dedup spreads the replicated items over the objects of a few ranks
        rep = [(objs[k % holders], FrameRef((k // holders) * frame, frame, frame, k, k // holders)) for k in range(replicated)]
        own_start = (replicated // holders + 1) * frame

        def items(i):
            for o, f in rep:
                yield o, [f]
            for k in range(sharded):
                yield objs[i], [FrameRef(own_start + k * frame, frame, frame, k, k)]

        plans = [types.SimpleNamespace(items=list(items(i))) for i in range(n)]
        t0 = time.perf_counter()
        xps = _peers.plan(v, plans, lambda ri: ri, make_group=True)
        secs = time.perf_counter() - t0
        per_rank = max(len(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)) for x in xps if x is not None)
        dcp_items = [ReadItem(LoadItemType.TENSOR, MetadataIndex(f"layers.{k}.weight", (0, 0)), (0, 0),
                              MetadataIndex(f"layers.{k}.weight", (0, 0)), (0, 0), (4096, 256))
                     for k in range(replicated + sharded)]
        blob = pickle.dumps(LoadPlan(dcp_items), protocol=pickle.HIGHEST_PROTOCOL)
        dcp_plan = len(blob)
        t1 = time.perf_counter()
        for _ in range(200):
            pickle.loads(blob)
        dcp_gather = (time.perf_counter() - t1) / 200 * n  # unpickling every rank's plan at the coordinator
        rows.append({"ranks": n, "coordinator_s": secs, "exchange_plan_bytes_per_rank": per_rank,
                     "dcp_load_plan_bytes_per_rank": dcp_plan, "dcp_gather_unpickle_s": dcp_gather,
                     "readers": sum(1 for x in xps if x is not None and x.read)})
        ok &= per_rank <= dcp_plan
    ok &= rows[-1]["exchange_plan_bytes_per_rank"] <= 1.1 * rows[0]["exchange_plan_bytes_per_rank"]
    return rows, ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--sim", default="16,1024,4096,16384")
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--out", default="bench-results")
    a = ap.parse_args()
    out: dict = {}
    ok = True
    if not a.no_s3:
        rows, good = s3_rows([int(x) for x in a.ranks.split(",")])
        ok &= good
        out["s3_only_restore"] = rows
        print("(a) S3-only restore (every root empty): GET bytes")
        print(f"  {'restore':<8} {'object GET B':>13} {'all GET B':>11} {'stored B':>10} {'vs 2':>6} {'exact':>6} "
              f"{'peer B max':>11} {'sent B max':>11} {'s':>6}")
        for r in rows:
            print(f"  {r['restore']:<8} {r['object_get_bytes']:>13,} {r['get_bytes']:>11,} {r['stored']:>10,} "
                  f"{r['ratio_to_2']:>6.3f} {str(r['bit_exact']):>6} {r['peer_bytes_max']:>11,} "
                  f"{r['peer_sent_bytes_max']:>11,} {r['seconds']:>6.1f}")
    rows, good = sim_rows([int(x) for x in a.sim.split(",")])
    ok &= good
    out["plan_at_scale"] = rows
    print("(b) the exchange plan (coordinator) for an S3-only restore, 100 replicated + 191 own items per rank")
    print(f"  {'ranks':>6} {'coordinator s':>14} {'DCP unpickle s':>15} {'plan B/rank':>12} {'DCP plan B/rank':>16} "
          f"{'readers':>8}")
    for r in rows:
        print(f"  {r['ranks']:>6} {r['coordinator_s']:>14.2f} {r['dcp_gather_unpickle_s']:>15.2f} "
              f"{r['exchange_plan_bytes_per_rank']:>12,} {r['dcp_load_plan_bytes_per_rank']:>16,} {r['readers']:>8}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "shared_read_bench.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("goals met" if ok else "GOAL MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
