"""The remote tier itself: :class:`S3Tier`, the :class:`~ckptstore.tiers.base.Tier` of an S3 prefix.

It keeps the tier's parameters, reads (single and ranged GETs, parallel downloads) and the choice
between a single PUT and a multipart upload; each other concern is a room of its own in this
package: ``client.py`` (requests, retries, errors), ``multipart.py``, ``listing.py``,
``conditional.py`` (put-if-absent and its probe), ``url.py``.

Writes
------
* ``put`` is a single PUT up to one part size, else a parallel multipart upload.
* ``put_if_absent`` is a PUT with ``If-None-Match: *`` to an endpoint seen enforcing it
  (``conditional.py``).
* ``replace_if_match`` is a PUT with ``If-Match: "<ETag>"`` (the ``token`` of ``stat``) to an
  endpoint seen enforcing it (``conditional.py``).
* ``open_writer`` streams, ``put_file`` uploads a file's parts in parallel, ``open_multipart``
  takes parts the caller cuts (``multipart.py``). Every multipart upload is aborted on any failure
  and its stored size verified with HEAD. A single PUT is verified by the server itself: it checks
  the Content-Length and the CRC32 checksum botocore sends with every PUT/UploadPart.
"""

from __future__ import annotations

import os
from typing import Iterator, Sequence

from ..._names import check_key
from ...errors import IntegrityError, StorageError
from ..base import ObjectInfo, ObjectWriter, PartLimits, Tier
from . import conditional, listing
from .client import Connection, Slice, body_of, run_bounded
from .multipart import (
    DEFAULT_PART_SIZE,
    MAX_PART_SIZE,
    MIN_PART_SIZE,
    MiB,
    MultipartUploadInfo,
    MultipartUploads,
    PartUpload,
    _S3Writer,
    part_size_for,
)
from .url import parse_s3_url


def _restore(url: str, kwargs: dict) -> "S3Tier":
    return S3Tier(url, **kwargs)


