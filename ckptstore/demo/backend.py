"""The storage calls the demo makes, all through ckptstore's public API."""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import Any

import ckptstore


def version_name(step: int) -> str:
    return f"step-{step:06d}"


@dataclass
class Rec:
    version: str
    step: int | None
    created: _dt.datetime | None
    world_size: int | None = None


def writer(root: str, remote: str | None, step: int, meta: dict[str, Any]) -> tuple[str, Any]:
    """``(checkpoint_id, storage_writer)`` for the save of ``step``; the version name is the checkpoint_id."""
    return version_name(step), ckptstore.StorageWriter(root, remote=remote, step=step, user_metadata=meta)


def reader(root: str, remote: str | None, version: str, *, partial: bool = False) -> tuple[str, Any]:
    """``(checkpoint_id, storage_reader)`` for ``version``; ``partial``: the caller loads only some keys."""
    return version, ckptstore.StorageReader(root, remote=remote, allow_partial_load=partial)


def _rec(r: Any) -> Rec:
    return Rec(r.version, getattr(r, "step", None), getattr(r, "created", None), getattr(r, "world_size", None))


def versions(root: str, remote: str | None = None) -> list[Rec]:
    """Committed versions, oldest → newest."""
    st = ckptstore.Store(root, remote=remote)
    try:
        return [_rec(r) for r in st.versions()]
    finally:
        st.close()


def latest(root: str, remote: str | None = None) -> Rec | None:
    """``Store(root, remote=remote).latest()``: the newest committed (undamaged) version, or None."""
    st = ckptstore.Store(root, remote=remote)
    try:
        r = st.latest()
        return None if r is None else _rec(r)
    finally:
        st.close()
