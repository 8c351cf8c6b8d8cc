"""What the loopback test servers (:mod:`ckptstore.testing.seaweed`, :mod:`ckptstore.testing.moto`)
share: one server process in its own session, its output appended to a log file, SIGKILLed when
the process that started it (from its main thread) dies (``PR_SET_PDEATHSIG``) and at interpreter
exit, and S3 clients and buckets on it. A subclass gives ``endpoint``, the credentials and
``_wait_ready()``."""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import subprocess
import sys
import threading

HOST = "127.0.0.1"
REGION = "us-east-1"

_started: "set[LoopbackServer]" = set()


@atexit.register
def _stop_all() -> None:  # never leave a server behind when the interpreter exits
    for s in list(_started):
        try:
            s.kill()
        except Exception:
            pass


try:
    _libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
except OSError:  # pragma: no cover
    _libc = None


def _die_with_parent():  # runs in the child between fork and exec
    _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class LoopbackServer:
    """The process half of a test S3 server. Subclasses set ``log_path``, ``buckets``, the
    credentials (``access_key``, ``secret_key``) and define ``endpoint`` and ``_wait_ready()``."""

    access_key: str
    secret_key: str
    log_path: str
    buckets: tuple[str, ...] = ()
    stop_timeout = 15.0  # seconds between SIGTERM and SIGKILL in stop()

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def endpoint(self) -> str:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    @property
    def env(self) -> dict[str, str]:
        """Environment that points the standard boto3 chain at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
        }

    def _client(self, access_key: str, secret_key: str):
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=access_key, aws_secret_access_key=secret_key,
            region_name=REGION,
            config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": 4},
                          connect_timeout=5, read_timeout=30),
        )

    def client(self, *, readonly: bool = False):
        """A boto3 S3 client for this server (path-style, standard retries)."""
        return self._client(self.access_key, self.secret_key)

    def create_bucket(self, name: str) -> str:
        """Create ``name`` (an existing bucket is fine); returns it."""
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

    def _spawn(self, cmd: list[str], cwd: str | None = None) -> None:
        """Start ``cmd``, wait until it serves (``_wait_ready``; killed if it does not), create the
        buckets."""
        self._log = open(self.log_path, "ab")
        # PR_SET_PDEATHSIG fires when the *thread* that started it ends, so only from main
        on_main = threading.current_thread() is threading.main_thread()
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C in the terminal goes to us, not to the server
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

    def _wait_ready(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def _signal(self, sig: int) -> None:
        if self.running:
            try:
                os.killpg(self.proc.pid, sig)  # the server runs in its own session/group
            except ProcessLookupError:
                pass

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds (default ``stop_timeout``)."""
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(self.stop_timeout if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait()
        self._closed_proc()

    def kill(self) -> None:
        """SIGKILL now (a crash: nothing is flushed); ``start()`` brings it back."""
        if self.proc is None:
            return
        self._signal(signal.SIGKILL)
        self.proc.wait()
        self._closed_proc()

    def _closed_proc(self) -> None:
        self.proc = None
        _started.discard(self)
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self) -> None:
        self.stop()

    def start(self):  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
