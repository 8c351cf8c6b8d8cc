"""The local tier: a directory on fast local disk.

Durability: every object is fsync'd, and so is every directory an entry was added to or removed
from. Put-if-absent links a fully written, fsync'd temporary file into place with ``os.link``
(which fails with EEXIST instead of replacing, unlike ``rename``), then removes the temporary
name. ``put`` (replace) uses ``os.replace``. Temporary files are named ``.tmp-*`` and are garbage
for ``ckptstore gc`` once older than the grace period.

Conditional replace (compare-and-swap, docs/FORMAT.md "Conditional writes"): an object's version
token is its inode, modification time (ns) and size (``stat``); ``replace_if_match`` takes an
exclusive ``flock`` on a lock file ``.tmp-lock.<name>`` next to the key, compares the token, then
renames the fsync'd new copy into place and removes the lock file before it unlocks. A lock is
stale exactly when its holder is gone: the kernel drops a ``flock`` when the process that holds it
exits or is killed, whatever the signal, so a crash never leaves the name locked; the file a killed
holder leaves is a ``.tmp-`` file, garbage for ``gc`` after the grace period, and never blocks: a
waiter that gets the lock on a file no longer at that path (removed by its holder) tries again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import shutil
import stat
import sys
from typing import Callable, Iterator, Sequence

from .. import _faults
from .._names import check_key
from ..errors import (
    CkptStoreError,
    ObjectExistsError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageError,
    StorageFullError,
)
from ..manifest.layout import TMP_PREFIX  # layout strings live in manifest/layout.py
from .base import ObjectInfo, ObjectWriter, Tier

_FULL = (errno.ENOSPC, errno.EDQUOT)

#: Start writeback of an object's pages after every this many bytes written (RocksDB's
#: ``bytes_per_sync`` idea): the disk writes while the encoder still works, so the fsync at commit
#: waits only for the tail. Without it nothing reaches the disk before the fsync unless the dirty
#: pages pass ``vm.dirty_background_ratio`` (10 % of RAM by default), and a save spent 35-40 % of its
#: wall time in that final fsync (512 MiB state; benchmarks/README.md, "Where the time goes").
WRITEBACK_BYTES = 8 << 20


def _writeback_fn() -> Callable[[int, int, int], None] | None:
    """``start(fd, offset, nbytes)``: ask the kernel to start writing that range back, without
    waiting for it (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; ctypes releases the GIL).
    None where it does not exist: then the commit's fsync does all the work, as before."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
    fn.restype = ctypes.c_int
    write = 2  # SYNC_FILE_RANGE_WRITE (linux/fs.h)

    def start(fd: int, offset: int, nbytes: int) -> None:
        fn(fd, offset, nbytes, write)  # advisory: a failure here shows up again at the fsync

    return start


_start_writeback = _writeback_fn()


def _oserror(e: OSError, what: str, key: str, *, object_key: bool = True) -> Exception:
    """The typed error for ``e``; a missing path is :class:`ObjectNotFoundError` only when ``key``
    names an object (``object_key``), not a directory the tier needs."""
    if isinstance(e, CkptStoreError):
        return e
    if e.errno in _FULL:
        return StorageFullError(
            f"local disk full while {what} {key!r} ({e.strerror}); free space or run 'ckptstore gc'"
        )
    if object_key and isinstance(e, FileNotFoundError):
        return ObjectNotFoundError(f"object {key!r} not found in local tier", object=key)
    return StorageError(f"local tier: {what} {key!r} failed: {e}")