class S3Tier(Tier):
    """Objects under ``s3://bucket/prefix/``; see the package docstring for every rule.

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
    (``conditional.py``); ``"trust"``: do not check (servers known to serialise writers another way).

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
    supports_part_upload = True
    listing_md5 = True  # the ETag of a single PUT is its body's MD5 (listing.py)

    @classmethod
    def bounded_options(cls, timeout_s: float) -> dict:
        """Connect/read timeouts of a quarter/half of ``timeout_s`` (at most botocore's usual 10 s /
        60 s) and 3 tries per request."""
        return {"connect_timeout": min(10.0, timeout_s / 4), "read_timeout": min(60.0, timeout_s / 2),
                "max_attempts": 3}
    #: the endpoint's enforcement of ``If-Match`` is probed before the first replace (``conditional.py``):
    #: one that ignores it raises :class:`~ckptstore.errors.ConditionalWritesError`, never overwrites
    supports_conditional_replace = True

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
        conditional_writes = conditional.mode(conditional_writes)
        self.url = f"s3://{self.bucket}/{self.prefix}"
        if not 1 <= max_parts <= 10000:
            raise ValueError(f"max_parts must be in [1, 10000], got {max_parts}")
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise ValueError(f"part_size must be in [5 MiB, 5 GiB], got {part_size}")
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
        self._conn = Connection(self.bucket, self.prefix, self._kwargs)
        self._uploads = MultipartUploads(self._conn, max_parts)
        self.conditional_writes = conditional_writes
        self.list_page_size = list_page_size
        self.endpoint_url = endpoint_url
        self.max_parts = max_parts
        self.part_size = part_size
        self.max_concurrency = self._conn.max_concurrency
        self.writer_inflight = max(1, int(writer_inflight))
        self.coalesce_gap = coalesce_gap
        self.max_coalesced = max_coalesced

    def __reduce__(self):
        return (_restore, (self.url, dict(self._kwargs)))

    def __repr__(self):
        return f"S3Tier({self.url!r})"

    @property
    def client(self):
        """The botocore S3 client of this process (created on first use; thread-safe)."""
        return self._conn.client

    def close(self) -> None:
        self._conn.close()

    # --- reads ---

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        if start is None and end is None:
            return self._conn.get(key, None)
        s = start or 0
        if s < 0 or (end is not None and end < 0):
            raise ValueError(f"negative range [{start}, {end}) for {key!r}")
        if end is None:
            return self._conn.get(key, f"bytes={s}-" if s else None)
        if end <= s:
            self.stat(key)  # an empty range of a missing object is still missing
            return b""
        return self._conn.get(key, f"bytes={s}-{end - 1}")

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
            return self._conn.get(key, f"bytes={g[0]}-{g[1] - 1}")

        if len(groups) == 1:
            bufs = [fetch(groups[0])]
        else:
            bufs = run_bounded(self._conn.pool, fetch, groups, self.max_concurrency)
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
        h = self._conn.head(key)
        etag = str(h.get("ETag") or "").strip('"') or None
        return ObjectInfo(key, int(h["ContentLength"]), h["LastModified"].timestamp(), etag=etag, token=etag)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        yield from listing.objects(self._conn, prefix, page_size=self.list_page_size)

    def list_dir(self, prefix: str = "") -> tuple[list[ObjectInfo], list[str]]:
        """``list_objects_v2`` with ``Delimiter="/"`` (see :meth:`Tier.list_dir`): one page per
        1,000 entries of this level, whatever lies below it."""
        return listing.one_level(self._conn, prefix, page_size=self.list_page_size)

    def get_file(self, key: str, path: str | os.PathLike) -> None:
        """Download ``key`` into ``path``: parallel ranged GETs (all of one ETag), then fsync."""
        h = self._conn.head(key)
        size, etag = int(h["ContentLength"]), h.get("ETag")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        ok = False
        try:
            if size <= self.part_size:
                data = self._conn.get(key, None, if_match=etag)
                if len(data) != size:
                    raise IntegrityError(
                        f"{self._conn.where(key)}: got {len(data)} bytes, expected {size}", object=key
                    )
                _pwrite_all(fd, data, 0)
            else:
                chunk = self.part_size

                def fetch(off):
                    end = min(off + chunk, size)
                    data = self._conn.get(key, f"bytes={off}-{end - 1}", if_match=etag)
                    if len(data) != min(chunk, size - off):
                        raise IntegrityError(
                            f"{self._conn.where(key)}: short read at offset {off}", object=key
                        )
                    _pwrite_all(fd, data, off)

                run_bounded(self._conn.pool, fetch, range(0, size, chunk), self.max_concurrency)
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

    def put(self, key: str, data) -> None:
        self._conn.key(key)
        mv = memoryview(data).cast("B")
        size = len(mv)
        if size <= self.part_size:
            self._conn.put(key, body_of(data))
        else:
            ps = part_size_for(size, self.max_parts)
            self._uploads.upload(key, size, ps, lambda off, n: Slice(n, buf=mv, off=off))
            self._uploads.verify_size(key, size)

    def put_if_absent(self, key: str, data) -> None:
        conditional.put_if_absent(self._conn, key, data, verify=self.conditional_writes == "verify")

    def replace_if_match(self, key: str, data, token: str) -> None:
        conditional.replace_if_match(self._conn, key, data, token, verify=self.conditional_writes == "verify")

    def check_conditional_writes(self) -> None:
        """Raise :class:`~ckptstore.errors.ConditionalWritesError` unless this endpoint enforces
        put-if-absent under this prefix (``conditional.py``; one probe per process, endpoint, bucket
        and prefix, answer cached). :class:`~ckptstore.errors.TransientStorageError` and other storage
        errors of the probe's requests are raised as they are (and not cached)."""
        conditional.check(self._conn)

    def open_writer(self, key: str) -> ObjectWriter:
        return _S3Writer(self._uploads, key, self.part_size, self.writer_inflight)

    @property
    def part_limits(self) -> PartLimits:
        """S3's: ``part_size`` first, 5 MiB–5 GiB, ``max_parts`` parts (multipart.py)."""
        return PartLimits(self.part_size, MIN_PART_SIZE, MAX_PART_SIZE, self.max_parts)

    def open_part_upload(self, key: str) -> PartUpload:
        """A multipart upload of ``key`` fed part by part by the caller (see :class:`PartUpload`).
        Nothing is sent until the first part runs."""
        return PartUpload(self._uploads, key)

    open_multipart = open_part_upload

    def put_file(self, key: str, path: str | os.PathLike, size: int | None = None) -> None:
        """Upload a local file: multipart with :func:`part_size_for` parts in parallel; verified."""
        self._conn.key(key)
        fd = os.open(path, os.O_RDONLY)
        try:
            actual = os.fstat(fd).st_size
            if size is None:
                size = actual
            elif size != actual:
                raise StorageError(f"{os.fspath(path)!r} is {actual} bytes, expected {size}")
            ps = part_size_for(size, self.max_parts)
            if size <= ps:
                self._conn.put(key, Slice(size, fd=fd))
            else:
                self._uploads.upload(key, size, ps, lambda off, n: Slice(n, fd=fd, off=off))
        finally:
            os.close(fd)
        self._uploads.verify_size(key, size)

    def list_multipart_uploads(self, prefix: str = "") -> Iterator[MultipartUploadInfo]:
        """Unfinished multipart uploads under ``prefix`` (relative to the tier), all pages."""
        return self._uploads.list(prefix)

    def abort_multipart_upload(self, key: str, upload_id: str) -> None:
        """Abort one multipart upload; an upload that is already gone is not an error."""
        self._uploads.abort(key, upload_id)

    def delete(self, key: str) -> None:
        self._conn.delete(key)


def _pwrite_all(fd: int, data, off: int) -> None:
    mv = memoryview(data)
    while len(mv):
        n = os.pwrite(fd, mv, off)
        mv = mv[n:]
        off += n
