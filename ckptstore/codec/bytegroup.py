"""Byte-grouping float codec, descriptor ``bytegroup/1:W`` (the ZipNN idea, arXiv 2411.05239).

Why: in trained weights (and optimizer moments) the exponent of a float takes only a few values
(≈ 2.7 bits of entropy out of 8 for bf16 weights), while sign and mantissa bits are close to random.
A general-purpose compressor sees them interleaved and finds little (zstd-1 on bf16 weights: 0.78).
Grouping byte ``k`` of every element into plane ``k`` makes the exponent plane a low-entropy stream
that an entropy coder shrinks to ≈ its entropy, while the mantissa planes are stored as they are.

Transform. Before splitting, each element (a ``W``-byte little-endian integer) may be rotated left
by one bit (``transform = 1``, "rotl1"). For IEEE floats this moves the sign bit from the top to the
bottom, so the top byte holds the 8 most significant exponent bits (the whole exponent for bf16 and
fp32) and the sign joins the random mantissa bits in plane 0. For bf16: plane 1 = exponent,
plane 0 = ``mantissa << 1 | sign``. Both transforms are bijections on bit patterns, so NaN
payloads, infinities, denormals, negative zero and non-float garbage all round-trip bit-exactly.
rotl1 wins on ordinary weights and moments (bf16 MiniLM 0.6654 vs 0.6709, fp32 Adam exp_avg 0.831
vs 0.836) but loses when the low bytes are zero (fp32 upcast from bf16: the sign would land in an
otherwise empty plane; 0.349 vs 0.334), so the encoder picks the transform per frame.

Entropy coding. Each plane is, per frame, stored raw, compressed as one zstd frame (with content
size), or Huffman-coded by ckptstore's own coder (plane codec 2, ``codec/_huff.c``; layout there).
Where the C module is built, a plane planned for compression of at least :data:`HUFF_MIN` bytes is
Huffman-coded, unless one byte value fills 3/4 of it (zeros, say: zstd's runs code those far better);
smaller planes, and every plane of a writer without the C module, go to zstd. On the exponent plane
of N(0, 0.02) bf16 weights the Huffman code is as small as zstd's (0.325 against 0.326 of the plane),
twice as fast to encode (1.43 against 0.64 GB/s of plane, one core) and faster to decode (2.54
against 1.84 GB/s; ``benchmarks/plane_coder.py``, which also has fp16 and fp32 rows). A payload
with a Huffman-coded plane has layout version 2 and the descriptor ``bytegroup/2:W``, so that a
release that knows only ``bytegroup/1`` refuses it as an unknown codec instead of misreading it; a
reader without the C module decodes such planes in numpy (:func:`huff_decode_numpy`, ≈ 8 MB/s of
plane).

Which planes are compressed. Frames up to 64 Ki elements are encoded whole with both transforms
(planes compressed with zstd) and the smaller kept. For larger frames the encoder decides once per
tensor (a :class:`Plan`, from the first large frame of the tensor it encodes) from a sample of 32 Ki
elements (four runs of 8 Ki spread over the frame): the sample is split and its planes compressed
under each transform; the transform with the smaller sample wins; planes whose sample did not shrink
below 97 % are planned raw. Every frame of the tensor then uses the plan: planned-compressed planes
are compressed whole (Huffman or zstd, as above) and kept only if below 97 %; planned-raw planes are
probed with a 16 KiB slice from the middle of the plane and compressed whole only when the slice
shrinks below 97 % (so zeros later in a tensor are still found). Deciding per tensor instead of per
frame cut the encoder's CPU time by ~9 % (the trials were ~0.2 of 2.3 CPU-s/GB); the payload format
is unchanged, so any ``bytegroup/1`` reader decodes it. Planes coded with zstd use parameters that
all but disable match finding (``strategy=fast, min_match=7, hash_log=6, search_log=1``), so zstd
works as a fast Huffman coder of literals with per-128 KiB-block tables (runs and repeats are still
found through repeat offsets, so all-zero planes still collapse). The ``level`` argument is accepted
for interface compatibility and is not used: on the exponent plane of real bf16 weights
(all-MiniLM-L6-v2) standard zstd levels do *worse* and are far slower than this setting (plane ratio
@ speed on one core: levels 1, 3, 9, 19 → 0.364 @ 0.26 GB/s, 0.412 @ 0.14, 0.388 @ 0.03, 0.331 @
0.001; this setting → 0.331 @ ≈ 1 GB/s).

Measured (``python benchmarks/codec_ratio.py``; ratio = stored/raw; one thread's CPU time):

    dataset                    zstd-1  zstd-3  bytegroup  encode GB/s  decode GB/s
    all-MiniLM-L6-v2 bf16      0.780   0.780   0.665      0.63         1.04
    all-MiniLM-L6-v2 fp16      0.921   0.921   0.848      0.75         0.96
    all-MiniLM-L6-v2 fp32      0.916   0.915   0.827      0.62         1.24
    bf16 ~ N(0, 0.02)          0.780   0.780   0.663      0.75         1.19
    Adam exp_avg fp32          0.927   0.928   0.831      0.94         1.22
    Adam exp_avg_sq fp32       0.923   0.924   0.830      0.79         0.91

Payload byte layout (all integers little-endian)::

    offset  size   field
    0       2      magic b"BG"
    2       1      layout version: 1 (descriptor bytegroup/1), 2 (bytegroup/2: plane codec 2 allowed)
    3       1      W, bytes per element: 1, 2, 4 or 8; equals the descriptor parameter
    4       1      transform: 0 = none, 1 = rotate each W-byte element left by one bit
    5       3      reserved, zero
    8       8      count, elements (count * W == the frame's raw length)
    16      9 * W  plane table, for plane k = 0 .. W-1 (plane k = byte k of every transformed element):
                     codec       u8   0 = stored raw (stored_len == count)
                                      1 = one zstd frame with content size == count
                                      2 = Huffman-coded (layout version 2 only; codec/_huff.c)
                     stored_len  u64  bytes of this plane in the payload
    16+9W   ...    the planes' stored bytes, plane 0 first; the lengths sum to exactly the rest

Decoding treats the payload as hostile: every field and length is checked against the frame's raw
length before anything is allocated (memory stays O(raw length): the output plus decoded planes),
the zstd content size is checked before decompressing, trailing bytes are refused, and every
failure raises :class:`~ckptstore.errors.IntegrityError`.

Speed: split and merge run in one pass per element in a small C module (``codec/_planes.c``, built
at install when a C compiler is there; each element read once and written once, the GIL released).
Without it (no compiler, or ``CKPTSTORE_NATIVE=0``) they are numpy shifts, narrowing casts and
strided copies over 256 KiB chunks (so temporaries stay in cache), three to six passes; no Python
loop runs per element either way. The two give the same bytes (tests/test_bytegroup.py). One core,
into memory out of cache (``s/GB`` of raw bytes): merge bf16 0.07-0.09 in C against 0.29-0.33 in
numpy, fp32 0.15-0.23 against 0.44-0.46; split bf16 0.08-0.11 against 0.22-0.23, fp32 0.06-0.13
against 0.30-0.33. Whole codec, ``benchmarks/codec_ratio.py`` synthetic rows, one thread, C against
numpy: decode bf16 2.07 against 1.42 GB/s, fp32 moments 1.88-2.40 against 1.21-1.41; encode 0.89
against 0.74, 1.24-1.36 against 0.97-1.05 (the table above is the numpy code's). When the caller
consumes the planes at once (the encrypting frame codec, :func:`encode_parts`), they are split into
a per-thread scratch buffer and handed over as parts, which saves both the first-touch page faults
of fresh memory and the copy that joins the planes. Both directions return a read-only memoryview
over a numpy buffer instead of ``bytes``: that saves a full copy of the data, and numpy asks for
huge pages on large buffers, which makes first-touch page faults cheaper. zstandard releases the
GIL, so frames may be encoded and decoded from several threads at once (the compressor objects are
per thread).
"""

