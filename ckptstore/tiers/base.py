"""The Tier interface: a flat key→bytes store with put-if-absent.

A *tier* is one place a store lives: the local root (NVMe) or a remote prefix (``s3://``,
``gs://``, ``az://``: the registry in :mod:`ckptstore.tiers`). All use the same layout (see
docs/FORMAT.md). Keys are relative, ``/``-separated, validated by
:func:`ckptstore._names.check_key`; tiers never see an absolute path or ``..``.

Errors are translated once, here at the boundary: a missing key raises
:class:`~ckptstore.errors.ObjectNotFoundError`; put-if-absent on an existing key raises
:class:`~ckptstore.errors.ObjectExistsError`; a refusal that retrying will not fix raises
:class:`~ckptstore.errors.StorageError`; one that may pass on retry raises
:class:`~ckptstore.errors.TransientStorageError`; a full disk raises
:class:`~ckptstore.errors.StorageFullError`.

Optional features are declared, not probed for (zarr's ``supports_*`` properties): a caller checks
:attr:`Tier.supports_multipart` before it calls :meth:`Tier.list_multipart_uploads` /
:meth:`Tier.abort_multipart_upload`, :attr:`Tier.supports_part_upload` (with its
:attr:`Tier.part_limits`) before :meth:`Tier.open_part_upload`,
:attr:`Tier.supports_conditional_replace` before :meth:`Tier.replace_if_match`, and
:attr:`Tier.listing_md5` before it takes a listing's :attr:`ObjectInfo.md5` for the object's
digest; each raises :class:`NotImplementedError` (or the field is None) on tiers without it. Operations that only mean something for a directory tree
(:meth:`Tier.list_empty_dirs`, :meth:`Tier.remove_empty_dir`) are no-ops elsewhere.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import tempfile
from typing import Callable, Iterator, Sequence


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One stored object: ``key`` (relative), ``size`` (bytes), ``mtime`` (POSIX seconds, UTC) and,
    where the tier reports one, ``etag`` (the server's entity tag without quotes, S3's and Azure's;
    None elsewhere) and ``md5``."""

    key: str
    size: int
    mtime: float
    etag: str | None = None
    #: The tier's opaque version token of this object (S3's ETag, GCS's generation, Azure's ETag;
    #: what the local tier's ``stat`` reports): what :meth:`Tier.replace_if_match` compares.
    #: None where the tier's listing does not carry it (ask :meth:`Tier.stat`).
    token: str | None = None
    #: The MD5 (32 lowercase hex digits) of the object's bytes, where the listing and ``stat``
    #: carry it: on a tier with :attr:`Tier.listing_md5`, always for an object written by
    #: :meth:`Tier.put` or :meth:`Tier.put_if_absent` of at most one part (docs/FORMAT.md, "Tiers":
    #: the manifest's digest is read from the listing, not from its bytes). None otherwise.
    md5: str | None = None


