"""The Azure tier itself: :class:`AzureTier`, the :class:`~ckptstore.tiers.base.Tier` of a
container prefix (block blobs).

Writes
------
* ``put`` / ``put_if_absent`` of at most ``part_size`` bytes are one Put Blob, carrying the body's
  MD5 as the blob's ``Content-MD5`` (what the listing reports: ``listing_md5``); larger bodies
  are staged blocks committed with one Put Block List.
* ``put_if_absent`` sends ``If-None-Match: *`` (docs/FORMAT.md, "Conditional writes"): 409
  ``BlobAlreadyExists`` → :class:`ObjectExistsError` — unless the stored MD5 is that of our body
  (an earlier try of this call whose response was lost). Before the first one per process and
  endpoint the probe of ``tiers/_conditional.py`` checks that the endpoint enforces it.
* ``replace_if_match(key, data, token)`` sends ``If-Match: <token>`` (the blob's ETag,
  :attr:`ObjectInfo.token`): 412 ``ConditionNotMet`` or 404 → :class:`PreconditionFailedError`.
* ``open_writer``, ``open_part_upload`` and ``put_file`` stage blocks in parallel (Put Block; ids
  unique per upload, so two writers of one key never mix blocks) and commit them in order (Put
  Block List). Nothing is visible before the commit; uncommitted blocks are discarded by the
  service after a week ("Put Block" in the Blob REST reference), so there is nothing for gc to
  list (``supports_multipart`` is False). Every block upload is verified with a properties GET.

Reads: ranged GETs (``get``), coalesced ranged GETs in parallel (``get_ranges``), and the SDK's
parallel chunked download pinned to one ETag (``get_file``).
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import hashlib
import os
import secrets
import threading
from typing import Iterator, Sequence

from azure.core import MatchConditions
from azure.core import exceptions as aex
from azure.storage.blob import BlobBlock, ContentSettings

from ... import _faults
from ...errors import (
    IntegrityError,
    ObjectExistsError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageError,
)
from .. import _conditional
from .._io import Slice, coalesced_get_ranges, run_bounded
from .._parts import PartWriter
from .._url import check_listing_prefix
from ..base import ObjectInfo, ObjectWriter, PartLimits, PartUpload, Tier
from .client import SDK_ERRORS, Connection, parse_az_url

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
#: Put Block: at most 4,000 MiB per block, 50,000 blocks per blob (Blob REST reference)
MAX_BLOCK = 4000 * MiB
MAX_BLOCKS = 50_000
#: ``CKPTSTORE_AZURE_CONDITIONAL_WRITES``: the default of ``AzureTier(conditional_writes=...)``
CONDITIONAL_WRITES_ENV = "CKPTSTORE_AZURE_CONDITIONAL_WRITES"


def _restore(url: str, kwargs: dict) -> "AzureTier":
    return AzureTier(url, **kwargs)


def _md5_hex(v) -> str | None:
    return bytes(v).hex() if v else None


class AzureTier(Tier):
    """Objects under ``az://container/prefix/``; see the package and module docstrings.

    Parameters: ``connection_string``, ``account_name``, ``account_key``, ``credential``,
    ``endpoint_url`` (the account's blob endpoint) — see the package docstring for the order;
    ``part_size`` (bytes: the single Put Blob limit and the block size, at least 1 MiB),
    ``max_concurrency`` (threads for blocks and ranged reads), ``writer_inflight`` (blocks
    buffered per writer), ``connect_timeout`` / ``read_timeout`` (seconds, each request),
    ``max_attempts`` (tries per request, the first included), ``coalesce_gap`` /
    ``max_coalesced`` (``get_ranges``), ``list_page_size`` (blobs per listing request; default
    the service's, 5000), ``conditional_writes`` (``"verify"``: probe once per process that the
    endpoint enforces ``If-None-Match: *``; ``"trust"``: do not; default
    ``$CKPTSTORE_AZURE_CONDITIONAL_WRITES``).
    """

    name = "remote"
    supports_part_upload = True
    supports_conditional_replace = True
    listing_md5 = True  # Content-MD5, set by every single Put Blob

    def __init__(self, url: str, *, connection_string: str | None = None, account_name: str | None = None,
                 account_key: str | None = None, credential=None, endpoint_url: str | None = None,
                 part_size: int = 8 * MiB, max_concurrency: int = 8, writer_inflight: int = 4,
                 connect_timeout: float = 10.0, read_timeout: float = 60.0, max_attempts: int = 8,
                 coalesce_gap: int = 1 * MiB, max_coalesced: int = 64 * MiB, list_page_size: int | None = None,
                 conditional_writes: str | None = None):
        self.container, self.prefix = parse_az_url(url)
        self.url = f"az://{self.container}/{self.prefix}"
        if not 1 * MiB <= part_size <= MAX_BLOCK:
            raise ValueError(f"part_size must be in [1 MiB, 4000 MiB], got {part_size}")
        conditional_writes = _conditional.mode(conditional_writes, CONDITIONAL_WRITES_ENV)
        self._kwargs = dict(connection_string=connection_string, account_name=account_name, account_key=account_key,
                            credential=credential, endpoint_url=endpoint_url, part_size=part_size,
                            max_concurrency=max_concurrency, writer_inflight=writer_inflight,
                            connect_timeout=connect_timeout, read_timeout=read_timeout, max_attempts=max_attempts,
                            coalesce_gap=coalesce_gap, max_coalesced=max_coalesced, list_page_size=list_page_size,
                            conditional_writes=conditional_writes)
        self._conn = Connection(self.container, self.prefix, self._kwargs)
        self.part_size = part_size
        self.writer_inflight = max(1, int(writer_inflight))
        self.coalesce_gap, self.max_coalesced = coalesce_gap, max_coalesced
        self.list_page_size = list_page_size
        self.conditional_writes = conditional_writes
        self.part_limits = PartLimits(part_size, 1, MAX_BLOCK, MAX_BLOCKS)

    @classmethod
    def bounded_options(cls, timeout_s: float) -> dict:
        """Connect/read timeouts of a quarter/half of ``timeout_s`` (at most 10 s / 60 s), 3 tries."""
        return {"connect_timeout": min(10.0, timeout_s / 4), "read_timeout": min(60.0, timeout_s / 2),
                "max_attempts": 3}

    def __reduce__(self):
        return (_restore, (self.url, dict(self._kwargs)))

    def __repr__(self):
        return f"AzureTier({self.url!r})"

    def close(self) -> None:
        self._conn.close()

    # --- reads ---

    def _get(self, key: str, start: int, end: int | None, etag: str | None = None) -> bytes:
        c = self._conn
        kw = {"max_concurrency": 1}
        if start:
            kw["offset"] = start
        if end is not None:
            kw["offset"] = start
            kw["length"] = end - start
        if etag is not None:
            kw.update(etag=etag, match_condition=MatchConditions.IfNotModified)
        try:
            return c.blob(key).download_blob(**kw).readall()
        except aex.HttpResponseError as e:
            if e.status_code == 416:
                return b""  # start at or past the end, like a short pread
            raise c.error(e, "GET of", key) from e
        except SDK_ERRORS as e:
            raise c.error(e, "GET of", key) from e

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        s = start or 0
        if s < 0 or (end is not None and end < 0):
            raise ValueError(f"negative range [{start}, {end}) for {key!r}")
        if end is not None and end <= s:
            self.stat(key)  # an empty range of a missing object is still missing
            return b""
        if not s and end is None:
            c = self._conn
            try:
                return c.blob(key).download_blob(max_concurrency=c.max_concurrency).readall()
            except SDK_ERRORS as e:
                raise c.error(e, "GET of", key) from e
        return self._get(key, s, end)

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        self._conn.name(key)
        return coalesced_get_ranges(lambda s, e: self._get(key, s, e), ranges, gap=self.coalesce_gap,
                                    max_bytes=self.max_coalesced, pool=self._conn.pool,
                                    limit=self._conn.max_concurrency, stat=lambda: self.stat(key))

    @staticmethod
    def _info(key: str, p) -> ObjectInfo:
        etag = str(p.etag or "").strip('"')  # quoted in a properties GET, bare in a listing
        md5 = _md5_hex(getattr(p.content_settings, "content_md5", None))
        return ObjectInfo(key, int(p.size or 0), p.last_modified.timestamp(), etag or None,
                          token=f'"{etag}"' if etag else None, md5=md5)

    def stat(self, key: str) -> ObjectInfo:
        c = self._conn
        try:
            return self._info(key, c.blob(key).get_blob_properties())
        except SDK_ERRORS as e:
            raise c.error(e, "properties GET of", key) from e

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        c = self._conn
        check_listing_prefix(prefix)
        n = len(c.prefix)
        kw = {"results_per_page": self.list_page_size} if self.list_page_size else {}
        try:
            for p in c.container.list_blobs(name_starts_with=c.prefix + prefix, **kw):
                if p.name.startswith(c.prefix) and not p.name.endswith("/"):
                    yield self._info(p.name[n:], p)
        except SDK_ERRORS as e:
            raise c.error(e, "listing of", prefix) from e

    def list_dir(self, prefix: str = "") -> tuple[list[ObjectInfo], list[str]]:
        """One level (``delimiter="/"``): the blobs directly under ``prefix`` and the prefixes below."""
        c = self._conn
        check_listing_prefix(prefix)
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list_dir takes a prefix ending with '/', not {prefix!r}")
        n = len(c.prefix)
        kw = {"results_per_page": self.list_page_size} if self.list_page_size else {}
        files, dirs = [], []
        try:
            for p in c.container.walk_blobs(name_starts_with=c.prefix + prefix, delimiter="/", **kw):
                if not p.name.startswith(c.prefix):
                    continue
                if p.name.endswith("/"):  # a BlobPrefix (never iterated: one level only)
                    dirs.append(p.name[n:])
                else:
                    files.append(self._info(p.name[n:], p))
        except SDK_ERRORS as e:
            raise c.error(e, "listing of", prefix) from e
        return sorted(files, key=lambda i: i.key), sorted(dirs)

    def get_file(self, key: str, path: str | os.PathLike) -> None:
        """Download ``key`` into ``path`` (the SDK's parallel chunked GETs, pinned to one ETag), then fsync."""
        c = self._conn
        ok = False
        try:
            with open(path, "wb") as f:
                try:
                    c.blob(key).download_blob(max_concurrency=c.max_concurrency).readinto(f)
                except SDK_ERRORS as e:
                    raise c.error(e, "GET of", key) from e
                f.flush()
                os.fsync(f.fileno())
            ok = True
        finally:
            if not ok:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    # --- writes ---

    def _put_blob(self, what: str, key: str, mv: memoryview, **conditions) -> None:
        """One Put Blob of ``mv`` (at most ``part_size``), its MD5 as the blob's Content-MD5."""
        c = self._conn
        md5 = bytearray(hashlib.md5(mv, usedforsecurity=False).digest())
        try:
            c.blob(key).upload_blob(Slice(len(mv), buf=mv), length=len(mv), content_settings=ContentSettings(content_md5=md5),
                                    max_concurrency=1, **conditions)
        except (aex.ResourceExistsError, aex.ResourceModifiedError):
            raise
        except aex.ResourceNotFoundError as e:
            if conditions.get("match_condition") is MatchConditions.IfNotModified:
                raise
            raise c.error(e, what, key) from e
        except SDK_ERRORS as e:
            raise c.error(e, what, key) from e

    def _blocks(self, key: str, size: int, body) -> None:
        """Stage ``size`` bytes as blocks of ``part_size`` in parallel (``body(off, n)``), commit, verify."""
        up = _BlockUpload(self, key)
        try:
            n = self.part_size
            run_bounded(self._conn.pool, lambda i: up.stage(i + 1, body(i * n, min(n, size - i * n))),
                        range(-(-size // n)), self._conn.max_concurrency)
            up.commit(-(-size // n), size)
        except BaseException:
            up.abort()
            raise

    def put(self, key: str, data) -> None:
        self._conn.name(key)
        mv = memoryview(data).cast("B")
        if len(mv) <= self.part_size:
            self._put_blob("Put Blob of", key, mv, overwrite=True)
        else:
            self._blocks(key, len(mv), lambda off, n: bytes(mv[off:off + n]))

    def check_conditional_writes(self) -> None:
        """Raise :class:`~ckptstore.errors.ConditionalWritesError` unless this endpoint enforces
        ``If-None-Match: *`` under this prefix (``tiers/_conditional.py``; cached per process)."""
        c = self._conn
        _conditional.check((c.endpoint, self.container, self.prefix), f"the Azure endpoint {c.endpoint} for {self.url}",
                           "If-None-Match: *", CONDITIONAL_WRITES_ENV, self._put_if_absent, self.get, self.delete)

    def put_if_absent(self, key: str, data) -> None:
        self._conn.name(key)
        if self.conditional_writes == "verify":
            self.check_conditional_writes()
        _faults.point("azure.put_if_absent")
        self._put_if_absent(key, data)

    def _put_if_absent(self, key: str, data) -> None:
        mv = memoryview(data).cast("B")
        if len(mv) > self.part_size:
            raise ValueError(f"put_if_absent takes at most part_size={self.part_size} bytes on Azure, got {len(mv)}")
        try:
            self._put_blob("conditional Put Blob of", key, mv, overwrite=False)
        except aex.ResourceExistsError:
            try:
                md5 = self.stat(key).md5
            except ObjectNotFoundError:
                md5 = None
            if md5 == hashlib.md5(mv, usedforsecurity=False).hexdigest():
                return  # an earlier try of this call landed; its response was lost
            raise ObjectExistsError(f"object {self._conn.where(key)} already exists") from None

    def replace_if_match(self, key: str, data, token: str) -> None:
        """Replace ``key`` only if its ETag is still ``token`` (``If-Match``)."""
        self._conn.name(key)
        mv = memoryview(data).cast("B")
        if len(mv) > self.part_size:
            raise ValueError(f"replace_if_match takes at most part_size={self.part_size} bytes on Azure, got {len(mv)}")
        try:
            self._put_blob("conditional replace of", key, mv, overwrite=True, etag=token,
                           match_condition=MatchConditions.IfNotModified)
        except (aex.ResourceModifiedError, aex.ResourceNotFoundError):
            raise PreconditionFailedError(
                f"object {self._conn.where(key)} changed or was deleted since ETag {token}: another writer replaced "
                "it first; nothing was written", object=key) from None

    def open_writer(self, key: str) -> ObjectWriter:
        self._conn.name(key)
        return PartWriter(self, key, self.writer_inflight)

    def open_part_upload(self, key: str) -> PartUpload:
        return _BlockUpload(self, key)

    def put_file(self, key: str, path: str | os.PathLike, size: int | None = None) -> None:
        """Upload a local file: one Put Blob up to ``part_size``, else blocks in parallel; verified."""
        self._conn.name(key)
        fd = os.open(path, os.O_RDONLY)
        try:
            actual = os.fstat(fd).st_size
            if size is None:
                size = actual
            elif size != actual:
                raise StorageError(f"{os.fspath(path)!r} is {actual} bytes, expected {size}")
            if size <= self.part_size:
                self._put_blob("Put Blob of", key, memoryview(os.pread(fd, size, 0)), overwrite=True)
            else:
                self._blocks(key, size, lambda off, n: Slice(n, fd=fd, off=off))
        finally:
            os.close(fd)
        got = self.stat(key).size
        if got != size:
            raise IntegrityError(f"{self._conn.where(key)} is {got} bytes after upload, expected {size}", object=key)

    def delete(self, key: str) -> None:
        c = self._conn
        try:
            c.blob(key).delete_blob()
        except aex.ResourceNotFoundError as e:
            if str(getattr(e, "error_code", "") or "") == "ContainerNotFound":
                raise c.error(e, "DELETE of", key) from e
        except SDK_ERRORS as e:
            raise c.error(e, "DELETE of", key) from e


class _BlockUpload(PartUpload):
    """Staged blocks of one blob (Put Block in parallel on the tier's pool, Put Block List at
    :meth:`complete`); block ids carry a nonce of this upload."""

    def __init__(self, tier: AzureTier, key: str):
        tier._conn.name(key)
        self._tier = tier
        self.key = key
        self._nonce = secrets.token_hex(8)
        self._futures: list[cf.Future] = []
        self._lock = threading.Lock()
        self._closed = False

    def _id(self, number: int) -> str:
        return base64.b64encode(f"{self._nonce}{number:08d}".encode()).decode()

    @property
    def parts(self) -> int:
        return len(self._futures)

    def stage(self, number: int, body) -> int:
        if self._closed:
            raise StorageError(f"upload of {self._tier._conn.where(self.key)} was aborted")
        _faults.point("azure.part")
        c = self._tier._conn
        n = len(body) if isinstance(body, (bytes, bytearray)) else body.seek(0, 2)
        if not isinstance(body, (bytes, bytearray)):
            body.seek(0)
        try:
            c.blob(self.key).stage_block(self._id(number), body, length=n)
        except SDK_ERRORS as e:
            raise c.error(e, f"Put Block {number} of", self.key) from e
        return n

    def send(self, number: int, read) -> cf.Future:
        if self._closed:
            raise StorageError(f"upload of {self._tier._conn.where(self.key)} is already completed or aborted")
        if number != len(self._futures) + 1:
            raise ValueError(f"parts must be sent in order: expected {len(self._futures) + 1}, got {number}")
        if number > MAX_BLOCKS:
            raise StorageError(f"{self._tier._conn.where(self.key)}: object needs more than {MAX_BLOCKS} blocks")
        fut = self._tier._conn.pool.submit(lambda: self.stage(number, read()))
        self._futures.append(fut)
        return fut

    def commit(self, count: int, size: int) -> None:
        c = self._tier._conn
        try:
            c.blob(self.key).commit_block_list([BlobBlock(self._id(i)) for i in range(1, count + 1)])
        except SDK_ERRORS as e:
            raise c.error(e, "Put Block List of", self.key) from e
        got = self._tier.stat(self.key).size
        if got != size:
            raise IntegrityError(f"{c.where(self.key)} is {got} bytes after upload, expected {size}", object=self.key)
        self._closed = True

    def complete(self, size: int) -> None:
        try:
            if not self._futures:
                raise ValueError("a part upload needs at least one part")
            done, _ = cf.wait(self._futures, return_when=cf.FIRST_EXCEPTION)
            for f in done:
                if f.exception() is not None:
                    raise f.exception()
            sent = sum(f.result() for f in self._futures)
            if sent != size:
                raise IntegrityError(f"{self._tier._conn.where(self.key)}: {sent} bytes were staged, expected {size}",
                                     object=self.key)
            self.commit(len(self._futures), size)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        self._closed = True
        for f in self._futures:
            f.cancel()
        cf.wait(self._futures)  # no block is staged after the abort; uncommitted blocks expire
