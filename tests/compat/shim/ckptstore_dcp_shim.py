"""FileSystemWriter/FileSystemReader look-alikes backed by ckptstore (for PyTorch's own DCP tests).

A DCP checkpoint directory ``path`` becomes a ckptstore root holding one version, ``dcp``.
``FileSystemWriter``'s default ``overwrite=True`` is kept (the tests save to one path repeatedly).
Options that only shape DCP's file layout (``single_file_per_rank``, ``thread_count``,
``per_thread_copy_ahead``, ``sync_files``, ``cache_staged_state_dict``, ``_extensions``,
``_extension_registry``) are accepted and ignored: ckptstore has its own layout, compression and
checksums (docs/TESTING.md, "PyTorch's DCP tests").
"""

from __future__ import annotations

import os
import sys

import ckptstore

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
        super().__init__(_root(path), version=VERSION, overwrite=overwrite)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None and _root(checkpoint_id) != self.root:
            FileSystemWriter.__init__(self, checkpoint_id, overwrite=self._shim_overwrite)
        super().reset(None)


class FileSystemReader(ckptstore.StorageReader):
    def __init__(self, path, **kwargs) -> None:
        _check("FileSystemReader", kwargs, _READER_OPTIONS)
        super().__init__(_root(path), version=VERSION)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None and _root(checkpoint_id) != self.root:
            FileSystemReader.__init__(self, checkpoint_id)
        super().reset(None)


def install() -> None:
    """Rebind the names in every loaded ``torch.distributed.checkpoint`` module."""
    import torch.distributed.checkpoint  # noqa: F401 - loads filesystem, _storage_utils, ...
    import torch.distributed.checkpoint._storage_utils  # noqa: F401

    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("torch.distributed.checkpoint"):
            continue
        if getattr(mod, "FileSystemWriter", None) is not None:
            mod.FileSystemWriter = FileSystemWriter
        if getattr(mod, "FileSystemReader", None) is not None:
            mod.FileSystemReader = FileSystemReader
