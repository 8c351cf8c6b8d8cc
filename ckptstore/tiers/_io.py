"""What the remote tiers share below their SDKs: seekable request bodies over a buffer or a file
descriptor without a copy (:class:`Slice`, :func:`body_of`) and bounded parallel calls
(:func:`run_bounded`). No SDK is imported here."""

from __future__ import annotations

import concurrent.futures as cf
import io
import os
from typing import Callable, Iterable

from ..errors import StorageError



class Slice(io.RawIOBase):
    """A seekable read-only view of ``[off, off+length)`` of a buffer or a file descriptor.

    The SDK (botocore, google-cloud-storage, azure-storage-blob) reads it (for the checksum and the
    request), seeks back on retries, and takes the length from seek/tell. It never exposes ``fileno`` (an SDK would use the whole file's size).
    """

    def __init__(self, length: int, *, buf=None, fd: int | None = None, off: int = 0):
        self._len = length
        self._buf = buf
        self._fd = fd
        self._off = off
        self._pos = 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, offset, whence=0):
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b):
        n = min(len(b), self._len - self._pos)
        if n <= 0:
            return 0
        start = self._off + self._pos
        if self._buf is not None:
            b[:n] = self._buf[start:start + n]
        else:
            data = os.pread(self._fd, n, start)
            if not data:
                raise StorageError("local file shrank while it was being uploaded")
            n = len(data)
            b[:n] = data
        self._pos += n
        return n

    def read(self, size=-1):
        if size is None or size < 0:
            size = self._len - self._pos
        size = max(0, min(size, self._len - self._pos))
        if self._buf is not None:
            start = self._off + self._pos
            self._pos += size
            return bytes(self._buf[start:start + size])
        return super().read(size)


def body_of(data) -> object:
    """The request body for ``data`` (bytes as they are; any other buffer without a copy)."""
    if isinstance(data, bytes):
        return data
    mv = memoryview(data).cast("B")
    return Slice(len(mv), buf=mv)


def run_bounded(pool: cf.Executor, fn: Callable, items: Iterable, limit: int) -> list:
    """``[fn(x) for x in items]`` on ``pool``, at most ``limit`` in flight; stops at the first
    failure (cancels what has not started, waits for what has), and raises it."""
    it = iter(enumerate(items))
    results: dict[int, object] = {}
    running: dict[cf.Future, int] = {}
    error: BaseException | None = None
    try:
        for idx, x in it:
            running[pool.submit(fn, x)] = idx
            if len(running) >= limit:
                break
        while running:
            done, _ = cf.wait(running, return_when=cf.FIRST_EXCEPTION)
            for f in done:
                idx = running.pop(f)
                exc = f.exception()
                if exc is not None:
                    error = error or exc
                else:
                    results[idx] = f.result()
            if error is not None:
                break
            for idx, x in it:
                running[pool.submit(fn, x)] = idx
                if len(running) >= limit:
                    break
    except BaseException as e:  # KeyboardInterrupt while waiting
        error = e
    if error is not None:
        for f in running:
            f.cancel()
        cf.wait(running)
        raise error
    return [results[i] for i in range(len(results))]


def coalesced_get_ranges(get: Callable[[int, int], bytes], ranges, *, gap: int, max_bytes: int,
                         pool: cf.Executor, limit: int, stat: Callable[[], object]) -> list[bytes]:
    """``[data[s:e] for s, e in ranges]`` of one object, in the caller's order: nearby ranges
    (closer than ``gap`` bytes, at most ``max_bytes`` together) merged into one ``get(start, end)``
    and the merged requests run on ``pool`` (at most ``limit`` at once). ``stat()`` is called when
    every range is empty (a missing object is still missing)."""
    ranges = [(int(s), int(e)) for s, e in ranges]
    for s, e in ranges:
        if s < 0 or e < s:
            raise ValueError(f"invalid range [{s}, {e})")
    if not ranges:
        return []
    wanted = sorted({r for r in ranges if r[1] > r[0]})
    if not wanted:
        stat()
        return [b""] * len(ranges)
    groups: list[list[int]] = []
    where: dict[tuple[int, int], int] = {}
    for s, e in wanted:
        if groups:
            g = groups[-1]
            if s <= g[1] + gap and max(e, g[1]) - g[0] <= max_bytes:
                g[1] = max(g[1], e)
                where[(s, e)] = len(groups) - 1
                continue
        groups.append([s, e])
        where[(s, e)] = len(groups) - 1
    if len(groups) == 1:
        bufs = [get(*groups[0])]
    else:
        bufs = run_bounded(pool, lambda g: get(g[0], g[1]), groups, limit)
    out = []
    for s, e in ranges:
        if e <= s:
            out.append(b"")
            continue
        gi = where[(s, e)]
        g0 = groups[gi][0]
        out.append(bytes(memoryview(bufs[gi])[s - g0:e - g0]))
    return out


def pwrite_all(fd: int, data, off: int) -> None:
    """Write all of ``data`` at ``off`` of ``fd``."""
    mv = memoryview(data)
    while len(mv):
        n = os.pwrite(fd, mv, off)
        mv = mv[n:]
        off += n
