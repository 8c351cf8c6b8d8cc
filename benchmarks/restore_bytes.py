"""What one rank receives, lists and stats for a restore, as the job grows (docs/FORMAT.md, "Restore
choice"; the per-rank cost must not grow with the number of ranks).

    python benchmarks/restore_bytes.py [--ranks 4,8,16,32] [--versions 3] [--per-node 4] [--out DIR]

For each job size and each layout — one **shared** root for every rank, and **node**-local roots
(``--per-node`` ranks share one directory, a simulated node disk) — a job of real gloo ranks
(``ckptstore.testing.dist.run_ranks``, forkserver) saves ``--versions`` versions of a tiny state (a
replicated tensor and one small tensor per rank, so every rank writes an object), then a second job
of the same size loads the newest with a plain ``dcp.load`` through ``StorageReader``. Around that
load every rank runs ``ckptstore.testing.meter.metered``: the bytes its ``torch.distributed``
collectives and point-to-point calls deliver to it, charged to ckptstore's own calls or to DCP's
planning, and its ``listdir``/``scandir``/``stat``/``lstat`` calls; and the seconds of the restore
choice (``dcp/_job.exchange``).

Prints one row per size and layout (mean and maximum over the ranks) and, per layout, the growth
exponent ``b`` of bytes per rank ~ ranks^b (least squares over the sizes, log-log) for ckptstore and
for DCP's planning. Goal: ckptstore's exponent <= 1.2 in both layouts (DCP's own is 1.0); listdir/stat
calls per rank constant. Writes ``restore_bytes.json`` into ``--out``. Exit status 1 when a load
failed, restored another version than the newest, or logged a warning.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # this module, for the ranks
os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])


def _state(rank: int, step: int, blank: bool = False) -> dict:
    import torch

    if blank:
        return {"step": torch.zeros(4), f"rank{rank}": torch.zeros(8, dtype=torch.int64)}
    return {"step": torch.full((4,), float(step)), f"rank{rank}": torch.arange(8) + 100 * rank + step}


def save_rank(rank: int, world: int, roots: list, versions: list) -> None:
    import torch.distributed.checkpoint as dcp

    import ckptstore

    w = ckptstore.StorageWriter(roots[rank], frame_size=65536)
    for i, v in enumerate(versions):
        dcp.save(_state(rank, i), checkpoint_id=v, storage_writer=w)
    w.close()


def load_rank(rank: int, world: int, roots: list) -> dict:
    import io
    import logging

    import torch
    import torch.distributed.checkpoint as dcp

    import ckptstore
    from ckptstore.dcp import _job
    from ckptstore.testing.meter import metered

    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    h.setLevel(logging.WARNING)
    logging.getLogger("ckptstore").addHandler(h)
    timing = {}
    orig = _job.exchange

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            timing["choice_s"] = time.perf_counter() - t0

    _job.exchange = timed
    r = ckptstore.StorageReader(roots[rank])
    sd = _state(rank, 0, blank=True)
    with metered() as m:
        dcp.load(sd, storage_reader=r)
    _job.exchange = orig
    n = int(sd["step"][0].item())
    ok = torch.equal(sd[f"rank{rank}"], torch.arange(8) + 100 * rank + n)
    return {"version": r.version, "ok": bool(ok), "meter": m.to_json(), "received": dict(m.received),
            "fs": m.fs_calls("ckptstore"), "choice_s": timing.get("choice_s"), "log": buf.getvalue()}


def _slope(xs: list, ys: list) -> float:
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den if den else float("nan")


def run(sizes: list, versions: int, per_node: int, work: str) -> dict:
    from ckptstore.testing.dist import run_ranks

    me = __import__("restore_bytes")
    names = [f"step-{i:06d}" for i in range(versions)]
    rows = []
    for n in sizes:
        for layout in ("shared", "node"):
            base = os.path.join(work, f"{layout}-{n}")
            roots = [os.path.join(base, "shared" if layout == "shared" else f"node{r // per_node}") for r in range(n)]
            fast = {"start_method": "forkserver", "preload": ["restore_bytes"], "timeout": 900}
            run_ranks(me.save_rank, n, roots, names, **fast)
            outs = run_ranks(me.load_rank, n, roots, **fast)
            ck = [o["received"].get("ckptstore", 0) for o in outs]
            dc = [o["received"].get("dcp", 0) for o in outs]
            fs = [o["fs"] for o in outs]
            row = {"ranks": n, "layout": layout, "roots": len(set(roots)), "ckpt_mean": sum(ck) / n, "ckpt_max": max(ck),
                   "dcp_mean": sum(dc) / n, "dcp_max": max(dc), "fs_mean": sum(fs) / n, "fs_max": max(fs),
                   "choice_s": max(o["choice_s"] or 0 for o in outs),
                   "ok": all(o["ok"] and o["version"] == names[-1] for o in outs),
                   "warnings": sorted({line for o in outs for line in o["log"].splitlines()}),
                   "calls": outs[0]["meter"]["calls"], "calls_last": outs[-1]["meter"]["calls"]}
            rows.append(row)
            print(f"  {n:>4} ranks {layout:>6} ({row['roots']:>2} roots): ckptstore {row['ckpt_mean'] / 1e3:8.1f} kB/rank "
                  f"(max {row['ckpt_max'] / 1e3:8.1f}), DCP planning {row['dcp_mean'] / 1e3:7.1f} kB/rank, "
                  f"listdir/stat {row['fs_mean']:6.1f}/rank (max {row['fs_max']}), choice {row['choice_s']:.3f} s"
                  + ("" if row["ok"] else "  LOAD NOT OK") + (f"  WARNINGS: {row['warnings']}" if row["warnings"] else ""),
                  flush=True)
    growth = {}
    for layout in ("shared", "node"):
        rs = [r for r in rows if r["layout"] == layout]
        xs = [r["ranks"] for r in rs]
        growth[layout] = {k: _slope(xs, [r[k] for r in rs]) for k in ("ckpt_mean", "ckpt_max", "dcp_mean", "fs_mean", "fs_max")}
    return {"rows": rows, "growth": growth, "versions": versions, "per_node": per_node}


def table(res: dict) -> str:
    out = ["| ranks | layout | roots | ckptstore bytes/rank (mean / max) | DCP planning bytes/rank | listdir+stat/rank (mean / max) | choice s |",
           "|---:|---|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        out.append(f"| {r['ranks']} | {r['layout']} | {r['roots']} | {r['ckpt_mean'] / 1e3:.1f} kB / {r['ckpt_max'] / 1e3:.1f} kB "
                   f"| {r['dcp_mean'] / 1e3:.1f} kB | {r['fs_mean']:.1f} / {r['fs_max']} | {r['choice_s']:.3f} |")
    for layout, g in res["growth"].items():
        out.append(f"\ngrowth exponent ({layout}): ckptstore {g['ckpt_mean']:.2f} (max-rank {g['ckpt_max']:.2f}), "
                   f"DCP planning {g['dcp_mean']:.2f}, listdir/stat {g['fs_mean']:.2f} (max-rank {g['fs_max']:.2f})")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="4,8,16,32")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--per-node", type=int, default=4)
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--work", default=None)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.ranks.split(",")]
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        res = run(sizes, args.versions, args.per_node, work)
    text = table(res)
    print("\n" + text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "restore_bytes.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    bad = [r for r in res["rows"] if not r["ok"] or r["warnings"]]
    for layout, g in res["growth"].items():
        print(f"goal ckptstore exponent <= 1.2 ({layout}): {'met' if g['ckpt_mean'] <= 1.2 and g['ckpt_max'] <= 1.2 else 'NOT met'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
