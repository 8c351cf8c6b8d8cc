"""Scrub: verify every committed version's stored objects, per tier, and optionally repair them.

What is checked, for each version committed in a tier (its ``manifest.json`` parses with a valid
seal) and each object the manifest names (the DCP metadata object and every rank's shard):

* **presence** and **size** (kinds ``missing``, ``truncated``, ``oversized``);
* the **frame walk** without an index or key (:class:`ckptstore.codec.frame.FrameWalk`: every
  header checksum, frame index, payload XXH3-64; kind ``corrupt``);
* the **object digest** — XXH3-64 over the concatenated frame headers, as recorded in the
  manifest's :class:`~ckptstore.manifest.schema.ObjectEntry` (kind ``digest``) — and the **frame
  count** (kind ``frame-count``);
* with ``deep``: the wrapped data key unwraps (kind ``key``, a damaged wrapped key), the manifest's
  HMAC (kind ``manifest``), every frame decrypts (AEAD tag) and decompresses to its raw length
  (:meth:`FrameCodec.decode`; kind ``undecodable``), and the DCP metadata (read with
  :meth:`ckptstore.StorageReader.read_metadata` and the same allow-list unpickler) references only
  objects the manifest lists and frames that exist in them, exactly (kind ``metadata``). Needs the
  key for encrypted versions (``key=``, ``CKPTSTORE_KEY``, ``CKPTSTORE_KEY_FILE``); without it
  the deep part of those versions is reported as *not checked*.

A manifest that is present but fails to parse is reported as damage of kind ``manifest``.

**Which objects** (docs/FORMAT.md, "Scrub"): per tier, the part of the version that tier holds —
the whole version in the remote tier; on a local root of a version split over several node-local
roots, the metadata object and the shard objects of that root's group
(:func:`ckptstore.manifest.placement.part_held`). Another root's objects are never reported
missing; :attr:`VersionCheck.part` (``"part"`` in JSON) says what was checked.

**In parallel**: a :class:`Verifier` of ``jobs`` worker threads (default :func:`default_jobs`)
hashes — and with ``deep`` decodes — the frames while each object's walker parses the headers in
order; up to ``jobs`` objects are walked at once. Local objects are read through ``mmap`` in
16 MiB windows, the kernel reading ahead (no copy: the CPU cost of a scrub is that of a plain read
of the same bytes); remote objects with 8 MiB ranged GETs, ``jobs`` in flight. The verdict is the
one a sequential walk gives (the first bad frame).

With ``repair``: a damaged or missing object is restored from another tier where the same version
is committed by the **same attempt** and whose copy verifies (to the same depth); the copy is
verified again before it replaces the damaged one (locally through a ``.tmp-*`` file and an atomic
rename). Damage that cannot be repaired marks the version damaged in that tier
(``versions/<v>/damaged.json`` with the reason, the attempt and the objects); ``Store.latest()``
skips, and ``StorageReader`` refuses, such a version. A version marked damaged that now verifies
(at least as deeply as when it was marked, or whose mark names another attempt) has its mark
removed. Fault point ``scrub.repair`` precedes every repair write (object restore, mark, unmark).

Exit codes (``ckptstore scrub``; also :attr:`ScrubReport.exit_code`), most severe first:

====  ======================  =========================================================
10    ``EXIT_DAMAGE``         damage found and not (all) repaired
5     ``EXIT_KEY``            no unrepaired damage, but the key given does not fit an
                              encrypted version (``--deep``): the key's exit code, as everywhere
12    ``EXIT_UNCHECKED``      no unrepaired damage, but something could not be checked
                              (key missing for ``--deep``, tier unreachable, read error)
11    ``EXIT_REPAIRED``       damage found and all of it repaired
0     ``EXIT_CLEAN``          everything checked and clean
====  ======================  =========================================================
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import mmap
import os
import queue
import threading
from typing import Callable

from . import _faults
from .codec.crypto import FrameCipher, resolve_key, unwrap_key
from .codec.frame import FIXED_LEN, MAX_CODEC_LEN, FrameCodec, FrameWalk, parse_header, xxh3, xxh3_stream
from .errors import (
    CkptStoreError,
    IntegrityError,
    KeyMismatchError,
    ManifestError,
    ObjectNotFoundError,
    UnsupportedFormatError,
    VersionNotFoundError,
    version_not_found,
)
from .manifest import catalogue, layout, placement
from .manifest.schema import ObjectEntry, utcnow
from .tiers.base import Tier, tiers_of

EXIT_CLEAN = 0
EXIT_KEY = 5  # KeyMismatchError.exit_code
EXIT_DAMAGE = 10
EXIT_REPAIRED = 11
EXIT_UNCHECKED = 12

OK = "ok"
DAMAGED = "damaged"
REPAIRED = "repaired"
UNCHECKED = "unchecked"

#: damage kinds of one object
OBJECT_KINDS = ("missing", "truncated", "oversized", "corrupt", "digest", "frame-count", "undecodable")
#: damage kinds of a version as a whole
VERSION_KINDS = ("manifest", "key", "metadata", "marked", "divergent")

_WINDOW = 16 << 20


@dataclasses.dataclass
class ObjectCheck:
    """The verdict on one object of one version in one tier."""

    tier: str
    version: str
    name: str
    key: str
    size: int
    status: str = OK
    kind: str | None = None
    detail: str = ""
    repaired_from: str | None = None
    frames: list = dataclasses.field(default_factory=list, repr=False, compare=False)
    #: this root holds the object as a replica of another root group's (docs/FORMAT.md, "Replicas")
    replica: bool = False

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("name", "key", "size", "status", "kind", "detail", "repaired_from", "replica")}


@dataclasses.dataclass
class Issue:
    """A finding about a version as a whole (``kind`` in :data:`VERSION_KINDS`, or a note)."""

    kind: str
    detail: str
    status: str = DAMAGED

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class VersionCheck:
    """The verdict on one version in one tier: its objects, version-level issues, mark changes."""

    tier: str
    version: str
    attempt: str | None
    encrypted: bool = False
    deep: bool = False
    objects: list[ObjectCheck] = dataclasses.field(default_factory=list)
    issues: list[Issue] = dataclasses.field(default_factory=list)
    was_marked: bool = False
    mark: str | None = None  # "marked damaged" | "mark removed"
    #: the part of the version this tier holds and that was checked (None: not looked at)
    part: placement.Part | None = None
    #: ``deep``: a key was given, but not the one this encrypted version was written with
    wrong_key: bool = False

    @property
    def status(self) -> str:
        items = [o.status for o in self.objects] + [i.status for i in self.issues]
        if DAMAGED in items:
            return DAMAGED
        if UNCHECKED in items:
            return UNCHECKED
        if REPAIRED in items or self.mark == "mark removed":
            return REPAIRED
        return OK

    def damaged_objects(self) -> list[ObjectCheck]:
        return [o for o in self.objects if o.status == DAMAGED]

    def to_json(self) -> dict:
        return {
            "tier": self.tier,
            "version": self.version,
            "attempt": self.attempt,
            "status": self.status,
            "encrypted": self.encrypted,
            "deep": self.deep,
            "was_marked_damaged": self.was_marked,
            "mark": self.mark,
            "part": None if self.part is None else self.part.to_json(),
            "wrong_key": self.wrong_key,
            "issues": [i.to_json() for i in self.issues],
            "objects": [o.to_json() for o in self.objects],
        }


@dataclasses.dataclass
class ScrubReport:
    deep: bool
    repair: bool
    versions: list[VersionCheck] = dataclasses.field(default_factory=list)
    unreachable: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (tier, why)

    @property
    def exit_code(self) -> int:
        st = [v.status for v in self.versions]
        if DAMAGED in st:
            return EXIT_DAMAGE
        if any(v.wrong_key for v in self.versions):
            return EXIT_KEY
        if UNCHECKED in st or self.unreachable:
            return EXIT_UNCHECKED
        if REPAIRED in st:
            return EXIT_REPAIRED
        return EXIT_CLEAN

    def damage(self) -> list[tuple[str, str, str, str]]:
        """``(tier, version, object or '', kind)`` of every damage found (repaired or not)."""
        out = []
        for v in self.versions:
            for o in v.objects:
                if o.kind is not None and o.status in (DAMAGED, REPAIRED):
                    out.append((v.tier, v.version, o.name, o.kind))
            for i in v.issues:
                if i.status in (DAMAGED, REPAIRED):
                    out.append((v.tier, v.version, "", i.kind))
        return out

    def to_json(self) -> dict:
        return {
            "exit_code": self.exit_code,
            "deep": self.deep,
            "repair": self.repair,
            "unreachable": [{"tier": t, "why": w} for t, w in self.unreachable],
            "versions": [v.to_json() for v in self.versions],
            "summary": {
                "versions": len(self.versions),
                "objects": sum(len(v.objects) for v in self.versions),
                "damaged": sum(1 for v in self.versions if v.status == DAMAGED),
                "repaired": sum(1 for v in self.versions if v.status == REPAIRED),
                "unchecked": sum(1 for v in self.versions if v.status == UNCHECKED) + len(self.unreachable),
            },
        }


# -- reading -----------------------------------------------------------------------------------------
class _Window:
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


def _open_local(tier: Tier, key: str) -> int | None:
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


def _open_object(tier: Tier, key: str):
    """``(size, fetch, close)`` for ``key``; raises ObjectNotFoundError."""
    fd = _open_local(tier, key)
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


def verify_stream(read, size: int, entry: ObjectEntry, codec: FrameCodec | None = None,
                  on_bytes: Callable[[int], None] | None = None) -> tuple[str | None, str, list]:
    """Check one object held in ``read(offset, n)`` of ``size`` bytes against its manifest entry.

    Returns ``(kind, detail, frames)``: ``kind`` None when clean; ``frames`` the walked frames as
    ``(offset, length, index, payload_xxh3, raw_len)``. With ``codec`` every frame is decoded too.
    """
    if size < entry.size:
        return "truncated", f"{size} bytes, the manifest says {entry.size} ({entry.size - size} missing)", []
    if size > entry.size:
        return "oversized", f"{size} bytes, the manifest says {entry.size}", []
    walk = FrameWalk(read, entry.size, entry.name)
    try:
        for off, hd, length in walk:
            if codec is not None:
                try:
                    codec.decode(entry.name, read(off, length), None)
                except (IntegrityError, KeyMismatchError) as e:
                    return "undecodable", _about(entry.name, e), walk.frames
            if on_bytes is not None:
                on_bytes(length)
    except IntegrityError as e:
        return "corrupt", _about(entry.name, e), walk.frames
    bad = walk.mismatch(entry.frames, entry.digest, entry.nbytes)
    if bad is not None:
        return bad[0], bad[1], walk.frames
    return None, "", walk.frames


def _about(name: str, e: Exception) -> str:
    """``e``'s message without a leading ``"<name>: "`` (the report names the object already)."""
    text = str(e)
    return text[len(name) + 2:] if text.startswith(name + ": ") else text


