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

The same endpoint answers the AWS KMS API (``GenerateDataKey``, ``Decrypt``, ``Encrypt``,
``DescribeKey``, ``DisableKey``, aliases, encryption contexts), for :class:`ckptstore.KmsKey`:
:meth:`MotoServer.kms_client` makes keys. moto 5.2.5 does not refuse cryptographic requests for a
disabled key (AWS answers ``DisabledException``); ``DescribeKey`` reports the state, which
``KmsKey`` checks before its first request.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request

from ._server import HOST, LoopbackServer
from .seaweed import _free_ports

__all__ = ["MotoServer", "MotoError", "find_moto", "ACCESS_KEY", "SECRET_KEY"]

ACCESS_KEY = "ckptstore-moto"
SECRET_KEY = "ckptstore-moto-secret-key"


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


class MotoServer(LoopbackServer):
    """One ``moto_server`` process on loopback; ``buckets`` are created at every start."""

    access_key, secret_key = ACCESS_KEY, SECRET_KEY
    stop_timeout = 10.0

    def __init__(self, *, buckets: tuple[str, ...] = (), startup_timeout: float = 60.0, log_path: str | None = None):
        super().__init__()
        self.cmd = find_moto()
        self.buckets = tuple(buckets)
        self.startup_timeout = startup_timeout
        self._dir = None if log_path else tempfile.mkdtemp(prefix="ckptstore-moto-")  # moto keeps no files
        self.log_path = log_path or os.path.join(self._dir, "moto.log")
        self.port: int | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def client(self, *, readonly: bool = False):
        if readonly:
            raise MotoError("moto does not check credentials: there is no read-only identity")
        return super().client()

    def kms_client(self):
        """A botocore KMS client for this server (to create, alias, disable and enable keys)."""
        import botocore.session

        from ._server import REGION

        return botocore.session.get_session().create_client(
            "kms", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key)

    def start(self) -> "MotoServer":
        if self.running:
            return self
        if self.port is None:
            self.port = _free_ports(1)[0]
        self._spawn([*self.cmd, "-H", HOST, "-p", str(self.port)])
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

    def close(self) -> None:
        self.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
