"""Requests and retries of the remote tier: the botocore client, its retry policy, request bodies,
and the one translation of botocore's errors into ckptstore's.

This package is the only part of the library that imports botocore (boto3's core; we need only its
client, so boto3 itself is not imported) for S3; ``ckptstore/kms.py`` imports it for AWS KMS.

Client and retries
------------------
Endpoint, region and credentials come from the standard boto3 chain (``AWS_ENDPOINT_URL``,
``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, profiles, instance roles), or ``endpoint_url=``.
Path-style addressing is used whenever the endpoint is not AWS's own, or the bucket has dots.
The client is created lazily, once per process (the tier is picklable and fork-safe), and is
shared by all threads. botocore retries every request (``standard`` mode, exponential backoff
with jitter, up to ``max_attempts=8`` tries in all; ``retry_mode="adaptive"`` adds client-side
rate limiting). 503 SlowDown and other throttling is therefore retried, and is only surfaced —
as :class:`~ckptstore.errors.TransientStorageError`, never as "not found" or as an empty
listing — once the attempts are used up. A GET whose body breaks off mid-stream (which botocore
does not retry) is retried here, up to 4 times.

Errors
------
Errors are translated once, here, by S3 error *code* and HTTP status (never by message text):
``NoSuchKey``/``404`` → :class:`ObjectNotFoundError` (a ``404`` from HEAD is checked against the
bucket, so a missing bucket is a :class:`StorageError`); ``PreconditionFailed``/``412`` from a
put-if-absent → :class:`ObjectExistsError` (``conditional.py``); throttling codes, 5xx, 429 and
connection errors → :class:`TransientStorageError`; everything else (``AccessDenied``,
``NoSuchBucket``, ``InvalidBucketName``, bad credentials…) → :class:`StorageError`.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
import botocore.exceptions as bce
import botocore.session
from botocore.config import Config

from ..._names import check_key
from ...errors import ObjectNotFoundError, StorageError, TransientStorageError

# --- error translation --------------------------------------------------------------------------

NOT_FOUND = frozenset({"NoSuchKey", "404", "NotFound"})
PRECONDITION = frozenset({"PreconditionFailed", "412"})
CONFLICT = frozenset({"ConditionalRequestConflict", "409"})
TRANSIENT = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "PriorRequestNotComplete",
        "OperationAborted",
        "500",
        "502",
        "503",
        "504",
    }
)
BAD_CREDENTIALS = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
)
CONNECTION_ERRORS = (
    bce.ConnectionError,  # EndpointConnectionError, ConnectionClosedError, timeouts, proxy, SSL
    bce.HTTPClientError,
    bce.ResponseStreamingError,
    bce.IncompleteReadError,
    bce.ReadTimeoutError,
)
#: a response body that broke off mid-stream (botocore does not retry reading it)
BODY_ERRORS = (
    bce.ResponseStreamingError,
    bce.IncompleteReadError,
    bce.ReadTimeoutError,
    bce.ConnectionClosedError,
)
#: what a request may raise: a reply with an error code, or no (complete) reply at all
BOTO_ERRORS = (bce.ClientError, bce.BotoCoreError)


def error_code(e: bce.ClientError) -> tuple[str, int]:
    """``(S3 error code, HTTP status)`` of a reply; the code is the status when the reply has none."""
    err = e.response.get("Error") or {}
    status = (e.response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0
    return str(err.get("Code") or status), int(status)


#: how far a request's signing time may be from the server's (AWS Signature Version 4: 15 minutes;
#: S3 refuses a request outside it with ``RequestTimeTooSkewed``, a HEAD with a bare 403)
SIGV4_MAX_SKEW_S = 15 * 60


def clock_skew(e: bce.ClientError, now: float | None = None) -> float | None:
    """Seconds this host's clock is ahead of the S3 server's (negative: behind), from the reply's
    ``Date`` header (RFC 7231, one-second resolution); None when the reply has none."""
    import email.utils

    date = ((e.response.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}).get("date")
    if not date:
        return None
    try:
        server = email.utils.parsedate_to_datetime(date).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return (time.time() if now is None else now) - server


def _skew_words(skew: float) -> str:
    a = abs(skew)
    n = f"{a / 3600:.1f} h" if a >= 3600 else f"{a / 60:.0f} min"
    return f"{n} {'ahead of' if skew > 0 else 'behind'}"


# --- request bodies (shared by every remote tier: tiers/_io.py) ---------------------------------

from .._io import Slice, body_of, run_bounded  # noqa: E402,F401


# --- the client ---------------------------------------------------------------------------------

_loader_lock = threading.Lock()
_loader: tuple[int, object] | None = None  # (pid, botocore data loader)


def _new_session(profile: str | None) -> botocore.session.Session:
    """A fresh botocore session (so credentials and endpoint are re-read from the chain) that
    shares one service-model loader per process: creating a client then costs ~20 ms, not ~250.
    Call with ``_loader_lock`` held (client creation is serialised; clients are thread-safe)."""
    global _loader
    s = botocore.session.get_session()
    if profile:
        s.set_config_variable("profile", profile)
    if _loader is not None and _loader[0] == os.getpid():
        s.register_component("data_loader", _loader[1])
    else:
        _loader = (os.getpid(), s.get_component("data_loader"))
    return s


class Connection:
    """The requests of one tier to ``s3://bucket/prefix``: :attr:`client` (one botocore client per
    process, made on first use, shared by all threads, never shared with a forked child),
    :attr:`pool` (``max_concurrency`` threads for parts and ranged reads), keys relative to the
    prefix (:meth:`key`, :meth:`where`), :meth:`error` (botocore's exceptions → ckptstore's), and
    the single-request operations every room of the tier uses (HEAD, GET, PUT, DELETE).

    ``config``: the tier's parameters (:class:`~ckptstore.tiers.s3.S3Tier`); this reads
    ``endpoint_url``, ``region_name``, ``profile_name``, ``retry_mode`` / ``max_attempts``
    (botocore's retries: ``max_attempts`` counts every try of a request including the first, i.e.
    botocore's ``total_max_attempts``; ``ValueError`` for values botocore does not take),
    ``connect_timeout`` / ``read_timeout``, ``payload_signing`` and ``max_concurrency``.
    """

    def __init__(self, bucket: str, prefix: str, config: dict):
        if config["max_attempts"] < 1:
            raise ValueError(f"max_attempts must be >= 1, got {config['max_attempts']}")
        if config["retry_mode"] not in ("standard", "adaptive", "legacy"):
            raise ValueError(f"retry_mode must be 'standard' or 'adaptive', got {config['retry_mode']!r}")
        self.bucket, self.prefix = bucket, prefix
        self.url = f"s3://{bucket}/{prefix}"
        self.endpoint_url = config["endpoint_url"]
        self.max_concurrency = max(1, int(config["max_concurrency"]))
        self._config = config
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._client_obj = None
        self._pool_obj: cf.ThreadPoolExecutor | None = None
        self._bucket_ok = False

    # --- per-process resources ---

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # forked: never share a client or threads with the parent
            self._lock = threading.Lock()
            self._client_obj = None
            self._pool_obj = None
            self._pid = os.getpid()

    @property
    def client(self):
        """The botocore S3 client of this process (created on first use; thread-safe)."""
        self._check_pid()
        c = self._client_obj
        if c is None:
            with self._lock:
                c = self._client_obj
                if c is None:
                    c = self._client_obj = self._make_client()
        return c

    def _make_client(self):
        kw = self._config

        def make(session, style: str):
            cfg = Config(
                retries={"mode": kw["retry_mode"], "total_max_attempts": kw["max_attempts"]},
                s3={"addressing_style": style, "payload_signing_enabled": kw["payload_signing"]},
                # explicit, so that AWS_REQUEST_CHECKSUM_CALCULATION=when_required cannot leave an
                # unsigned body without the CRC32 the server checks
                request_checksum_calculation="when_supported",
                max_pool_connections=2 * self.max_concurrency + 8,
                connect_timeout=kw["connect_timeout"],
                read_timeout=kw["read_timeout"],
                tcp_keepalive=True,
                user_agent_extra="ckptstore",
            )
            return session.create_client(
                "s3", region_name=kw["region_name"], endpoint_url=self.endpoint_url, config=cfg
            )

        try:
            with _loader_lock:
                session = _new_session(kw["profile_name"])
                if self.endpoint_url or "." in self.bucket:
                    return make(session, "path")
                c = make(session, "auto")
                url = c.meta.endpoint_url or ""
                host = url.split("://", 1)[-1].split("/", 1)[0].split(":")[0]
                if not host.endswith((".amazonaws.com", ".amazonaws.com.cn")):
                    c.close()
                    c = make(session, "path")  # an endpoint from the environment or a profile
                return c
        except bce.BotoCoreError as e:
            raise StorageError(f"cannot create an S3 client for {self.url}: {e}") from e

    @property
    def pool(self) -> cf.ThreadPoolExecutor:
        """The worker threads of this process (created on first use)."""
        self._check_pid()
        p = self._pool_obj
        if p is None:
            with self._lock:
                p = self._pool_obj
                if p is None:
                    p = self._pool_obj = cf.ThreadPoolExecutor(
                        self.max_concurrency, thread_name_prefix="ckptstore-s3"
                    )
        return p

    def close(self) -> None:
        self._check_pid()
        with self._lock:
            pool, self._pool_obj = self._pool_obj, None
            client, self._client_obj = self._client_obj, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if client is not None:
            client.close()

    # --- keys and errors ---

    def key(self, key: str) -> str:
        """The S3 key of the tier key ``key`` (validated: :func:`ckptstore._names.check_key`)."""
        return self.prefix + check_key(key)

    def where(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{key}"

    def error(self, e: BaseException, what: str, key: str) -> Exception:
        """The ckptstore exception for a boto error (translated by code, never by message)."""
        where = self.where(key)
        if isinstance(e, bce.ClientError):
            code, status = error_code(e)
            msg = (e.response.get("Error") or {}).get("Message") or ""
            detail = f"{code} (HTTP {status}){': ' + msg if msg else ''}"
            if code in NOT_FOUND:
                return ObjectNotFoundError(f"object {where} not found", object=key)
            if code in TRANSIENT or status >= 500 or status == 429:
                return TransientStorageError(
                    f"S3 {what} {where} failed after retries: {detail}; try again later"
                )
            skew = clock_skew(e) if status == 403 else None
            if code == "RequestTimeTooSkewed" or (skew is not None and abs(skew) > SIGV4_MAX_SKEW_S):
                # a HEAD has no body: its bare 403 reads like a permissions problem unless the clocks are compared
                off = f"this host's clock is {_skew_words(skew)} the S3 server's" if skew is not None else \
                    "this host's clock is too far from the S3 server's"
                # transient: the clock comes back (NTP), and meanwhile a restore the local roots can serve
                # must not fail on it, as while S3 is down
                return TransientStorageError(
                    f"S3 {what} {where} refused: {off} ({detail}); S3 accepts a signed request only within "
                    f"{SIGV4_MAX_SKEW_S // 60} minutes of its own time: fix the host's clock (NTP) and retry"
                )
            if code in ("AccessDenied", "403", "AllAccessDisabled"):
                return StorageError(
                    f"S3 {what} {where}: access denied ({detail}); "
                    "check the credentials and the bucket policy"
                )
            if code in BAD_CREDENTIALS:
                return StorageError(f"S3 {what} {where}: credentials rejected ({detail})")
            if code == "NoSuchBucket":
                return StorageError(f"S3 bucket {self.bucket!r} does not exist ({what} {where})")
            return StorageError(f"S3 {what} {where} failed: {detail}")
        if isinstance(e, (bce.NoCredentialsError, bce.PartialCredentialsError)):
            return StorageError(
                f"no S3 credentials for {where}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, or use an instance role"
            )
        if isinstance(e, CONNECTION_ERRORS):
            return TransientStorageError(f"S3 {what} {where} failed after retries: {e}")
        if isinstance(e, bce.BotoCoreError):
            return StorageError(f"S3 {what} {where} failed: {e}")
        return e if isinstance(e, Exception) else StorageError(str(e))

    def check_bucket(self) -> None:
        """Raise :class:`StorageError` unless the bucket exists (HEAD 404 cannot tell)."""
        if self._bucket_ok:
            return
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except bce.ClientError as e:
            code, status = error_code(e)
            if code in NOT_FOUND or code == "NoSuchBucket":
                raise StorageError(f"S3 bucket {self.bucket!r} does not exist ({self.url})") from e
            raise self.error(e, "checking bucket of", "") from e
        except bce.BotoCoreError as e:
            raise self.error(e, "checking bucket of", "") from e
        self._bucket_ok = True

    # --- single requests ---

    def head(self, key: str) -> dict:
        full = self.key(key)
        try:
            return self.client.head_object(Bucket=self.bucket, Key=full)
        except BOTO_ERRORS as e:
            err = self.error(e, "HEAD of", key)
            if isinstance(err, ObjectNotFoundError):
                self.check_bucket()
            raise err from e

    def get(self, key: str, rng: str | None, if_match: str | None = None) -> bytes:
        """GET ``key`` (``rng``: an HTTP ``Range`` value; ``if_match``: the ETag it must still
        have, else :class:`TransientStorageError`). A range starting at or past the end is
        ``b""``, like a short ``pread``."""
        kw = {"Bucket": self.bucket, "Key": self.key(key)}
        if rng:
            kw["Range"] = rng
        if if_match:
            kw["IfMatch"] = if_match
        for attempt in range(4):
            try:
                resp = self.client.get_object(**kw)  # botocore retries the request itself
            except bce.ClientError as e:
                code, status = error_code(e)
                if rng and (code == "InvalidRange" or status == 416):
                    return b""  # start at or past the end, like a short pread
                if if_match and code in PRECONDITION:
                    raise TransientStorageError(
                        f"object {self.where(key)} changed while it was being read"
                    ) from e
                raise self.error(e, "GET of", key) from e
            except bce.BotoCoreError as e:
                raise self.error(e, "GET of", key) from e
            try:
                return resp["Body"].read()
            except BODY_ERRORS as e:  # the body broke off mid-stream: botocore does not retry that
                if attempt == 3:
                    raise self.error(e, "GET of", key) from e
                time.sleep(0.1 * 2**attempt)
        raise AssertionError("unreachable")

    def put(self, key: str, body) -> None:
        """One PUT of ``body`` (bytes or a :class:`Slice`); the server checks its Content-Length
        and the CRC32 botocore sends with it."""
        full = self.key(key)
        try:
            self.client.put_object(Bucket=self.bucket, Key=full, Body=body)
        except BOTO_ERRORS as e:
            raise self.error(e, "PUT of", key) from e

    def delete(self, key: str) -> None:
        """DELETE ``key``; a key that is already gone is not an error."""
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key(key))
        except bce.ClientError as e:
            code, _ = error_code(e)
            if code in NOT_FOUND:
                return
            raise self.error(e, "DELETE of", key) from e
        except bce.BotoCoreError as e:
            raise self.error(e, "DELETE of", key) from e