@dataclasses.dataclass(frozen=True)
class PartLimits:
    """The part sizes a tier's :meth:`Tier.open_part_upload` takes (bytes).

    ``part_size``: the first part's size (and the size of every part until the caller grows it);
    ``min_part``: every part but the last at least this; ``max_part``: no part larger;
    ``max_parts``: at most this many parts in one upload; ``multiple``: every part but the last a
    multiple of this. Sources: S3 (5 MiB–5 GiB, 10,000 parts: the S3 API reference, "UploadPart"),
    GCS resumable uploads (chunks a multiple of 256 KiB: cloud.google.com/storage/docs/
    performing-resumable-uploads), Azure block blobs (≤ 4,000 MiB per block, 50,000 blocks:
    "Put Block" in the Blob service REST reference)."""

    part_size: int
    min_part: int
    max_part: int
    max_parts: int
    multiple: int = 1

    def __post_init__(self):
        if not (0 < self.min_part <= self.part_size <= self.max_part) or self.max_parts < 1:
            raise ValueError(f"inconsistent part limits {self}")
        if self.part_size % self.multiple:
            raise ValueError(f"part_size {self.part_size} is not a multiple of {self.multiple}")

    def grown(self, size: int, parts_so_far: int) -> int:
        """The part size after ``parts_so_far`` parts of which the last had ``size`` bytes: doubled
        every ``max_parts // 10`` parts (so any object fits in ``max_parts``), at most ``max_part``."""
        if parts_so_far and parts_so_far % max(1, self.max_parts // 10) == 0:
            return min(size * 2, self.max_part - self.max_part % self.multiple)
        return size


class PartUpload(abc.ABC):
    """An upload of one object whose parts the caller cuts while the object is still being produced
    elsewhere (the streamed upload of a rank object while it is written locally,
    ``ckptstore/dcp/upload.py``); made by :meth:`Tier.open_part_upload`.

    :meth:`send` queues part ``number`` (1, 2, … in order; sizes within the tier's
    :attr:`Tier.part_limits`); ``read()`` runs on the tier's threads and returns the part's bytes
    (it may check them and raise). Nothing is visible under the key until :meth:`complete`, which
    waits for every part (the first failure aborts the upload and is raised), makes the object and
    checks that ``size`` bytes are stored. :meth:`abort` cancels queued parts, waits for running
    ones (no part lands after it) and never raises; what a failed abort leaves is invisible under
    the key (S3: an incomplete upload that gc finds, :attr:`Tier.supports_multipart`; GCS: a
    resumable session that expires after a week; Azure: uncommitted blocks the service discards
    after a week)."""

    key: str

    @property
    @abc.abstractmethod
    def parts(self) -> int:
        """Parts queued so far."""

    @abc.abstractmethod
    def send(self, number: int, read: Callable[[], bytes]):
        """Queue part ``number`` (the next one); returns a ``concurrent.futures.Future``."""

    @abc.abstractmethod
    def complete(self, size: int) -> None:
        """Wait for every part, make the object, verify that ``size`` bytes are stored."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard the upload (never raises)."""


class ObjectWriter(abc.ABC):
    """A streaming writer for one object. ``commit()`` makes it durable; ``abort()`` removes it."""

    @abc.abstractmethod
    def write(self, data: bytes | memoryview) -> None: ...

    def flush(self) -> None:
        """Hand buffered bytes to the operating system, so a reader of the object's local file
        (:meth:`Tier.local_path`) sees everything written so far. Not durable; a no-op by default."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Flush and make the object durable (fsync / complete upload)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard the partial object. Never raises for an object that was never created."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class Tier(abc.ABC):
    """A place objects live. ``name`` is ``"local"`` or ``"remote"``; ``url`` is for messages."""

    name: str = "tier"
    url: str = ""
    #: True when the tier has multipart uploads that can outlive a failed writer (S3): they are
    #: listed with :meth:`list_multipart_uploads` and removed with :meth:`abort_multipart_upload`.
    supports_multipart: bool = False
    #: True when :meth:`replace_if_match` is a real compare-and-swap on this tier (a local lock, or
    #: a precondition the server enforces: S3 ``If-Match``, GCS ``ifGenerationMatch``, Azure
    #: ``If-Match``). A tier whose endpoint ignores the precondition must refuse, not overwrite.
    supports_conditional_replace: bool = False
    #: True when :meth:`open_part_upload` streams an object part by part (:class:`PartUpload`),
    #: with the part sizes of :attr:`part_limits`.
    supports_part_upload: bool = False
    part_limits: PartLimits | None = None
    #: True when :meth:`list` / :meth:`list_dir` / :meth:`stat` report :attr:`ObjectInfo.md5` for
    #: every object written by one :meth:`put` / :meth:`put_if_absent` (S3: the ETag of a single
    #: PUT; GCS: ``md5Hash``; Azure: ``Content-MD5``). What lets a reader recognise a manifest it
    #: already holds from the listing alone (docs/FORMAT.md, "Tiers", rule 3).
    listing_md5: bool = False

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float | None = None, **options) -> "Tier":
        """The tier of ``url``, as :func:`ckptstore.tiers.make_remote` builds it: ``options`` are
        the tier's own keyword arguments (its constructor's); ``timeout_s`` bounds every request
        of the tier and its retries to about that many seconds (:meth:`bounded_options`; an
        option given explicitly wins)."""
        if timeout_s is not None:
            options = {**cls.bounded_options(float(timeout_s)), **options}
        return cls(url, **options)

    @classmethod
    def bounded_options(cls, timeout_s: float) -> dict:
        """The constructor options (connect/read timeouts, attempts) under which one request of the
        tier, retries included, takes about ``timeout_s`` seconds at most. Default: none."""
        return {}

    @abc.abstractmethod
    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``key`` (whole object when both are None)."""

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Several ``[start, end)`` ranges of one object, in the order given."""
        return [self.get(key, s, e) for s, e in ranges]

    @abc.abstractmethod
    def put(self, key: str, data: bytes | memoryview) -> None:
        """Write ``key`` atomically and durably, replacing any existing object."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        """Write ``key`` atomically and durably only if it does not exist.

        Raises :class:`ObjectExistsError` if it exists. Two racing callers: exactly one wins.
        """

    def replace_if_match(self, key: str, data: bytes | memoryview, token: str) -> None:
        """Replace ``key`` atomically and durably, only if it still holds the object whose version
        token (:attr:`ObjectInfo.token` from :meth:`stat`) is ``token``.

        Raises :class:`~ckptstore.errors.PreconditionFailedError` when the object was replaced or
        deleted since (another writer won; nothing was written), and :class:`NotImplementedError`
        on a tier without :attr:`supports_conditional_replace`.
        """
        raise NotImplementedError(f"the {self.name} tier has no conditional replace")

    @abc.abstractmethod
    def open_writer(self, key: str) -> ObjectWriter:
        """A streaming writer for a new object (used for shard objects)."""

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size and modification time; raises :class:`ObjectNotFoundError`."""

    def exists(self, key: str) -> bool:
        from ..errors import ObjectNotFoundError

        try:
            self.stat(key)
            return True
        except ObjectNotFoundError:
            return False

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (all pages), in no particular order."""

    def list_dir(self, prefix: str = "") -> tuple[list[ObjectInfo], list[str]]:
        """One level of the layout under ``prefix`` (``""`` or ending with ``/``): the objects whose
        key has no further ``/`` after it, and the prefixes (``prefix + name + "/"``) of the deeper
        ones, sorted — S3's ListObjectsV2 with ``Delimiter="/"``. What a catalogue lists to learn
        which versions a tier holds without walking their objects (docs/FORMAT.md, "Restore
        choice"). This default derives it from :meth:`list`; tiers answer it in one request."""
        files, dirs = [], set()
        for info in self.list(prefix):
            rest = info.key[len(prefix):]
            if "/" in rest:
                dirs.add(prefix + rest.split("/", 1)[0] + "/")
            else:
                files.append(info)
        return sorted(files, key=lambda i: i.key), sorted(dirs)

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing key is not an error."""

    def put_file(self, key: str, path: str | os.PathLike, size: int | None = None) -> None:
        """Upload/copy a local file to ``key`` (durable). Default: read and ``put``."""
        with open(path, "rb") as f:
            self.put(key, f.read())

    def get_file(self, key: str, path: str | os.PathLike) -> None:
        """Download ``key`` into local file ``path`` (written whole, then fsync'd)."""
        data = self.get(key)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def put_verified(self, key: str, fill: Callable[[str], None],
                     verify: Callable[[Callable[[int, int], bytes], int], None]) -> None:
        """Replace ``key`` with a new copy, but only once the copy has been checked.

        ``fill(path)`` writes the new copy into the local file ``path``; ``verify(read, size)``
        checks it (``read(offset, n) -> bytes``) and raises to refuse it, in which case the stored
        object is left as it was. Used by repair. Default: stage in a temporary local file, then
        :meth:`put_file`.
        """
        fd, tmp = tempfile.mkstemp(prefix="ckptstore-repair-")
        os.close(fd)
        try:
            fill(tmp)
            with open(tmp, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                verify(lambda off, n: os.pread(f.fileno(), n, off), size)
            self.put_file(key, tmp, size)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    # -- optional features ---------------------------------------------------------------------
    def open_part_upload(self, key: str) -> PartUpload:
        """A :class:`PartUpload` of ``key`` (only when :attr:`supports_part_upload`)."""
        raise NotImplementedError(f"the {self.name} tier has no part uploads")

    def list_multipart_uploads(self, prefix: str = "") -> Iterator:
        """Unfinished multipart uploads under ``prefix`` (only when :attr:`supports_multipart`)."""
        raise NotImplementedError(f"the {self.name} tier has no multipart uploads")

    def abort_multipart_upload(self, key: str, upload_id: str) -> None:
        """Abort one multipart upload (only when :attr:`supports_multipart`)."""
        raise NotImplementedError(f"the {self.name} tier has no multipart uploads")

    def list_empty_dirs(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Empty directories under ``prefix`` (key, size 0, mtime); none on a flat object store."""
        return iter(())

    def remove_empty_dir(self, key: str) -> bool:
        """Remove the empty directory ``key`` and any parents it leaves empty, below the
        directory of ``key``'s first component. True when it is gone; False when it is not
        empty (or the tier has no directories)."""
        return False

    def local_path(self, key: str) -> str | None:
        """A filesystem path for ``key`` when the tier is a local directory, else None.

        A read-only fast path (``os.pread``, ``put_file`` from it): write and delete through the
        tier's methods, which keep the durability and typed-error rules.
        """
        return None

    def close(self) -> None:
        """Release clients and pools (tiers are re-creatable from their constructor args)."""


def tiers_of(store) -> dict[str, Tier]:
    """``{name: Tier}`` of a :class:`ckptstore.Store` (its ``.tiers``) or of a mapping given as is —
    what gc, scrub and rekey accept as their ``store`` argument."""
    return dict(store.tiers if hasattr(store, "tiers") else store)
