"""Reading stored objects for scrub: windows of an object, from a local file or a remote tier.

Local objects are read through ``mmap`` in :data:`LOCAL_CHUNK` (16 MiB) windows, the kernel reading
ahead (:class:`MappedSource`; no copy: the CPU cost of a scrub is that of a plain read of the same
bytes), or with one ``preadv`` per window into reused buffers (:class:`LocalSource`, where ``mmap``
is not available or :data:`LOCAL_MMAP` is off); remote objects with :data:`REMOTE_PART` (8 MiB)
ranged GETs run ahead of the walker by the verifier's workers (:class:`RemoteSource`). A source
gives ``window(offset, need) -> (bytes, release)``; :class:`Window` is the simple sequential
``read(offset, n)`` over any fetch function. An object that shrinks or changes while it is read
raises :class:`~ckptstore.errors.IntegrityError` ("short read").

The tunables below are read when they are used, so setting them (``ckptstore.scrub.LOCAL_CHUNK =
…``, as tests and benchmarks do) takes effect for the next window.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import queue
from typing import Callable

from ..errors import CkptStoreError, IntegrityError, ObjectNotFoundError
from ..tiers.base import Tier

#: bytes of one local window: mapped (:data:`LOCAL_MMAP`) and read ahead by the kernel, or read with
#: one ``preadv`` into a reused buffer; the frames of one window are hashed by the workers while the
#: walker moves on to the next
LOCAL_CHUNK = 16 << 20
#: verify local objects through ``mmap`` (no copy); False: ``preadv`` into buffers
LOCAL_MMAP = True
#: how far past the current window the kernel is asked to read ahead (``MADV_WILLNEED``)
LOCAL_AHEAD = 48 << 20
#: bytes of one ranged GET on a remote tier; up to ``jobs`` of them are in flight per object
REMOTE_PART = 8 << 20
#: the least a :class:`Window` fetches at once
_WINDOW = 16 << 20


class Window:
    """``read(offset, n)`` over an object, fetching windows of at least 16 MiB."""

    def __init__(self, fetch: Callable[[int, int], bytes], size: int):
        self._fetch = fetch
        self._size = size
        self._start = 0
        self._buf = b""

    def __call__(self, off: int, n: int):
        if self._start <= off and off + n <= self._start + len(self._buf):
            s = off - self._start
            return memoryview(self._buf)[s : s + n]
        end = min(self._size, off + max(n, _WINDOW))
        data = self._fetch(off, end)
        if len(data) != end - off:
            raise IntegrityError(f"short read at offset {off}: {len(data)} of {end - off} bytes (object changed?)")
        self._start, self._buf = off, data
        return memoryview(data)[:n]


def open_local(tier: Tier, key: str) -> int | None:
    """A read-only descriptor of ``key`` when ``tier`` is a local directory, else None; raises
    ObjectNotFoundError / CkptStoreError."""
    path = tier.local_path(key)
    if path is None:
        return None
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise ObjectNotFoundError(f"object {key!r} not found in {tier.name} tier", object=key) from None
    except OSError as e:
        raise CkptStoreError(f"cannot open {key!r}: {e.strerror}") from None


def open_object(tier: Tier, key: str):
    """``(size, fetch, close)`` for ``key``; raises ObjectNotFoundError."""
    fd = open_local(tier, key)
    if fd is not None:
        size = os.fstat(fd).st_size

        def fetch(s, e):
            first = os.pread(fd, e - s, s)
            if len(first) == e - s or not first:
                return first
            out = bytearray(first)
            while len(out) < e - s:
                chunk = os.pread(fd, e - s - len(out), s + len(out))
                if not chunk:
                    break
                out += chunk
            return bytes(out)

        return size, fetch, lambda: os.close(fd)
    size = tier.stat(key).size
    return size, (lambda s, e: tier.get(key, s, e)), (lambda: None)


def nothing() -> None:
    """A release function for a buffer that needs no release."""
    return None


class Buffers:
    """At most ``count`` reused read buffers of :data:`LOCAL_CHUNK` bytes, each made on first use."""

    def __init__(self, count: int):
        self._free: queue.Queue = queue.Queue()
        for _ in range(count):
            self._free.put(None)  # a slot; its buffer is made on first use

    def get(self, n: int) -> tuple[bytearray, Callable[[], None]]:
        """A buffer of at least ``n`` bytes and the function that gives it back (a window smaller
        than a chunk — a small object, the tail of a big one — gets its own, as does a frame larger
        than a chunk)."""
        if n != LOCAL_CHUNK:
            return bytearray(n), nothing
        b = self._free.get()
        if b is None:
            b = bytearray(LOCAL_CHUNK)
        return b, (lambda: self._free.put(b))


def _fadvise(fd: int, off: int, n: int, how: str) -> None:
    if hasattr(os, "posix_fadvise") and n > 0:
        try:
            os.posix_fadvise(fd, off, n, getattr(os, how))
        except OSError:  # advice only
            pass


class LocalSource:
    """Windows of a local file, read with one ``preadv`` each into the verifier's buffers."""

    def __init__(self, v, fd: int, size: int):
        self.v, self.fd, self.size = v, fd, size
        self.advised = 0
        _fadvise(fd, 0, size, "POSIX_FADV_SEQUENTIAL")

    def window(self, off: int, need: int) -> tuple[memoryview, Callable[[], None]]:
        n = min(max(LOCAL_CHUNK, need), self.size - off)
        upto = min(self.size, off + n + LOCAL_AHEAD)
        if upto > self.advised:  # the kernel reads the next windows while this one is hashed
            _fadvise(self.fd, max(off, self.advised), upto - max(off, self.advised), "POSIX_FADV_WILLNEED")
            self.advised = upto
        buf, release = self.v.buffer(n)
        mv = memoryview(buf)[:n]
        got = 0
        try:
            while got < n:
                k = os.preadv(self.fd, [mv[got:]], off + got)
                if k == 0:
                    raise IntegrityError(f"short read at offset {off}: {got} of {n} bytes (object changed?)")
                got += k
        except BaseException:
            release()
            raise
        return mv, release

    def close(self) -> None:
        os.close(self.fd)


