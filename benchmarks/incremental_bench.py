"""Incremental saves against full saves, measured in the same run (docs/FORMAT.md, "References").

A frozen-base fine-tune: a frozen bf16 base (default 256 MiB), a trained fp32 adapter (default
1 MiB) and its AdamW state (2 MiB): 10 saves through ``CheckpointManager`` with ``durability=
"remote"`` to a loopback SeaweedFS, once with ``incremental=True`` and once without, each step
changing only the adapter and its optimizer state. Per save: bytes written locally (the objects of
the save's attempt), bytes uploaded (the objects the save put in S3) and seconds until the save is
durable in S3 (``save()`` to ``wait()``); then the load time of the 10th version, from the local
root and from S3 alone, incremental vs full. Prints a table and writes ``--out`` JSON.

    python benchmarks/incremental_bench.py [--base-mib 256] [--adapter-mib 1] [--saves 10] [--out f.json]

``--writers``: instead, the README's pattern of a new ``StorageWriter(incremental=True)`` for every
``dcp.save`` against one writer kept for all of them (plain DCP, local root only, no S3): bytes
stored after ``--saves`` saves as a multiple of one save, and seconds per save::

    python benchmarks/incremental_bench.py --writers --base-mib 64 --saves 6
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


class FineTune(torch.nn.Module):
    def __init__(self, base_mib: int, adapter_mib: float):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.base = torch.nn.Parameter(torch.randn((base_mib << 20) // 2, generator=g).to(torch.bfloat16),
                                       requires_grad=False)
        self.adapter = torch.nn.Parameter(torch.zeros(int(adapter_mib * (1 << 20)) // 4))


def _objects_bytes(tier, version: str) -> int:
    from ckptstore.manifest import layout

    return sum(i.size for i in tier.list(layout.version_dir(version) + "/") if i.key.endswith(".ckd"))


def run(args, work: str, url: str, incremental: bool) -> dict:
    import ckptstore
    from ckptstore import CheckpointManager
    from ckptstore.tiers import LocalTier, make_remote

    root = os.path.join(work, "inc" if incremental else "full")
    model = FineTune(args.base_mib, args.adapter_mib)
    opt = torch.optim.AdamW([model.adapter], lr=1e-3)
    rows = []
    with CheckpointManager(root, {"model": model, "optim": opt}, remote=url, durability="remote",
                           incremental=incremental) as m:
        for i in range(1, args.saves + 1):
            target = torch.randn(model.adapter.shape, generator=torch.Generator().manual_seed(i))
            loss = (model.adapter - target).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            os.sync()
            t0 = time.perf_counter()
            m.save(i)
            m.wait()
            rows.append({"step": i, "durable_s": time.perf_counter() - t0})
    local = LocalTier(root)
    remote = make_remote(url)
    for r in rows:
        v = f"step-{r['step']}"
        r["written"] = _objects_bytes(local, v)
        r["uploaded"] = _objects_bytes(remote, v)
    loads = {}
    for where in ("local", "s3"):
        fresh = FineTune(args.base_mib, args.adapter_mib)
        state = {"model": fresh, "optim": torch.optim.AdamW([fresh.adapter], lr=1e-3)}
        r_root = root if where == "local" else os.path.join(work, f"empty-{incremental}")
        os.makedirs(r_root, exist_ok=True)
        t0 = time.perf_counter()
        with CheckpointManager(r_root, state, remote=url) as m2:
            m2.restore(version=f"step-{args.saves}")
        loads[where] = time.perf_counter() - t0
        assert torch.equal(fresh.adapter, model.adapter) and torch.equal(fresh.base.view(torch.int16),
                                                                         model.base.view(torch.int16))
    st = ckptstore.Store(root)
    return {"rows": rows, "loads": loads, "stored_total": sum(r["written"] for r in rows),
            "list": [(r.version, r.stored_bytes, r.unique_bytes) for r in st.versions()]}


def writers(args, work: str, per_save: bool) -> dict:
    """``args.saves`` plain ``dcp.save`` calls of the frozen-base state into a fresh root, with a new
    ``StorageWriter(incremental=True)`` per save (``per_save``) or one kept; bytes stored and seconds."""
    import torch.distributed.checkpoint as dcp

    import ckptstore

    root = os.path.join(work, "per-save" if per_save else "kept")
    model = FineTune(args.base_mib, args.adapter_mib)
    w = None
    secs, stored = [], []
    for i in range(1, args.saves + 1):
        with torch.no_grad():  # a trained adapter: new values at every save
            model.adapter.copy_(torch.randn(model.adapter.shape, generator=torch.Generator().manual_seed(i)))
        t0 = time.perf_counter()
        if w is None or per_save:
            w = ckptstore.StorageWriter(root, incremental=True)
        dcp.save({"model": model.state_dict()}, checkpoint_id=f"step-{i}", storage_writer=w)
        secs.append(time.perf_counter() - t0)
        stored.append(sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(root) for f in fs
                          if f.endswith(".ckd")))
    return {"seconds": secs, "stored": stored}


def main_writers(args) -> int:
    work = tempfile.mkdtemp(prefix="ckpt-incwriters-")
    try:
        res = {k: writers(args, work, k == "per-save") for k in ("kept", "per-save")}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    one = res["kept"]["stored"][0]
    print(f"frozen base {args.base_mib} MiB bf16 + adapter {args.adapter_mib} MiB fp32, {args.saves} dcp.save calls, "
          "StorageWriter(incremental=True), local root")
    for k in ("kept", "per-save"):
        r = res[k]
        print(f"{'one writer kept' if k == 'kept' else 'a new writer per save':>22}: stored {r['stored'][-1] / one:.2f} x "
              f"one save; seconds per save {' '.join(f'{x:.2f}' for x in r['seconds'])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), **res}, f, indent=2)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-mib", type=int, default=256)
    ap.add_argument("--adapter-mib", type=float, default=1.0)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--writers", action="store_true", help="a writer per save against one kept (local, no S3)")
    args = ap.parse_args()
    if args.writers:
        return main_writers(args)
    from ckptstore.testing.seaweed import SeaweedServer

    work = tempfile.mkdtemp(prefix="ckpt-incbench-")
    sw = SeaweedServer(os.path.join(work, "seaweed"))
    try:
        sw.start()
        bucket = sw.create_bucket("incbench")
        os.environ.update(sw.env)
        res = {k: run(args, work, f"s3://{bucket}/{k}", k == "inc") for k in ("full", "inc")}
    finally:
        sw.stop()
        shutil.rmtree(work, ignore_errors=True)
    full, inc = res["full"], res["inc"]
    one_full = full["rows"][0]["written"]
    mib = 1 << 20
    print(f"frozen base {args.base_mib} MiB bf16, adapter {args.adapter_mib} MiB fp32 + AdamW state, {args.saves} saves, "
          "durability=remote (loopback SeaweedFS)")
    print(f"{'save':>4} | {'written MiB full':>16} {'inc':>8} | {'uploaded MiB full':>17} {'inc':>8} | "
          f"{'S3-durable s full':>17} {'inc':>6} {'ratio':>6}")
    for a, b in zip(full["rows"], inc["rows"]):
        print(f"{a['step']:>4} | {a['written'] / mib:>16.1f} {b['written'] / mib:>8.2f} | {a['uploaded'] / mib:>17.1f} "
              f"{b['uploaded'] / mib:>8.2f} | {a['durable_s']:>17.2f} {b['durable_s']:>6.2f} {b['durable_s'] / a['durable_s']:>6.2f}")
    print(f"local stored after {args.saves} saves: full {full['stored_total'] / mib:.1f} MiB, incremental "
          f"{inc['stored_total'] / mib:.1f} MiB = {inc['stored_total'] / one_full:.2f} x one full save")
    worst = max(r["uploaded"] for r in inc["rows"][1:]) / one_full
    print(f"uploaded per save 2-{args.saves}, incremental: at most {100 * worst:.2f} % of a full save")
    for where in ("local", "s3"):
        print(f"load of step-{args.saves} from {where}: full {full['loads'][where]:.2f} s, incremental "
              f"{inc['loads'][where]:.2f} s ({inc['loads'][where] / full['loads'][where]:.2f} x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), **res}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
