"""Requests of the Azure tier: the URL, the account and credentials, the per-process
``BlobServiceClient``, timeouts and retries, and the one translation of the SDK's errors.

Retries are the SDK's (``azure.storage.blob.ExponentialRetry``: 408, 429, 500, 502–504 and
connection errors; backoff 1 s, then 1 + 2ⁿ s, ±1 s jitter; ``max_attempts`` tries in all); every
request has ``connect_timeout`` / ``read_timeout``. Errors are translated by exception class, HTTP
status and the service's error code, never by message text: ``BlobNotFound`` (404) →
:class:`ObjectNotFoundError`, ``ContainerNotFound`` → :class:`StorageError`; 408/429/5xx and
connection errors after the retries → :class:`TransientStorageError`; 401/403 →
:class:`StorageError` saying what to check; everything else → :class:`StorageError`.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import threading
from urllib.parse import urlparse

from azure.core import exceptions as aex
from azure.storage.blob import BlobServiceClient, ExponentialRetry

from ..._names import check_key
from ...errors import InvalidNameError, ObjectNotFoundError, StorageError, TransientStorageError
from .._url import split_url

_CONTAINER_RE = re.compile(r"^[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62}$")
SDK_ERRORS = (aex.AzureError, ConnectionError, TimeoutError)


def parse_az_url(url: object) -> tuple[str, str]:
    """``"az://container/a//b"`` → ``("container", "a/b/")``; :class:`InvalidNameError` for a bad
    name (containers: 3–63 characters of ``[a-z0-9-]``, starting with a letter or digit, no two
    hyphens in a row, not ending with one; "Naming and referencing containers" in the Blob REST
    reference)."""
    container, prefix = split_url(url, "az", "container")
    if not _CONTAINER_RE.match(container):
        raise InvalidNameError(
            f"invalid Azure container name {container!r} in {url!r}: 3-63 characters of lowercase letters, "
            "digits and single hyphens, starting and ending with a letter or digit")
    return container, prefix


class Connection:
    """One tier's requests to ``az://container/prefix``: :attr:`container` (a ``ContainerClient``
    of this process's service client, made on first use, never shared with a forked child),
    :attr:`pool` (``max_concurrency`` threads), :meth:`blob`, :meth:`error`."""

    def __init__(self, container: str, prefix: str, config: dict):
        self.container_name, self.prefix = container, prefix
        self.url = f"az://{container}/{prefix}"
        self._config = config
        if int(config["max_attempts"]) < 1:
            raise ValueError(f"max_attempts must be >= 1, got {config['max_attempts']}")
        self.max_concurrency = max(1, int(config["max_concurrency"]))
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._service: BlobServiceClient | None = None
        self._container = None
        self._pool: cf.ThreadPoolExecutor | None = None

    def _check_pid(self) -> None:
        if self._pid != os.getpid():
            self._lock = threading.Lock()
            self._service = self._container = self._pool = None
            self._pid = os.getpid()

    @property
    def container(self):
        self._check_pid()
        if self._container is None:
            with self._lock:
                if self._container is None:
                    self._service = self._make_service()
                    self._container = self._service.get_container_client(self.container_name)
        return self._container

    @property
    def endpoint(self) -> str:
        """The blob endpoint requests go to (for messages and the probe's cache)."""
        return str(getattr(self.container, "primary_endpoint", "") or self.url)

    def _make_service(self) -> BlobServiceClient:
        kw = self._config
        part = int(kw["part_size"])
        common = dict(
            connection_timeout=float(kw["connect_timeout"]), read_timeout=float(kw["read_timeout"]),
            retry_policy=ExponentialRetry(initial_backoff=1, increment_base=2, retry_total=int(kw["max_attempts"]) - 1,
                                          random_jitter_range=1),
            max_single_put_size=part, max_block_size=part, max_single_get_size=part, max_chunk_get_size=part,
            user_agent="ckptstore",
        )
        explicit = kw["account_name"] or kw["endpoint_url"] or kw["credential"] is not None
        cs = kw["connection_string"] or (None if explicit else os.environ.get("AZURE_STORAGE_CONNECTION_STRING"))
        try:
            if cs:
                return BlobServiceClient.from_connection_string(cs, **common)
            account = kw["account_name"] or os.environ.get("AZURE_STORAGE_ACCOUNT")
            endpoint = kw["endpoint_url"] or os.environ.get("AZURE_STORAGE_BLOB_ENDPOINT") or (
                f"https://{account}.blob.core.windows.net" if account else None)
            if not endpoint:
                raise StorageError(
                    f"no Azure storage account for {self.url}: set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT "
                    "(with AZURE_STORAGE_KEY, AZURE_STORAGE_SAS_TOKEN or azure-identity credentials), or pass "
                    "remote_options={'account_name': ...} / {'connection_string': ...}")
            cred = kw["credential"]
            key = kw["account_key"] or os.environ.get("AZURE_STORAGE_KEY")
            if cred is None and key:
                name = account or _account_of(endpoint)
                cred = {"account_name": name, "account_key": key}
            if cred is None and os.environ.get("AZURE_STORAGE_SAS_TOKEN"):
                cred = os.environ["AZURE_STORAGE_SAS_TOKEN"]
            if cred is None:
                try:
                    from azure.identity import DefaultAzureCredential
                except ImportError:
                    raise StorageError(
                        f"no Azure credentials for {self.url}: set AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN, pass "
                        "account_key=/credential=, or install azure-identity for Microsoft Entra ID credentials") from None
                cred = DefaultAzureCredential()
            return BlobServiceClient(endpoint, credential=cred, **common)
        except ValueError as e:  # a malformed connection string or URL
            raise StorageError(f"cannot use the Azure account settings for {self.url}: {e}") from e

    @property
    def pool(self) -> cf.ThreadPoolExecutor:
        self._check_pid()
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = cf.ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="ckptstore-azure")
        return self._pool

    def close(self) -> None:
        with self._lock:
            pool, service = self._pool, self._service
            self._pool = self._service = self._container = None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True)
        if service is not None and self._pid == os.getpid():
            try:
                service.close()
            except Exception:  # noqa: BLE001
                pass

    # --- keys and errors ---

    def name(self, key: str) -> str:
        return self.prefix + check_key(key)

    def blob(self, key: str):
        return self.container.get_blob_client(self.name(key))

    def where(self, key: str) -> str:
        return f"az://{self.container_name}/{self.prefix}{key}"

    def error(self, e: BaseException, what: str, key: str) -> Exception:
        where = self.where(key)
        if isinstance(e, aex.HttpResponseError):
            status = int(e.status_code or 0)
            code = str(getattr(e, "error_code", "") or "")
            detail = f"{code or status} (HTTP {status})"
            if status == 404 or isinstance(e, aex.ResourceNotFoundError):
                if code == "ContainerNotFound":
                    return StorageError(f"Azure container {self.container_name!r} does not exist ({what} {where})")
                return ObjectNotFoundError(f"object {where} not found", object=key)
            if status in (408, 429) or status >= 500:
                return TransientStorageError(f"Azure {what} {where} failed after retries: {detail}; try again later")
            if status in (401, 403) or isinstance(e, aex.ClientAuthenticationError):
                return StorageError(f"Azure {what} {where}: access denied ({detail}); check the account key, SAS "
                                    "token or role assignment, and this host's clock")
            return StorageError(f"Azure {what} {where} failed: {detail}")
        if isinstance(e, (aex.ServiceRequestError, aex.ServiceResponseError, ConnectionError, TimeoutError)):
            return TransientStorageError(f"Azure {what} {where} failed after retries: {type(e).__name__}: {e}")
        if isinstance(e, aex.AzureError):
            return StorageError(f"Azure {what} {where} failed: {type(e).__name__}: {e}")
        return e if isinstance(e, Exception) else StorageError(str(e))


def _account_of(endpoint: str) -> str:
    """The account of a blob endpoint: ``acct.blob.core.windows.net`` or an emulator's path."""
    u = urlparse(endpoint)
    host = u.hostname or ""
    if host.endswith(".blob.core.windows.net") or ".blob." in host:
        return host.split(".", 1)[0]
    return u.path.strip("/").split("/", 1)[0]
