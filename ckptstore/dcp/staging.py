"""Staging for ``dcp.async_save``: copy the state into reusable host buffers.

``async_save`` blocks training only for this copy (docs/FORMAT.md, "SHOULD"). Buffers are cached per
state-dict path and reused across saves while shapes and dtypes stay the same, so host memory stays
flat over many saves; they are pinned when the source is on a GPU (so device→host copies run
non-blocking on a side stream and are synchronised once at the end). When the previous save is
still using the buffers (overlapping saves), this save gets a fresh, uncached set instead of
waiting, so a failed earlier save can never block training. Non-tensor leaves are deep-copied, so
mutating Python state after ``async_save`` returns does not change what is saved.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore


class Stager:
    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._busy = False
        self.reuse = True
        self.last_reused = 0  # bytes reused by the last stage() (for benchmarks)

    def __getstate__(self):  # the PROCESS executor pickles the writer: do not ship buffers
        return {"reuse": False}

    def __setstate__(self, s):
        self.__init__()
        self.reuse = s.get("reuse", False)

    def release(self) -> None:
        with self._lock:
            self._busy = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            use_cache = self.reuse and not self._busy
            if use_cache:
                self._busy = True
        buffers = self._buffers if use_cache else {}
        self.last_reused = 0
        streams: list = []
        out = self._walk(state_dict, (), buffers, streams)
        for s in streams:
            s.synchronize()
        return out

    def _buf(self, path: tuple, t: torch.Tensor, buffers: dict) -> torch.Tensor:
        b = buffers.get(path)
        if b is not None and b.shape == t.shape and b.dtype == t.dtype:
            self.last_reused += b.numel() * b.element_size()
            return b
        pin = t.device.type == "cuda" and torch.cuda.is_available()
        b = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        buffers[path] = b
        return b

    def _copy(self, path, t: torch.Tensor, buffers, streams) -> torch.Tensor:
        b = self._buf(path, t, buffers)
        if t.device.type == "cuda":
            b.copy_(t.detach(), non_blocking=b.is_pinned())
            if b.is_pinned() and not streams:
                streams.append(torch.cuda.current_stream(t.device))
        else:
            b.copy_(t.detach())
        return b

    def _walk(self, obj: Any, path: tuple, buffers, streams) -> Any:
        if DTensor is not None and isinstance(obj, DTensor):
            local = self._copy(path, obj._local_tensor, buffers, streams)
            return DTensor(local, obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor):
            return self._copy(path, obj, buffers, streams)
        if isinstance(obj, dict):
            return {k: self._walk(v, path + (k,), buffers, streams) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._walk(v, path + (i,), buffers, streams) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._walk(v, path + (i,), buffers, streams) for i, v in enumerate(obj))
        return copy.deepcopy(obj)
