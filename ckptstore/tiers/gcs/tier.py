"""The GCS tier itself: :class:`GCSTier`, the :class:`~ckptstore.tiers.base.Tier` of a GCS prefix.

Writes
------
* ``put`` and ``put_if_absent`` of at most ``part_size`` bytes are one multipart request
  (``uploadType=multipart``); larger bodies (and ``put_file``) are resumable uploads in chunks of
  ``4 * part_size``. The SDK sends a CRC32C or MD5 of
  every body, which the server checks.
* ``put_if_absent`` sends ``ifGenerationMatch=0`` (docs/FORMAT.md, "Conditional writes"): the
  server refuses it with 412 when the object exists, also between retries of the same call — so a
  412 whose stored MD5 is that of our body is our own earlier try (a lost response), not another
  writer's. Before the first one per process and endpoint the probe of ``tiers/_conditional.py``
  checks that the endpoint enforces it.
* ``replace_if_match(key, data, token)`` sends ``ifGenerationMatch=<token>`` (the object's
  generation, :attr:`ObjectInfo.token`): 412 → :class:`PreconditionFailedError`.
* ``open_writer`` and ``open_part_upload`` stream through one resumable upload session per object
  (GCS resumable uploads take chunks in order, each a multiple of 256 KiB but the last; the parts
  go up one after another on a thread of their own). Nothing is visible before the session is
  finalised; an abandoned session expires after a week (cloud.google.com/storage/docs/
  resumable-uploads), so there is nothing for gc to list (``supports_multipart`` is False).
  Every streamed and file upload is verified with a metadata GET: the stored size must equal the
  bytes sent.

Reads are single GETs with ``Range`` (``get``), coalesced ranged GETs in parallel (``get_ranges``),
and ranged GETs of ``part_size`` in parallel into the file for ``get_file``, all pinned to the
generation first seen (a replaced object fails the read: :class:`TransientStorageError`).
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import hashlib
import os
import threading
from typing import Iterator, Sequence

from google.api_core import exceptions as gex

from ... import _faults
from ...errors import (
    IntegrityError,
    ObjectExistsError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageError,
    TransientStorageError,
)
from .. import _conditional
from .._io import Slice, coalesced_get_ranges, pwrite_all, run_bounded
from .._parts import PartWriter
from .._url import check_listing_prefix
from ..base import ObjectInfo, ObjectWriter, PartLimits, PartUpload, Tier
from .client import SDK_ERRORS, Connection, parse_gs_url

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
#: GCS resumable uploads: every chunk but the last a multiple of 256 KiB; objects up to 5 TiB
CHUNK_MULTIPLE = 256 * KiB
MAX_OBJECT = 5 << 40
#: ``CKPTSTORE_GCS_CONDITIONAL_WRITES``: the default of ``GCSTier(conditional_writes=...)``
CONDITIONAL_WRITES_ENV = "CKPTSTORE_GCS_CONDITIONAL_WRITES"


def _restore(url: str, kwargs: dict) -> "GCSTier":
    return GCSTier(url, **kwargs)


def _md5_hex(b64: str | None) -> str | None:
    return base64.b64decode(b64).hex() if b64 else None


class GCSTier(Tier):
    """Objects under ``gs://bucket/prefix/``; see the package and module docstrings.

    Parameters: ``project`` (else ``GOOGLE_CLOUD_PROJECT`` / the credentials' project),
    ``credentials`` (a ``google.auth`` credentials object; else application default credentials),
    ``endpoint_url`` (the JSON API's endpoint; else ``STORAGE_EMULATOR_HOST``, else Google's),
    ``anonymous`` (no credentials: an emulator at ``endpoint_url``), ``part_size`` (bytes, a multiple
    of 256 KiB, at least 5 MiB: the single-request limit of ``put`` and the first part of a streamed
    upload), ``max_concurrency`` (threads for ranged reads), ``writer_inflight`` (parts buffered
    per writer), ``connect_timeout`` / ``read_timeout`` (seconds, each request), ``deadline``
    (seconds: the SDK retries one call until then), ``coalesce_gap`` / ``max_coalesced``
    (``get_ranges``), ``list_page_size`` (objects per listing request; default the server's, 1000),
    ``conditional_writes`` (``"verify"``: probe once per process that the endpoint enforces
    ``ifGenerationMatch=0``; ``"trust"``: do not; default ``$CKPTSTORE_GCS_CONDITIONAL_WRITES``).
    """

    name = "remote"
    supports_part_upload = True
    supports_conditional_replace = True
    listing_md5 = True  # md5Hash of every object not made by compose

    def __init__(self, url: str, *, project: str | None = None, credentials=None, endpoint_url: str | None = None,
                 anonymous: bool = False, part_size: int = 8 * MiB, max_concurrency: int = 8, writer_inflight: int = 4,
                 connect_timeout: float = 10.0, read_timeout: float = 60.0, deadline: float = 300.0,
                 coalesce_gap: int = 1 * MiB, max_coalesced: int = 64 * MiB, list_page_size: int | None = None,
                 conditional_writes: str | None = None):
        self.bucket, self.prefix = parse_gs_url(url)
        self.url = f"gs://{self.bucket}/{self.prefix}"
        if part_size < 5 * MiB or part_size % CHUNK_MULTIPLE:
            raise ValueError(f"part_size must be a multiple of 256 KiB and at least 5 MiB, got {part_size}")
        conditional_writes = _conditional.mode(conditional_writes, CONDITIONAL_WRITES_ENV)
        self._kwargs = dict(project=project, credentials=credentials, endpoint_url=endpoint_url, anonymous=anonymous,
                            part_size=part_size, max_concurrency=max_concurrency, writer_inflight=writer_inflight,
                            connect_timeout=connect_timeout, read_timeout=read_timeout, deadline=deadline,
                            coalesce_gap=coalesce_gap, max_coalesced=max_coalesced, list_page_size=list_page_size,
                            conditional_writes=conditional_writes)
        self._conn = Connection(self.bucket, self.prefix, self._kwargs)
        self.part_size = part_size
        self.writer_inflight = max(1, int(writer_inflight))
        self.coalesce_gap, self.max_coalesced = coalesce_gap, max_coalesced
        self.list_page_size = list_page_size
        self.conditional_writes = conditional_writes
        self.part_limits = PartLimits(part_size, CHUNK_MULTIPLE, 4 * GiB, 1 << 31, CHUNK_MULTIPLE)

    @classmethod
    def bounded_options(cls, timeout_s: float) -> dict:
        """Connect/read timeouts of a quarter/half of ``timeout_s`` (at most 10 s / 60 s) and a
        retry deadline of ``timeout_s``."""
        return {"connect_timeout": min(10.0, timeout_s / 4), "read_timeout": min(60.0, timeout_s / 2),
                "deadline": float(timeout_s)}

    def __reduce__(self):
        return (_restore, (self.url, dict(self._kwargs)))

    def __repr__(self):
        return f"GCSTier({self.url!r})"

    def close(self) -> None:
        self._conn.close()

    def _call(self, what: str, key: str, fn, *a, **kw):
        c = self._conn
        try:
            return fn(*a, timeout=c.timeout, retry=c.retry, **kw)
        except SDK_ERRORS as e:
            raise c.not_found(e, what, key) from e

    # --- reads ---

    def _get(self, key: str, start: int, end: int | None, generation: int | None = None) -> bytes:
        """Bytes ``[start, end)`` (``end`` None: to the end); a start at or past the end is ``b""``."""
        c = self._conn
        blob = c.bucket.blob(c.name(key), generation=generation)
        try:
            return blob.download_as_bytes(start=start or None, end=None if end is None else end - 1, raw_download=True,
                                          checksum="auto" if not start and end is None else None,
                                          timeout=c.timeout, retry=c.retry)
        except gex.RequestRangeNotSatisfiable:
            return b""
        except SDK_ERRORS as e:
            err = c.not_found(e, "GET of", key)
            if generation is not None and isinstance(err, ObjectNotFoundError):
                err = TransientStorageError(f"object {c.where(key)} changed while it was being read")
            raise err from e

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        s = start or 0
        if s < 0 or (end is not None and end < 0):
            raise ValueError(f"negative range [{start}, {end}) for {key!r}")
        if end is not None and end <= s:
            self.stat(key)  # an empty range of a missing object is still missing
            return b""
        return self._get(key, s, end)

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Ranges in the caller's order; nearby ranges merged and fetched in parallel."""
        self._conn.name(key)
        return coalesced_get_ranges(lambda s, e: self._get(key, s, e), ranges, gap=self.coalesce_gap,
                                    max_bytes=self.max_coalesced, pool=self._conn.pool,
                                    limit=self._conn.max_concurrency, stat=lambda: self.stat(key))

    def _info(self, key: str, blob) -> ObjectInfo:
        return ObjectInfo(key, int(blob.size or 0), blob.updated.timestamp(), blob.etag,
                          token=None if blob.generation is None else str(blob.generation), md5=_md5_hex(blob.md5_hash))

    def stat(self, key: str) -> ObjectInfo:
        c = self._conn
        blob = self._call("metadata GET of", key, c.bucket.get_blob, c.name(key))
        if blob is None:
            c.check_bucket()
            raise ObjectNotFoundError(f"object {c.where(key)} not found", object=key)
        return self._info(key, blob)

    def _pages(self, prefix: str, delimiter: str | None = None):
        c = self._conn
        check_listing_prefix(prefix)
        kw = {"prefix": c.prefix + prefix, "timeout": c.timeout, "retry": c.retry}
        if delimiter:
            kw["delimiter"] = delimiter
        if self.list_page_size:
            kw["page_size"] = self.list_page_size
        return c.client.list_blobs(c.bucket, **kw)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        c = self._conn
        n = len(c.prefix)
        it = self._pages(prefix)
        try:
            for blob in it:
                if blob.name.startswith(c.prefix) and not blob.name.endswith("/"):
                    yield self._info(blob.name[n:], blob)
        except SDK_ERRORS as e:
            raise c.not_found(e, "listing of", prefix) from e

    def list_dir(self, prefix: str = "") -> tuple[list[ObjectInfo], list[str]]:
        """One level (``delimiter="/"``): the objects directly under ``prefix`` and the prefixes below."""
        c = self._conn
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list_dir takes a prefix ending with '/', not {prefix!r}")
        n = len(c.prefix)
        it = self._pages(prefix, "/")
        files = []
        try:
            for blob in it:
                if blob.name.startswith(c.prefix) and not blob.name.endswith("/"):
                    files.append(self._info(blob.name[n:], blob))
            dirs = sorted(p[n:] for p in it.prefixes if p.startswith(c.prefix))
        except SDK_ERRORS as e:
            raise c.not_found(e, "listing of", prefix) from e
        return sorted(files, key=lambda i: i.key), dirs

    def get_file(self, key: str, path: str | os.PathLike) -> None:
        """Download ``key`` into ``path``: ranged GETs of ``part_size`` in parallel, all of the
        generation first seen, then fsync."""
        info = self.stat(key)
        size, gen = info.size, int(info.token) if info.token else None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        ok = False
        try:
            chunk = self.part_size

            def fetch(off):
                end = min(off + chunk, size)
                data = self._get(key, off, end, generation=gen)
                if len(data) != end - off:
                    raise IntegrityError(f"{self._conn.where(key)}: short read at offset {off}", object=key)
                pwrite_all(fd, data, off)

            if size:
                run_bounded(self._conn.pool, fetch, range(0, size, chunk), self._conn.max_concurrency)
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

    def _upload(self, what: str, key: str, body, size: int, **conditions) -> None:
        c = self._conn
        blob = c.blob(key)
        if size > self.part_size:  # a resumable upload in chunks of 4 parts (fewer round trips: 2x on
            blob.chunk_size = 4 * self.part_size  # fake-gcs-server, benchmarks/tier_bench.py; 32 MiB held)
        try:
            blob.upload_from_file(body, size=size, timeout=c.timeout, retry=c.retry, **conditions)
        except SDK_ERRORS as e:
            if isinstance(e, gex.PreconditionFailed):
                raise
            raise c.not_found(e, what, key) from e

    def _verify_size(self, key: str, expected: int) -> None:
        got = self.stat(key).size
        if got != expected:
            raise IntegrityError(f"{self._conn.where(key)} is {got} bytes after upload, expected {expected}", object=key)

    def put(self, key: str, data) -> None:
        self._conn.name(key)
        mv = memoryview(data).cast("B")
        self._upload("upload of", key, Slice(len(mv), buf=mv), len(mv))
        if len(mv) > self.part_size:
            self._verify_size(key, len(mv))

    def check_conditional_writes(self) -> None:
        """Raise :class:`~ckptstore.errors.ConditionalWritesError` unless this endpoint enforces
        ``ifGenerationMatch=0`` under this prefix (``tiers/_conditional.py``; cached per process)."""
        c = self._conn
        _conditional.check((c.endpoint, self.bucket, self.prefix), f"the GCS endpoint {c.endpoint} for {self.url}",
                           "ifGenerationMatch=0", CONDITIONAL_WRITES_ENV, self._put_if_absent, self.get, self.delete)

    def put_if_absent(self, key: str, data) -> None:
        self._conn.name(key)
        if self.conditional_writes == "verify":
            self.check_conditional_writes()
        _faults.point("gcs.put_if_absent")
        self._put_if_absent(key, data)

    def _put_if_absent(self, key: str, data) -> None:
        mv = memoryview(data).cast("B")
        try:
            self._upload("conditional upload of", key, Slice(len(mv), buf=mv), len(mv), if_generation_match=0)
        except gex.PreconditionFailed:
            if self._holds(key, mv):
                return  # an earlier try of this call landed; its response was lost
            raise ObjectExistsError(f"object {self._conn.where(key)} already exists") from None

    def _holds(self, key: str, mv: memoryview) -> bool:
        try:
            md5 = self.stat(key).md5
        except ObjectNotFoundError:
            return False
        return md5 == hashlib.md5(mv, usedforsecurity=False).hexdigest()

    def replace_if_match(self, key: str, data, token: str) -> None:
        """Replace ``key`` only if its generation is still ``token`` (``ifGenerationMatch``)."""
        self._conn.name(key)
        mv = memoryview(data).cast("B")
        try:
            gen = int(token)
        except (TypeError, ValueError):
            raise ValueError(f"{token!r} is not a GCS generation (ObjectInfo.token of this tier)") from None
        try:
            self._upload("conditional replace of", key, Slice(len(mv), buf=mv), len(mv), if_generation_match=gen)
        except gex.PreconditionFailed:
            raise PreconditionFailedError(
                f"object {self._conn.where(key)} changed or was deleted since generation {token}: another writer "
                "replaced it first; nothing was written", object=key) from None

    def open_writer(self, key: str) -> ObjectWriter:
        self._conn.name(key)
        return PartWriter(self, key, self.writer_inflight)

    def open_part_upload(self, key: str) -> PartUpload:
        return _ResumableParts(self, key)

    def put_file(self, key: str, path: str | os.PathLike, size: int | None = None) -> None:
        """Upload a local file (one request up to ``part_size``, else a resumable upload); verified."""
        self._conn.name(key)
        fd = os.open(path, os.O_RDONLY)
        try:
            actual = os.fstat(fd).st_size
            if size is None:
                size = actual
            elif size != actual:
                raise StorageError(f"{os.fspath(path)!r} is {actual} bytes, expected {size}")
            self._upload("upload of", key, Slice(size, fd=fd), size)
        finally:
            os.close(fd)
        self._verify_size(key, size)

    def delete(self, key: str) -> None:
        c = self._conn
        try:
            c.blob(key).delete(timeout=c.timeout, retry=c.retry)
        except gex.NotFound:
            return
        except SDK_ERRORS as e:
            raise c.error(e, "DELETE of", key) from e


class _ResumableParts(PartUpload):
    """:meth:`GCSTier.open_part_upload`: one resumable session fed in order (``BlobWriter``), the
    parts read and sent one after another on a thread of this upload (see the module docstring)."""

    def __init__(self, tier: GCSTier, key: str):
        tier._conn.name(key)
        self._tier = tier
        self.key = key
        self._exec = cf.ThreadPoolExecutor(1, thread_name_prefix="ckptstore-gcs-upload")
        self._writer = None
        self._futures: list[cf.Future] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def parts(self) -> int:
        return len(self._futures)

    def _write(self, number: int, read) -> int:
        if self._closed:
            raise StorageError(f"upload of {self._tier._conn.where(self.key)} was aborted")
        data = read()
        _faults.point("gcs.part")
        c = self._tier._conn
        try:
            if self._writer is None:
                # chunks of 4 parts, as _upload (the session buffers one chunk: 32 MiB by default)
                self._writer = c.blob(self.key).open("wb", chunk_size=4 * self._tier.part_size, ignore_flush=True,
                                                   retry=c.retry, timeout=c.timeout)
            self._writer.write(data)
        except SDK_ERRORS as e:
            raise c.not_found(e, f"upload of part {number} of", self.key) from e
        return len(data)

    def send(self, number: int, read) -> cf.Future:
        if self._closed:
            raise StorageError(f"upload of {self._tier._conn.where(self.key)} is already completed or aborted")
        if number != len(self._futures) + 1:
            raise ValueError(f"parts must be sent in order: expected {len(self._futures) + 1}, got {number}")
        prev = self._futures[-1] if self._futures else None

        def job():
            if prev is not None and prev.exception() is not None:  # a part failed: send nothing after it
                raise prev.exception()
            return self._write(number, read)

        fut = self._exec.submit(job)
        self._futures.append(fut)
        return fut

    def complete(self, size: int) -> None:
        c = self._tier._conn
        try:
            if not self._futures:
                raise ValueError("a part upload needs at least one part")
            sent = sum(f.result() for f in self._futures)
            if sent != size:
                raise IntegrityError(f"{c.where(self.key)}: {sent} bytes were sent, expected {size}", object=self.key)
            try:
                self._writer.close()  # the last chunk finalises the object
            except SDK_ERRORS as e:
                raise c.not_found(e, "completing upload of", self.key) from e
            self._tier._verify_size(self.key, size)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._exec.shutdown(wait=False)

    def abort(self) -> None:
        self._closed = True
        for f in self._futures:
            f.cancel()
        cf.wait(self._futures)  # no part is sent after the abort
        w, self._writer = self._writer, None
        if w is not None and not w.closed:
            try:  # cancel the session (else closing the writer, even by the collector, would finalise it)
                w.terminate()
            except Exception:  # noqa: BLE001 - an unfinished session is invisible and expires after a week
                try:
                    w._buffer.close()
                except Exception:  # noqa: BLE001
                    pass
        self._exec.shutdown(wait=False)
