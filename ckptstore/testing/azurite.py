"""A throwaway Azure Blob emulator for tests: Azurite's blob service (the npm package ``azurite``,
pinned in ``scripts/install-azurite.sh``, installed into ``.azurite/`` of the checkout), on
127.0.0.1 only.

It runs ``azurite-blob --blobHost 127.0.0.1 --blobPort P --location DIR --skipApiVersionCheck
--loose --silent --disableTelemetry`` on a free port kept across restarts, with its data in a
directory of its own (:meth:`kill` then :meth:`start` keeps the blobs). The server is SIGKILLed if
the process that started it dies (:mod:`ckptstore.testing._server`). It is ready when the account
answers a container listing. :attr:`env` points the Azure SDK at it the SDK's own way: the
connection string of Azurite's well-known development account (``devstoreaccount1``; its key is
public, learn.microsoft.com/azure/storage/common/storage-use-azurite) in
``AZURE_STORAGE_CONNECTION_STRING``.

The binary is looked up in ``$CKPTSTORE_AZURITE``, in ``.azurite/node_modules/.bin/`` of this
checkout, then on ``PATH`` (``azurite-blob``); it needs ``node``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request

from ._server import HOST, LoopbackServer
from .seaweed import _free_ports

__all__ = ["AzuriteServer", "AzuriteError", "find_azurite", "ACCOUNT", "ACCOUNT_KEY"]

ACCOUNT = "devstoreaccount1"
#: Azurite's documented development key (public; not a secret)
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class AzuriteError(RuntimeError):
    """Azurite could not be found or started; the message has the log tail."""


def find_azurite() -> str:
    """Path of ``azurite-blob`` (see the module docstring), else :class:`AzuriteError`."""
    cands = [os.environ.get("CKPTSTORE_AZURITE"), os.path.join(_CHECKOUT, ".azurite", "node_modules", ".bin", "azurite-blob"),
             shutil.which("azurite-blob")]
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            if shutil.which("node") is None:
                raise AzuriteError("azurite-blob needs node on PATH (Debian package nodejs)")
            return c
    raise AzuriteError("Azurite not found; install it with 'bash scripts/install-azurite.sh' (npm, into .azurite/) "
                       "or set CKPTSTORE_AZURITE=/path/to/azurite-blob")


class AzuriteServer(LoopbackServer):
    """One ``azurite-blob`` process; ``dir`` defaults to a fresh temporary directory (removed by
    :meth:`close`); ``buckets`` (containers) are created at every start."""

    access_key, secret_key = ACCOUNT, ACCOUNT_KEY

    def __init__(self, dir=None, *, binary: str | None = None, startup_timeout: float = 60.0,
                 buckets: tuple[str, ...] = (), log_path=None):
        super().__init__()
        self.binary = binary or find_azurite()
        self._own_dir = dir is None
        self.dir = os.fspath(dir) if dir is not None else tempfile.mkdtemp(prefix="ckptstore-azurite-")
        os.makedirs(self.dir, exist_ok=True)
        self.log_path = os.fspath(log_path) if log_path else os.path.join(self.dir, "azurite.log")
        self.startup_timeout = startup_timeout
        self.buckets = tuple(buckets)
        self.port: int | None = None

    @property
    def endpoint(self) -> str:
        """The blob endpoint of the development account."""
        return f"http://{HOST}:{self.port}/{ACCOUNT}"

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
                f"BlobEndpoint={self.endpoint};")

    @property
    def env(self) -> dict[str, str]:
        """Environment that points the Azure SDK at this server."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def command(self) -> list[str]:
        return [self.binary, "--blobHost", HOST, "--blobPort", str(self.port), "--location", os.path.join(self.dir, "data"),
                "--skipApiVersionCheck", "--loose", "--silent", "--disableTelemetry"]

    def start(self) -> "AzuriteServer":
        if self.running:
            return self
        if self.port is None:
            self.port = _free_ports(1)[0]
        os.makedirs(os.path.join(self.dir, "data"), exist_ok=True)
        self._spawn(self.command(), cwd=self.dir)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise AzuriteError(f"azurite-blob exited during startup; log {self.log_path}:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(f"{self.endpoint}?comp=list", timeout=2).close()
                return
            except urllib.error.HTTPError:  # any answer (403: unsigned) means it serves
                return
            except OSError as e:
                last = e
                time.sleep(0.1)
        raise AzuriteError(f"Azurite at {self.endpoint} did not answer within {self.startup_timeout:.0f}s "
                           f"(last error: {last}); log {self.log_path}:\n{self.log_tail()}")

    def client(self, *, readonly: bool = False):
        """An ``azure.storage.blob.BlobServiceClient`` for this server."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string)

    def create_bucket(self, name: str) -> str:
        """Create the container ``name`` (an existing one is fine); returns it."""
        from azure.core.exceptions import ResourceExistsError

        c = self.client()
        try:
            c.create_container(name)
        except ResourceExistsError:
            pass
        finally:
            c.close()
        return name

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
