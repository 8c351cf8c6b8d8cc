"""The streaming :class:`~ckptstore.tiers.base.ObjectWriter` of a tier that has part uploads
(:attr:`~ckptstore.tiers.base.Tier.supports_part_upload`): it buffers one part, makes the object
with one :meth:`~ckptstore.tiers.base.Tier.put` if it fits in that part, else hands the parts to a
:meth:`~ckptstore.tiers.base.Tier.open_part_upload` as they fill (at most ``inflight`` parts
buffered), growing the part size as :meth:`~ckptstore.tiers.base.PartLimits.grown` says. Nothing is
visible under the key before :meth:`commit`; :meth:`abort` discards the upload."""

from __future__ import annotations

import threading

from .base import ObjectWriter, PartUpload, Tier


class PartWriter(ObjectWriter):
    """``tier.open_writer(key)`` of the GCS and Azure tiers (see the module docstring)."""

    def __init__(self, tier: Tier, key: str, inflight: int = 4):
        self._tier = tier
        self._key = key
        self._lim = tier.part_limits
        self._part_size = self._lim.part_size
        self._buf = bytearray()
        self._size = 0
        self._up: PartUpload | None = None
        self._futures: list = []
        self._sem = threading.BoundedSemaphore(max(1, int(inflight)))
        self._done = False

    def write(self, data) -> None:
        if self._done:
            raise ValueError(f"writer for {self._key!r} is already committed or aborted")
        mv = memoryview(data).cast("B")
        self._size += len(mv)
        try:
            while len(mv):
                room = self._part_size - len(self._buf)
                self._buf += mv[:room]
                mv = mv[room:]
                if len(self._buf) >= self._part_size:
                    self._flush_part()
        except BaseException:
            self.abort()
            raise

    def _flush_part(self) -> None:
        for f in self._futures:  # report a failed part as early as possible
            if f.done() and f.exception() is not None:
                raise f.exception()
        if self._up is None:
            self._up = self._tier.open_part_upload(self._key)
        data = bytes(self._buf)
        self._buf = bytearray()
        self._sem.acquire()
        try:
            fut = self._up.send(self._up.parts + 1, lambda: data)
        except BaseException:
            self._sem.release()
            raise
        fut.add_done_callback(lambda _f: self._sem.release())
        self._futures.append(fut)
        self._part_size = self._lim.grown(len(data), len(self._futures))

    def commit(self) -> None:
        if self._done:
            return
        try:
            if self._up is None:
                self._tier.put(self._key, bytes(self._buf))
            else:
                if self._buf:
                    self._flush_part()
                self._up.complete(self._size)
            self._buf = bytearray()
        except BaseException:
            self.abort()
            raise
        self._done = True

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._buf = bytearray()
        if self._up is not None:
            self._up.abort()
