"""Requests of the GCS tier: the URL, the per-process ``storage.Client``, timeouts and retries, and
the one translation of the SDK's errors into ckptstore's.

Retries are the SDK's (``google.api_core.retry.Retry``: exponential backoff with jitter on 408,
429, 5xx and connection errors; docs: cloud.google.com/storage/docs/retry-strategy), bounded by
``deadline`` seconds per call; every request has ``(connect_timeout, read_timeout)``. Conditional
requests (``ifGenerationMatch``) are idempotent, so they are retried too. Errors are translated by
exception class and HTTP status, never by message text: 404 → :class:`ObjectNotFoundError` (a
missing bucket is checked and reported as :class:`StorageError`); 408/429/5xx, connection errors
and spent retries → :class:`TransientStorageError`; 401/403 and missing credentials →
:class:`StorageError` saying what to set; everything else → :class:`StorageError`.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import threading

import requests.exceptions as rex
from google.api_core import exceptions as gex
from google.api_core import retry as gretry
from google.auth import exceptions as gaex
from google.cloud import storage
from google.cloud.storage.retry import DEFAULT_RETRY

from ..._names import check_key
from ...errors import IntegrityError, InvalidNameError, ObjectNotFoundError, StorageError, TransientStorageError
from .._url import split_url

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
#: what a request may raise
SDK_ERRORS = (gex.GoogleAPIError, gaex.GoogleAuthError, rex.RequestException, ConnectionError, TimeoutError)

try:  # the SDK's own resumable-media errors (vendored since google-cloud-storage 3.0)
    from google.cloud.storage.exceptions import DataCorruption, InvalidResponse
except ImportError:  # pragma: no cover - older SDKs
    from google.resumable_media import DataCorruption, InvalidResponse  # type: ignore
SDK_ERRORS = SDK_ERRORS + (InvalidResponse, DataCorruption)


def parse_gs_url(url: object) -> tuple[str, str]:
    """``"gs://bucket/a//b"`` → ``("bucket", "a/b/")``; :class:`InvalidNameError` for a bad name
    (bucket names: 3–222 characters of ``[a-z0-9._-]``, starting and ending with a letter or digit,
    each dot-separated part at most 63; cloud.google.com/storage/docs/buckets#naming)."""
    bucket, prefix = split_url(url, "gs", "bucket")
    if not _BUCKET_RE.match(bucket) or any(len(p) > 63 or not p for p in bucket.split(".")) \
            or bucket.startswith("goog"):
        raise InvalidNameError(
            f"invalid GCS bucket name {bucket!r} in {url!r}: 3-222 characters of lowercase letters, digits, "
            "'.', '-' and '_', starting and ending with a letter or digit, not starting with 'goog'")
    return bucket, prefix


class Connection:
    """One tier's requests to ``gs://bucket/prefix``: :attr:`bucket` (a ``storage.Bucket`` of this
    process's client, made on first use, never shared with a forked child), :attr:`pool`
    (``max_concurrency`` threads), :meth:`blob`, :attr:`retry` / :attr:`timeout` for every call,
    and :meth:`error`."""

    def __init__(self, bucket: str, prefix: str, config: dict):
        self.bucket_name, self.prefix = bucket, prefix
        self.url = f"gs://{bucket}/{prefix}"
        self._config = config
        self.max_concurrency = max(1, int(config["max_concurrency"]))
        self.timeout = (float(config["connect_timeout"]), float(config["read_timeout"]))
        if config["deadline"] <= 0:
            raise ValueError(f"deadline must be > 0 seconds, got {config['deadline']}")
        self.retry: gretry.Retry = DEFAULT_RETRY.with_timeout(float(config["deadline"]))
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._client = None
        self._bucket = None
        self._pool: cf.ThreadPoolExecutor | None = None
        self._bucket_ok = False

    @property
    def endpoint(self) -> str:
        """The API endpoint requests go to (for messages and the probe's cache)."""
        return self._config["endpoint_url"] or os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # forked: never share a client or threads with the parent
            self._lock = threading.Lock()
            self._client = self._bucket = self._pool = None
            self._pid = os.getpid()

    @property
    def client(self) -> storage.Client:
        self._check_pid()
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._make_client()
                    self._bucket = self._client.bucket(self.bucket_name)
        return self._client

    @property
    def bucket(self):
        self.client
        return self._bucket

    def _make_client(self) -> storage.Client:
        kw = self._config
        creds = kw["credentials"]
        if creds is None and kw["anonymous"]:
            from google.auth.credentials import AnonymousCredentials

            creds = AnonymousCredentials()
        opts = {"api_endpoint": kw["endpoint_url"]} if kw["endpoint_url"] else None
        try:
            c = storage.Client(project=kw["project"], credentials=creds, client_options=opts)
        except SDK_ERRORS as e:
            raise self.error(e, "connecting for", "") from e
        # the SDK's session pools 10 connections per host: enough for our threads plus listings
        adapter = requests_adapter(2 * self.max_concurrency + 8)
        if adapter is not None and hasattr(c, "_http"):
            c._http.mount("https://", adapter)
            c._http.mount("http://", adapter)
        return c

    @property
    def pool(self) -> cf.ThreadPoolExecutor:
        self._check_pid()
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = cf.ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="ckptstore-gcs")
        return self._pool

    def close(self) -> None:
        with self._lock:
            pool, client = self._pool, self._client
            self._pool = self._client = self._bucket = None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True)
        if client is not None and self._pid == os.getpid():
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass

    # --- keys and errors ---

    def name(self, key: str) -> str:
        """The object name of the tier key ``key`` (validated: :func:`ckptstore._names.check_key`)."""
        return self.prefix + check_key(key)

    def blob(self, key: str):
        return self.bucket.blob(self.name(key))

    def where(self, key: str) -> str:
        return f"gs://{self.bucket_name}/{self.prefix}{key}"

    def error(self, e: BaseException, what: str, key: str) -> Exception:
        """The ckptstore exception for an SDK error (by class and HTTP status, never by message)."""
        where = self.where(key)
        if isinstance(e, gex.RetryError):  # the deadline passed while retrying
            cause = e.cause if e.cause is not None else e
            return TransientStorageError(f"GCS {what} {where} failed after retries for {self._config['deadline']:.0f} s: "
                                         f"{type(cause).__name__}: {cause}; try again later")
        if isinstance(e, DataCorruption):
            return IntegrityError(f"GCS {what} {where}: the checksum of the bytes received does not match ({e})", object=key)
        status = getattr(e, "code", None)
        if isinstance(e, InvalidResponse):
            status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(status, int):
            detail = f"HTTP {status}: {getattr(e, 'message', None) or e}"
            if status == 404:
                return ObjectNotFoundError(f"object {where} not found", object=key)
            if status in (408, 429) or status >= 500:
                return TransientStorageError(f"GCS {what} {where} failed after retries: {detail}; try again later")
            if status in (401, 403):
                return StorageError(f"GCS {what} {where}: access denied ({detail}); check the credentials "
                                    "(application default credentials, GOOGLE_APPLICATION_CREDENTIALS) and the bucket's IAM")
            return StorageError(f"GCS {what} {where} failed: {detail}")
        if isinstance(e, gaex.DefaultCredentialsError):
            return StorageError(f"no GCS credentials for {where}: set GOOGLE_APPLICATION_CREDENTIALS, run "
                                "'gcloud auth application-default login', or point STORAGE_EMULATOR_HOST at an emulator "
                                f"({e})")
        if isinstance(e, (gaex.TransportError, rex.ConnectionError, rex.Timeout, ConnectionError, TimeoutError)):
            return TransientStorageError(f"GCS {what} {where} failed after retries: {type(e).__name__}: {e}")
        if isinstance(e, (gaex.GoogleAuthError, gex.GoogleAPIError, rex.RequestException)):
            return StorageError(f"GCS {what} {where} failed: {type(e).__name__}: {e}")
        return e if isinstance(e, Exception) else StorageError(str(e))

    def not_found(self, e: BaseException, what: str, key: str) -> Exception:
        """:meth:`error`, with a 404 checked against the bucket (a missing bucket is no missing object)."""
        err = self.error(e, what, key)
        if isinstance(err, ObjectNotFoundError):
            self.check_bucket()
        return err

    def check_bucket(self) -> None:
        """Raise :class:`StorageError` unless the bucket exists."""
        if self._bucket_ok:
            return
        try:
            ok = self.bucket.exists(timeout=self.timeout, retry=self.retry)
        except SDK_ERRORS as e:
            raise self.error(e, "checking bucket of", "") from e
        if not ok:
            raise StorageError(f"GCS bucket {self.bucket_name!r} does not exist ({self.url})")
        self._bucket_ok = True


def requests_adapter(pool: int):
    """A ``requests`` adapter pooling ``pool`` connections per host (retries stay the SDK's)."""
    try:
        from requests.adapters import HTTPAdapter
    except ImportError:  # pragma: no cover
        return None
    return HTTPAdapter(pool_connections=pool, pool_maxsize=pool, max_retries=0)
