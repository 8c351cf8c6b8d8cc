"""ckptstore: a crash-consistent, checksummed, encrypted storage backend for PyTorch DCP."""

from ._version import __version__  # noqa: E402,F401

from .errors import (  # noqa: E402
    CkptStoreError,
    ConditionalWritesError,
    DamagedVersionError,
    DtypeMismatchError,
    IntegrityError,
    InvalidNameError,
    FencedError,
    JobBrokenError,
    KeyMismatchError,
    KeyServiceError,
    KeyServiceUnavailableError,
    ManifestError,
    Preempted,
    StateDictKeysError,
    StorageError,
    StorageFullError,
    StoreNotFoundError,
    UnsupportedFormatError,
    UnsupportedStateError,
    VersionExistsError,
    VersionNotFoundError,
)
from .kms import KmsKey  # noqa: E402
from .manifest.catalogue import VersionRecord  # noqa: E402
from .store import Store  # noqa: E402



def __getattr__(name: str):
    # StorageWriter/StorageReader pull in torch; load them on first use so that the CLI and the
    # catalogue (list, gc, scrub) start without importing torch.
    if name in ("StorageWriter", "StorageReader"):
        from . import dcp

        return getattr(dcp, name)
    if name in ("CheckpointManager", "SaveInfo", "RestoreInfo"):
        from . import manager

        return getattr(manager, name)
    raise AttributeError(f"module 'ckptstore' has no attribute {name!r}")


__all__ = [
    "CheckpointManager",
    "SaveInfo",
    "RestoreInfo",
    "StorageWriter",
    "StorageReader",
    "Store",
    "KmsKey",
    "VersionRecord",
    "CkptStoreError",
    "IntegrityError",
    "ManifestError",
    "VersionNotFoundError",
    "VersionExistsError",
    "DamagedVersionError",
    "KeyMismatchError",
    "KeyServiceError",
    "KeyServiceUnavailableError",
    "InvalidNameError",
    "StateDictKeysError",
    "DtypeMismatchError",
    "StorageError",
    "StorageFullError",
    "StoreNotFoundError",
    "ConditionalWritesError",
    "UnsupportedFormatError",
    "UnsupportedStateError",
    "FencedError",
    "JobBrokenError",
    "Preempted",
]
