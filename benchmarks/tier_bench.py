"""Upload and restore throughput of one checkpoint per remote tier, side by side, on loopback:
S3 (SeaweedFS), GCS (fake-gcs-server) and Azure Blob (Azurite), each started here.

For each tier and repetition (tiers in a shuffled order within every repetition, so drifting load
hits them alike):

* **upload**: ``StorageWriter(root, remote=url, durability="remote", compression="none")`` saving
  a state of ``--mib`` MiB of float32 (random, incompressible), ``close()`` included: the time until
  the version is committed in the remote tier (local write + fsync, streamed part uploads, size
  checks, remote manifest). MB/s of state.
* **restore**: the local root removed, ``dcp.load`` through ``StorageReader(root, remote=url)``
  from the remote tier only; values checked bit-exact. MB/s of state.
* **raw put_file / get_file** of a ``--mib`` MiB file through the tier itself (no codec, no DCP).

Prints a table (medians; min–max) with the load average at start and end, and writes
``--out/tier_bench.json``. The servers share this machine's cores with the client: the numbers
compare the tiers' client and server CPU costs on loopback, not a cloud's network.

Run: ``python benchmarks/tier_bench.py [--mib 256] [--reps 2] [--tiers s3,gs,az]``. Needs the test
extra (``bash scripts/setup.sh test``) and Azurite (``bash scripts/install-azurite.sh``).
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


def _servers(names, work):
    out = {}
    if "s3" in names:
        from ckptstore.testing.seaweed import SeaweedServer

        sw = SeaweedServer(os.path.join(work, "seaweed"), buckets=("bench",)).start()
        out["s3"] = (sw, "s3://bench/b/")
    if "gs" in names:
        from ckptstore.testing.fake_gcs import FakeGCSServer

        fg = FakeGCSServer(os.path.join(work, "fake-gcs"), buckets=("bench",)).start()
        out["gs"] = (fg, "gs://bench/b/")
    if "az" in names:
        from ckptstore.testing.azurite import AzuriteServer

        az = AzuriteServer(os.path.join(work, "azurite"), buckets=("bench",)).start()
        out["az"] = (az, "az://bench/b/")
    for srv, _url in out.values():
        os.environ.update(srv.env)
    return out


def _state(mib: int):
    import torch

    g = torch.Generator().manual_seed(0)
    n = mib * (1 << 20) // 4 // 8
    return {f"layer{i}.w": torch.randn(n, generator=g) for i in range(8)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/tier_bench.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tiers", default="s3,gs,az")
    ap.add_argument("--out", default="bench-results")
    a = ap.parse_args(argv)
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptstore
    from ckptstore.tiers import make_remote

    names = [t for t in a.tiers.split(",") if t]
    work = tempfile.mkdtemp(prefix="ckptstore-tierbench-")
    load0 = os.getloadavg()
    res: dict[str, dict[str, list[float]]] = {n: {"upload": [], "restore": [], "put_file": [], "get_file": []} for n in names}
    servers = {}
    try:
        servers = _servers(names, work)
        sd = _state(a.mib)
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        blob = os.path.join(work, "blob.bin")
        with open(blob, "wb") as f:
            f.write(os.urandom(a.mib << 20))
        for rep in range(a.reps):
            order = list(names)
            random.Random(rep).shuffle(order)
            for n in order:
                _srv, url = servers[n]
                url = f"{url}r{rep}/"
                root = os.path.join(work, f"root-{n}-{rep}")
                t0 = time.perf_counter()
                w = ckptstore.StorageWriter(root, remote=url, durability="remote", compression="none")
                dcp.save(sd, checkpoint_id="v1", storage_writer=w)
                w.close()
                res[n]["upload"].append(nbytes / (time.perf_counter() - t0) / 1e6)
                shutil.rmtree(root)
                tgt = {k: torch.empty_like(v) for k, v in sd.items()}
                t0 = time.perf_counter()
                dcp.load(tgt, checkpoint_id="v1", storage_reader=ckptstore.StorageReader(root, remote=url))
                res[n]["restore"].append(nbytes / (time.perf_counter() - t0) / 1e6)
                assert all(torch.equal(tgt[k], sd[k]) for k in sd), f"{n}: restored values differ"
                tier = make_remote(url)
                t0 = time.perf_counter()
                tier.put_file("raw/blob", blob)
                res[n]["put_file"].append((a.mib << 20) / (time.perf_counter() - t0) / 1e6)
                t0 = time.perf_counter()
                tier.get_file("raw/blob", blob + ".back")
                res[n]["get_file"].append((a.mib << 20) / (time.perf_counter() - t0) / 1e6)
                os.unlink(blob + ".back")
                tier.close()
                print(f"rep {rep} {n}: " + ", ".join(f"{k} {v[-1]:.0f} MB/s" for k, v in res[n].items()), file=sys.stderr)
    finally:
        for srv, _url in servers.values():
            srv.close()
        shutil.rmtree(work, ignore_errors=True)
    load1 = os.getloadavg()
    label = {"s3": "S3 (SeaweedFS)", "gs": "GCS (fake-gcs-server)", "az": "Azure (Azurite)"}
    lines = [f"{a.mib} MiB checkpoint, {a.reps} reps, {os.cpu_count()} cores; load average {load0[0]:.1f} at start, "
             f"{load1[0]:.1f} at end (MB/s of state; median, min-max)",
             f"{'tier':24} {'upload (durable)':>20} {'restore (remote only)':>22} {'put_file':>16} {'get_file':>16}"]
    for n in names:
        cells = [f"{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})" for v in res[n].values()]
        lines.append(f"{label[n]:24} {cells[0]:>20} {cells[1]:>22} {cells[2]:>16} {cells[3]:>16}")
    print("\n".join(lines))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "tier_bench.json"), "w") as f:
        json.dump({"mib": a.mib, "reps": a.reps, "load": [load0, load1], "results": res, "table": lines}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