# -- parallel verification -------------------------------------------------------------------------
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
_HEAD_MAX = FIXED_LEN + 8 + MAX_CODEC_LEN


def default_jobs() -> int:
    """The default ``jobs`` of :func:`scrub` (and ``ckptstore scrub --jobs``): the CPUs this
    process may run on, at most 8.

    Verifying is XXH3-64 over every stored byte — several GB/s per core, with the GIL released — so
    one worker per core keeps a local disk (or the page cache) busy and more workers only contend
    for the same cores; on S3 each worker also keeps one ranged GET in flight.
    """
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


class Verifier:
    """The thread pools of one scrub.

    ``jobs`` workers hash (and, deep, decode) frames and run the remote ranged GETs; up to ``jobs``
    objects are walked at once (headers are parsed in order by the object's walker thread). Local
    reads go into at most ``jobs + 2`` reused buffers of :data:`LOCAL_CHUNK` bytes (a frame larger
    than that gets a buffer of its own), so memory stays bounded: ≈ 16 MiB × (jobs + 2) locally,
    ≈ 8 MiB × 2 × jobs per object being read remotely.
    """

    def __init__(self, jobs: int | None = None):
        self.jobs = default_jobs() if jobs is None else int(jobs)
        if self.jobs < 1:
            raise ValueError(f"jobs must be at least 1 (got {jobs})")
        self.workers = concurrent.futures.ThreadPoolExecutor(self.jobs, thread_name_prefix="ckptstore-scrub")
        self.walkers = concurrent.futures.ThreadPoolExecutor(self.jobs, thread_name_prefix="ckptstore-scrub-object")
        self._free: queue.Queue = queue.Queue()
        for _ in range(self.jobs + 2):
            self._free.put(None)  # a slot; its buffer is made on first use

    def buffer(self, n: int) -> tuple[bytearray, Callable[[], None]]:
        """A buffer of at least ``n`` bytes and the function that gives it back (a window smaller
        than a chunk — a small object, the tail of a big one — gets its own, as does a frame larger
        than a chunk)."""
        if n != LOCAL_CHUNK:
            return bytearray(n), _nothing
        b = self._free.get()
        if b is None:
            b = bytearray(LOCAL_CHUNK)
        return b, (lambda: self._free.put(b))

    def close(self) -> None:
        self.walkers.shutdown(wait=True)
        self.workers.shutdown(wait=True)

    def __enter__(self) -> "Verifier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _nothing() -> None:
    return None