def fsync_dir(path: str) -> None:
    """fsync directory ``path``; errors are typed (:class:`StorageFullError` / :class:`StorageError`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise _oserror(e, "syncing directory", path, object_key=False) from e


def makedirs_synced(d: str) -> None:
    """Create ``d`` and its missing parents one by one, fsyncing each new entry's parent.
    Errors are typed (:class:`StorageFullError` / :class:`StorageError`)."""
    missing = []
    p = d
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for m in reversed(missing):
        try:
            os.mkdir(m)
        except FileExistsError:
            pass
        except OSError as e:
            raise _oserror(e, "creating directory", m, object_key=False) from e
        fsync_dir(os.path.dirname(m))


class _LocalWriter(ObjectWriter):
    def __init__(self, tier: "LocalTier", key: str):
        self._tier = tier
        self._key = key
        self._path = tier._path(key)
        self._dir = os.path.dirname(self._path)
        try:
            tier._makedirs(self._dir)
            self._f = open(self._path, "xb")
        except FileExistsError:
            raise ObjectExistsError(f"object {key!r} already exists in local tier") from None
        except OSError as e:
            raise _oserror(e, "creating", key) from e
        self._done = False
        self._written = 0  # bytes handed to write()
        self._synced = 0  # bytes whose writeback was started

    def write(self, data) -> None:
        try:
            self._written += self._f.write(data)
            if _start_writeback is not None and self._written - self._synced >= WRITEBACK_BYTES:
                self._f.flush()
                _start_writeback(self._f.fileno(), self._synced, self._written - self._synced)
                self._synced = self._written
        except OSError as e:
            raise _oserror(e, "writing", self._key) from e

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as e:
            raise _oserror(e, "writing", self._key) from e

    def commit(self) -> None:
        if self._done:
            return
        try:
            self._f.flush()
            _faults.point("local.fsync")
            os.fsync(self._f.fileno())
            self._f.close()
            fsync_dir(self._dir)
        except OSError as e:
            raise _oserror(e, "syncing", self._key) from e
        self._done = True

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._f.close()
        except OSError:
            pass
        _unlink_quietly(self._path)


#: seconds ``replace_if_match`` waits for the lock of a key another writer holds (a holder keeps it
#: for one stat and one rename; a killed holder's lock is released by the kernel at once)
CAS_LOCK_WAIT = 30.0


def token_of(st: os.stat_result) -> str:
    """The local tier's version token of a file (:attr:`ObjectInfo.token`): inode, mtime in ns and
    size, hex. A replace (``os.replace`` of a new file) always changes the inode while the old file
    is still linked, so a token names one content."""
    return f"{st.st_ino:x}.{st.st_mtime_ns:x}.{st.st_size:x}"


@contextlib.contextmanager
def _cas_lock(path: str, key: str):
    """Hold the exclusive lock of ``path``'s conditional replace (module docstring)."""
    import socket
    import time

    lock = os.path.join(os.path.dirname(path), f"{TMP_PREFIX}lock.{os.path.basename(path)}")
    deadline = time.monotonic() + CAS_LOCK_WAIT
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise _oserror(e, "locking", key) from e
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() > deadline:
                    raise TransientStorageError(f"local tier: the lock {lock} of {key!r} is held by another writer "
                                                f"for more than {CAS_LOCK_WAIT:.0f} s; try again") from None
                time.sleep(0.002)
                continue
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(lock))
            except FileNotFoundError:
                same = False
            if not same:  # its holder removed it before unlocking: take the one at the path now
                os.close(fd)
                continue
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        break
    try:
        with contextlib.suppress(OSError):  # who holds it, for a person looking at a stuck root
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode())
        yield
    finally:
        _unlink_quietly(lock)
        os.close(fd)


