"""The encode/write stage of a save: a rank's write items → frames → one object (docs/FORMAT.md,
"Frame byte layout"), as :class:`ShardWriter` runs it in ``write_data`` (phase 1).

The frame loop (:func:`write_frames`) is the hot path of a save: frames are encoded
(byte-group/zstd, AES-GCM, XXH3) in a thread pool, at most a window ahead, and appended in order to
an :class:`ObjectSink`, which tracks size, digest and codec chains, feeds the streamed upload and
commits (fsync) or aborts the object. The coordinator writes the DCP metadata object through the
same loop (:func:`write_small_object`).
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures as cf
import io
import itertools
from typing import Any

import torch

from .. import _faults
from ..codec import FrameCodec, FrameRef
from ..codec.bytegroup import PlanCell
from ..codec.crypto import WrappedKey
from ..codec.frame import FIXED_LEN, xxh3_stream
from ..codec.numerics import count_nonfinite, rule_for
from ..errors import KeyMismatchError
from ..manifest import layout
from ..manifest.schema import ObjectEntry
from . import _subclass
from ._reports import items_result, object_result
from ._types import ItemLocation, ObjectReport, PlanData

DEFAULT_FRAME_SIZE = 2 << 20  # bytes; a multiple of every element size (≤ 16). 2 MiB: AES-GCM and
# zstd run fastest on buffers that stay below the allocator's mmap threshold; 48 B of header per frame.
_FLOAT_WIDTH = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4, torch.float64: 8}
#: write items with non-finite values a rank names in its report (and the manifest: docs/FORMAT.md, "Manifest")
NONFINITE_FIRST = 8


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def tensor_bytes(t: torch.Tensor, key: str = "?") -> memoryview:
    """The bytes of ``t`` in C order as a flat memoryview (copies only if non-contiguous/non-CPU, or a
    tensor subclass without memory of its own: its values through its ``copy_``, docs/FORMAT.md "Index").

    Raises :class:`UnsupportedStateError` naming ``key`` when such a subclass cannot give its values."""
    t = t.detach()
    if t.numel() and not _subclass.has_memory(t):  # a wrapper subclass (quantized / Float8 weights)
        t = _subclass.values(t, key)
    t = t.resolve_conj().resolve_neg()  # lazy conjugate/negative views: materialise
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous() or t.storage_offset() < 0:
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    mv = _subclass.own_bytes(t)
    if mv is None:  # a class whose reshape/view copy: the values, as a plain tensor
        mv = _subclass.own_bytes(_subclass.values(t, key))
    return memoryview(mv)


class Scan:
    """The non-finite values of one write item (``codec/numerics.py``): ``rule`` of its dtype, and
    ``count`` added up frame by frame as the frames are encoded."""

    __slots__ = ("rule", "count")

    def __init__(self, rule) -> None:
        self.rule = rule
        self.count = 0


def split(mv: memoryview, frame_size: int, width: int, refs: list, scan: Scan | None = None):
    """(chunk, element width, refs list, plan cell, scan) for each frame of ``mv``; one empty frame
    when empty. The frames of one item share a ``bytegroup.PlanCell`` (its encoding is decided once)
    and a :class:`Scan` (None: nothing to count)."""
    n = len(mv)
    cell = PlanCell() if width and n > frame_size else None
    for start in range(0, n, frame_size) if n else [0]:
        yield mv[start : start + frame_size], width, refs, cell, scan


def _encode(codec: FrameCodec, name: str, index: int, chunk, width: int, cell, scan: Scan | None):
    """Encode the frame and count its non-finite values: ``(header, payload, payload XXH3, non-finite
    count)``. A float frame's count rides on the byte-grouping split (the C split reads each element
    once for both); where the split did not count (small frames, the numpy split, compression off),
    it is counted here (``codec/numerics.py``)."""
    rule = scan.rule if scan is not None else None
    counted: list = []
    fused = rule is not None and rule.exp is not None and rule.components == 1 and rule.width == width
    head, payload, h = codec.encode(name, index, chunk, width, cell, rule.exp if fused else 0, counted if fused else None)
    bad = counted[0] if counted else (count_nonfinite(chunk, rule) if rule is not None else 0)
    return head, payload, h, bad


class ObjectSink:
    """One object being written: appends encoded frames, tracks size, digest and codec chains;
    commits on a clean exit from ``with``, aborts on any exception.

    With ``stream`` (an ``upload.PartStream``), every part's worth of appended bytes is handed to
    the remote upload as soon as it is in the local file; a failed or aborted write aborts it."""

    def __init__(self, tier, key: str, fault: str, stream=None) -> None:
        try:
            self._w = tier.open_writer(key)
        except BaseException:
            if stream is not None:
                stream.abort()
            raise
        self._fault = fault
        self._stream = stream
        self._digest = xxh3_stream()
        self.offset = 0
        self.frames = 0
        self.codecs: set[str] = set()

    def append(self, head: bytes, payload, h: int, raw_len: int, index: int) -> FrameRef:
        _faults.point(self._fault)
        self._w.write(head)
        self._w.write(payload)
        self._digest.update(head)
        ref = FrameRef(self.offset, len(head) + len(payload), raw_len, h, index)
        self.codecs.add(chain_of(head))
        self.offset += ref.length
        self.frames += 1
        st = self._stream
        if st is not None:
            cut = st.feed(head)
            if st.feed(payload) or cut:
                self._w.flush()  # the upload threads read the part back from the local file
                st.send()
        return ref

    def hexdigest(self) -> str:
        return f"{self._digest.intdigest():016x}"

    def __enter__(self) -> "ObjectSink":
        return self

    def __exit__(self, et, e, tb) -> None:
        st = self._stream
        if et is None:
            try:
                self._w.commit()
            except BaseException:
                if st is not None:
                    st.abort()
                raise
            if st is not None:
                st.written(self.offset)
        else:
            self._w.abort()
            if st is not None:
                st.abort()


def write_frames(sink: ObjectSink, codec: FrameCodec, name: str, chunks, pool=None, window: int = 0,
                 inline_bytes: int = 0) -> None:
    """The one frame-writing loop: count and encode each (chunk, width, refs, cell, scan) — in ``pool``,
    at most ``window`` frames ahead — and append the frames to ``sink`` in order, recording a FrameRef
    in ``refs`` and adding the frame's non-finite values to ``scan``. Frames are encoded in the calling
    thread while the raw bytes so far stay within ``inline_bytes``: a small object costs no hand-off
    (and with a :class:`LazyPool`, no thread is started for it)."""
    pending: collections.deque = collections.deque()

    def drain(limit: int) -> None:
        while len(pending) > limit:
            refs, scan, index, raw_len, job = pending.popleft()
            head, payload, h, bad = job.result() if isinstance(job, cf.Future) else job
            refs.append(sink.append(head, payload, h, raw_len, index))
            if bad:
                scan.count += bad

    seen = 0
    try:
        for index, (chunk, width, refs, cell, scan) in enumerate(chunks):
            seen += len(chunk)
            if pool is not None and seen > inline_bytes:
                job = pool.submit(_encode, codec, name, index, chunk, width, cell, scan)
                pending.append((refs, scan, index, len(chunk), job))
                drain(window)
            else:  # ``seen`` only grows: every frame before this one was inline and is written
                pending.append((refs, scan, index, len(chunk), _encode(codec, name, index, chunk, width, cell, scan)))
                drain(0)
        drain(0)
    finally:
        for _refs, _s, _i, _n, job in pending:  # an error: do not leave encodes running
            if isinstance(job, cf.Future):
                job.cancel()


class LazyPool:
    """A ``ThreadPoolExecutor`` of ``threads`` threads started at its first ``submit`` (a save of a few
    KiB starts none); shut down, waiting for its work, when the ``with`` block ends."""

    def __init__(self, threads: int, prefix: str) -> None:
        self._threads, self._prefix = threads, prefix
        self._pool: cf.ThreadPoolExecutor | None = None

    def submit(self, fn, *args) -> cf.Future:
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(self._threads, thread_name_prefix=self._prefix)
        return self._pool.submit(fn, *args)

    def __enter__(self) -> LazyPool:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def chain_of(head: bytes) -> str:
    n = int.from_bytes(head[6:8], "little")
    return head[FIXED_LEN : FIXED_LEN + n].decode("ascii")


#: frames of a whole object above which :func:`write_small_object` encodes them on threads
_PARALLEL_FRAMES = 4


def split_parts(parts: list, frame_size: int, refs: list):
    """(chunk, 0, refs, None, None) for each frame of the bytes of ``parts`` (bytes or byte-format
    memoryviews, read one after the other), as :func:`split` gives them for one buffer: a frame
    inside one part is a slice of it, a frame across parts joins its parts (at most ``frame_size``
    bytes copied at a time). The work per part is its length; per frame, a search and a join."""
    ends = list(itertools.accumulate(map(len, parts)))
    total = ends[-1] if ends else 0
    if not total:
        yield memoryview(b""), 0, refs, None, None
        return
    i = 0  # the part that holds byte ``pos``
    for pos in range(0, total, frame_size):
        stop = min(pos + frame_size, total)
        while ends[i] <= pos:
            i += 1
        j = bisect.bisect_left(ends, stop, i)  # the part that holds byte ``stop - 1``
        lo = pos - (ends[i] - len(parts[i]))
        if i == j:
            yield memoryview(parts[i])[lo : lo + stop - pos], 0, refs, None, None
            continue
        hi = stop - (ends[j] - len(parts[j]))
        pieces = [memoryview(parts[i])[lo:], *parts[i + 1 : j], memoryview(parts[j])[:hi]]
        yield memoryview(b"".join(pieces)), 0, refs, None, None


def write_small_object(tier, codec: FrameCodec, version: str, name: str, blob: bytes | memoryview | list,
                       frame_size: int, threads: int = 1) -> tuple[ObjectEntry, tuple]:
    """Write ``blob`` (one buffer, or a list of buffers that follow each other) as the object
    ``name`` of ``version``; its manifest entry and codec chains. Its frames are encoded
    (compressed, encrypted, checksummed) on up to ``threads`` threads when there are more than a few
    (the DCP metadata object of a large job), and written in order."""
    refs: list = []
    parts = blob if isinstance(blob, list) else [blob]
    parts = [p if type(p) is bytes else memoryview(p).cast("B") for p in parts]
    size = sum(map(len, parts))
    nframes = -(-size // frame_size)
    with ObjectSink(tier, layout.object_key(version, name), "write.metadata") as sink:
        if threads > 1 and nframes > _PARALLEL_FRAMES:
            with cf.ThreadPoolExecutor(threads, thread_name_prefix="ckptstore-meta") as pool:
                write_frames(sink, codec, name, split_parts(parts, frame_size, refs), pool, 2 * threads)
        else:
            write_frames(sink, codec, name, split_parts(parts, frame_size, refs))
    return ObjectEntry(name, sink.offset, sink.hexdigest(), sink.frames, None, size), tuple(sink.codecs)


class ShardWriter:
    """Phase 1 of one rank (``write_data``): every plan item's frames, in order, into the rank's one
    object ``attempts/<attempt>/rNNNNN.ckd`` — except, with ``incremental``, the items identical to the
    baseline's, whose earlier frames the references collaborator (``_incremental.SaveRefs``) names.

    ``cfg``: the writer's settings (``threads``, ``frame_size``, ``compression``, ``level``,
    ``incremental``); ``tier``: this rank's root; ``keys``: ``_keys.DataKeys``; ``inc``: the rank's
    ``_incremental.Incremental`` baseline."""

    def __init__(self, cfg, tier, keys, inc) -> None:
        self.cfg = cfg
        self.tier = tier
        self.keys = keys
        self.inc = inc

    @staticmethod
    def name(pd: PlanData) -> str:
        """The name of the rank's object in this save."""
        return layout.shard_name(pd.attempt, pd.rank)

    def codec(self, version: str, rank: int, pd: PlanData) -> FrameCodec:
        """The frame codec of this save (with a key: its data key, unwrapped)."""
        cipher = None
        if pd.wrapped_key is not None:
            if self.keys.master is None:
                raise KeyMismatchError(f"rank {rank} has no master key but the coordinator encrypts; give every rank the same key")
            cipher = self.keys.cipher(WrappedKey.of(pd), version, pd.attempt)
        return FrameCodec(version, pd.attempt, cipher, compress=self.cfg.compression, level=self.cfg.level)

    def write(self, version: str, rank: int, plan, planner, pd: PlanData, staged: list,
              stream=None, codec: FrameCodec | None = None, *,
              whole: bool = False) -> tuple[list, ObjectReport, "Any"]:
        """Write the rank's object (``stream``: its streamed upload, or None; ``codec``: the save's
        :meth:`codec`, made here when not given); returns the write results (the packed item table
        and the object's report), the report and the save's ``_incremental.SaveRefs`` (None unless
        incremental). ``staged`` receives the storage address of the first staged tensor (which host
        copy to free). ``whole``: reference nothing (every item written), with an incremental writer
        still recording the items' digests."""
        cfg = self.cfg
        if codec is None:
            codec = self.codec(version, rank, pd)
        name = self.name(pd)
        refs = None
        if cfg.incremental:
            self.inc.adopt(pd.baseline)  # a baseline the coordinator read from the store for this rank
            refs = self.inc.for_save(self.tier, pd.key_id, version, pd.attempt, pd.rank, whole=whole)
        count = cfg.count_nonfinite
        # (item, refs list or location, nbytes, dtype, shape, Scan or None)
        per_item: list[tuple[Any, Any, int, str | None, tuple | None, Scan | None]] = []
        frame_size = cfg.frame_size

        def chunks():
            for item in plan.items:
                data = planner.resolve_data(item)
                scan = None
                if isinstance(data, io.BytesIO):
                    mv, dtype, shape, width = data.getbuffer(), None, None, 0
                else:
                    if not staged and data.numel() and _subclass.has_memory(data):
                        staged.append(data.untyped_storage().data_ptr())
                    dtype, shape = _dtype_name(data.dtype), tuple(data.shape)
                    width = _FLOAT_WIDTH.get(data.dtype, 0)
                    mv = tensor_bytes(data, item.index.fqn)
                    rule = rule_for(dtype) if count else None
                    scan = Scan(rule) if rule is not None else None
                if refs is not None:
                    loc = refs.match(item.index, mv, dtype, shape)
                    if loc is not None:  # identical to the baseline: reference its frames
                        if scan is not None:  # the same bytes, so the same count as when they were written
                            scan.count = count_nonfinite(mv, scan.rule)
                        per_item.append((item, loc, len(mv), dtype, shape, scan))
                        continue
                frames: list = []
                per_item.append((item, frames, len(mv), dtype, shape, scan))
                yield from split(mv, frame_size, width, frames, scan)

        try:
            sink = ObjectSink(self.tier, layout.object_key(version, name), "write.frame", stream=stream)
            with LazyPool(cfg.threads, "ckptstore-enc") as pool, sink:  # the first frame: in this thread
                write_frames(sink, codec, name, chunks(), pool, window=max(2, 2 * cfg.threads), inline_bytes=frame_size)
                _faults.point("write.commit")
        except BaseException:
            if refs is not None:
                refs.release()  # the save failed on this rank: nothing of it to protect
            raise
        locs = [f if isinstance(f, ItemLocation) else ItemLocation(name, tuple(f), n, dtype, shape)
                for _item, f, n, dtype, shape, _sc in per_item]
        total_raw = sum(x[2] for x in per_item)
        ref_raw = sum(x[2] for x in per_item if isinstance(x[1], ItemLocation))
        indexes = [item.index for item, *_ in per_item]
        rep = ObjectReport(name, sink.offset, sink.hexdigest(), sink.frames, pd.rank, total_raw - ref_raw,
                           tuple(sorted(sink.codecs)), refs.refs() if refs is not None else (), ref_raw,
                           nonfinite=_nonfinite_of(per_item) if count else None)
        digests = None
        if refs is not None:
            refs.remember(version, pd.attempt, indexes, locs)
            digests = refs.digests(indexes)
        return [items_result(pd.rank, total_raw, indexes, locs, digests), object_result(rep, total_raw)], rep, refs


def _nonfinite_of(per_item: list) -> tuple:
    """A rank's non-finite values (``ObjectReport.nonfinite``): ``(values, write items holding any,
    ((fqn, values), ...) of the first NONFINITE_FIRST such items in plan order)``."""
    bad = [(item.index.fqn, sc.count) for item, _f, _n, _d, _s, sc in per_item if sc is not None and sc.count]
    return sum(c for _k, c in bad), len(bad), tuple(bad[:NONFINITE_FIRST])


__all__ = ["DEFAULT_FRAME_SIZE", "NONFINITE_FIRST", "ObjectSink", "Scan", "ShardWriter", "split", "tensor_bytes",
           "split_parts", "write_frames", "write_small_object"]
