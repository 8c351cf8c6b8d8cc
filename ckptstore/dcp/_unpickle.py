"""Restricted unpickling of DCP's ``Metadata`` (docs/FORMAT.md, "DCP metadata object"): the
allow-list unpickler the reader uses on *verified* metadata objects, and the writer on every
``Metadata`` before it commits it (``_checks.check_metadata_loads``), so that the two can never
disagree about what loads.
"""

from __future__ import annotations

import io
import pickle

import torch

from ..errors import IntegrityError


class RefusedClassError(pickle.UnpicklingError):
    """The pickle refers to a class outside the allow-list (``qualname``: ``module.name``)."""

    def __init__(self, module: str, name: str):
        self.qualname = f"{module}.{name}"
        super().__init__(f"DCP metadata refers to {self.qualname}, which is not allowed")


class _MetadataUnpickler(pickle.Unpickler):
    """Only the classes DCP metadata is made of (plus torch dtypes/``Size`` and our records).

    That is every class torch ≥ 2.6 DCP itself puts in ``Metadata`` (``metadata.py``:
    ``ChunkStorageMetadata``, ``TensorStorageMetadata``, ``BytesStorageMetadata``,
    ``TensorProperties`` with ``_MEM_FORMAT_ENCODING``, ``MetadataIndex``, ``StorageMeta``;
    ``torch.dtype``/``Size``/``layout``/``memory_format``), and the sharded-tensor
    ``TensorProperties``/``MEM_FORMAT_ENCODING`` that older DCP wrote. The writer checks every
    Metadata against this list before committing (``_checks.check_metadata_loads``).

    Names must be plain (no dots: protocol 4 resolves dotted names through attributes) and resolve
    to classes, except torch dtypes/layouts and ``torch.serialization._get_layout``.
    """

    _MODULES = frozenset(
        {
            "torch.distributed.checkpoint.metadata",
            "torch.distributed.checkpoint.planner",
            "ckptstore.dcp._types",
            "ckptstore.codec.frame",
        }
    )
    _EXACT = {
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
        ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    }

    def find_class(self, module: str, name: str):
        if "." in name or not name.isidentifier():
            raise RefusedClassError(module, name)
        if (module, name) in self._EXACT:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if module in self._MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        raise RefusedClassError(module, name)


def _restricted_loads(blob: bytes, what: str, digests: list | None = None):
    """The DCP ``Metadata`` of a *verified* metadata object (format 1: a pickle; formats 2 and 3: a
    pickle plus packed tables, ``_metadata.unpack``, which fills ``digests`` when given); everything
    unpickled goes through the allow-list."""
    from ._metadata import unpack

    try:
        return unpack(blob, lambda mv: _MetadataUnpickler(io.BytesIO(mv)).load(), what, digests)
    except IntegrityError:
        raise
    except Exception as e:
        raise IntegrityError(f"{what}: DCP metadata does not unpickle with the allow-list: {e}", object=what) from None


__all__ = ["RefusedClassError"]
