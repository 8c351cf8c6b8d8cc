"""The Tier interface: a flat key→bytes store with put-if-absent.

A *tier* is one place a store lives: the local root (NVMe) or an S3 prefix. Both use the same
layout (see docs/FORMAT.md). Keys are relative, ``/``-separated, validated by
:func:`ckptstore._names.check_key`; tiers never see an absolute path or ``..``.

Errors are translated once, here at the boundary: a missing key raises
:class:`~ckptstore.errors.ObjectNotFoundError`; put-if-absent on an existing key raises
:class:`~ckptstore.errors.ObjectExistsError`; a refusal that retrying will not fix raises
:class:`~ckptstore.errors.StorageError`; one that may pass on retry raises
:class:`~ckptstore.errors.TransientStorageError`; a full disk raises
:class:`~ckptstore.errors.StorageFullError`.

Optional features are declared, not probed for (zarr's ``supports_*`` properties): a caller checks
:attr:`Tier.supports_multipart` before it calls :meth:`Tier.list_multipart_uploads` /
:meth:`Tier.abort_multipart_upload`, which raise :class:`NotImplementedError` on tiers without
multipart uploads. Operations that only mean something for a directory tree
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
    where the tier's listing reports one, ``etag`` (S3's ETag without quotes: the MD5 of an object
    written by one PUT; None elsewhere)."""

    key: str
    size: int
    mtime: float
    etag: str | None = None
    #: The tier's opaque version token of this object (S3's ETag, GCS's generation, Azure's ETag;
    #: what the local tier's ``stat`` reports): what :meth:`Tier.replace_if_match` compares.
    #: None where the tier's listing does not carry it (ask :meth:`Tier.stat`).
    token: str | None = None


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