class MappedSource:
    """Windows of a local file through one read-only ``mmap``: the frames are hashed straight from
    the page cache, without the copy a ``read`` makes (half the CPU of read-then-hash). The kernel
    is asked to read each next window ahead (``MADV_WILLNEED``, on top of ``MADV_SEQUENTIAL``), so
    the disk sees large sequential reads. Committed objects are never rewritten in place (a repair
    replaces the file by a rename), so the mapped file does not change under the walk; its size is
    checked again before each window is used."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self.m = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        self.view = memoryview(self.m)
        self.advised = 0
        self._advise(mmap.MADV_SEQUENTIAL if hasattr(mmap, "MADV_SEQUENTIAL") else None, 0, size)

    def _advise(self, how, start: int, n: int) -> None:
        if how is None or n <= 0:
            return
        a = start - start % mmap.PAGESIZE
        try:
            self.m.madvise(how, a, min(self.size - a, n + start - a))
        except (OSError, ValueError, AttributeError):  # advice only
            pass

    def window(self, off: int, need: int) -> tuple[memoryview, Callable[[], None]]:
        n = min(max(LOCAL_CHUNK, need), self.size - off)
        upto = min(self.size, off + n + LOCAL_AHEAD)
        if upto > self.advised:  # read ahead: this window and the next LOCAL_AHEAD bytes
            # through the file (posix_fadvise releases the GIL while the kernel queues the reads;
            # mmap.madvise holds it, stalling the hashing workers whenever the disk queue is full)
            start = max(off, self.advised)
            if hasattr(os, "posix_fadvise"):
                _fadvise(self.fd, start, upto - start, "POSIX_FADV_WILLNEED")
            else:
                self._advise(getattr(mmap, "MADV_WILLNEED", None), start, upto - start)
            self.advised = upto
        if os.fstat(self.fd).st_size < off + n:
            raise IntegrityError(f"short read at offset {off}: the file shrank while being read (object changed?)")
        # once its frames are verified, the window is unmapped from this process (the pages stay in
        # the page cache), so the resident size stays near (jobs + 1) windows however big the object
        return self.view[off:off + n], (lambda: self._advise(getattr(mmap, "MADV_DONTNEED", None), off, n))

    def close(self) -> None:
        try:
            self.view.release()
            self.m.close()
        except BufferError:  # a frame view still alive somewhere: unmapped when collected
            pass
        os.close(self.fd)


class RemoteSource:
    """Windows of a remote object, from ranged GETs of :data:`REMOTE_PART` bytes run by the
    workers, ``jobs`` parts ahead of the walker."""

    def __init__(self, v, tier: Tier, key: str, size: int):
        self.v, self.tier, self.key, self.size = v, tier, key, size
        self.parts: dict[int, concurrent.futures.Future] = {}
        self.last = (size - 1) // REMOTE_PART

    def _part(self, i: int) -> concurrent.futures.Future:
        f = self.parts.get(i)
        if f is None:
            s = i * REMOTE_PART
            f = self.parts[i] = self.v.workers.submit(self.tier.get, self.key, s, min(self.size, s + REMOTE_PART))
        return f

    def window(self, off: int, need: int) -> tuple[memoryview, Callable[[], None]]:
        first = off // REMOTE_PART
        last = (min(self.size, off + max(need, 1)) - 1) // REMOTE_PART
        for i in range(first, min(self.last, last + self.v.jobs) + 1):
            self._part(i)
        for i in [i for i in self.parts if i < first]:
            del self.parts[i]
        datas = []
        for i in range(first, last + 1):
            d = self.parts[i].result()
            want = min(self.size, (i + 1) * REMOTE_PART) - i * REMOTE_PART
            if len(d) != want:
                raise IntegrityError(f"short read at offset {i * REMOTE_PART}: {len(d)} of {want} bytes (object changed?)")
            datas.append(d)
        data = datas[0] if len(datas) == 1 else b"".join(datas)
        return memoryview(data)[off - first * REMOTE_PART:], nothing

    def close(self) -> None:
        for f in self.parts.values():
            f.cancel()
        concurrent.futures.wait(list(self.parts.values()))


def open_source(v, tier: Tier, key: str):
    """``(size, source)`` for ``key``, read with the buffers and workers of the verifier ``v``;
    raises ObjectNotFoundError."""
    fd = open_local(tier, key)
    if fd is not None:
        try:
            size = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            raise
        if LOCAL_MMAP and size > 0:
            try:
                return size, MappedSource(fd, size)
            except (OSError, ValueError):  # a file system without mmap: read into buffers
                pass
        return size, LocalSource(v, fd, size)
    size = tier.stat(key).size
    return size, RemoteSource(v, tier, key, size)
