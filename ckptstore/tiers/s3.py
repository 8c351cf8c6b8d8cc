"""The remote tier: an S3 (or S3-compatible) bucket prefix, ``s3://bucket/prefix``.

This is the only module of the library that imports botocore (boto3's core; we need only its
client, so boto3 itself is not imported).

URL and prefix rules
--------------------
``s3://BUCKET[/PREFIX]`` is parsed literally: it is *not* percent-decoded, and ``?`` or ``#`` are
ordinary characters (``s3://b/a%20b`` means the prefix ``a%20b/``, as with the AWS CLI).

* ``BUCKET`` must be a valid S3 bucket name: 3–63 characters from ``[a-z0-9.-]``, starting and
  ending with a letter or digit, no ``..``, ``.-`` or ``-.``, not shaped like an IP address, and
  without the reserved ``xn--``/``sthree-`` prefixes or ``-s3alias``/``--ol-s3``/``.mrap``/
  ``--x-s3`` suffixes. Buckets with dots are allowed; they are addressed path-style.
* ``PREFIX`` is normalised: empty components are dropped, so leading, trailing and repeated
  slashes do not matter — ``s3://b/runs``, ``s3://b/runs/`` and ``s3://b//runs//`` all mean the
  prefix ``runs/`` (objects under ``runs//x`` written by other tools are not reachable). A
  non-empty prefix always ends in ``/``, so ``s3://b/exp1`` never sees ``exp10/...``.
* Prefix components may contain any printable Unicode (spaces, ``+``, ``%``, ``#``, ``[``…)
  except: control characters, backslash (some servers turn it into ``/``), and the components
  ``.`` / ``..`` (HTTP stacks may collapse them). At most 512 UTF-8 bytes. Anything else raises
  :class:`~ckptstore.errors.InvalidNameError` at construction, before any request is made.

Client, retries, errors
-----------------------
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

Errors are translated once, here, by S3 error *code* and HTTP status (never by message text):
``NoSuchKey``/``404`` → :class:`ObjectNotFoundError` (a ``404`` from HEAD is checked against the
bucket, so a missing bucket is a :class:`StorageError`); ``PreconditionFailed``/``412`` from a
put-if-absent → :class:`ObjectExistsError`; throttling codes, 5xx, 429 and connection errors →
:class:`TransientStorageError`; everything else (``AccessDenied``, ``NoSuchBucket``,
``InvalidBucketName``, bad credentials…) → :class:`StorageError`.

Writes
------
* ``put`` is a single PUT up to one part size, else a parallel multipart upload.
* ``put_if_absent`` is a PUT with ``If-None-Match: *``. Some S3-compatible servers accept the header
  and ignore it (an emulator answered 200 and overwrote, pithings/mountx #19; Ceph's conformance
  suite does not test conditional writes, ceph/s3-tests #583), so before the first ``put_if_absent``
  of a process to an endpoint and prefix the tier checks that the endpoint enforces it: it writes a
  probe key ``probes/put-if-absent.<nonce>`` under the prefix twice with ``If-None-Match: *``,
  expects 412 the second time, and deletes it. The answer is cached per process for that endpoint,
  bucket and prefix. An endpoint that overwrites raises
  :class:`~ckptstore.errors.ConditionalWritesError` from every ``put_if_absent`` (so every remote
  commit is refused), naming the endpoint and the opt-out: ``conditional_writes="trust"`` (or
  ``CKPTSTORE_S3_CONDITIONAL_WRITES=trust``) for servers known to serialise writers another way
  (docs/FORMAT.md, "Conditional writes"). If the PUT was retried by botocore and
  the final answer is 412, the stored object's ETag is compared with the MD5 of our body: an
  earlier attempt of *this* call may have landed with its response lost. A ``409
  ConditionalRequestConflict`` (another conditional write in flight) is retried a few times,
  then reported as :class:`ObjectExistsError`.
* ``open_writer`` streams: it buffers up to the part size and does a single PUT if the object
  fits in one part, else a multipart upload whose parts are uploaded in the background (at most
  ``writer_inflight`` parts buffered per writer). The part size doubles every ``max_parts // 10``
  parts so any object fits in ``max_parts``. The S3 writer replaces an existing key (the local
  tier's refuses); our layout never writes a shard name twice.
* ``put_file`` uses :func:`part_size_for` and uploads parts in parallel straight from the file.
* ``open_multipart`` returns a :class:`PartUpload` whose parts the caller cuts and supplies while
  the object is still being produced elsewhere (the streamed upload of a rank object while it is
  written locally, see ``ckptstore/dcp/upload.py``); each part's bytes are read on the tier's
  pool, by a callable that may check them first.
* Every multipart upload is aborted on any failure (including ``KeyboardInterrupt``). Every
  completed multipart upload and every ``put_file`` is verified with HEAD: the stored size must
  equal the bytes we sent. A single PUT is verified by the server itself: it checks the
  Content-Length and the CRC32 checksum botocore sends with every PUT/UploadPart.
  Leftovers of killed processes are found with :meth:`S3Tier.list_multipart_uploads` (gc).

Fault points (see :mod:`ckptstore._faults`): ``s3.part`` before each UploadPart, ``s3.complete``
before CompleteMultipartUpload, ``s3.put_if_absent`` before the conditional PUT.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import io
import ipaddress
import os
import re
import threading
import time
from typing import Callable, Iterable, Iterator, Sequence

import botocore.exceptions as bce
import botocore.session
from botocore.config import Config

from .. import _faults
from .._names import check_key
from ..errors import (
    ConditionalWritesError,
    IntegrityError,
    InvalidNameError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    TransientStorageError,
)
from .base import ObjectInfo, ObjectWriter, Tier

__all__ = ["S3Tier", "MultipartUploadInfo", "PartUpload", "part_size_for", "parse_s3_url"]

#: ``CKPTSTORE_S3_CONDITIONAL_WRITES``: the default of ``S3Tier(conditional_writes=...)``
CONDITIONAL_WRITES_ENV = "CKPTSTORE_S3_CONDITIONAL_WRITES"
_CONDITIONAL_MODES = ("verify", "trust")
#: (endpoint, bucket, prefix) -> None (enforced) or the reason it is not: the probe's answers
_conditional: dict[tuple[str, str, str], str | None] = {}
_conditional_lock = threading.Lock()

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
MIN_PART_SIZE = 5 * MiB
MAX_PART_SIZE = 5 * GiB
DEFAULT_PART_SIZE = 8 * MiB
MAX_PREFIX_BYTES = 512

# --- part sizing --------------------------------------------------------------------------------


def part_size_for(size: int, max_parts: int = 10000) -> int:
    """Part size for a multipart upload of ``size`` bytes.

    The smallest of 8 MiB, 16 MiB, 32 MiB, … such that the object needs at most ``max_parts``
    parts, clamped to S3's limits [5 MiB, 5 GiB]. Raises :class:`StorageError` when even 5 GiB
    parts are not enough.
    """
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if max_parts < 1:
        raise ValueError(f"max_parts must be >= 1, got {max_parts}")
    part = DEFAULT_PART_SIZE
    while -(-size // part) > max_parts and part < MAX_PART_SIZE:
        part *= 2
    part = min(max(part, MIN_PART_SIZE), MAX_PART_SIZE)
    if -(-size // part) > max_parts:
        raise StorageError(
            f"an object of {size} bytes does not fit in {max_parts} parts of at most 5 GiB"
        )
    return part


# --- URL parsing --------------------------------------------------------------------------------

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_BAD_BUCKET_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_BAD_BUCKET_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")


def _check_bucket(bucket: str, url: str) -> None:
    why = None
    if not _BUCKET_RE.match(bucket):
        why = (
            "must be 3-63 characters of lowercase letters, digits, '.' and '-', "
            "starting and ending with a letter or digit"
        )
    elif ".." in bucket or ".-" in bucket or "-." in bucket:
        why = "must not contain '..', '.-' or '-.'"
    elif bucket.startswith(_BAD_BUCKET_PREFIXES) or bucket.endswith(_BAD_BUCKET_SUFFIXES):
        why = "uses a prefix or suffix reserved by S3"
    else:
        try:
            ipaddress.IPv4Address(bucket)
            why = "must not be formatted as an IP address"
        except ValueError:
            pass
    if why:
        raise InvalidNameError(f"invalid S3 bucket name {bucket!r} in {url!r}: {why}")


def parse_s3_url(url: object) -> tuple[str, str]:
    """``"s3://bucket/a//b"`` → ``("bucket", "a/b/")``; raises :class:`InvalidNameError`.

    See the module docstring for the rules.
    """
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise InvalidNameError(f"remote must be an 's3://bucket/prefix' URL, got {url!r}")
    bucket, _, path = url[len("s3://"):].partition("/")
    if not bucket:
        raise InvalidNameError(f"S3 URL {url!r} has no bucket name; use 's3://bucket/prefix'")
    _check_bucket(bucket, url)
    parts = []
    for comp in path.split("/"):
        if not comp:
            continue
        if comp in (".", ".."):
            raise InvalidNameError(f"S3 prefix in {url!r} must not contain a {comp!r} component")
        bad = [c for c in comp if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c == "\\"]
        if bad:
            raise InvalidNameError(
                f"S3 prefix in {url!r} contains unsupported character {bad[0]!r} "
                "(control characters and backslash are not allowed)"
            )
        try:
            comp.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidNameError(f"S3 prefix in {url!r} is not valid Unicode") from None
        parts.append(comp)
    prefix = "/".join(parts) + "/" if parts else ""
    if len(prefix.encode("utf-8")) > MAX_PREFIX_BYTES:
        n = len(prefix.encode("utf-8"))
        raise InvalidNameError(
            f"S3 prefix in {url!r} is {n} UTF-8 bytes; the limit is {MAX_PREFIX_BYTES}"
        )
    return bucket, prefix


# --- error translation --------------------------------------------------------------------------

_NOT_FOUND = frozenset({"NoSuchKey", "404", "NotFound"})
_PRECONDITION = frozenset({"PreconditionFailed", "412"})
_CONFLICT = frozenset({"ConditionalRequestConflict", "409"})
_TRANSIENT = frozenset(
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
_BAD_CREDENTIALS = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
)
_CONNECTION_ERRORS = (
    bce.ConnectionError,  # EndpointConnectionError, ConnectionClosedError, timeouts, proxy, SSL
    bce.HTTPClientError,
    bce.ResponseStreamingError,
    bce.IncompleteReadError,
    bce.ReadTimeoutError,
)
_BODY_ERRORS = (
    bce.ResponseStreamingError,
    bce.IncompleteReadError,
    bce.ReadTimeoutError,
    bce.ConnectionClosedError,
)


def _code(e: bce.ClientError) -> tuple[str, int]:
    err = e.response.get("Error") or {}
    status = (e.response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0
    return str(err.get("Code") or status), int(status)


@dataclasses.dataclass(frozen=True)
class MultipartUploadInfo:
    """An unfinished multipart upload: ``key`` (relative to the tier), ``upload_id``,
    ``initiated`` (POSIX seconds, UTC)."""

    key: str
    upload_id: str
    initiated: float


# --- request bodies -----------------------------------------------------------------------------


class _Slice(io.RawIOBase):
    """A seekable read-only view of ``[off, off+length)`` of a buffer or a file descriptor.

    botocore reads it (for the checksum and the request), seeks back on retries, and takes the
    length from seek/tell. It never exposes ``fileno`` (botocore would use the whole file's size).
    """

    def __init__(self, length: int, *, buf=None, fd: int | None = None, off: int = 0):
        self._len = length
        self._buf = buf
        self._fd = fd
        self._off = off
        self._pos = 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, offset, whence=0):
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b):
        n = min(len(b), self._len - self._pos)
        if n <= 0:
            return 0
        start = self._off + self._pos
        if self._buf is not None:
            b[:n] = self._buf[start:start + n]
        else:
            data = os.pread(self._fd, n, start)
            if not data:
                raise StorageError("local file shrank while it was being uploaded")
            n = len(data)
            b[:n] = data
        self._pos += n
        return n

    def read(self, size=-1):
        if size is None or size < 0:
            size = self._len - self._pos
        size = max(0, min(size, self._len - self._pos))
        if self._buf is not None:
            start = self._off + self._pos
            self._pos += size
            return bytes(self._buf[start:start + size])
        return super().read(size)


def _run_bounded(pool: cf.Executor, fn: Callable, items: Iterable, limit: int) -> list:
    """``[fn(x) for x in items]`` on ``pool``, at most ``limit`` in flight; stops at the first
    failure (cancels what has not started, waits for what has), and raises it."""
    it = iter(enumerate(items))
    results: dict[int, object] = {}
    running: dict[cf.Future, int] = {}
    error: BaseException | None = None
    try:
        for idx, x in it:
            running[pool.submit(fn, x)] = idx
            if len(running) >= limit:
                break
        while running:
            done, _ = cf.wait(running, return_when=cf.FIRST_EXCEPTION)
            for f in done:
                idx = running.pop(f)
                exc = f.exception()
                if exc is not None:
                    error = error or exc
                else:
                    results[idx] = f.result()
            if error is not None:
                break
            for idx, x in it:
                running[pool.submit(fn, x)] = idx
                if len(running) >= limit:
                    break
    except BaseException as e:  # KeyboardInterrupt while waiting
        error = e
    if error is not None:
        for f in running:
            f.cancel()
        cf.wait(running)
        raise error
    return [results[i] for i in range(len(results))]


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


def _restore(url: str, kwargs: dict) -> "S3Tier":
    return S3Tier(url, **kwargs)


# --- the tier -----------------------------------------------------------------------------------


class S3Tier(Tier):
    """Objects under ``s3://bucket/prefix/``; see the module docstring for every rule.

    Parameters: ``endpoint_url`` (else the boto3 chain), ``region_name``, ``profile_name``,
    ``max_parts`` (per multipart upload), ``part_size`` (streaming writer's first part size and
    the single-PUT threshold of ``put``; at least 5 MiB), ``max_concurrency`` (worker threads per
    process for parts and ranged reads), ``writer_inflight`` (parts buffered per writer),
    ``retry_mode`` / ``max_attempts`` (botocore retries; ``max_attempts`` counts every try of a
    request including the first, i.e. botocore's ``total_max_attempts``), ``coalesce_gap`` /
    ``max_coalesced`` (``get_ranges`` merges ranges closer than the gap into one GET of at most
    that many bytes),
    ``connect_timeout`` / ``read_timeout`` (seconds), ``list_page_size`` (keys per LIST request;
    default: the server's maximum, 1000 on S3), ``payload_signing`` (see below),
    ``conditional_writes``: ``"verify"`` (default, or ``$CKPTSTORE_S3_CONDITIONAL_WRITES``): before the
    first ``put_if_absent`` check once per process that the endpoint enforces ``If-None-Match: *``
    (module docstring); ``"trust"``: do not check (servers known to serialise writers another way).

    Request bodies are not part of the SigV4 signature (``UNSIGNED-PAYLOAD``, botocore's
    ``payload_signing_enabled=False``) unless ``payload_signing=True``: every PUT and UploadPart
    carries the CRC32 checksum botocore computes, which the server verifies, every frame its own
    XXH3 (and with a key an AES-GCM tag) that every reader verifies, and the headers stay signed.
    This is what botocore itself does over https; over plain http (an on-premises endpoint) it
    would otherwise hash every body with SHA-256 on both sides, which measured 0.8 CPU-s of the
    client and 0.3-0.6 CPU-s of the server per 356 MB uploaded (benchmarks/README.md, "Where the time goes").
    """

    name = "remote"
    supports_multipart = True

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        profile_name: str | None = None,
        max_parts: int = 10000,
        part_size: int = DEFAULT_PART_SIZE,
        max_concurrency: int = 8,
        writer_inflight: int = 4,
        retry_mode: str = "standard",
        max_attempts: int = 8,
        coalesce_gap: int = 1 * MiB,
        max_coalesced: int = 64 * MiB,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        list_page_size: int | None = None,
        payload_signing: bool = False,
        conditional_writes: str | None = None,
    ):
        self.bucket, self.prefix = parse_s3_url(url)
        if conditional_writes is None:
            conditional_writes = os.environ.get(CONDITIONAL_WRITES_ENV) or "verify"
        if conditional_writes not in _CONDITIONAL_MODES:
            raise ValueError(f"conditional_writes must be 'verify' or 'trust' (also ${CONDITIONAL_WRITES_ENV}), "
                             f"got {conditional_writes!r}")
        self.url = f"s3://{self.bucket}/{self.prefix}"
        if not 1 <= max_parts <= 10000:
            raise ValueError(f"max_parts must be in [1, 10000], got {max_parts}")
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise ValueError(f"part_size must be in [5 MiB, 5 GiB], got {part_size}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if retry_mode not in ("standard", "adaptive", "legacy"):
            raise ValueError(f"retry_mode must be 'standard' or 'adaptive', got {retry_mode!r}")
        self._kwargs = dict(
            endpoint_url=endpoint_url,
            region_name=region_name,
            profile_name=profile_name,
            max_parts=max_parts,
            part_size=part_size,
            max_concurrency=max_concurrency,
            writer_inflight=writer_inflight,
            retry_mode=retry_mode,
            max_attempts=max_attempts,
            coalesce_gap=coalesce_gap,
            max_coalesced=max_coalesced,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            list_page_size=list_page_size,
            payload_signing=bool(payload_signing),
            conditional_writes=conditional_writes,
        )
        self.conditional_writes = conditional_writes
        self.list_page_size = list_page_size
        self.endpoint_url = endpoint_url
        self.max_parts = max_parts
        self.part_size = part_size
        self.max_concurrency = max(1, int(max_concurrency))
        self.writer_inflight = max(1, int(writer_inflight))
        self.coalesce_gap = coalesce_gap
        self.max_coalesced = max_coalesced
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._client_obj = None
        self._pool_obj: cf.ThreadPoolExecutor | None = None
        self._bucket_ok = False

    def __reduce__(self):
        return (_restore, (self.url, dict(self._kwargs)))

    def __repr__(self):
        return f"S3Tier({self.url!r})"

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
        kw = self._kwargs

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
                "s3", region_name=kw["region_name"], endpoint_url=kw["endpoint_url"], config=cfg
            )

        try:
            with _loader_lock:
                session = _new_session(kw["profile_name"])
                if kw["endpoint_url"] or "." in self.bucket:
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
    def _pool(self) -> cf.ThreadPoolExecutor:
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

    # --- helpers ---

    def _full(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{key}"

    def _error(self, e: BaseException, what: str, key: str) -> Exception:
        """The ckptstore exception for a boto error (translated by code, never by message)."""
        where = self._where(key)
        if isinstance(e, bce.ClientError):
            code, status = _code(e)
            msg = (e.response.get("Error") or {}).get("Message") or ""
            detail = f"{code} (HTTP {status}){': ' + msg if msg else ''}"
            if code in _NOT_FOUND:
                return ObjectNotFoundError(f"object {where} not found", object=key)
            if code in _TRANSIENT or status >= 500 or status == 429:
                return TransientStorageError(
                    f"S3 {what} {where} failed after retries: {detail}; try again later"
                )
            if code in ("AccessDenied", "403", "AllAccessDisabled"):
                return StorageError(
                    f"S3 {what} {where}: access denied ({detail}); "
                    "check the credentials and the bucket policy"
                )
            if code in _BAD_CREDENTIALS:
                return StorageError(f"S3 {what} {where}: credentials rejected ({detail})")
            if code == "NoSuchBucket":
                return StorageError(f"S3 bucket {self.bucket!r} does not exist ({what} {where})")
            return StorageError(f"S3 {what} {where} failed: {detail}")
        if isinstance(e, (bce.NoCredentialsError, bce.PartialCredentialsError)):
            return StorageError(
                f"no S3 credentials for {where}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, or use an instance role"
            )
        if isinstance(e, _CONNECTION_ERRORS):
            return TransientStorageError(f"S3 {what} {where} failed after retries: {e}")
        if isinstance(e, bce.BotoCoreError):
            return StorageError(f"S3 {what} {where} failed: {e}")
        return e if isinstance(e, Exception) else StorageError(str(e))

    def _check_bucket(self) -> None:
        """Raise :class:`StorageError` unless the bucket exists (HEAD 404 cannot tell)."""
        if self._bucket_ok:
            return
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except bce.ClientError as e:
            code, status = _code(e)
            if code in _NOT_FOUND or code == "NoSuchBucket":
                raise StorageError(f"S3 bucket {self.bucket!r} does not exist ({self.url})") from e
            raise self._error(e, "checking bucket of", "") from e
        except bce.BotoCoreError as e:
            raise self._error(e, "checking bucket of", "") from e
        self._bucket_ok = True

    def _head(self, key: str) -> dict:
        full = self._full(key)
        try:
            return self.client.head_object(Bucket=self.bucket, Key=full)
        except (bce.ClientError, bce.BotoCoreError) as e:
            err = self._error(e, "HEAD of", key)
            if isinstance(err, ObjectNotFoundError):
                self._check_bucket()
            raise err from e

    # --- reads ---

    def _get_object(self, key: str, rng: str | None, if_match: str | None = None) -> bytes:
        kw = {"Bucket": self.bucket, "Key": self._full(key)}
        if rng:
            kw["Range"] = rng
        if if_match:
            kw["IfMatch"] = if_match
        for attempt in range(4):
            try:
                resp = self.client.get_object(**kw)  # botocore retries the request itself
            except bce.ClientError as e:
                code, status = _code(e)
                if rng and (code == "InvalidRange" or status == 416):
                    return b""  # start at or past the end, like a short pread
                if if_match and code in _PRECONDITION:
                    raise TransientStorageError(
                        f"object {self._where(key)} changed while it was being read"
                    ) from e
                raise self._error(e, "GET of", key) from e
            except bce.BotoCoreError as e:
                raise self._error(e, "GET of", key) from e
            try:
                return resp["Body"].read()
            except _BODY_ERRORS as e:  # the body broke off mid-stream: botocore does not retry that
                if attempt == 3:
                    raise self._error(e, "GET of", key) from e
                time.sleep(0.1 * 2**attempt)
        raise AssertionError("unreachable")

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        if start is None and end is None:
            return self._get_object(key, None)
        s = start or 0
        if s < 0 or (end is not None and end < 0):
            raise ValueError(f"negative range [{start}, {end}) for {key!r}")
        if end is None:
            return self._get_object(key, f"bytes={s}-" if s else None)
        if end <= s:
            self.stat(key)  # an empty range of a missing object is still missing
            return b""
        return self._get_object(key, f"bytes={s}-{end - 1}")

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Ranges in the caller's order; nearby ranges are merged and fetched in parallel."""
        ranges = [(int(s), int(e)) for s, e in ranges]
        for s, e in ranges:
            if s < 0 or e < s:
                raise ValueError(f"invalid range [{s}, {e}) for {key!r}")
        check_key(key)
        if not ranges:
            return []
        wanted = sorted({r for r in ranges if r[1] > r[0]})
        if not wanted:
            self.stat(key)
            return [b""] * len(ranges)
        groups: list[list[int]] = []  # [start, end]
        where: dict[tuple[int, int], int] = {}
        for s, e in wanted:
            if groups:
                g = groups[-1]
                if s <= g[1] + self.coalesce_gap and max(e, g[1]) - g[0] <= self.max_coalesced:
                    g[1] = max(g[1], e)
                    where[(s, e)] = len(groups) - 1
                    continue
            groups.append([s, e])
            where[(s, e)] = len(groups) - 1

        def fetch(g):
            return self._get_object(key, f"bytes={g[0]}-{g[1] - 1}")

        if len(groups) == 1:
            bufs = [fetch(groups[0])]
        else:
            bufs = _run_bounded(self._pool, fetch, groups, self.max_concurrency)
        out = []
        for s, e in ranges:
            if e <= s:
                out.append(b"")
                continue
            gi = where[(s, e)]
            g0 = groups[gi][0]
            out.append(bytes(memoryview(bufs[gi])[s - g0:e - g0]))
        return out

    def stat(self, key: str) -> ObjectInfo:
        h = self._head(key)
        return ObjectInfo(key, int(h["ContentLength"]), h["LastModified"].timestamp())

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if (
            not isinstance(prefix, str)
            or any(ord(c) < 0x20 for c in prefix)
            or prefix.startswith("/")
        ):
            raise InvalidNameError(f"invalid listing prefix {prefix!r}")
        n = len(self.prefix)
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket,
                Prefix=self.prefix + prefix,
                PaginationConfig={"PageSize": self.list_page_size} if self.list_page_size else {},
            )
            for page in pages:
                for obj in page.get("Contents", ()):
                    k = obj["Key"]
                    if not k.startswith(self.prefix) or k.endswith("/"):
                        continue
                    yield ObjectInfo(k[n:], int(obj["Size"]), obj["LastModified"].timestamp(),
                                     str(obj.get("ETag") or "").strip('"') or None)
        except (bce.ClientError, bce.BotoCoreError) as e:
            raise self._error(e, "LIST of", prefix) from e

    def get_file(self, key: str, path: str | os.PathLike) -> None:
        """Download ``key`` into ``path``: parallel ranged GETs (all of one ETag), then fsync."""
        h = self._head(key)
        size, etag = int(h["ContentLength"]), h.get("ETag")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        ok = False
        try:
            if size <= self.part_size:
                data = self._get_object(key, None, if_match=etag)
                if len(data) != size:
                    raise IntegrityError(
                        f"{self._where(key)}: got {len(data)} bytes, expected {size}", object=key
                    )
                _pwrite_all(fd, data, 0)
            else:
                chunk = self.part_size

                def fetch(off):
                    end = min(off + chunk, size)
                    data = self._get_object(key, f"bytes={off}-{end - 1}", if_match=etag)
                    if len(data) != min(chunk, size - off):
                        raise IntegrityError(
                            f"{self._where(key)}: short read at offset {off}", object=key
                        )
                    _pwrite_all(fd, data, off)

                _run_bounded(self._pool, fetch, range(0, size, chunk), self.max_concurrency)
            os.fsync(fd)
            ok = True
        finally:
            os.close(fd)
            if not ok:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    # --- writes ---

    def _body(self, data) -> object:
        if isinstance(data, bytes):
            return data
        mv = memoryview(data).cast("B")
        return _Slice(len(mv), buf=mv)

    def _verify_size(self, key: str, expected: int) -> None:
        got = self.stat(key).size
        if got != expected:
            raise IntegrityError(
                f"{self._where(key)} is {got} bytes after upload, expected {expected}", object=key
            )

    def put(self, key: str, data) -> None:
        full = self._full(key)
        mv = memoryview(data).cast("B")
        size = len(mv)
        if size <= self.part_size:
            try:
                self.client.put_object(Bucket=self.bucket, Key=full, Body=self._body(data))
            except (bce.ClientError, bce.BotoCoreError) as e:
                raise self._error(e, "PUT of", key) from e
        else:
            ps = part_size_for(size, self.max_parts)
            self._multipart(key, size, ps, lambda off, n: _Slice(n, buf=mv, off=off))
            self._verify_size(key, size)

    def put_if_absent(self, key: str, data) -> None:
        full = self._full(key)
        mv = memoryview(data).cast("B")
        if self.conditional_writes == "verify":
            self.check_conditional_writes()
        self._put_if_absent(key, full, data, mv)

    def check_conditional_writes(self) -> None:
        """Raise :class:`~ckptstore.errors.ConditionalWritesError` unless this endpoint enforces
        put-if-absent under this prefix (module docstring; one probe per process, endpoint, bucket and
        prefix, answer cached). :class:`~ckptstore.errors.TransientStorageError` and other storage
        errors of the probe's requests are raised as they are (and not cached)."""
        where = (str(self.client.meta.endpoint_url), self.bucket, self.prefix)
        with _conditional_lock:
            known = where in _conditional
            why = _conditional.get(where)
        if not known:
            why = self._probe_conditional_writes()
            with _conditional_lock:
                _conditional[where] = why
        if why is not None:
            raise ConditionalWritesError(
                f"the S3 endpoint {where[0]} does not enforce put-if-absent (If-None-Match: *) for "
                f"s3://{self.bucket}/{self.prefix}: {why}. Two writers could both commit one version there, so "
                "ckptstore refuses remote commits. Use a server that answers 412 PreconditionFailed to a "
                "conditional PUT of an existing key (AWS S3, MinIO, SeaweedFS, moto); if the writers of this "
                f"prefix are serialised another way, opt out with {CONDITIONAL_WRITES_ENV}=trust "
                "(or S3Tier(url, conditional_writes='trust'))"
            )

    def _probe_conditional_writes(self) -> str | None:
        """None when a second conditional PUT of a fresh probe key is refused with 412 (and the first
        body stays), else what the endpoint did instead. The probe is deleted either way."""
        from ..manifest.layout import conditional_probe_key

        key = conditional_probe_key()
        full = self._full(key)
        first, second = b"ckptstore put-if-absent probe 1\n", b"ckptstore put-if-absent probe 2\n"
        try:
            try:
                self.client.put_object(Bucket=self.bucket, Key=full, Body=first, IfNoneMatch="*")
            except bce.ClientError as e:
                code, status = _code(e)
                if code in _PRECONDITION and self._is_ours(key, memoryview(first)):
                    pass  # a retried first PUT: the earlier try landed
                elif code in _TRANSIENT or (status >= 500 and status != 501) or status == 429:
                    raise self._error(e, "conditional PUT of", key) from e
                elif code in ("AccessDenied", "403") or code in _BAD_CREDENTIALS or code == "NoSuchBucket":
                    raise self._error(e, "conditional PUT of", key) from e
                else:
                    return f"a conditional PUT of a new key was answered {code} (HTTP {status})"
            except bce.BotoCoreError as e:
                raise self._error(e, "conditional PUT of", key) from e
            for attempt in range(6):
                try:
                    self.client.put_object(Bucket=self.bucket, Key=full, Body=second, IfNoneMatch="*")
                except bce.ClientError as e:
                    code, _status = _code(e)
                    if code in _PRECONDITION:
                        break
                    if code in _CONFLICT and attempt < 5:
                        time.sleep(0.05 * 2**attempt)
                        continue
                    raise self._error(e, "conditional PUT of", key) from e
                except bce.BotoCoreError as e:
                    raise self._error(e, "conditional PUT of", key) from e
                return f"a second conditional PUT of the probe key {self._where(key)} succeeded (expected 412)"
            if self.get(key) != first:
                return f"the probe key {self._where(key)} was overwritten although the second PUT got 412"
            return None
        finally:
            try:
                self.delete(key)
            except Exception:  # noqa: BLE001 - a leftover probe is garbage for gc (probes/, after the grace period)
                pass

    def _put_if_absent(self, key: str, full: str, data, mv: memoryview) -> None:
        for attempt in range(6):
            try:
                _faults.point("s3.put_if_absent")
                self.client.put_object(
                    Bucket=self.bucket, Key=full, Body=self._body(data), IfNoneMatch="*"
                )
                break
            except bce.ClientError as e:
                code, _ = _code(e)
                if code in _PRECONDITION:
                    retried = (e.response.get("ResponseMetadata") or {}).get("RetryAttempts", 0)
                    if retried and self._is_ours(key, mv):
                        break  # an earlier try of this call landed; its response was lost
                    raise ObjectExistsError(f"object {self._where(key)} already exists") from None
                if code in _CONFLICT:  # a concurrent conditional write is in flight
                    if attempt < 5:
                        time.sleep(0.05 * 2**attempt)
                        continue
                    raise ObjectExistsError(
                        f"object {self._where(key)} is being written concurrently by another writer"
                    ) from None
                raise self._error(e, "conditional PUT of", key) from e
            except bce.BotoCoreError as e:
                raise self._error(e, "conditional PUT of", key) from e

    def _is_ours(self, key: str, mv: memoryview) -> bool:
        try:
            etag = str(self._head(key).get("ETag", "")).strip('"')
        except ObjectNotFoundError:
            return False
        return etag == hashlib.md5(mv, usedforsecurity=False).hexdigest()

    def open_writer(self, key: str) -> ObjectWriter:
        return _S3Writer(self, key)

    def open_multipart(self, key: str) -> "PartUpload":
        """A multipart upload of ``key`` fed part by part by the caller (see :class:`PartUpload`).
        Nothing is sent until the first part runs."""
        return PartUpload(self, key)

    def put_file(self, key: str, path: str | os.PathLike, size: int | None = None) -> None:
        """Upload a local file: multipart with :func:`part_size_for` parts in parallel; verified."""
        self._full(key)
        fd = os.open(path, os.O_RDONLY)
        try:
            actual = os.fstat(fd).st_size
            if size is None:
                size = actual
            elif size != actual:
                raise StorageError(f"{os.fspath(path)!r} is {actual} bytes, expected {size}")
            ps = part_size_for(size, self.max_parts)
            if size <= ps:
                try:
                    self.client.put_object(
                        Bucket=self.bucket, Key=self._full(key), Body=_Slice(size, fd=fd)
                    )
                except (bce.ClientError, bce.BotoCoreError) as e:
                    raise self._error(e, "PUT of", key) from e
            else:
                self._multipart(key, size, ps, lambda off, n: _Slice(n, fd=fd, off=off))
        finally:
            os.close(fd)
        self._verify_size(key, size)

    def _multipart(
        self, key: str, size: int, part_size: int, body: Callable[[int, int], object]
    ) -> None:
        """Upload ``size`` bytes as parts of ``part_size`` in parallel; aborts on any failure."""
        upload_id = self._create_upload(key)
        try:
            def one(i: int) -> dict:
                off = i * part_size
                n = min(part_size, size - off)
                return self._upload_part(key, upload_id, i + 1, body(off, n))

            count = -(-size // part_size)
            parts = _run_bounded(self._pool, one, range(count), self.max_concurrency)
            self._complete(key, upload_id, parts)
        except BaseException:
            self._abort_quietly(key, upload_id)
            raise

    def _create_upload(self, key: str) -> str:
        try:
            r = self.client.create_multipart_upload(Bucket=self.bucket, Key=self._full(key))
            return r["UploadId"]
        except (bce.ClientError, bce.BotoCoreError) as e:
            raise self._error(e, "starting multipart upload of", key) from e

    def _upload_part(self, key: str, upload_id: str, number: int, body) -> dict:
        _faults.point("s3.part")
        try:
            r = self.client.upload_part(
                Bucket=self.bucket,
                Key=self._full(key),
                UploadId=upload_id,
                PartNumber=number,
                Body=body,
            )
        except (bce.ClientError, bce.BotoCoreError) as e:
            raise self._error(e, f"upload of part {number} of", key) from e
        return {"PartNumber": number, "ETag": r["ETag"]}

    def _complete(self, key: str, upload_id: str, parts: list[dict]) -> None:
        _faults.point("s3.complete")
        try:
            self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=self._full(key),
                UploadId=upload_id,
                MultipartUpload={"Parts": sorted(parts, key=lambda p: p["PartNumber"])},
            )
        except (bce.ClientError, bce.BotoCoreError) as e:
            raise self._error(e, "completing multipart upload of", key) from e

    def list_multipart_uploads(self, prefix: str = "") -> Iterator[MultipartUploadInfo]:
        """Unfinished multipart uploads under ``prefix`` (relative to the tier), all pages."""
        n = len(self.prefix)
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix
            )
            for page in pages:
                for u in page.get("Uploads", ()):
                    if u["Key"].startswith(self.prefix):
                        yield MultipartUploadInfo(
                            u["Key"][n:], u["UploadId"], u["Initiated"].timestamp()
                        )
        except (bce.ClientError, bce.BotoCoreError) as e:
            raise self._error(e, "listing multipart uploads of", prefix) from e

    def abort_multipart_upload(self, key: str, upload_id: str) -> None:
        """Abort one multipart upload; an upload that is already gone is not an error."""
        try:
            self.client.abort_multipart_upload(
                Bucket=self.bucket, Key=self._full(key), UploadId=upload_id
            )
        except bce.ClientError as e:
            code, _ = _code(e)
            if code in ("NoSuchUpload", "404", "NoSuchKey"):
                return
            raise self._error(e, "aborting multipart upload of", key) from e
        except bce.BotoCoreError as e:
            raise self._error(e, "aborting multipart upload of", key) from e

    def _abort_quietly(self, key: str, upload_id: str) -> None:
        try:
            self.abort_multipart_upload(key, upload_id)
        except Exception:
            pass

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._full(key))
        except bce.ClientError as e:
            code, _ = _code(e)
            if code in _NOT_FOUND:
                return
            raise self._error(e, "DELETE of", key) from e
        except bce.BotoCoreError as e:
            raise self._error(e, "DELETE of", key) from e


