"""The storage calls the demo makes: ``ckptstore`` when it is importable, else a stand-in.

The demo talks to storage only through these functions, so it runs against
``ckptstore.StorageWriter`` / ``StorageReader`` / ``Store`` (the real thing) and, while those
are not importable, against DCP's own ``FileSystemWriter`` with a tiny catalogue of
``<root>/<version>/.metadata`` directories (no remote tier then).
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass
from typing import Any


def real() -> bool:
    try:
        import ckptstore

        return all(hasattr(ckptstore, n) for n in ("StorageWriter", "StorageReader", "Store"))
    except Exception:  # noqa: BLE001 - any import problem means "not available"
        return False


def version_name(step: int) -> str:
    return f"step-{step:06d}"


@dataclass
class Rec:
    version: str
    step: int | None
    created: _dt.datetime | None
    world_size: int | None = None


def writer(root: str, remote: str | None, step: int, meta: dict[str, Any]) -> tuple[str, Any]:
    """``(checkpoint_id, storage_writer)`` for the save of ``step``."""
    v = version_name(step)
    if real():
        import ckptstore

        return v, ckptstore.StorageWriter(root, remote=remote, step=step, user_metadata=meta)
    if remote:
        raise RuntimeError("--remote needs ckptstore.StorageWriter, which is not importable yet")
    from torch.distributed.checkpoint import FileSystemWriter

    path = os.path.join(root, v)
    return path, FileSystemWriter(path)


def reader(root: str, remote: str | None, version: str, *, partial: bool = False) -> tuple[str, Any]:
    """``(checkpoint_id, storage_reader)`` for ``version``; ``partial``: the caller loads only some keys."""
    if real():
        import ckptstore

        return version, ckptstore.StorageReader(root, remote=remote, allow_partial_load=partial)
    from torch.distributed.checkpoint import FileSystemReader

    path = os.path.join(root, version)
    return path, FileSystemReader(path)


def versions(root: str, remote: str | None = None) -> list[Rec]:
    """Committed versions, oldest → newest."""
    if real():
        import ckptstore

        st = ckptstore.Store(root, remote=remote)
        try:
            return [
                Rec(r.version, getattr(r, "step", None), getattr(r, "created", None), getattr(r, "world_size", None))
                for r in st.versions()
            ]
        finally:
            close = getattr(st, "close", None)
            if close:
                close()
    out = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            md = os.path.join(root, name, ".metadata")
            if name.startswith("step-") and os.path.exists(md):
                ts = _dt.datetime.fromtimestamp(os.path.getmtime(md), tz=_dt.timezone.utc)
                out.append(Rec(name, int(name[5:]), ts))
    out.sort(key=lambda r: (r.created, r.version))
    return out


def latest(root: str, remote: str | None = None) -> Rec | None:
    if real():
        import ckptstore

        st = ckptstore.Store(root, remote=remote)
        try:
            r = st.latest()
            return None if r is None else Rec(r.version, getattr(r, "step", None), getattr(r, "created", None), getattr(r, "world_size", None))
        finally:
            close = getattr(st, "close", None)
            if close:
                close()
    vs = versions(root, remote)
    return vs[-1] if vs else None
