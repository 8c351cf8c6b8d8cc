"""FileSystemWriter/FileSystemReader look-alikes backed by ckptstore (for PyTorch's own DCP tests).

A DCP checkpoint directory ``path`` becomes a ckptstore root holding one version, ``dcp``; what DCP
records as the checkpoint id (``storage_meta.checkpoint_id``) is the directory, as with
``FileSystemWriter``. ``FileSystemWriter``'s default ``overwrite=True`` is kept (the tests save to
one path repeatedly). Which ids the classes accept is DCP's own rule (a ``Path``, or a string that
is not a URL and has a writable parent: ``FileSystem.validate_checkpoint_id``), so DCP's storage
auto-detection picks them exactly where it picks its own and refuses ``"abc://…"``.
Options that only shape DCP's file layout (``single_file_per_rank``, ``thread_count``,
``per_thread_copy_ahead``, ``sync_files``, ``cache_staged_state_dict``, ``_extensions``,
``_extension_registry``) are accepted and ignored: ckptstore has its own layout, compression and
checksums (docs/TESTING.md, "PyTorch's DCP tests").
"""

from __future__ import annotations

import os
import sys

import ckptstore
from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint.metadata import StorageMeta

# DCP's own classes, kept: the names are rebound only where tests and auto-detection look them up
# (``torch.distributed.checkpoint``, ``_storage_utils``), never in ``filesystem`` itself, which
# ``FsspecWriter``/``FsspecReader`` subclass
_DCPWriter, _DCPReader = _dcp_fs.FileSystemWriter, _dcp_fs.FileSystemReader

VERSION = "dcp"
_WRITER_OPTIONS = {
    "single_file_per_rank", "sync_files", "thread_count", "per_thread_copy_ahead",
    "cache_staged_state_dict", "_extensions", "serialization_format", "enable_plan_caching",
}
_READER_OPTIONS = {"_extension_registry"}


def _root(path) -> str:
    return os.path.abspath(os.fspath(path))


def _check(kind: str, kwargs: dict, allowed: set) -> None:
    unknown = set(kwargs) - allowed
    if unknown:
        raise TypeError(f"{kind}: the ckptstore shim does not know {sorted(unknown)}")


class FileSystemWriter(ckptstore.StorageWriter):
    def __init__(self, path, overwrite: bool = True, **kwargs) -> None:
        _check("FileSystemWriter", kwargs, _WRITER_OPTIONS)
        self._shim_overwrite = overwrite
        self._shim_path = path
        super().__init__(_root(path), version=VERSION, overwrite=overwrite)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return _DCPWriter.validate_checkpoint_id(checkpoint_id)

    def storage_meta(self):
        meta = super().storage_meta()
        return None if meta is None else StorageMeta(checkpoint_id=self._shim_path, save_id=meta.save_id)

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None and _root(checkpoint_id) != self.root:
            FileSystemWriter.__init__(self, checkpoint_id, overwrite=self._shim_overwrite)
        elif checkpoint_id is not None:
            self._shim_path = checkpoint_id
        super().reset(None)


class FileSystemReader(ckptstore.StorageReader):
    def __init__(self, path, **kwargs) -> None:
        _check("FileSystemReader", kwargs, _READER_OPTIONS)
        self._shim_path = path
        super().__init__(_root(path), version=VERSION)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return _DCPReader.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self):
        md = super().read_metadata()
        if md.storage_meta is not None:  # the directory this reader was given, as DCP's reader reports it
            md.storage_meta.checkpoint_id = self._shim_path
        return md

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None and _root(checkpoint_id) != self.root:
            FileSystemReader.__init__(self, checkpoint_id)
        elif checkpoint_id is not None:
            self._shim_path = checkpoint_id
        super().reset(None)


#: the modules whose ``FileSystemWriter``/``FileSystemReader`` names are rebound: the package (what
#: tests import), the auto-detection of ``dcp.save``/``dcp.load`` without a storage object, and the
#: format converters that make a reader or writer by name. ``filesystem`` (DCP's own classes) is never
#: touched, and the modules that *subclass* them (``FsspecWriter``/``FsspecReader``, the HF storage
#: classes) are imported before the rebinding, so they keep DCP's classes as their bases.
REBOUND = ("torch.distributed.checkpoint", "torch.distributed.checkpoint._storage_utils",
           "torch.distributed.checkpoint.format_utils")
_SUBCLASSERS = ("torch.distributed.checkpoint._fsspec_filesystem", "torch.distributed.checkpoint.hf_storage")


def install() -> None:
    """Rebind the names in the modules of :data:`REBOUND`."""
    import importlib

    import torch.distributed.checkpoint  # noqa: F401 - loads filesystem, _storage_utils, ...

    for name in _SUBCLASSERS:
        try:
            importlib.import_module(name)
        except ImportError:  # fsspec not installed: DCP's auto-detection skips it as well
            pass
    for name in REBOUND:
        mod = importlib.import_module(name)
        mod.FileSystemWriter = FileSystemWriter
        mod.FileSystemReader = FileSystemReader
