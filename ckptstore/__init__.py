"""ckptstore: a crash-consistent, checksummed, encrypted storage backend for PyTorch DCP."""

__version__ = "0.1.0"

from .dcp import StorageReader, StorageWriter  # noqa: E402
from .errors import (  # noqa: E402
    CkptStoreError,
    DamagedVersionError,
    DtypeMismatchError,
    IntegrityError,
    InvalidNameError,
    KeyMismatchError,
    ManifestError,
    StateDictKeysError,
    StorageError,
    StorageFullError,
    UnsupportedFormatError,
    VersionExistsError,
    VersionNotFoundError,
)
from .manifest.catalogue import VersionRecord  # noqa: E402
from .store import Store  # noqa: E402

__all__ = [
    "StorageWriter",
    "StorageReader",
    "Store",
    "VersionRecord",
    "CkptStoreError",
    "IntegrityError",
    "ManifestError",
    "VersionNotFoundError",
    "VersionExistsError",
    "DamagedVersionError",
    "KeyMismatchError",
    "InvalidNameError",
    "StateDictKeysError",
    "DtypeMismatchError",
    "StorageError",
    "StorageFullError",
    "UnsupportedFormatError",
]