class _Hold:
    """Gives a read buffer back once its reader and every frame task reading it are done."""

    def __init__(self, release: Callable[[], None]):
        self._release = release
        self._n = 1
        self._lock = threading.Lock()

    def add(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._n += 1
        fut.add_done_callback(self._done)

    def _done(self, _fut=None) -> None:
        with self._lock:
            self._n -= 1
            last = self._n == 0
        if last:
            self._release()

    done = _done


def _fadvise(fd: int, off: int, n: int, how: str) -> None:
    if hasattr(os, "posix_fadvise") and n > 0:
        try:
            os.posix_fadvise(fd, off, n, getattr(os, how))
        except OSError:  # advice only
            pass


class _LocalSource:
    """Windows of a local file, read with one ``preadv`` each into the verifier's buffers."""

    def __init__(self, v: Verifier, fd: int, size: int):
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


class _MappedSource:
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
            self._advise(getattr(mmap, "MADV_WILLNEED", None), max(off, self.advised), upto - max(off, self.advised))
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


class _RemoteSource:
    """Windows of a remote object, from ranged GETs of :data:`REMOTE_PART` bytes run by the
    workers, ``jobs`` parts ahead of the walker."""

    def __init__(self, v: Verifier, tier: Tier, key: str, size: int):
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
        return memoryview(data)[off - first * REMOTE_PART:], _nothing

    def close(self) -> None:
        for f in self.parts.values():
            f.cancel()
        concurrent.futures.wait(list(self.parts.values()))


def _frame_task(index: int, name: str, frame: memoryview, header_len: int, expect: int, codec: FrameCodec | None):
    """``(index, kind, detail)`` when the frame is bad, else None (runs on a worker)."""
    if xxh3(frame[header_len:]) != expect:
        return index, "corrupt", f"frame {index} payload checksum mismatch"
    if codec is not None:
        try:
            codec.decode(name, frame, None)
        except (IntegrityError, KeyMismatchError) as e:
            return index, "undecodable", _about(name, e)
    return None


def _walk(v: Verifier, src, size: int, entry: ObjectEntry, codec: FrameCodec | None,
          on_bytes: Callable[[int], None] | None) -> tuple[str | None, str, list]:
    """:func:`verify_stream`'s checks, with the frames hashed (and decoded) by the workers while
    the walker reads on and parses the headers in order. The verdict is the one the first bad frame
    gives, as with a sequential walk."""
    name = entry.name
    digest = xxh3_stream()
    count = raw = 0
    frames: list = []
    futs: list = []
    stop = None  # (frame index, kind, detail) of a bad header
    pos, need = 0, _HEAD_MAX
    try:
        while pos < size and stop is None:
            try:
                mv, release = src.window(pos, need)
            except IntegrityError as e:
                stop = (count, "corrupt", _about(name, e))
                break
            hold = _Hold(release)
            local, n, need = 0, len(mv), _HEAD_MAX
            try:
                while pos + local < size:
                    off = pos + local
                    hn = min(_HEAD_MAX, size - off)
                    if local + hn > n:
                        break
                    try:
                        hd = parse_header(mv[local:local + hn], f"{name}@{off}")
                    except IntegrityError as e:
                        stop = (count, "corrupt", _about(name, e))
                        break
                    if hd.index != count:
                        stop = (count, "corrupt", f"frame at offset {off} has index {hd.index}, expected {count}")
                        break
                    length = hd.header_len + hd.stored_len
                    if off + length > size:
                        stop = (count, "corrupt", f"frame {hd.index} runs past the end of the object (truncated)")
                        break
                    if local + length > n:
                        if local == 0:
                            need = length  # a frame larger than a window: read it whole next
                        break
                    digest.update(mv[local:local + hd.header_len])
                    fut = v.workers.submit(_frame_task, count, name, mv[local:local + length], hd.header_len,
                                           hd.payload_xxh3, codec)
                    hold.add(fut)
                    futs.append(fut)
                    frames.append((off, length, hd.index, hd.payload_xxh3, hd.raw_len))
                    count += 1
                    raw += hd.raw_len
                    local += length
                    if on_bytes is not None:
                        on_bytes(length)
                pos += local
            finally:
                hold.done()
    finally:
        concurrent.futures.wait(futs)
    bad = [r for r in (f.result() for f in futs) if r is not None]
    first = min(bad) if bad else None
    if stop is not None and (first is None or stop[0] <= first[0]):
        first = stop
    if first is not None:
        good = [fr for fr in frames if fr[2] < first[0]]
        return first[1], first[2], good
    if count != entry.frames:
        return "frame-count", f"{count} frames, the manifest says {entry.frames}", frames
    got = f"{digest.intdigest():016x}"
    if got != entry.digest:
        return "digest", f"frame-header digest {got}, the manifest says {entry.digest}", frames
    if raw != entry.nbytes:
        return "digest", f"frames hold {raw} raw bytes, the manifest says {entry.nbytes}", frames
    return None, "", frames


def _open_source(v: Verifier, tier: Tier, key: str):
    """``(size, source)`` for ``key``; raises ObjectNotFoundError."""
    fd = _open_local(tier, key)
    if fd is not None:
        try:
            size = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            raise
        if LOCAL_MMAP and size > 0:
            try:
                return size, _MappedSource(fd, size)
            except (OSError, ValueError):  # a file system without mmap: read into buffers
                pass
        return size, _LocalSource(v, fd, size)
    size = tier.stat(key).size
    return size, _RemoteSource(v, tier, key, size)


def check_object(tier: Tier, tier_name: str, version: str, entry: ObjectEntry, codec: FrameCodec | None = None,
                 on_bytes: Callable[[int], None] | None = None, verifier: Verifier | None = None) -> ObjectCheck:
    """Verify one object of ``version`` in ``tier`` against its manifest ``entry`` (presence, size,
    every frame, digest, frame count; with ``codec`` every frame decodes). ``verifier``: the thread
    pools to use (default: a one-off :class:`Verifier` of :func:`default_jobs` workers)."""
    if verifier is None:
        with Verifier() as v:
            return check_object(tier, tier_name, version, entry, codec, on_bytes, v)
    key = layout.object_key(version, entry.name)
    oc = ObjectCheck(tier_name, version, entry.name, key, entry.size)
    try:
        size, src = _open_source(verifier, tier, key)
    except ObjectNotFoundError:
        oc.status, oc.kind, oc.detail = DAMAGED, "missing", "object is missing"
        return oc
    except (CkptStoreError, OSError) as e:
        oc.status, oc.detail = UNCHECKED, f"could not read: {e}"
        return oc
    try:
        if size != entry.size:
            kind, detail, frames = verify_stream(None, size, entry)
        else:
            kind, detail, frames = _walk(verifier, src, size, entry, codec, on_bytes)
    except UnsupportedFormatError as e:
        oc.status, oc.detail = UNCHECKED, f"codec not supported by this release: {e}"
        return oc
    except ObjectNotFoundError:
        oc.status, oc.kind, oc.detail = DAMAGED, "missing", "object vanished while being read"
        return oc
    except (CkptStoreError, OSError) as e:
        oc.status, oc.detail = UNCHECKED, f"could not read: {e}"
        return oc
    finally:
        src.close()
    oc.frames = frames
    if kind is not None:
        oc.status, oc.kind, oc.detail = DAMAGED, kind, detail
    return oc


# -- the scrub ---------------------------------------------------------------------------------------
def scrub(
    store,
    *,
    version: str | None = None,
    deep: bool = False,
    repair: bool = False,
    key=None,
    on_total: Callable[[int], None] | None = None,
    on_bytes: Callable[[int], None] | None = None,
    jobs: int | None = None,
) -> ScrubReport:
    """Verify (and with ``repair`` fix) the committed versions of ``store`` (a :class:`Store` or a
    ``{name: Tier}`` mapping). ``version``: only that one (raises :class:`VersionNotFoundError` when
    no reachable tier commits it). ``key``: master key for ``deep`` (default ``CKPTSTORE_KEY`` /
    ``CKPTSTORE_KEY_FILE``). ``on_total(bytes)``/``on_bytes(n)``: progress callbacks (``on_bytes``
    may be called from several threads). ``jobs``: worker threads that verify objects and frames
    (and run ranged GETs on S3); default :func:`default_jobs`.

    Per tier, the part of each version that tier holds is checked
    (:func:`ckptstore.manifest.placement.part_held`): the whole version in the ``remote`` tier; on a
    local root of a version split over several roots, the metadata object and the shard objects of
    that root's group — the other groups' objects live on other roots and are never reported
    missing. :attr:`VersionCheck.part` says which part was checked.
    """
    tiers = tiers_of(store)
    report = ScrubReport(deep=deep, repair=repair)
    master = None
    key_problem = None
    if deep:  # an invalid key, however given (key=, CKPTSTORE_KEY, CKPTSTORE_KEY_FILE): KeyMismatchError, exit 5
        master = resolve_key(key if key is not None else getattr(store, "key", None))
    entries: dict[str, dict] = {}
    for name, t in tiers.items():
        problems: list = []
        try:
            entries[name] = catalogue.scan(t, problems)
        except (CkptStoreError, OSError) as e:
            report.unreachable.append((name, f"{type(e).__name__}: {e}"))
            continue
        for _t, mkey, why in problems:
            v = layout.version_of_key(mkey)
            if version is not None and v != version:
                continue
            report.versions.append(VersionCheck(name, v or mkey, None, issues=[Issue("manifest", f"{mkey}: {why}")]))
    names = {v for e in entries.values() for v in e}
    if version is not None:
        if version not in names and not report.unreachable and not report.versions:
            raise version_not_found(version, " or ".join(f"the {n} tier ({t.url})" for n, t in tiers.items()) or "no tier",
                                    names)
        names &= {version}
    recs = catalogue.merge({n: {v: e[v] for v in names if v in e} for n, e in entries.items()})
    order = [r.version for r in recs]
    parts: dict[tuple[str, str], placement.Part] = {}
    for n, e in entries.items():
        for v in order:
            if v in e:
                try:
                    parts[n, v] = placement.part_held(tiers[n], e[v].manifest, remote=n != "local")
                except (CkptStoreError, OSError):  # the listing failed: check (and report) everything
                    parts[n, v] = placement.whole(e[v].manifest)
    orphans = _orphan_refs(entries, order)
    if on_total is not None:
        on_total(sum(o.size for p in parts.values() for o in p.objects) + sum(r.size for rs in orphans.values() for r in rs))
    with Verifier(jobs) as verifier:
        for v in order:
            _scrub_version(tiers, entries, v, parts, verifier, deep, repair, master, key_problem, on_bytes, report, orphans)
    return report


def _orphan_refs(entries: dict, order: list) -> dict:
    """``{(tier, version): [RefEntry]}``: each referenced object (docs/FORMAT.md, "References") whose
    origin version is not committed in that tier, checked once — with the first version (in order)
    that references it. A reference whose origin is committed there is checked with its origin."""
    out: dict = {}
    for n, e in entries.items():
        committed = {v: te.manifest.attempt for v, te in e.items()}
        seen: set = set()
        for v in order:
            if v not in e:
                continue
            for ref in e[v].manifest.refs:
                if committed.get(ref.version) == ref.attempt or (ref.version, ref.name) in seen:
                    continue
                seen.add((ref.version, ref.name))
                out.setdefault((n, v), []).append(ref)
    return out


def _scrub_version(tiers, entries, v, parts, verifier, deep, repair, master, key_problem, on_bytes, report,
                   orphans=None) -> None:
    holders = {n: e[v] for n, e in entries.items() if v in e}
    checks: dict[str, VersionCheck] = {}
    codecs: dict[str, FrameCodec | None] = {}
    for n, te in holders.items():
        checks[n], codecs[n] = _check_version(tiers[n], n, v, te, parts[n, v], deep, master, key_problem, on_bytes, verifier,
                                              (orphans or {}).get((n, v), ()))
    if repair:
        _repair_objects(tiers, holders, checks, codecs, verifier)
    if deep:
        for n, vc in checks.items():
            _check_metadata(tiers[n], vc, holders[n], codecs[n], master)
    for n, vc in checks.items():
        _settle_mark(tiers[n], vc, holders[n], repair, deep)
    _check_divergence(holders, checks)
    report.versions.extend(checks[n] for n in tiers if n in checks)


def _check_divergence(holders: dict, checks: dict[str, VersionCheck]) -> None:
    """Tiers that hold different attempts of one name (docs/FORMAT.md, "One name, one content"):
    every copy but the one :func:`ckptstore.manifest.order.resolve` chooses is reported (kind
    ``divergent``): it is never loaded, and it is not repaired (it is another save)."""
    from .manifest.order import resolve

    if len({te.manifest.attempt for te in holders.values()}) < 2:
        return
    chosen = resolve([catalogue.copy_of(te.manifest, remote=(n == "remote")) for n, te in holders.items()])
    winner = next(n for n, te in holders.items() if te.manifest.attempt == chosen)
    for n, te in holders.items():
        if te.manifest.attempt != chosen:
            why = ("supersedes it" if te.manifest.attempt in holders[winner].manifest.superseded_attempts
                   else "is the copy of record")
            checks[n].issues.append(Issue("divergent", (
                f"this copy (attempt {te.manifest.attempt}) is not the version: the {winner} tier holds attempt {chosen}, "
                f"which {why}; this copy is never loaded. Remove it with 'ckptstore drop ROOT {te.manifest.version} "
                f"--tier {n}' (the {winner} copy stays), or let the pending upload replace it")))


def _NO_KEY() -> None:
    """A key provider with no key (not the environment's): for versions that are not encrypted."""
    return None


def _codec_for(vc: VersionCheck, te, master, key_problem) -> FrameCodec | None:
    """The frame codec for a deep check, or None (with an issue recorded) when not possible."""
    m = te.manifest
    if not m.encrypted:
        return FrameCodec(m.version, m.attempt, None)
    if master is None:
        vc.issues.append(Issue("key", key_problem or (
            f"version is encrypted (key id {m.encryption['key_id']}); the deep check needs the key "
            "(--key-file, CKPTSTORE_KEY or CKPTSTORE_KEY_FILE)"), UNCHECKED))
        return None
    try:
        data_key = unwrap_key(master, m.encryption["wrapped_key"], m.version, m.attempt, m.encryption["key_id"])
    except KeyMismatchError as e:
        vc.issues.append(Issue("key", str(e), UNCHECKED))
        vc.wrong_key = True
        return None
    except IntegrityError:
        vc.issues.append(Issue("key", "the wrapped data key does not authenticate under the master key "
                                      "whose key id the manifest names: the wrapped key is damaged"))
        return None
    try:
        te.parsed.verify_mac(data_key)
    except ManifestError as e:
        vc.issues.append(Issue("manifest", str(e)))
    return FrameCodec(m.version, m.attempt, FrameCipher(data_key))


def _check_version(tier, name, version, te, part, deep, master, key_problem, on_bytes,
                   verifier: Verifier, refs=()) -> tuple[VersionCheck, FrameCodec | None]:
    m = te.manifest
    # any damaged.json counts here, also one naming another attempt (the catalogue ignores those):
    # scrub reports it and --repair removes it
    marked = te.damaged or tier.exists(layout.damaged_key(version))
    vc = VersionCheck(name, version, m.attempt, encrypted=m.encrypted, deep=deep, was_marked=marked, part=part)
    codec = _codec_for(vc, te, master, key_problem) if deep else None
    vc.deep = deep and codec is not None
    futs = [verifier.walkers.submit(check_object, tier, name, version, entry, codec, on_bytes, verifier)
            for entry in part.objects]
    for ref in refs:  # an earlier version's object this one references, whose origin is gone here
        rc = None
        if vc.deep:
            cipher = None
            if ref.wrapped_key is not None:
                cipher = FrameCipher(unwrap_key(master, ref.wrapped_key, ref.version, ref.attempt, ref.key_id))
            rc = FrameCodec(ref.version, ref.attempt, cipher)
        futs.append(verifier.walkers.submit(check_object, tier, name, ref.version, ref.entry, rc, on_bytes, verifier))
    vc.objects.extend(f.result() for f in futs)
    for o in vc.objects:
        o.replica = o.name in part.replicas
    return vc, codec


def _repair_objects(tiers, holders, checks: dict[str, VersionCheck], codecs: dict, verifier: Verifier | None = None) -> None:
    for n, vc in checks.items():
        for oc in vc.damaged_objects():
            sources = [
                s for s, svc in checks.items()
                if s != n and holders[s].manifest.attempt == holders[n].manifest.attempt
                and any(so.name == oc.name and so.status == OK for so in svc.objects)
                and (not vc.deep or svc.deep)
            ]
            entry = next(o for o in holders[n].manifest.all_objects() if o.name == oc.name)
            errors = []
            for s in sources:
                try:
                    restore_object(tiers[s], tiers[n], oc.key, entry)
                except (CkptStoreError, OSError) as e:
                    errors.append(f"restore from the {s} tier failed: {e}")
                    continue
                again = check_object(tiers[n], n, vc.version, entry, codecs[n], verifier=verifier)
                if again.status == OK:
                    oc.status, oc.repaired_from, oc.frames = REPAIRED, s, again.frames
                    oc.detail += f"; restored from the {s} tier"
                    break
                errors.append(f"copy from the {s} tier does not verify after restore: {again.kind} {again.detail}")
            if oc.status == DAMAGED:
                if not sources:
                    errors.append("no other tier holds a verified copy of the same attempt")
                oc.detail += "; not repaired: " + "; ".join(errors)


def restore_object(src: Tier, dst: Tier, key: str, entry: ObjectEntry) -> None:
    """Copy ``key`` from ``src`` to ``dst``, replacing the damaged copy only with a verified one."""
    _faults.point("scrub.repair")

    def verify(fetch, size):
        kind, detail, _fr = verify_stream(_Window(lambda s, e: fetch(s, e - s), size), size, entry)
        if kind is not None:
            raise IntegrityError(f"the {src.name} copy of {key} does not verify: {kind} {detail}", object=key)

    dst.put_verified(key, lambda path: src.get_file(key, path), verify)


def _check_metadata(tier: Tier, vc: VersionCheck, te, codec: FrameCodec | None, master) -> None:
    """Deep: the DCP metadata unpickles (allow-list) and names only frames that exist."""
    from .dcp._types import ItemLocation
    from .dcp.reader import StorageReader, _restricted_loads

    if codec is None:
        return
    m = te.manifest
    by_name = {o.name: o for o in vc.objects}
    meta = by_name.get(m.metadata_object.name)
    if meta is None or meta.status not in (OK, REPAIRED):
        return  # already reported
    md = None
    if not tier.exists(layout.damaged_key(vc.version)):
        try:
            # an unencrypted version needs no key: never fall back to CKPTSTORE_KEY for it
            reader = StorageReader(None, remote=tier, key=master if master is not None else _NO_KEY,
                                   version=vc.version, allow_unencrypted=True)
            md = reader.read_metadata()
        except KeyMismatchError as e:
            vc.issues.append(Issue("metadata", f"not checked: {e}", UNCHECKED))
            return
        except (CkptStoreError, OSError) as e:
            vc.issues.append(Issue("metadata", f"StorageReader.read_metadata failed: {e}"))
            return
    else:  # StorageReader refuses versions marked damaged; decode it here instead
        try:
            entry = m.metadata_object
            size, fetch, close = _open_object(tier, layout.object_key(vc.version, entry.name))
            try:
                read = _Window(fetch, size)
                blob = b"".join(bytes(codec.decode(entry.name, read(off, length), None))
                                for off, _hd, length in FrameWalk(read, size, entry.name))
            finally:
                close()
            md = _restricted_loads(blob, entry.name)
        except (CkptStoreError, OSError) as e:
            vc.issues.append(Issue("metadata", f"DCP metadata does not decode: {e}"))
            return
    sd = getattr(md, "storage_data", None)
    if not isinstance(sd, dict):
        vc.issues.append(Issue("metadata", "DCP metadata has no ckptstore storage_data"))
        return
    walked = {o.name: set(o.frames) for o in vc.objects if o.status in (OK, REPAIRED)}
    listed = {o.name for o in m.all_objects()} | {r.name for r in m.refs}  # its own objects and the referenced ones
    bad = []
    for idx, loc in sd.items():
        fqn = getattr(idx, "fqn", idx)
        if not isinstance(loc, ItemLocation):
            bad.append(f"{fqn!r}: not an ItemLocation")
            continue
        if loc.object not in listed:
            bad.append(f"{fqn!r} names object {loc.object!r}, which the manifest does not list")
            continue
        have = walked.get(loc.object)
        if have is None:
            continue  # that object is damaged: reported on its own
        total = 0
        for f in loc.frames:
            if (f.offset, f.length, f.index, f.xxh3, f.raw_len) not in have:
                bad.append(f"{fqn!r} references frame {f.index} at offset {f.offset} of {loc.object!r}, which does not exist")
                break
            total += f.raw_len
        else:
            if total != loc.nbytes:
                bad.append(f"{fqn!r}: its frames hold {total} bytes, the index says {loc.nbytes}")
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        vc.issues.append(Issue("metadata", "; ".join(bad[:5]) + more))


def _read_mark(tier: Tier, version: str) -> dict:
    try:
        d = json.loads(tier.get(layout.damaged_key(version)))
        return d if isinstance(d, dict) else {}
    except Exception:  # noqa: BLE001 - an unreadable mark is still a mark
        return {}


def _drop_bad_replicas(tier: Tier, vc: VersionCheck, repair: bool) -> None:
    """A damaged replica (that no other tier repaired) is this root's copy of another node's object,
    not the version: it never marks the version damaged. With ``repair`` it is removed from the root
    and from its record, so no restore reads it, and the job's next restore copies it again from the
    node that holds the primary (docs/FORMAT.md, "Replicas")."""
    for o in vc.objects:
        if not (o.replica and o.status == DAMAGED):
            continue
        if not repair:
            o.detail += " (a replica: the primary is on its own node; --repair removes this copy and the next restore " \
                        "re-replicates it)"
            continue
        _faults.point("scrub.repair")
        tier.delete(o.key)
        o.status = REPAIRED
        o.detail += " (a replica: removed; the next restore of the job copies it again from its primary)"
        prefix = layout.version_dir(vc.version) + "/" + layout.attempt_dir(vc.attempt or "") + "/"
        for info in list(tier.list(prefix)):
            if layout.replica_record_rank(info.key) is None:
                continue
            rec = json.loads(tier.get(info.key))
            if o.name in rec.get("objects", []):
                rec["objects"] = [n for n in rec["objects"] if n != o.name]
                tier.put(info.key, json.dumps(rec, sort_keys=True).encode())


def _settle_mark(tier: Tier, vc: VersionCheck, te, repair: bool, deep: bool) -> None:
    """Mark versions that stay damaged; clear marks of versions that verify (with ``repair``)."""
    _drop_bad_replicas(tier, vc, repair)
    unrepaired = [o for o in vc.objects if o.status == DAMAGED and not o.replica] + \
        [i for i in vc.issues if i.status == DAMAGED]
    if vc.was_marked:
        mark = _read_mark(tier, vc.version)
        if unrepaired:
            vc.issues.append(Issue("marked", f"marked damaged: {mark.get('reason', '?')}"))
            return
        stale = mark.get("attempt") not in (None, vc.attempt)
        needs_deep = bool(mark.get("deep")) and not vc.deep and not stale
        if UNCHECKED in [o.status for o in vc.objects]:
            vc.issues.append(Issue("marked", f"marked damaged: {mark.get('reason', '?')}"))
            return
        if not repair or needs_deep:
            hint = "run 'ckptstore scrub --deep --repair' to re-check it" if needs_deep else "run 'ckptstore scrub --repair' to clear the mark"
            vc.issues.append(Issue("marked", f"marked damaged ({mark.get('reason', '?')}), but verifies clean now; {hint}"))
            return
        _faults.point("scrub.repair")
        tier.delete(layout.damaged_key(vc.version))
        vc.mark = "mark removed"
        return
    if unrepaired and repair:
        reasons = [f"{o.name}: {o.kind} ({o.detail})" for o in unrepaired if isinstance(o, ObjectCheck)]
        reasons += [f"{i.kind}: {i.detail}" for i in unrepaired if isinstance(i, Issue)]
        body = {
            "reason": "; ".join(reasons),
            "attempt": vc.attempt,
            "objects": {o.name: o.kind for o in unrepaired if isinstance(o, ObjectCheck)},
            "deep": vc.deep,
            "time": utcnow(),
            "by": "ckptstore scrub",
        }
        _faults.point("scrub.repair")
        tier.put(layout.damaged_key(vc.version), json.dumps(body, sort_keys=True).encode())
        vc.mark = "marked damaged"


def format_report(report: ScrubReport) -> list[str]:
    """Human-readable lines (what ``ckptstore scrub`` prints without ``--json``)."""
    lines = []
    for t, why in report.unreachable:
        lines.append(f"{t} tier: NOT CHECKED ({why})")
    for v in report.versions:
        bad = [o for o in v.objects if o.status != OK]
        head = f"{v.tier:<6} {v.version}: {v.status.upper()}"
        if v.objects:
            where = f"{v.part.label}: " if v.part is not None and not v.part.whole else ""
            head += f" ({where}{len(v.objects)} objects{', deep' if v.deep else ''})"
        if v.mark:
            head += f" [{v.mark} now]"
        lines.append(head)
        for i in v.issues:  # a "marked" issue's detail says "marked damaged ..." itself
            lines.append(f"         {i.detail}" if i.kind == "marked" else f"         {i.status}: {i.kind}: {i.detail}")
        for o in bad:
            what = o.kind or "not checked"
            lines.append(f"         {o.status}: {o.name}{' (replica)' if o.replica else ''}: {what}: {o.detail}")
    return lines


__all__ = [
    "EXIT_CLEAN",
    "EXIT_DAMAGE",
    "EXIT_REPAIRED",
    "EXIT_UNCHECKED",
    "ObjectCheck",
    "VersionCheck",
    "Issue",
    "ScrubReport",
    "scrub",
    "default_jobs",
    "Verifier",
    "check_object",
    "verify_stream",
    "restore_object",
    "format_report",
]