class _S3Writer(ObjectWriter):
    """Streams one object: a single PUT if it fits in one part, else a multipart upload whose
    parts go up in the background while the caller keeps writing."""

    def __init__(self, tier: S3Tier, key: str):
        tier._full(key)
        self._tier = tier
        self._key = key
        self._part_size = tier.part_size
        self._grow_every = max(1, tier.max_parts // 10)
        self._buf = bytearray()
        self._size = 0
        self._upload_id: str | None = None
        self._futures: list[cf.Future] = []
        self._sem = threading.BoundedSemaphore(tier.writer_inflight)
        self._done = False

    def write(self, data) -> None:
        if self._done:
            raise ValueError(f"writer for {self._key!r} is already committed or aborted")
        mv = memoryview(data).cast("B")
        self._size += len(mv)
        try:
            while len(mv):
                room = self._part_size - len(self._buf)
                self._buf += mv[:room]
                mv = mv[room:]
                if len(self._buf) >= self._part_size:
                    self._flush_part()
        except BaseException:
            self.abort()
            raise

    def _flush_part(self) -> None:
        t = self._tier
        for f in self._futures:  # report a failed part as early as possible
            if f.done() and f.exception() is not None:
                raise f.exception()
        number = len(self._futures) + 1
        if number > t.max_parts:
            raise StorageError(
                f"{t._where(self._key)}: object needs more than max_parts={t.max_parts} parts"
            )
        if self._upload_id is None:
            self._upload_id = t._create_upload(self._key)
        data = bytes(self._buf)
        self._buf = bytearray()
        self._sem.acquire()
        try:
            fut = t._pool.submit(t._upload_part, self._key, self._upload_id, number, data)
        except BaseException:
            self._sem.release()
            raise
        fut.add_done_callback(lambda _f: self._sem.release())
        self._futures.append(fut)
        if number % self._grow_every == 0:
            self._part_size = min(self._part_size * 2, MAX_PART_SIZE)

    def commit(self) -> None:
        if self._done:
            return
        t = self._tier
        try:
            if self._upload_id is None:
                try:
                    t.client.put_object(
                        Bucket=t.bucket, Key=t._full(self._key), Body=bytes(self._buf)
                    )
                except (bce.ClientError, bce.BotoCoreError) as e:
                    raise t._error(e, "PUT of", self._key) from e
            else:
                if self._buf:
                    self._flush_part()
                parts = [f.result() for f in self._futures]
                t._complete(self._key, self._upload_id, parts)
                t._verify_size(self._key, self._size)
            self._buf = bytearray()
        except BaseException:
            self.abort()
            raise
        self._done = True

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._buf = bytearray()
        for f in self._futures:
            f.cancel()
        cf.wait(self._futures)  # no part may land after the abort
        if self._upload_id is not None:
            self._tier._abort_quietly(self._key, self._upload_id)


class PartUpload:
    """A multipart upload whose parts the caller cuts while the object is still being produced.

    :meth:`send` queues part ``number`` (1, 2, … in order, every part but the last at least 5 MiB)
    on the tier's pool; ``read()`` runs there and returns the part's bytes (it may check them and
    raise). The upload itself is created by the first part that runs, so a caller never waits
    for S3 in :meth:`send`. :meth:`complete` waits for every part — the first failure aborts the
    upload and is raised — completes the upload and checks the stored size with HEAD.
    :meth:`abort` cancels queued parts, waits for running ones (no part lands after it) and
    aborts the upload; it never raises (a failed abort leaves an incomplete upload that
    :meth:`S3Tier.list_multipart_uploads` finds). The server verifies each part's CRC32, which
    botocore sends with every UploadPart.
    """

    def __init__(self, tier: S3Tier, key: str):
        tier._full(key)
        self._tier = tier
        self.key = key
        self._lock = threading.Lock()
        self._upload_id: str | None = None
        self._create_error: BaseException | None = None
        self._futures: list[cf.Future] = []
        self._closed = False

    @property
    def parts(self) -> int:
        """Parts queued so far."""
        return len(self._futures)

    def _id(self) -> str:
        with self._lock:
            if self._closed:
                raise StorageError(f"multipart upload of {self._tier._where(self.key)} was aborted")
            if self._create_error is not None:
                raise self._create_error
            if self._upload_id is None:
                try:
                    self._upload_id = self._tier._create_upload(self.key)
                except BaseException as e:
                    self._create_error = e
                    raise
            return self._upload_id

    def send(self, number: int, read: Callable[[], bytes]) -> cf.Future:
        """Queue part ``number`` (the next one); its future yields ``{"PartNumber", "ETag"}``."""
        t = self._tier
        if self._closed:
            raise StorageError(f"multipart upload of {t._where(self.key)} is already completed or aborted")
        if number != len(self._futures) + 1:
            raise ValueError(f"parts must be sent in order: expected {len(self._futures) + 1}, got {number}")
        if number > t.max_parts:
            raise StorageError(f"{t._where(self.key)}: object needs more than max_parts={t.max_parts} parts")

        def job() -> dict:
            body = read()
            return t._upload_part(self.key, self._id(), number, body)

        fut = t._pool.submit(job)
        self._futures.append(fut)
        return fut

    def complete(self, size: int) -> None:
        """Wait for every part, complete the upload and verify that ``size`` bytes are stored."""
        try:
            if not self._futures:
                raise ValueError("a multipart upload needs at least one part")
            done, _ = cf.wait(self._futures, return_when=cf.FIRST_EXCEPTION)
            for f in done:
                if f.exception() is not None:
                    raise f.exception()
            parts = [f.result() for f in self._futures]
            self._tier._complete(self.key, self._id(), parts)
            self._tier._verify_size(self.key, size)
        except BaseException:
            self.abort()
            raise
        self._closed = True

    def abort(self) -> None:
        with self._lock:
            self._closed = True
            futures = list(self._futures)
        for f in futures:
            f.cancel()
        cf.wait(futures)  # no part may land after the abort
        with self._lock:
            upload_id = self._upload_id
        if upload_id is not None:
            self._tier._abort_quietly(self.key, upload_id)


def _pwrite_all(fd: int, data, off: int) -> None:
    mv = memoryview(data)
    while len(mv):
        n = os.pwrite(fd, mv, off)
        mv = mv[n:]
        off += n