from __future__ import annotations

import os
import struct
import threading

import numpy as np
import zstandard

from ..errors import IntegrityError
from . import stages

__all__ = ["encode", "decode", "descriptor_of", "DESCRIPTOR", "DESCRIPTOR_HUFF", "WIDTHS"]

#: the stage's name for a payload whose planes are raw or zstd (layout version 1)
DESCRIPTOR = "bytegroup/1"
#: the stage's name for a payload with a Huffman-coded plane (layout version 2; the same layout, plane
#: codec 2 allowed): a release that knows only ``bytegroup/1`` refuses it as an unknown codec
DESCRIPTOR_HUFF = "bytegroup/2"
MAGIC = b"BG"
LAYOUT_VERSION = 1
LAYOUT_VERSION_HUFF = 2
WIDTHS = (1, 2, 4, 8)

TRANSFORM_NONE = 0
TRANSFORM_ROTL1 = 1

CODEC_RAW = 0
CODEC_ZSTD = 1
CODEC_HUFF = 2

#: planes of fewer bytes are not Huffman-coded (its 141-byte header and per-plane set-up would not pay)
HUFF_MIN = 64 << 10

_HEAD = struct.Struct("<2sBBB3sQ")  # magic, version, width, transform, reserved, count
_PLANE = struct.Struct("<BQ")  # codec, stored_len
HEAD_LEN = _HEAD.size  # 16

#: a plane (or its sample) is compressed only when that saves at least this fraction
MIN_SAVING = 0.03
#: the sample that picks the transform and the planes to compress: 4 runs of 8 Ki elements
_SAMPLE_PIECES = 4
_SAMPLE_PIECE = 8 << 10
#: bytes of elements processed per step of split/merge (keeps temporaries in L2)
_CHUNK_BYTES = 256 << 10

