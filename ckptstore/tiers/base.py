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
"""

from __future__ import annotations

import abc
import dataclasses
import os
from typing import Iterator, Sequence


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One stored object: ``key`` (relative), ``size`` (bytes), ``mtime`` (POSIX seconds, UTC)."""

    key: str
    size: int
    mtime: float


class ObjectWriter(abc.ABC):
    """A streaming writer for one object. ``commit()`` makes it durable; ``abort()`` removes it."""

    @abc.abstractmethod
    def write(self, data: bytes | memoryview) -> None: ...

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
    #: True when ``put`` of an existing key atomically replaces it (both our tiers do).
    atomic_replace: bool = True

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

    def local_path(self, key: str) -> str | None:
        """A filesystem path for ``key`` when the tier is a local directory, else None."""
        return None

    def close(self) -> None:
        """Release clients and pools (tiers are re-creatable from their constructor args)."""
