"""The storage calls the demo makes, all through ckptstore's public API."""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import Any

import ckptstore

@dataclass
class Rec:
    version: str
    step: int | None
    created: _dt.datetime | None
    world_size: int | None = None


def _rec(r: Any) -> Rec:
    return Rec(r.version, getattr(r, "step", None), getattr(r, "created", None), getattr(r, "world_size", None))


def versions(root: str, remote: str | None = None) -> list[Rec]:
    """Committed versions, oldest → newest."""
    st = ckptstore.Store(root, remote=remote)
    try:
        return [_rec(r) for r in st.versions()]
    finally:
        st.close()
