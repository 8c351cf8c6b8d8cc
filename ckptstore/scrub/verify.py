"""Verifying stored objects for scrub, without the index and (shallow) without the key.

For each object a manifest names (:func:`check_object`):

* **presence** and **size** (kinds ``missing``, ``truncated``, ``oversized``);
* the **frame walk** without an index or key (every header checksum, frame index, payload XXH3-64;
  kind ``corrupt``), as :class:`ckptstore.codec.frame.FrameWalk` does it;
* the **object digest** — XXH3-64 over the concatenated frame headers, as recorded in the
  manifest's :class:`~ckptstore.manifest.schema.ObjectEntry` (kind ``digest``) — and the **frame
  count** (kind ``frame-count``);
* with a codec (``deep``): every frame decrypts (AEAD tag) and decompresses to its raw length
  (:meth:`FrameCodec.decode`; kind ``undecodable``).

Deep checks of a version as a whole: the wrapped data key unwraps (kind ``key``, a damaged wrapped
key) and the manifest's HMAC verifies (kind ``manifest``) — :func:`codec_for`; the DCP metadata
(read with :meth:`ckptstore.StorageReader.read_metadata` and the same allow-list unpickler)
references only objects the manifest lists and frames that exist in them, exactly (kind
``metadata``) — :func:`check_metadata`. They need the key of an encrypted version; without it the
deep part of that version is reported as *not checked*. Every data key a scrub unwraps is
unwrapped here (:func:`codec_for`, :func:`ref_codec` for referenced objects), by the master key —
raw or AWS KMS (:mod:`ckptstore.keys`). A key service that refuses or does not answer
(:class:`~ckptstore.errors.KeyServiceError`) leaves the deep part *not checked*, never damaged.

**In parallel**: a :class:`Verifier` of ``jobs`` worker threads (default :func:`default_jobs`)
hashes — and with ``deep`` decodes — the frames while each object's walker parses the headers in
order; up to ``jobs`` objects are walked at once, each read through a source of
:mod:`ckptstore.scrub.read`. The verdict is the one a sequential walk (:func:`verify_stream`)
gives: the first bad frame.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Callable

from ..codec.crypto import FrameCipher, WrappedKey
from ..codec.frame import FIXED_LEN, MAX_CODEC_LEN, FrameCodec, FrameWalk, parse_header, xxh3, xxh3_stream
from ..errors import (
    CkptStoreError,
    IntegrityError,
    KeyMismatchError,
    KeyServiceError,
    ManifestError,
    ObjectNotFoundError,
    TransientStorageError,
    UnsupportedFormatError,
)
from ..manifest import layout
from ..manifest.schema import ObjectEntry
from ..tiers.base import Tier
from .read import Buffers, Window, open_object, open_source
from .report import DAMAGED, OK, REPAIRED, UNCHECKED, Issue, ObjectCheck, VersionCheck

#: the most bytes a frame header takes
_HEAD_MAX = FIXED_LEN + 8 + MAX_CODEC_LEN


def default_jobs() -> int:
    """The default ``jobs`` of :func:`~ckptstore.scrub.scrub` (and ``ckptstore scrub --jobs``): the
    CPUs this process may run on, at most 8.

    Verifying is XXH3-64 over every stored byte — several GB/s per core, with the GIL released — so
    one worker per core keeps a local disk (or the page cache) busy and more workers only contend
    for the same cores; on a remote tier each worker also keeps one ranged GET in flight.
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
    reads go into at most ``jobs + 2`` reused buffers of
    :data:`~ckptstore.scrub.read.LOCAL_CHUNK` bytes (a frame larger than that gets a buffer of its
    own), so memory stays bounded: ≈ 16 MiB × (jobs + 2) locally, ≈ 8 MiB × 2 × jobs per object
    being read remotely.
    """

    def __init__(self, jobs: int | None = None):
        self.jobs = default_jobs() if jobs is None else int(jobs)
        if self.jobs < 1:
            raise ValueError(f"jobs must be at least 1 (got {jobs})")
        self.workers = concurrent.futures.ThreadPoolExecutor(self.jobs, thread_name_prefix="ckptstore-scrub")
        self.walkers = concurrent.futures.ThreadPoolExecutor(self.jobs, thread_name_prefix="ckptstore-scrub-object")
        self._buffers = Buffers(self.jobs + 2)

    def buffer(self, n: int) -> tuple[bytearray, Callable[[], None]]:
        """A buffer of at least ``n`` bytes and the function that gives it back (a window smaller
        than a chunk — a small object, the tail of a big one — gets its own, as does a frame larger
        than a chunk)."""
        return self._buffers.get(n)

    def close(self) -> None:
        self.walkers.shutdown(wait=True)
        self.workers.shutdown(wait=True)

    def __enter__(self) -> "Verifier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def _walk_frames(v: Verifier, src, size: int, entry: ObjectEntry, codec: FrameCodec | None,
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
        size, src = open_source(verifier, tier, key)
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
            kind, detail, frames = _walk_frames(verifier, src, size, entry, codec, on_bytes)
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


def _NO_KEY() -> None:
    """A key provider with no key (not the environment's): for versions that are not encrypted."""
    return None


def codec_for(vc: VersionCheck, te, master, key_problem) -> FrameCodec | None:
    """The frame codec for a deep check, or None (with an issue recorded) when not possible."""
    m = te.manifest
    if not m.encrypted:
        return FrameCodec(m.version, m.attempt, None)
    w = WrappedKey.of_encryption(m.encryption)
    if master is None:
        vc.issues.append(Issue("key", key_problem or (
            f"version is encrypted (key id {m.encryption['key_id']}); the deep check needs the key "
            "(--key-file, CKPTSTORE_KEY or CKPTSTORE_KEY_FILE)" if w.kms_key_arn is None else
            f"version is encrypted with the AWS KMS key {w.kms_key_arn}; the deep check needs it "
            "(--kms-key or CKPTSTORE_KMS_KEY_ID)"), UNCHECKED))
        return None
    try:
        data_key = master.unwrap(w, m.version, m.attempt)
    except KeyMismatchError as e:
        vc.issues.append(Issue("key", str(e), UNCHECKED))
        vc.wrong_key = True
        return None
    except KeyServiceError as e:  # not damage: the key service refused or did not answer
        vc.issues.append(Issue("key", f"not checked: {e}", UNCHECKED))
        return None
    except IntegrityError as e:
        vc.issues.append(Issue("key", str(e) if w.kms_key_arn is not None else (
            "the wrapped data key does not authenticate under the master key "
            "whose key id the manifest names: the wrapped key is damaged")))
        return None
    try:
        te.parsed.verify_mac(data_key)
    except ManifestError as e:
        vc.issues.append(Issue("manifest", str(e)))
    return FrameCodec(m.version, m.attempt, FrameCipher(data_key))


def ref_codec(ref, master) -> FrameCodec:
    """The frame codec of a referenced object (docs/FORMAT.md, "References"): the attempt and the
    data key (unwrapped with ``master``) of the version that wrote it, for a deep check. Raises what
    :meth:`unwrap` raises (``KeyMismatchError``, ``IntegrityError``, ``KeyServiceError``)."""
    cipher = None
    if ref.wrapped_key is not None:
        cipher = FrameCipher(master.unwrap(WrappedKey.of(ref), ref.version, ref.attempt))
    return FrameCodec(ref.version, ref.attempt, cipher)


def check_metadata(tier: Tier, vc: VersionCheck, te, codec: FrameCodec | None, master) -> None:
    """Deep: the DCP metadata unpickles (allow-list) and names only frames that exist."""
    from ..dcp._types import ItemLocation
    from ..dcp.reader import StorageReader, _restricted_loads

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
        except (KeyMismatchError, KeyServiceError, TransientStorageError) as e:
            # no key, or storage that did not answer: not checked, never damage (docs/FORMAT.md, Read rule 5)
            vc.issues.append(Issue("metadata", f"not checked: {e}", UNCHECKED))
            return
        except (CkptStoreError, OSError) as e:
            vc.issues.append(Issue("metadata", f"StorageReader.read_metadata failed: {e}"))
            return
    else:  # StorageReader refuses versions marked damaged; decode it here instead
        try:
            entry = m.metadata_object
            size, fetch, close = open_object(tier, layout.object_key(vc.version, entry.name))
            try:
                read = Window(fetch, size)
                blob = b"".join(bytes(codec.decode(entry.name, read(off, length), None))
                                for off, _hd, length in FrameWalk(read, size, entry.name))
            finally:
                close()
            md = _restricted_loads(blob, entry.name)
        except TransientStorageError as e:
            vc.issues.append(Issue("metadata", f"not checked: {e}", UNCHECKED))
            return
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