_UINT = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}

_tls = threading.local()

try:  # the one-pass split/merge (codec/_planes.c); optional: the numpy code below gives the same bytes
    from . import _planes as _native
except ImportError:  # pragma: no cover - built at install when a C compiler is present
    _native = None
try:  # the Huffman coder of exponent planes (codec/_huff.c); optional: without it planes go to zstd
    from . import _huff
except ImportError:  # pragma: no cover - built at install when a C compiler is present
    _huff = None
if os.environ.get("CKPTSTORE_NATIVE", "1") == "0":
    _native = _huff = None
#: whether split and merge run in the C module (False: numpy; ``CKPTSTORE_NATIVE=0`` forces that)
NATIVE = _native is not None
#: whether compressible planes are Huffman-coded (plane codec 2) by the C module (False: zstd, and codec 2
#: planes are decoded by :func:`huff_decode_numpy`; ``CKPTSTORE_NATIVE=0`` forces that)
HUFF = _huff is not None


def _cctx() -> zstandard.ZstdCompressor:
    c = getattr(_tls, "cctx", None)
    if c is None:
        params = zstandard.ZstdCompressionParameters.from_level(
            1,
            strategy=zstandard.STRATEGY_FAST,
            min_match=7,
            hash_log=6,
            chain_log=6,
            search_log=1,
            target_length=0,  # > 0 with strategy fast would turn literal compression off
            write_content_size=True,
            write_checksum=False,  # the frame carries an xxh3 of the stored bytes
        )
        c = _tls.cctx = zstandard.ZstdCompressor(compression_params=params)
    return c


from .stages import _dctx  # noqa: E402  (one thread-local decompressor per thread for all stages)


# -- split / merge ----------------------------------------------------------------------------------


