"""Staging for ``dcp.async_save``: copy the state into host buffers, with back-pressure.

``async_save`` blocks training only for this copy (docs/FORMAT.md, "SHOULD"). One set of buffers is cached
per state-dict path and reused across saves while shapes and dtypes stay the same, so host memory
stays flat over many saves; buffers are pinned when the source is on a GPU (so device→host copies
run non-blocking on a side stream and are synchronised once at the end). Non-tensor leaves are
deep-copied, so mutating Python state after ``async_save`` returns does not change what is saved.
A tensor subclass without memory of its own is staged as its values, through its own ``copy_``
(``_subclass``; :class:`UnsupportedStateError` naming the key when it cannot give them).

Overlapping saves: each ``stage()`` takes a *ticket*. A ticket is returned when its save has
written its data (``release``, called by ``write_data`` with the address of a staged tensor) or
when its staged copy is garbage (a save that failed before writing). Only the save holding the
cached set may use it; a save staged while the cache is held gets a fresh set, freed after use.
At most ``max_staged`` tickets exist: ``stage()`` waits for one to come back (back-pressure),
at most ``timeout`` seconds, then raises :class:`CkptStoreError`.
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Any

import torch

from ..errors import CkptStoreError
from . import _subclass

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore


class _Staged(dict):
    """The staged state dict (a dict that can carry a weak reference)."""


class _Ticket:
    __slots__ = ("cached", "ptrs", "released")

    def __init__(self, cached: bool) -> None:
        self.cached = cached
        self.ptrs: list[int] = []
        self.released = False


class Stager:
    def __init__(self, max_staged: int = 2, timeout: float = 3600.0) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._cond = threading.Condition()
        self._live: set[_Ticket] = set()
        self._by_ptr: dict[int, _Ticket] = {}
        self._cache_held = False
        self.max_staged = max_staged
        self.timeout = timeout
        self.reuse = True
        self.last_reused = 0  # bytes reused by the last stage() (for benchmarks)
        self.last_wait_s = 0.0  # seconds the last stage() waited for an earlier save (back-pressure)

    def __getstate__(self):  # the PROCESS executor pickles the writer: do not ship buffers
        return {"reuse": False, "max_staged": self.max_staged, "timeout": self.timeout}

    def __setstate__(self, s):
        self.__init__(s.get("max_staged", 2), s.get("timeout", 3600.0))
        self.reuse = s.get("reuse", False)

    @property
    def staged(self) -> int:
        """Host copies held now (saves staged and not yet written)."""
        with self._cond:
            return len(self._live)

    def release(self, ptr: int | None = None) -> None:
        """Return the ticket whose staged copy holds the tensor at storage address ``ptr``."""
        if ptr is None:
            return
        with self._cond:
            t = self._by_ptr.get(ptr)
        if t is not None:
            self._release(t)

    def _release(self, t: _Ticket) -> None:
        with self._cond:
            if t.released:
                return
            t.released = True
            self._live.discard(t)
            for p in t.ptrs:
                if self._by_ptr.get(p) is t:
                    del self._by_ptr[p]
            if t.cached:
                self._cache_held = False
            self._cond.notify_all()

    def _take(self) -> _Ticket:
        import time

        t0 = time.monotonic()
        with self._cond:
            if len(self._live) >= self.max_staged:
                import gc

                gc.collect()  # staged copies of failed saves may sit in reference cycles
            if not self._cond.wait_for(lambda: len(self._live) < self.max_staged, timeout=self.timeout):
                raise CkptStoreError(
                    f"{len(self._live)} earlier saves still hold their staged host copies after {self.timeout:.0f} s "
                    "(max_staged); wait for their futures (and drop failed ones) before saving again"
                )
            t = _Ticket(self.reuse and not self._cache_held)
            if t.cached:
                self._cache_held = True
            self._live.add(t)
        self.last_wait_s = time.monotonic() - t0
        return t

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        t = self._take()
        try:
            buffers = self._buffers if t.cached else {}
            self.last_reused = 0
            streams: list = []
            out = _Staged(self._walk(state_dict, (), buffers, streams, t))
            for s in streams:
                s.synchronize()
        except BaseException:
            self._release(t)
            raise
        with self._cond:
            for p in t.ptrs:
                self._by_ptr[p] = t
        weakref.finalize(out, self._release, t)
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

    def _copy(self, path, t: torch.Tensor, buffers, streams, ticket: _Ticket) -> torch.Tensor:
        b = self._buf(path, t, buffers)
        if b.numel():
            ticket.ptrs.append(b.untyped_storage().data_ptr())
        if t.numel() and not _subclass.has_memory(t):  # a wrapper subclass: its values, through its copy_
            _subclass.values(t, ".".join(map(str, path)), out=b)
        elif t.device.type == "cuda":
            b.copy_(t.detach(), non_blocking=b.is_pinned())
            if b.is_pinned() and not streams:
                streams.append(torch.cuda.current_stream(t.device))
        else:
            b.copy_(t.detach())
        return b

    def _walk(self, obj: Any, path: tuple, buffers, streams, ticket) -> Any:
        if DTensor is not None and isinstance(obj, DTensor):
            local = self._copy(path, obj._local_tensor, buffers, streams, ticket)
            return DTensor(local, obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor):
            return self._copy(path, obj, buffers, streams, ticket)
        if isinstance(obj, dict):
            return {k: self._walk(v, path + (k,), buffers, streams, ticket) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._walk(v, path + (i,), buffers, streams, ticket) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._walk(v, path + (i,), buffers, streams, ticket) for i, v in enumerate(obj))
        return copy.deepcopy(obj)
