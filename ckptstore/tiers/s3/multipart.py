"""Multipart uploads of the remote tier: part sizing, the streaming writer, caller-fed uploads,
and the listing and abort of unfinished ones.

* :func:`part_size_for` derives the part size from the object size (≤ ``max_parts`` parts of
  5 MiB–5 GiB); ``put`` and ``put_file`` upload such parts in parallel
  (:meth:`MultipartUploads.upload`).
* ``open_writer`` streams (:class:`_S3Writer`): it buffers up to the part size and does a single
  PUT if the object fits in one part, else a multipart upload whose parts are uploaded in the
  background (at most ``writer_inflight`` parts buffered per writer). The part size doubles every
  ``max_parts // 10`` parts so any object fits in ``max_parts``. The S3 writer replaces an
  existing key (the local tier's refuses); our layout never writes a shard name twice.
* ``open_multipart`` returns a :class:`PartUpload` whose parts the caller cuts and supplies while
  the object is still being produced elsewhere (the streamed upload of a rank object while it is
  written locally, see ``ckptstore/dcp/upload.py``); each part's bytes are read on the tier's
  pool, by a callable that may check them first.
* Every multipart upload is aborted on any failure (including ``KeyboardInterrupt``). Every
  completed multipart upload and every ``put_file`` is verified with HEAD: the stored size must
  equal the bytes we sent. The server checks each part's CRC32, which botocore sends with every
  UploadPart. Leftovers of killed processes are found with :meth:`MultipartUploads.list`
  (``S3Tier.list_multipart_uploads``, used by gc).

Fault points (see :mod:`ckptstore._faults`): ``s3.part`` before each UploadPart, ``s3.complete``
before CompleteMultipartUpload.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading
from typing import Callable, Iterator

import botocore.exceptions as bce

from ... import _faults
from ...errors import IntegrityError, StorageError
from ..base import ObjectWriter
from ..base import PartUpload as _PartUploadABC
from .client import BOTO_ERRORS, Connection, error_code, run_bounded
from .listing import pages

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
MIN_PART_SIZE = 5 * MiB
MAX_PART_SIZE = 5 * GiB
DEFAULT_PART_SIZE = 8 * MiB


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


@dataclasses.dataclass(frozen=True)
class MultipartUploadInfo:
    """An unfinished multipart upload: ``key`` (relative to the tier), ``upload_id``,
    ``initiated`` (POSIX seconds, UTC)."""

    key: str
    upload_id: str
    initiated: float


class MultipartUploads:
    """The multipart requests of one tier (``conn``), at most ``max_parts`` parts per upload."""

    def __init__(self, conn: Connection, max_parts: int):
        self.conn = conn
        self.max_parts = max_parts

    def upload(self, key: str, size: int, part_size: int, body: Callable[[int, int], object]) -> None:
        """Upload ``size`` bytes as parts of ``part_size`` in parallel; aborts on any failure.
        ``body(offset, n)``: the request body of the ``n`` bytes at ``offset``."""
        upload_id = self.create(key)
        try:
            def one(i: int) -> dict:
                off = i * part_size
                n = min(part_size, size - off)
                return self.upload_part(key, upload_id, i + 1, body(off, n))

            count = -(-size // part_size)
            parts = run_bounded(self.conn.pool, one, range(count), self.conn.max_concurrency)
            self.complete(key, upload_id, parts)
        except BaseException:
            self.abort_quietly(key, upload_id)
            raise

    def create(self, key: str) -> str:
        c = self.conn
        try:
            r = c.client.create_multipart_upload(Bucket=c.bucket, Key=c.key(key))
            return r["UploadId"]
        except BOTO_ERRORS as e:
            raise c.error(e, "starting multipart upload of", key) from e

    def upload_part(self, key: str, upload_id: str, number: int, body) -> dict:
        _faults.point("s3.part")
        c = self.conn
        try:
            r = c.client.upload_part(
                Bucket=c.bucket,
                Key=c.key(key),
                UploadId=upload_id,
                PartNumber=number,
                Body=body,
            )
        except BOTO_ERRORS as e:
            raise c.error(e, f"upload of part {number} of", key) from e
        return {"PartNumber": number, "ETag": r["ETag"]}

    def complete(self, key: str, upload_id: str, parts: list[dict]) -> None:
        _faults.point("s3.complete")
        c = self.conn
        try:
            c.client.complete_multipart_upload(
                Bucket=c.bucket,
                Key=c.key(key),
                UploadId=upload_id,
                MultipartUpload={"Parts": sorted(parts, key=lambda p: p["PartNumber"])},
            )
        except BOTO_ERRORS as e:
            raise c.error(e, "completing multipart upload of", key) from e

    def verify_size(self, key: str, expected: int) -> None:
        """HEAD ``key``: raise :class:`IntegrityError` unless ``expected`` bytes are stored."""
        got = int(self.conn.head(key)["ContentLength"])
        if got != expected:
            raise IntegrityError(
                f"{self.conn.where(key)} is {got} bytes after upload, expected {expected}", object=key
            )

    def list(self, prefix: str = "") -> Iterator[MultipartUploadInfo]:
        """Unfinished multipart uploads under ``prefix`` (relative to the tier), all pages."""
        c = self.conn
        n = len(c.prefix)
        for page in pages(c, "list_multipart_uploads", prefix, what="listing multipart uploads of"):
            for u in page.get("Uploads", ()):
                if u["Key"].startswith(c.prefix):
                    yield MultipartUploadInfo(u["Key"][n:], u["UploadId"], u["Initiated"].timestamp())

    def abort(self, key: str, upload_id: str) -> None:
        """Abort one multipart upload; an upload that is already gone is not an error."""
        c = self.conn
        try:
            c.client.abort_multipart_upload(Bucket=c.bucket, Key=c.key(key), UploadId=upload_id)
        except bce.ClientError as e:
            code, _ = error_code(e)
            if code in ("NoSuchUpload", "404", "NoSuchKey"):
                return
            raise c.error(e, "aborting multipart upload of", key) from e
        except bce.BotoCoreError as e:
            raise c.error(e, "aborting multipart upload of", key) from e

    def abort_quietly(self, key: str, upload_id: str) -> None:
        try:
            self.abort(key, upload_id)
        except Exception:
            pass


class _S3Writer(ObjectWriter):
    """Streams one object: a single PUT if it fits in one part, else a multipart upload whose
    parts go up in the background while the caller keeps writing (``part_size`` first, doubling
    every ``max_parts // 10`` parts; at most ``inflight`` parts buffered)."""

    def __init__(self, uploads: MultipartUploads, key: str, part_size: int, inflight: int):
        uploads.conn.key(key)
        self._up = uploads
        self._key = key
        self._part_size = part_size
        self._grow_every = max(1, uploads.max_parts // 10)
        self._buf = bytearray()
        self._size = 0
        self._upload_id: str | None = None
        self._futures: list[cf.Future] = []
        self._sem = threading.BoundedSemaphore(inflight)
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
        up = self._up
        for f in self._futures:  # report a failed part as early as possible
            if f.done() and f.exception() is not None:
                raise f.exception()
        number = len(self._futures) + 1
        if number > up.max_parts:
            raise StorageError(
                f"{up.conn.where(self._key)}: object needs more than max_parts={up.max_parts} parts"
            )
        if self._upload_id is None:
            self._upload_id = up.create(self._key)
        data = bytes(self._buf)
        self._buf = bytearray()
        self._sem.acquire()
        try:
            fut = up.conn.pool.submit(up.upload_part, self._key, self._upload_id, number, data)
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
        up = self._up
        try:
            if self._upload_id is None:
                up.conn.put(self._key, bytes(self._buf))
            else:
                if self._buf:
                    self._flush_part()
                parts = [f.result() for f in self._futures]
                up.complete(self._key, self._upload_id, parts)
                up.verify_size(self._key, self._size)
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
            self._up.abort_quietly(self._key, self._upload_id)


class PartUpload(_PartUploadABC):
    """A multipart upload whose parts the caller cuts while the object is still being produced
    (made by :meth:`S3Tier.open_multipart <ckptstore.tiers.s3.S3Tier.open_multipart>`).

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

    def __init__(self, uploads: MultipartUploads, key: str):
        uploads.conn.key(key)
        self._up = uploads
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
                raise StorageError(f"multipart upload of {self._up.conn.where(self.key)} was aborted")
            if self._create_error is not None:
                raise self._create_error
            if self._upload_id is None:
                try:
                    self._upload_id = self._up.create(self.key)
                except BaseException as e:
                    self._create_error = e
                    raise
            return self._upload_id

    def send(self, number: int, read: Callable[[], bytes]) -> cf.Future:
        """Queue part ``number`` (the next one); its future yields ``{"PartNumber", "ETag"}``."""
        up = self._up
        if self._closed:
            raise StorageError(f"multipart upload of {up.conn.where(self.key)} is already completed or aborted")
        if number != len(self._futures) + 1:
            raise ValueError(f"parts must be sent in order: expected {len(self._futures) + 1}, got {number}")
        if number > up.max_parts:
            raise StorageError(f"{up.conn.where(self.key)}: object needs more than max_parts={up.max_parts} parts")

        def job() -> dict:
            body = read()
            return up.upload_part(self.key, self._id(), number, body)

        fut = up.conn.pool.submit(job)
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
            self._up.complete(self.key, self._id(), parts)
            self._up.verify_size(self.key, size)
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
            self._up.abort_quietly(self.key, upload_id)