def _scratch(nbytes: int) -> np.ndarray:
    """This thread's reusable byte buffer of at least ``nbytes`` (grown, never shrunk): split planes
    that are consumed before the thread's next frame land here instead of in fresh memory, whose
    first-touch page faults cost as much as the split itself."""
    buf = getattr(_tls, "scratch", None)
    if buf is None or buf.shape[0] < nbytes:  # grown in whole MiB: frames differ in size
        buf = _tls.scratch = np.empty(max(-(-nbytes // (1 << 20)) << 20, 1), dtype=np.uint8)
    return buf


def _split(x: np.ndarray, width: int, transform: int, out: np.ndarray | None = None, nonfinite: int = 0,
           counted: list | None = None) -> np.ndarray:
    """``x``: 1-D little-endian uint array of ``count`` elements → ``(width, count)`` uint8 planes
    (in ``out``, a byte buffer of at least ``width * count``, when given). With ``nonfinite`` and
    ``counted``, the C split also counts the non-finite elements and appends the count (see
    :func:`encode_parts`); the numpy split appends nothing."""
    count = x.shape[0]
    if out is None:
        planes = np.empty((width, count), dtype=np.uint8)
    else:
        planes = out[: width * count].reshape(width, count)
    if count == 0:
        return planes
    if _native is not None:
        exp = nonfinite if counted is not None and width > 1 else 0
        got = _native.split(np.ascontiguousarray(x), planes, width, transform, exp)
        if exp:
            counted.append(got)
        return planes
    return _split_numpy(x, width, transform, planes)


def _split_numpy(x: np.ndarray, width: int, transform: int, planes: np.ndarray) -> np.ndarray:
    count = x.shape[0]
    if width == 1:
        planes[0] = x.view(np.uint8)
        return planes
    step = max(1, _CHUNK_BYTES // width)
    if transform == TRANSFORM_NONE:
        b = x.view(np.uint8).reshape(count, width)
        for i in range(0, count, step):
            planes[:, i : i + step] = b[i : i + step].T
        return planes
    bits = 8 * width
    y = np.empty(min(step, count), dtype=_UINT[width])
    t = np.empty_like(y)
    for i in range(0, count, step):
        xs = x[i : i + step]
        m = xs.shape[0]
        ym, tm = y[:m], t[:m]
        np.left_shift(xs, 1, out=ym)
        np.right_shift(xs, bits - 1, out=tm)
        np.bitwise_or(ym, tm, out=ym)
        if width <= 4:  # narrowing casts are vectorized; faster than strided byte copies here
            np.copyto(planes[0, i : i + m], ym, casting="unsafe")
            for k in range(1, width):
                np.right_shift(ym, 8 * k, out=tm)
                np.copyto(planes[k, i : i + m], tm, casting="unsafe")
        else:
            planes[:, i : i + m] = ym.view(np.uint8).reshape(m, width).T
    return planes


def _merge(planes: list, count: int, width: int, transform: int, dest: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`_split`: ``width`` uint8 arrays of ``count`` → ``count * width`` uint8
    (written into ``dest``, a writable uint8 array of ``count * width``, when given)."""
    dt = _UINT[width]
    out = np.empty(count, dtype=dt) if dest is None else dest.view(dt)
    if count == 0:
        return out.view(np.uint8)
    if _native is not None:
        _native.merge(planes, out, width, transform)
        return out.view(np.uint8)
    return _merge_numpy(planes, count, width, transform, out)


def _merge_numpy(planes: list, count: int, width: int, transform: int, out: np.ndarray) -> np.ndarray:
    dt = out.dtype
    if width == 1:
        out[:] = planes[0]
        return out.view(np.uint8)
    step = max(1, _CHUNK_BYTES // width)
    if transform == TRANSFORM_NONE:
        ob = out.view(np.uint8).reshape(count, width)
        for i in range(0, count, step):
            for k in range(width):
                ob[i : i + step, k] = planes[k][i : i + step]
        return out.view(np.uint8)
    bits = 8 * width
    y = np.empty(min(step, count), dtype=dt)
    t = np.empty_like(y)
    buf = np.empty((min(step, count), width), dtype=np.uint8) if width > 4 else None
    for i in range(0, count, step):
        m = min(step, count - i)
        tm = t[:m]
        if buf is None:
            ym = y[:m]
            np.copyto(ym, planes[width - 1][i : i + m])
            for k in range(width - 2, -1, -1):
                np.left_shift(ym, 8, out=ym)
                np.bitwise_or(ym, planes[k][i : i + m], out=ym)
        else:
            bm = buf[:m]
            for k in range(width):
                bm[:, k] = planes[k][i : i + m]
            ym = bm.view(dt).reshape(m)
        o = out[i : i + m]
        np.right_shift(ym, 1, out=o)
        np.left_shift(ym, bits - 1, out=tm)
        np.bitwise_or(o, tm, out=o)
    return out.view(np.uint8)


# -- encode ---------------------------------------------------------------------------------------


def _sample(x: np.ndarray) -> np.ndarray | None:
    """A few contiguous runs of elements spread over ``x`` (None when ``x`` is small: use it all)."""
    n = x.shape[0]
    if n <= 2 * _SAMPLE_PIECES * _SAMPLE_PIECE:
        return None
    stride = (n - _SAMPLE_PIECE) // (_SAMPLE_PIECES - 1)
    return np.concatenate([x[j * stride : j * stride + _SAMPLE_PIECE] for j in range(_SAMPLE_PIECES)])


def _trial(x: np.ndarray, width: int, transform: int) -> tuple[int, list]:
    """Split ``x`` and compress each plane; returns (payload size, [(codec, data) per plane])."""
    planes = _split(x, width, transform)
    keep = 1.0 - MIN_SAVING
    cctx = _cctx()
    out = []
    size = 0
    for k in range(width):
        p = planes[k]
        n = p.shape[0]
        c = cctx.compress(p) if n >= 64 else None
        if c is not None and len(c) < n * keep:
            out.append((CODEC_ZSTD, c))
            size += len(c)
        else:
            out.append((CODEC_RAW, p))
            size += n
    return size, out


class Plan:
    """How the frames of one tensor are encoded: the transform and, per plane, whether to try zstd.

    Decided once per tensor (from its first frame to be encoded; frames encoded concurrently before
    that decide for themselves) and shared through a :class:`PlanCell`, so the trial compressions
    that pick it run once per tensor instead of once per frame. A plane planned raw is still probed
    in every frame (a 16 KiB slice), so a tensor whose later frames turn compressible (zeros, say)
    still gets them compressed."""

    __slots__ = ("transform", "zstd", "alphabet")

    def __init__(self, transform: int, zstd: tuple):
        self.transform = transform
        self.zstd = zstd
        #: per plane, the byte values the Huffman coder has met in this tensor (a 256-bit set, see codec/_huff.c)
        self.alphabet = [np.zeros(32, dtype=np.uint8) for _ in zstd]


class PlanCell:
    """A slot for one tensor's :class:`Plan`, shared by the encodes of its frames (lock-free: a
    race only means two frames decide, with the same rule)."""

    __slots__ = ("plan",)

    def __init__(self) -> None:
        self.plan: Plan | None = None


#: bytes of a raw-planned plane probed with zstd in every frame
_PROBE = 16 << 10


def encode(raw, width: int, level: int = 1, cell: PlanCell | None = None) -> memoryview | None:
    """Byte-group ``raw`` (``width``-byte elements, C order) and entropy-code its planes.

    Returns the payload (layout in the module docstring) as a read-only, contiguous byte memoryview
    (a bytes-like object backed by a numpy buffer, which saves a copy), or None when byte grouping
    does not apply (unsupported ``width``, or a length that is not a multiple of ``width``).
    ``level`` is unused (see the module docstring). ``cell`` shares the tensor's :class:`Plan`
    between its frames. The caller decides whether the result is worth keeping. Thread-safe;
    releases the GIL while compressing.
    """
    r = encode_parts(raw, width, cell, scratch=False)
    return None if r is None else _join(*r)


def _join(parts: list, total: int) -> memoryview:
    out = np.empty(total, dtype=np.uint8)
    pos = 0
    for d in parts:
        a = np.frombuffer(d, dtype=np.uint8)
        out[pos : pos + a.shape[0]] = a
        pos += a.shape[0]
    return memoryview(out).toreadonly()


def encode_parts(raw, width: int, cell: PlanCell | None = None, *, scratch: bool = False, nonfinite: int = 0,
                 counted: list | None = None):
    """:func:`encode` without the final concatenation: ``(parts, total)``, the payload as a list of
    bytes-likes (header and plane table, then the planes) whose lengths sum to ``total``; or None
    when byte grouping does not apply. With ``scratch`` the raw planes are views of this thread's
    scratch buffer: the caller must consume (copy, encrypt) them before this thread encodes again.

    ``nonfinite``: a float format's all-ones exponent pattern (``codec/numerics.py``, ``Rule.exp``);
    when the C split reads the frame whole it also counts the elements whose bits without the sign
    bit reach it (NaN and ±Inf) and appends that count to ``counted``. Nothing is appended when it
    did not (a frame of up to 64 Ki elements, the numpy split): the caller counts then."""
    if width not in WIDTHS:
        return None
    b = np.frombuffer(raw, dtype=np.uint8)
    n = b.shape[0]
    if n % width:
        return None
    transforms = (TRANSFORM_ROTL1, TRANSFORM_NONE) if width > 1 else (TRANSFORM_NONE,)
    count = n // width
    x = b.view(_UINT[width])
    plan = cell.plan if cell is not None else None
    if plan is None:
        sample = _sample(x)
        if sample is None:  # small: try every transform on the whole frame and keep the smallest
            best = min((_trial(x, width, t) + (t,) for t in transforms), key=lambda r: r[0])
            return _parts(width, best[2], count, best[1])
        # choose the transform and which planes to compress from a sample (32 Ki elements)
        trials = [(_trial(sample, width, t), t) for t in transforms]
        (_, sample_planes), transform = min(trials, key=lambda r: r[0][0])
        plan = Plan(transform, tuple(c == CODEC_ZSTD for c, _ in sample_planes))
        if cell is not None:
            cell.plan = plan
    planes = _split(x, width, plan.transform, _scratch(n) if scratch else None, nonfinite, counted)
    keep = 1.0 - MIN_SAVING
    cctx = _cctx()
    out = []
    coded = None  # Huffman output: this thread's scratch (scratch=True) or fresh memory
    for k in range(width):
        p = planes[k]
        try_zstd = plan.zstd[k]
        if not try_zstd and count >= 4 * _PROBE:  # probe a slice from the middle of a raw-planned plane
            mid = (count - _PROBE) // 2
            try_zstd = len(cctx.compress(p[mid : mid + _PROBE])) < _PROBE * keep
        if try_zstd and _huff is not None and count >= HUFF_MIN:
            if coded is None:
                coded = _huff_out(width, count, scratch)
            dst = coded[k]
            m = _huff.encode(p, dst, _huff_work(), plan.alphabet[k])
            if m >= 0:  # -1: one value fills 3/4 of the plane; zstd's runs do better there
                out.append((CODEC_HUFF, dst[:m]) if m < count * keep else (CODEC_RAW, p))
                continue
        if try_zstd and count >= 64:
            c = cctx.compress(p)
            if len(c) < count * keep:
                out.append((CODEC_ZSTD, c))
                continue
        out.append((CODEC_RAW, p))
    return _parts(width, plan.transform, count, out)


def _huff_work() -> np.ndarray:
    """This thread's work buffer of the Huffman encoder (its 256 KiB pair table)."""
    w = getattr(_tls, "huff_work", None)
    if w is None:
        w = _tls.huff_work = np.empty(_huff.WORK_BYTES // 4, dtype=np.uint32)
    return w


def _huff_out(width: int, count: int, scratch: bool) -> list:
    """One output buffer per plane for the Huffman encoder, ``_huff.bound(count)`` bytes each: views of
    this thread's reused buffer with ``scratch`` (consumed before the thread's next frame), else fresh."""
    b = _huff.bound(count)
    if scratch:
        buf = getattr(_tls, "huff_out", None)
        if buf is None or buf.shape[0] < width * b:
            buf = _tls.huff_out = np.empty(max(-(-width * b // (1 << 20)) << 20, 1), dtype=np.uint8)
        return [buf[k * b : (k + 1) * b] for k in range(width)]
    return [np.empty(b, dtype=np.uint8) for _ in range(width)]


def _parts(width: int, transform: int, count: int, planes: list) -> tuple[list, int]:
    version = LAYOUT_VERSION_HUFF if any(c == CODEC_HUFF for c, _ in planes) else LAYOUT_VERSION
    head = [_HEAD.pack(MAGIC, version, width, transform, b"\0\0\0", count)]
    head += [_PLANE.pack(codec, len(data)) for codec, data in planes]
    hb = b"".join(head)
    parts = [hb] + [d for _, d in planes]
    return parts, len(hb) + sum(len(d) for _, d in planes)


def _encode(raw, width: int, transforms) -> memoryview | None:
    """Encode with the best of ``transforms`` (an int or a tuple; ties go to the first); for tests
    and benchmarks that pin a transform."""
    if isinstance(transforms, int):
        transforms = (transforms,)
    b = np.frombuffer(raw, dtype=np.uint8)
    if b.shape[0] % width:
        return None
    x = b.view(_UINT[width])
    best = min((_trial(x, width, t) + (t,) for t in transforms), key=lambda r: r[0])
    return _join(*_parts(width, best[2], x.shape[0], best[1]))


# -- decode ---------------------------------------------------------------------------------------


def descriptor_of(payload) -> str:
    """The stage name of an encoded payload (or of the first part from :func:`encode_parts`):
    :data:`DESCRIPTOR_HUFF` when a plane is Huffman-coded, else :data:`DESCRIPTOR`."""
    return DESCRIPTOR_HUFF if bytes(memoryview(payload)[2:3]) == bytes([LAYOUT_VERSION_HUFF]) else DESCRIPTOR


def _bad(msg: str) -> IntegrityError:
    return IntegrityError(f"bytegroup/1 payload: {msg}")


def _decode_plane(data: memoryview, count: int, k: int, into: np.ndarray | None = None):
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise _bad(f"plane {k} is not a zstd frame: {e}") from None
    if size != count:  # also refuses unknown (-1) content size; checked before anything is allocated
        raise _bad(f"plane {k} declares {size} bytes, expected {count}")
    if into is not None:  # into reused memory (no first-touch page faults per frame)
        try:
            stages.zstd_decompress_into(data, count, memoryview(into))
        except IntegrityError as e:
            raise _bad(f"plane {k}: {e}") from None
        return into
    try:
        out = _dctx().decompress(data, max_output_size=count, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise _bad(f"plane {k} does not decode: {e}") from None
    if len(out) != count:
        raise _bad(f"plane {k} decoded to {len(out)} bytes, expected {count}")
    return np.frombuffer(out, dtype=np.uint8)


def _decode_huff(data: memoryview, count: int, k: int, into: np.ndarray) -> np.ndarray:
    try:
        if _huff is not None:
            _huff.decode(data, into)
        else:
            into[:] = huff_decode_numpy(data, count)
    except ValueError as e:
        raise _bad(f"huffman plane {k}: {e}") from None
    return into


#: bytes before a Huffman-coded plane's streams (codec/_huff.c): max length, 128 bytes of lengths, 3 stream lengths
HUFF_HEAD = 141
if _huff is not None and _huff.HEAD != HUFF_HEAD:  # pragma: no cover - a stale build of codec/_huff.c
    _huff = None
    HUFF = False
_HUFF_MAX = 11
_SEGMENT_BITS = 1024


def _huff_tables(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decode tables (symbol, length per 11-bit LSB-first window) of the canonical code of ``lengths``
    (256 values), or ValueError unless they form a complete code of two or more symbols."""
    ln = [int(v) for v in lengths]
    if max(ln) > _HUFF_MAX:
        raise ValueError("code lengths do not form a complete code of two or more symbols")
    bl = [0] * (_HUFF_MAX + 1)
    for v in ln:
        if v:
            bl[v] += 1
    if sum(bl[v] << (_HUFF_MAX - v) for v in range(1, _HUFF_MAX + 1)) != 1 << _HUFF_MAX or sum(bl) < 2:
        raise ValueError("code lengths do not form a complete code of two or more symbols")
    nxt, c = [0] * (_HUFF_MAX + 2), 0
    for v in range(1, _HUFF_MAX + 1):
        nxt[v] = c
        c = (c + bl[v]) << 1
    sym = np.zeros(1 << _HUFF_MAX, dtype=np.uint8)
    length = np.zeros(1 << _HUFF_MAX, dtype=np.uint8)
    for s_, v in enumerate(ln):
        if not v:
            continue
        code = nxt[v]
        nxt[v] += 1
        r = int(format(code, f"0{v}b")[::-1], 2)  # written least significant bit first
        sym[r :: 1 << v] = s_
        length[r :: 1 << v] = v
    return sym, length


def _huff_stream_numpy(stream: np.ndarray, m: int, sym: np.ndarray, length: np.ndarray) -> np.ndarray:
    """The ``m`` symbols of one stream, without a per-symbol Python loop: the window at every bit
    position is looked up at once, then the code boundaries are followed in segments of 1,024 bits
    for all segments together (a code starts in the first 11 bits of a segment, so each segment is
    walked from each of those 11 entries in lockstep, and the entries are then chained)."""
    nbytes = stream.shape[0]
    if m == 0:
        if nbytes:
            raise ValueError("a stream's length does not fit its symbols")
        return np.zeros(0, dtype=np.uint8)
    nb = nbytes * 8
    bits = np.zeros(nb + _HUFF_MAX, dtype=np.uint16)
    bits[:nb] = np.unpackbits(stream, bitorder="little")
    win = np.zeros(nb, dtype=np.uint16)
    for j in range(_HUFF_MAX):
        win |= bits[j : j + nb] << j
    step = length[win]  # bits of the code starting at each position
    nseg = -(-nb // _SEGMENT_BITS)
    seg_end = np.minimum((np.arange(nseg, dtype=np.int64) + 1) * _SEGMENT_BITS, nb)
    # every segment from each of its 11 possible entries, to the first boundary at or past its end
    pos = (np.arange(nseg, dtype=np.int64) * _SEGMENT_BITS)[:, None] + np.arange(_HUFF_MAX, dtype=np.int64)[None, :]
    ends = np.broadcast_to(seg_end[:, None], pos.shape)
    pos = pos.ravel().copy()
    ends = ends.ravel()
    live = np.flatnonzero(pos < ends)
    while live.size:
        pos[live] += step[pos[live]]
        live = live[pos[live] < ends[live]]
    exits = pos.reshape(nseg, _HUFF_MAX)
    entry = np.empty(nseg, dtype=np.int64)
    e = 0
    for s_ in range(nseg):  # chain the segments: where the codes enter each one
        entry[s_] = e
        e = int(exits[s_, e - s_ * _SEGMENT_BITS]) if s_ < nseg - 1 else e
    starts = np.zeros(nb, dtype=bool)
    p = entry.copy()
    live = np.flatnonzero(p < seg_end)
    while live.size:
        starts[p[live]] = True
        p[live] += step[p[live]]
        live = live[p[live] < seg_end[live]]
    at = np.flatnonzero(starts)  # every code start, in order (codes in the zero padding included)
    if at.shape[0] < m:
        raise ValueError("a stream does not decode to exactly its symbols")
    end = int(at[m - 1] + step[at[m - 1]])
    if end > nb or (end + 7) // 8 != nbytes or bits[end:nb].any():
        raise ValueError("a stream does not decode to exactly its symbols")
    return sym[win[at[:m]]]


def huff_decode_numpy(data, count: int) -> np.ndarray:
    """A Huffman-coded plane (plane codec 2, layout in codec/_huff.c) → its ``count`` bytes, in numpy; the
    reader's path when the C module is not built (the same checks, ValueError on any malformed field).
    About 6-8 MB/s of plane against the C decoder's 2.5 GB/s, and about 16x the plane in temporary
    memory (bit arrays per stream): fine for the default 2 MiB frames, a MemoryError for frames near
    the 2 GiB limit on a small host (build the C module there)."""
    b = np.frombuffer(data, dtype=np.uint8)
    n = b.shape[0]
    if n < HUFF_HEAD:
        raise ValueError("shorter than its 141-byte header")
    if b[0] != _HUFF_MAX:
        raise ValueError("unknown maximum code length")
    nib = b[1:129]
    lengths = np.empty(256, dtype=np.uint8)
    lengths[0::2] = nib & 15
    lengths[1::2] = nib >> 4
    sym, length = _huff_tables(lengths)
    q = count // 4
    off = HUFF_HEAD
    out = np.empty(count, dtype=np.uint8)
    for k in range(4):
        if k < 3:
            sb = int.from_bytes(bytes(b[129 + 4 * k : 133 + 4 * k]), "little")
            if sb > n - off:
                raise ValueError("a stream runs past the end of the plane")
        else:
            sb = n - off
        m = q if k < 3 else count - 3 * q
        if (sb != 0) if m == 0 else (sb == 0 or sb > m * _HUFF_MAX // 8 + 1):
            raise ValueError("a stream's length does not fit its symbols")
        out[k * q : k * q + m] = _huff_stream_numpy(b[off : off + sb], m, sym, length)
        off += sb
    return out


def decode(data, param: str, raw_len: int, out=None, version: int | None = None) -> memoryview:
    """Decode a ``bytegroup/1:<param>`` or ``bytegroup/2:<param>`` payload to exactly ``raw_len``
    bytes, or raise IntegrityError. ``version``: the layout version the frame's descriptor names (the
    payload's must equal it; None: either).

    Returns a read-only, contiguous byte memoryview (bytes-like, like :func:`encode`). With ``out``
    (a writable byte buffer of ``raw_len`` bytes: a destination tensor's memory) the planes are
    decompressed into this thread's scratch and merged straight into ``out``, which is returned.
    """
    if param not in ("1", "2", "4", "8"):
        raise _bad(f"bad width parameter {param!r}")
    width = int(param)
    if not isinstance(raw_len, int) or raw_len < 0 or raw_len > stages.MAX_FRAME_RAW:
        raise _bad(f"raw length {raw_len!r} out of range")
    try:
        mv = memoryview(data).cast("B")
    except (TypeError, ValueError) as e:
        raise _bad(f"not a contiguous byte buffer: {e}") from None
    total = len(mv)
    if total < HEAD_LEN:
        raise _bad(f"truncated header ({total} bytes)")
    magic, layout, w, transform, reserved, count = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC:
        raise _bad(f"bad magic {bytes(magic)!r}")
    if layout not in (LAYOUT_VERSION, LAYOUT_VERSION_HUFF) or (version is not None and layout != version):
        raise _bad(f"layout version {layout} where the descriptor says {version}" if layout in (1, 2)
                   else f"unknown layout version {layout}")
    if w != width:
        raise _bad(f"width {w} does not match the descriptor's {width}")
    if not (transform == TRANSFORM_NONE or (transform == TRANSFORM_ROTL1 and width > 1)):
        raise _bad(f"unknown transform {transform}")
    if reserved != b"\0\0\0":
        raise _bad("reserved bytes are not zero")
    if count * width != raw_len:
        raise _bad(f"{count} elements of {width} bytes do not make the frame's {raw_len} bytes")
    table_end = HEAD_LEN + _PLANE.size * width
    if total < table_end:
        raise _bad("truncated plane table")
    entries = []
    off = table_end
    for k in range(width):
        codec, stored = _PLANE.unpack_from(mv, HEAD_LEN + _PLANE.size * k)
        if codec == CODEC_RAW:
            if stored != count:
                raise _bad(f"raw plane {k} has {stored} bytes, expected {count}")
        elif codec == CODEC_ZSTD:
            if stored == 0 or stored > total:
                raise _bad(f"zstd plane {k} has a bad length {stored}")
        elif codec == CODEC_HUFF and layout == LAYOUT_VERSION_HUFF:
            if stored < HUFF_HEAD or stored > HUFF_HEAD + (11 * count + 7) // 8 + 4:
                raise _bad(f"huffman plane {k} has a bad length {stored} for {count} bytes")
        else:
            raise _bad(f"plane {k} has unknown codec {codec}")
        if stored > total - off:
            raise _bad(f"plane {k} runs past the end of the payload")
        entries.append((codec, off, stored))
        off += stored
    if off != total:
        raise _bad(f"{total - off} trailing bytes after the planes")
    if out is not None:
        dest = np.frombuffer(out, dtype=np.uint8)
        if dest.shape[0] != raw_len or dest.flags.writeable is False:
            raise ValueError("out must be a writable byte buffer of raw_len bytes")
        scratch = _scratch(count * sum(1 for c, _s, _n in entries if c != CODEC_RAW))
    planes = []
    used = 0
    for k, (codec, start, stored) in enumerate(entries):
        piece = mv[start : start + stored]
        if codec == CODEC_RAW:
            planes.append(np.frombuffer(piece, dtype=np.uint8))
        elif codec == CODEC_HUFF:
            into = scratch[used : used + count] if out is not None else np.empty(count, dtype=np.uint8)
            used += count if out is not None else 0
            planes.append(_decode_huff(piece, count, k, into))
        elif out is not None:
            planes.append(_decode_plane(piece, count, k, scratch[used : used + count]))
            used += count
        else:
            planes.append(_decode_plane(piece, count, k))
    try:
        if out is not None:
            _merge(planes, count, width, transform, dest)
            return out
        out = _merge(planes, count, width, transform)
    except (ValueError, MemoryError) as e:  # pragma: no cover - lengths were all checked above
        raise _bad(f"planes do not merge: {e}") from None
    if out.shape[0] != raw_len:  # pragma: no cover - guaranteed by the checks above
        raise _bad(f"decoded to {out.shape[0]} bytes, expected {raw_len}")
    return memoryview(out).toreadonly()


for _v, _name in ((LAYOUT_VERSION, DESCRIPTOR), (LAYOUT_VERSION_HUFF, DESCRIPTOR_HUFF)):
    stages.register_decoder(_name, lambda data, param, raw_len, _v=_v: decode(data, param, raw_len, version=_v),
                            lambda data, param, raw_len, out, _v=_v: decode(data, param, raw_len, out, version=_v))