class LocalTier(Tier):
    """A tier in directory ``root`` (created on first write)."""

    name = "local"
    supports_conditional_replace = True

    def __init__(self, root: str | os.PathLike):
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        self._made: set[str] = set()

    def __reduce__(self):
        return (LocalTier, (self.root,))

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def local_path(self, key: str) -> str:
        return self._path(key)

    def _makedirs(self, d: str) -> None:
        if d not in self._made:
            makedirs_synced(d)
            self._made.add(d)

    def get(self, key, start=None, end=None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                if start is None and end is None:
                    return f.read()
                start = start or 0
                if end is None:
                    return os.pread(f.fileno(), os.fstat(f.fileno()).st_size - start, start)
                return _pread_all(f.fileno(), end - start, start)
        except OSError as e:
            raise _oserror(e, "reading", key) from e

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise _oserror(e, "reading", key) from e
        try:
            return [_pread_all(fd, e - s, s) for s, e in ranges]
        finally:
            os.close(fd)

    def readv_ranges(self, key: str, reqs: Sequence[tuple[int, Sequence]]) -> list[int]:
        """Read into caller buffers instead of fresh ``bytes``: for each ``(offset, buffers)`` of
        ``reqs`` (writable byte buffers, e.g. a frame header buffer and its destination tensor's
        memory), fill the buffers in order from ``offset`` (``preadv``, no intermediate copy).
        Returns the bytes read per request (fewer than asked: the object ends early). Before the
        first read the span of all requests is announced to the kernel (``POSIX_FADV_WILLNEED``:
        it starts reading ahead while the first frames are verified). Raises like :meth:`get`."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise _oserror(e, "reading", key) from e
        try:
            if reqs and hasattr(os, "posix_fadvise"):
                lo = min(o for o, _b in reqs)
                hi = max(o + sum(len(memoryview(b).cast("B")) for b in bs) for o, bs in reqs)
                os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_WILLNEED)
            # adjacent requests (the frames of one item follow each other) go in one preadv: the
            # device sees one large read instead of one per frame
            out: list[int] = []
            i = 0
            while i < len(reqs):
                off, bs = reqs[i]
                views = [memoryview(b).cast("B") for b in bs]
                sizes = [sum(map(len, views))]
                end = off + sizes[0]
                j = i + 1
                while j < len(reqs) and reqs[j][0] == end and len(views) < 512:
                    more = [memoryview(b).cast("B") for b in reqs[j][1]]
                    views += more
                    sizes.append(sum(map(len, more)))
                    end += sizes[-1]
                    j += 1
                got = _preadv_all(fd, views, off)
                for n in sizes:  # what each request got of the bytes read (short at end of file)
                    out.append(max(0, min(n, got)))
                    got -= n
                i = j
            return out
        except OSError as e:
            raise _oserror(e, "reading", key) from e
        finally:
            os.close(fd)

    def _write_tmp(self, key: str, data) -> tuple[str, str]:
        path = self._path(key)
        d = os.path.dirname(path)
        self._makedirs(d)
        tmp = os.path.join(d, f"{TMP_PREFIX}{secrets.token_hex(8)}")
        try:
            with open(tmp, "xb") as f:
                _faults.point("local.tmp_write")
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            _unlink_quietly(tmp)
            raise _oserror(e, "writing", key) from e
        return path, tmp

    def put(self, key, data) -> None:
        path, tmp = self._write_tmp(key, data)
        try:
            _faults.point("local.replace")
            os.replace(tmp, path)
            fsync_dir(os.path.dirname(path))
        except OSError as e:
            raise _oserror(e, "replacing", key) from e

    def put_if_absent(self, key, data) -> None:
        path, tmp = self._write_tmp(key, data)
        try:
            _faults.point("local.link")
            os.link(tmp, path)
        except FileExistsError:
            raise ObjectExistsError(f"object {key!r} already exists in local tier") from None
        except OSError as e:
            raise _oserror(e, "linking", key) from e
        finally:
            _unlink_quietly(tmp)
        fsync_dir(os.path.dirname(path))

    def replace_if_match(self, key, data, token: str) -> None:
        """Compare-and-swap under the key's lock (module docstring): :class:`PreconditionFailedError`
        when ``key`` is gone or its token is no longer ``token``; nothing is written then."""
        path, tmp = self._write_tmp(key, data)
        try:
            with _cas_lock(path, key):
                try:
                    now = token_of(os.stat(path))
                except FileNotFoundError:
                    now = None
                if now != token:
                    raise PreconditionFailedError(
                        f"object {key!r} in the local tier {self.root} was "
                        f"{'deleted' if now is None else 'replaced'} by another writer since it was read; "
                        "not replaced", object=key)
                _faults.point("local.replace_if_match")
                os.replace(tmp, path)
                fsync_dir(os.path.dirname(path))
        except OSError as e:
            raise _oserror(e, "replacing", key) from e
        finally:
            _unlink_quietly(tmp)  # gone after the rename

    def open_writer(self, key) -> ObjectWriter:
        return _LocalWriter(self, key)

    def stat(self, key) -> ObjectInfo:
        try:
            st = os.stat(self._path(key))
        except OSError as e:
            raise _oserror(e, "stat of", key) from e
        if stat.S_ISDIR(st.st_mode):  # a directory is not an object (as on S3)
            raise ObjectNotFoundError(f"object {key!r} not found in local tier (it is a directory)", object=key)
        return ObjectInfo(key, st.st_size, st.st_mtime, token=token_of(st))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # walk only the directory that can hold the prefix
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = os.path.join(self.root, *base.split("/")) if base else self.root
        if not os.path.isdir(top):
            return
        for dirpath, dirnames, filenames in os.walk(top):
            rel = os.path.relpath(dirpath, self.root)
            rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            for fn in filenames:
                key = rel + fn
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, fn))
                except FileNotFoundError:
                    continue
                yield ObjectInfo(key, st.st_size, st.st_mtime)

    def list_dir(self, prefix: str = "") -> tuple[list[ObjectInfo], list[str]]:
        """One ``scandir`` of the directory ``prefix`` names (see :meth:`Tier.list_dir`)."""
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list_dir takes a directory prefix ending with '/', not {prefix!r}")
        top = os.path.join(self.root, *check_key(prefix[:-1]).split("/")) if prefix else self.root
        files, dirs = [], []
        try:
            with os.scandir(top) as it:
                for e in it:
                    try:
                        if e.is_dir():
                            dirs.append(prefix + e.name + "/")
                        else:
                            st = e.stat()
                            files.append(ObjectInfo(prefix + e.name, st.st_size, st.st_mtime))
                    except FileNotFoundError:
                        continue
        except (FileNotFoundError, NotADirectoryError):
            return [], []
        except OSError as e:
            raise _oserror(e, "listing of", prefix) from e
        return sorted(files, key=lambda i: i.key), sorted(dirs)

    def delete(self, key) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise _oserror(e, "deleting", key) from e
        d = os.path.dirname(path)
        fsync_dir(d)
        self._prune(d, self.root)

    def get_file(self, key, path) -> None:
        try:
            with open(self._path(key), "rb") as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
                dst.flush()
                os.fsync(dst.fileno())
        except OSError as e:
            raise _oserror(e, "copying", key) from e

    def put_verified(self, key: str, fill: Callable[[str], None],
                     verify: Callable[[Callable[[int, int], bytes], int], None]) -> None:
        """The new copy is written to a ``.tmp-`` file next to ``key`` and fsync'd, checked, then
        renamed over ``key`` (and the directory fsync'd); a refused copy is removed."""
        path, tmp = self._write_tmp(key, b"")
        try:
            fill(tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
                size = os.fstat(f.fileno()).st_size
                verify(lambda off, n: _pread_all(f.fileno(), n, off), size)
            os.replace(tmp, path)
        except OSError as e:
            raise _oserror(e, "replacing", key) from e
        finally:
            _unlink_quietly(tmp)  # gone after the rename
        fsync_dir(os.path.dirname(path))

    def list_empty_dirs(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = os.path.join(self.root, *base.split("/")) if base else self.root
        if not os.path.isdir(top):
            return
        for dirpath, _dirnames, filenames in os.walk(top, topdown=False):
            if dirpath == top or filenames:
                continue
            key = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            if not key.startswith(prefix):
                continue
            try:
                if os.listdir(dirpath):
                    continue
                mt = os.stat(dirpath).st_mtime
            except OSError:
                continue
            yield ObjectInfo(key, 0, mt)

    def remove_empty_dir(self, key: str) -> bool:
        path = self._path(key)
        top = os.path.join(self.root, check_key(key).split("/")[0])
        try:
            os.rmdir(path)
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise _oserror(e, "removing directory", key) from e
        self._made.discard(path)
        d = os.path.dirname(path)
        fsync_dir(d)
        self._prune(d, top)
        return True

    def _prune(self, d: str, top: str) -> None:
        """Remove now-empty directories from ``d`` up to (not including) ``top`` (best effort)."""
        while d != top and d.startswith(top + os.sep):
            try:
                os.rmdir(d)
            except OSError:
                break
            self._made.discard(d)
            d = os.path.dirname(d)

    def put_file(self, key, path, size=None) -> None:
        with open(path, "rb") as src:
            w = self.open_writer(key)
            try:
                while True:
                    buf = src.read(8 << 20)
                    if not buf:
                        break
                    w.write(buf)
                w.commit()
            except BaseException:
                w.abort()
                raise


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _preadv_all(fd: int, bufs: list, off: int) -> int:
    """Fill ``bufs`` (byte memoryviews) from ``off``; returns the bytes read (short at end of file)."""
    want = sum(len(b) for b in bufs)
    got = os.preadv(fd, bufs, off)
    while got < want:  # a short read (signal, or end of file): continue where it stopped
        skip = got
        rest = []
        for b in bufs:
            if skip >= len(b):
                skip -= len(b)
                continue
            rest.append(b[skip:])
            skip = 0
        n = os.preadv(fd, rest, off + got)
        if n <= 0:
            break
        got += n
    return got


def _pread_all(fd: int, n: int, off: int) -> bytes:
    data = os.pread(fd, n, off)
    if len(data) == n:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        chunk = os.pread(fd, n - got, off + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)
