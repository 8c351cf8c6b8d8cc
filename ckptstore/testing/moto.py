"""A throwaway moto S3 server for tests: a second, independent S3 implementation next to SeaweedFS
(:mod:`ckptstore.testing.seaweed`), from the PyPI package ``moto[server]`` (5.2.5 tested).

``moto_server -H 127.0.0.1 -p PORT`` (or ``python -m moto.server``) bound to loopback only, on a free
port, path-style addressing. moto keeps everything in memory (a restart starts empty) and does not
check signatures; it answers ``412 PreconditionFailed`` to a second ``If-None-Match: *`` PutObject and
CompleteMultipartUpload, as AWS S3 does. The server is SIGKILLed if the process that started it (from
its main thread) dies, and stopped at interpreter exit. :class:`MotoServer` has the interface of
:class:`~ckptstore.testing.seaweed.SeaweedServer` that the fixtures use (``endpoint``, ``env``,
``client()``, ``create_bucket``, ``start``/``stop``/``kill``, ``running``)::

    with MotoServer(buckets=("ckpt",)) as m:
        os.environ.update(m.env)          # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from .seaweed import HOST, REGION, _die_with_parent, _free_ports, _libc

__all__ = ["MotoServer", "MotoError", "find_moto", "ACCESS_KEY", "SECRET_KEY"]

ACCESS_KEY = "ckptstore-moto"
SECRET_KEY = "ckptstore-moto-secret-key"

_started: "set[MotoServer]" = set()


@atexit.register
def _stop_all() -> None:
    for m in list(_started):
        try:
            m.kill()
        except Exception:
            pass


class MotoError(RuntimeError):
    """moto could not be found or started; the message has the log tail."""


def find_moto() -> list[str]:
    """The command that starts moto's server: ``moto_server`` next to the running Python (where
    ``pip install 'moto[server]'`` puts it), else on PATH, else ``python -m moto.server``;
    :class:`MotoError` when moto (with its server extra: flask) is not installed."""
    try:
        import flask  # noqa: F401
        import moto  # noqa: F401
    except ImportError as e:
        raise MotoError(f"moto's server is not installed ({e}); pip install 'moto[server]'") from None
    for c in (os.path.join(os.path.dirname(sys.executable), "moto_server"), shutil.which("moto_server")):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return [c]
    return [sys.executable, "-m", "moto.server"]


class MotoServer:
    """One ``moto_server`` process on loopback; ``buckets`` are created at every start."""

    def __init__(self, *, buckets: tuple[str, ...] = (), startup_timeout: float = 60.0, log_path: str | None = None):
        self.cmd = find_moto()
        self.buckets = tuple(buckets)
        self.startup_timeout = startup_timeout
        self._dir = tempfile.mkdtemp(prefix="ckptstore-moto-")
        self.log_path = log_path or os.path.join(self._dir, "moto.log")
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
        }

    def client(self, *, readonly: bool = False):
        if readonly:
            raise MotoError("moto does not check credentials: there is no read-only identity")
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            region_name=REGION, config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": 4},
                                              connect_timeout=5, read_timeout=30),
        )

    def create_bucket(self, name: str) -> str:
        c = self.client()
        try:
            c.create_bucket(Bucket=name)
        except (c.exceptions.BucketAlreadyOwnedByYou, c.exceptions.BucketAlreadyExists):
            pass
        finally:
            c.close()
        return name

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> "MotoServer":
        if self.running:
            return self
        if self.port is None:
            self.port = _free_ports(1)[0]
        self._log = open(self.log_path, "ab")
        on_main = threading.current_thread() is threading.main_thread()
        self.proc = subprocess.Popen(
            [*self.cmd, "-H", HOST, "-p", str(self.port)], stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent if on_main and _libc is not None else None,
        )
        _started.add(self)
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        for b in self.buckets:
            self.create_bucket(b)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last = None
        while time.monotonic() < deadline:
            if not self.running:
                raise MotoError(f"moto_server exited during startup; log {self.log_path}:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=2).close()
                return
            except urllib.error.HTTPError:
                return  # any HTTP answer: it serves
            except OSError as e:
                last = e
                time.sleep(0.1)
        raise MotoError(f"moto at {self.endpoint} did not answer within {self.startup_timeout:.0f}s ({last}); "
                        f"log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def _signal(self, sig: int) -> None:
        if self.running:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait()
        self._closed()

    def kill(self) -> None:
        if self.proc is None:
            return
        self._signal(signal.SIGKILL)
        self.proc.wait()
        self._closed()

    def _closed(self) -> None:
        self.proc = None
        _started.discard(self)
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "MotoServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
