"""Checks that keep ckptstore a drop-in for DCP's FileSystemWriter/Reader (see docs/FORMAT.md,
"DCP metadata"): constructor arguments, save-time verification of the pickled DCP ``Metadata``
against the reader's allow-list, value digests of replicated items, and the log filter that keeps
the typed error the first thing a failed load reports.
"""

from __future__ import annotations

import difflib
import inspect
import io
import logging
import pickle
from typing import Any

from ..errors import CkptStoreError, UnsupportedStateError
from ._unpickle import RefusedClassError, _MetadataUnpickler


# -- unknown keyword arguments ------------------------------------------------------
def reject_unknown_kwargs(cls: type, kwargs: dict[str, Any]) -> None:
    """Raise ``TypeError`` naming the first unknown keyword argument and its closest known one."""
    if not kwargs:
        return
    known = [
        p.name
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"
    ]
    name = sorted(kwargs)[0]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; it takes {', '.join(known)}"
    raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {name!r}{hint}")


# -- never commit metadata the reader refuses ---------------------------------------
def check_metadata_loads(blob: bytes, version: str) -> None:
    """Unpickle the pickled part of ``blob`` (the DCP metadata object's contents about to be
    committed, ``_metadata.pack``) with the reader's allow-list; raise
    :class:`UnsupportedStateError` naming the refused class otherwise. The packed location and
    chunk tables are plain integers that ``_metadata.pack`` itself wrote; not unpacked here."""
    from ._metadata import pickled_part

    try:
        _MetadataUnpickler(io.BytesIO(pickled_part(blob))).load()
    except RefusedClassError as e:
        raise UnsupportedStateError(
            f"the DCP metadata of version {version!r} refers to {e.qualname}, which ckptstore's reader does "
            "not load (only the classes DCP itself puts in Metadata are allowed); nothing was committed. "
            "Keep such objects out of the planner's metadata (planner_data, storage_meta) or save them as "
            "state dict values"
        ) from None
    except Exception as e:
        raise UnsupportedStateError(
            f"the DCP metadata of version {version!r} does not unpickle again ({type(e).__name__}: {e}); "
            "nothing was committed"
        ) from None


# -- replicated items compare by value, not by pickled bytes ------------------------
class _CanonicalPickler(pickle.Pickler):
    """Pickles equal builtin containers to equal bytes: sets and dicts in a canonical order.

    Pickled bytes of a set follow the per-process hash seed (``PYTHONHASHSEED``) and those of a
    dict its insertion order, though ``==`` ignores both. ``persistent_id`` sees every object
    (``reducer_override`` skips exact builtins), also inside other objects' ``__dict__``; a set or
    dict is replaced by the sorted canonical pickles of its elements, so the order does not depend
    on the process.
    """

    def persistent_id(self, obj):
        t = type(obj)
        if t is set or t is frozenset:
            return (t.__name__, tuple(sorted(_canonical_bytes(x) for x in obj)))
        if t is dict:
            return ("dict", tuple(sorted((_canonical_bytes(k), _canonical_bytes(v)) for k, v in obj.items())))
        return None


def _canonical_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    _CanonicalPickler(buf, protocol=4).dump(obj)
    return buf.getvalue()


def value_digest(planner: Any, item: Any, data: Any) -> bytes | memoryview:
    """The bytes whose digest stands for a non-tensor item's *value* across ranks.

    Tries the planner's object (``DefaultSavePlanner.lookup_object``) and a canonical pickle of it;
    falls back to the item's serialised bytes when the object cannot be canonicalised.
    """
    lookup = getattr(planner, "lookup_object", None)
    if lookup is not None:
        try:
            return _canonical_bytes(lookup(item.index))
        except Exception:  # noqa: BLE001 - unpicklable or custom reducers: compare the bytes
            pass
    return data.getbuffer()


# -- no "Global metadata is not found" before ckptstore's own error -----------------
class _OwnErrorFilter(logging.Filter):
    """Drops DCP's "Global metadata is not found. Falling back to rank local metadata." warning
    (and its traceback) when the cause is a ckptstore error: the reader defers that error to
    ``set_up_storage_reader``, where DCP raises it, so it is the first thing the user reads."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, CkptStoreError) and str(record.msg).startswith("Global metadata is not found"):
            return False
        return True


_FILTER = _OwnErrorFilter()


def install_log_filter() -> None:
    """Attach the filter to the logger DCP's loader uses (the root logger in torch ≤ 2.13)."""
    import torch.distributed.checkpoint.state_dict_loader as sdl

    lg = getattr(sdl, "logger", None)
    if isinstance(lg, logging.Logger) and _FILTER not in lg.filters:
        lg.addFilter(_FILTER)


# -- a first run: DCP's single-process warning when ckptstore knows the intent ---------------------
def quiet_single_process() -> None:
    """A ckptstore writer or reader made in a process without ``torch.distributed`` is for one
    process: DCP's "torch.distributed is disabled, unavailable or uninitialized, assuming the intent
    is to save (load) in a single process" warning says nothing new then, and is silenced (in this
    process, for DCP's checkpoint modules only)."""
    import warnings

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    warnings.filterwarnings(
        "ignore", category=UserWarning, module=r"torch\.distributed\.checkpoint",
        message=r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to (save|load) "
                r"in a single process",
    )


__all__ = ["reject_unknown_kwargs", "check_metadata_loads", "value_digest", "install_log_filter", "quiet_single_process"]
