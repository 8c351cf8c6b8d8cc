"""Reading stored objects for scrub: windows of an object, from a local file or a remote tier.

Local objects are read through ``mmap`` in :data:`LOCAL_CHUNK` (16 MiB) windows, a read-ahead thread
filling the page cache ahead of the walker (:class:`MappedSource`, :class:`ReadAhead`; no copy: the
CPU cost of a scrub is that of a plain read of the same bytes), or with one ``preadv`` per window
into reused buffers (:class:`LocalSource`, where ``mmap`` is not available or :data:`LOCAL_MMAP` is
off); remote objects with :data:`REMOTE_PART` (8 MiB)
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
import threading
from typing import Callable

from ..errors import CkptStoreError, IntegrityError, ObjectNotFoundError
from ..tiers.base import Tier

#: bytes of one local window: mapped (:data:`LOCAL_MMAP`) and read ahead by the kernel, or read with
#: one ``preadv`` into a reused buffer; the frames of one window are hashed by the workers while the
#: walker moves on to the next
LOCAL_CHUNK = 16 << 20
#: verify local objects through ``mmap`` (no copy); False: ``preadv`` into buffers
LOCAL_MMAP = True
#: how far past the walker's window the read-ahead thread fills the page cache (:class:`ReadAhead`)
LOCAL_AHEAD = 48 << 20
#: bytes of one read-ahead step (one ``sendfile`` to ``/dev/null``); objects no larger than this
#: are left to the kernel's own read-ahead
_AHEAD_STEP = 4 << 20
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


class ReadAhead:
    """A thread that reads a local file into the page cache, in order, at most :data:`LOCAL_AHEAD`
    bytes past the walker's window (:meth:`wait`), while the walker and the workers read it through
    ``mmap``.

    Each step is one ``sendfile`` of :data:`_AHEAD_STEP` bytes to ``/dev/null``: the kernel reads the
    pages as a sequential ``read`` would (its read-ahead grows) and copies nothing, and the GIL is
    released while it waits on the disk. Measured on a cold 700 MB object (benchmarks/README.md,
    "Scrub vs a plain read"): 0.29-0.32 s against 0.32-0.75 s for a ``read`` loop, 0.014 s when the
    pages are already cached. The walker waits for the thread to pass a window before the hashing
    threads read it: their page faults on pages not yet read each read 128 KiB synchronously and
    defeat the kernel's sequential read-ahead, and ``POSIX_FADV_WILLNEED`` of the next windows did
    not help (measured slower than no advice). Where ``sendfile`` cannot write to ``/dev/null`` (not
    Linux) the thread reads with ``preadv`` into one reused buffer instead. Advice only: a failed
    read ends the thread, and the walker's own reads report what is wrong with the file."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self._cv = threading.Condition()
        self._upto = 0  # the walker's window ends here
        self._done = 0  # read up to here
        self._stop = self._ended = False
        self._thread = threading.Thread(target=self._run, name="ckptstore-scrub-readahead", daemon=True)
        self._thread.start()

    def wait(self, end: int) -> None:
        """Block until the file is in the page cache up to ``end`` (the end of the walker's next
        window) or the thread has ended; the thread may then read on to ``end + LOCAL_AHEAD``."""
        with self._cv:
            if end > self._upto:
                self._upto = end
                self._cv.notify_all()
            while self._done < end and not self._ended:
                self._cv.wait()

    def close(self) -> None:
        """Stop and wait for the thread (before the descriptor is closed)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()

    def _run(self) -> None:
        try:
            self._read()
        finally:
            with self._cv:
                self._ended = True
                self._cv.notify_all()

    def _read(self) -> None:
        try:
            null = os.open(os.devnull, os.O_WRONLY)
        except OSError:
            return
        scratch = None
        try:
            off = 0
            while off < self.size:
                with self._cv:
                    while not self._stop and off >= self._upto + LOCAL_AHEAD:
                        self._cv.wait()
                    if self._stop:
                        return
                n = min(_AHEAD_STEP, self.size - off)
                if scratch is None:
                    try:
                        k = os.sendfile(null, self.fd, off, n)
                    except (OSError, AttributeError):  # not to /dev/null here: read into a buffer
                        scratch = memoryview(bytearray(_AHEAD_STEP))
                        continue
                else:
                    k = os.preadv(self.fd, [scratch[:n]], off)
                if k <= 0:
                    return
                off += k
                with self._cv:
                    self._done = off
                    self._cv.notify_all()
        except (OSError, AttributeError):  # no preadv either (not POSIX): the kernel's read-ahead only
            return
        finally:
            os.close(null)


class LocalSource:
    """Windows of a local file, read with one ``preadv`` each into the verifier's buffers."""

    def __init__(self, v, fd: int, size: int):
        self.v, self.fd, self.size = v, fd, size
        _fadvise(fd, 0, size, "POSIX_FADV_SEQUENTIAL")

    def window(self, off: int, need: int) -> tuple[memoryview, Callable[[], None]]:
        n = min(max(LOCAL_CHUNK, need), self.size - off)
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
    the page cache, without the copy a ``read`` makes (half the CPU of read-then-hash). A
    :class:`ReadAhead` thread reads the file into the page cache ahead of the walker, so the disk
    sees one large sequential read and the hashing threads rarely wait on a page fault. Committed
    objects are never rewritten in place (a repair replaces the file by a rename), so the mapped
    file does not change under the walk; its size is checked again before each window is used."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self.m = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        self.view = memoryview(self.m)
        self._advise(getattr(mmap, "MADV_SEQUENTIAL", None), 0, size)
        self.ahead = ReadAhead(fd, size) if size > _AHEAD_STEP else None

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
        if self.ahead is not None:  # the hashing threads then never fault on a page the disk has not read
            self.ahead.wait(off + n)
        if os.fstat(self.fd).st_size < off + n:
            raise IntegrityError(f"short read at offset {off}: the file shrank while being read (object changed?)")
        # once its frames are verified, the window is unmapped from this process (the pages stay in
        # the page cache), so the resident size stays near (jobs + 1) windows however big the object
        return self.view[off:off + n], (lambda: self._advise(getattr(mmap, "MADV_DONTNEED", None), off, n))

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
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
