"""Frames: the unit of storage, checksumming, encryption and partial reads (docs/FORMAT.md, Format rules 1-3).

Byte layout of one frame (all integers little-endian)::

    offset  size  field
    0       4     magic  b"CKF1"
    4       2     header_len  (= 48 + codec_len)
    6       2     codec_len   (bytes of the codec chain string)
    8       8     frame_index (position of the frame in its object, 0-based)
    16      8     raw_len     (bytes after decoding)
    24      8     stored_len  (payload bytes that follow the header)
    32      8     payload_xxh3 (XXH3-64 of the payload as stored)
    40      n     codec chain, ASCII, e.g. "zstd/1|aesgcm/1" ("" = raw)
    40+n    8     header_xxh3 (XXH3-64 of bytes [0, 40+n))
    48+n    m     payload (m = stored_len)

An object is a plain concatenation of frames, so a scrub can walk it without any index and without
the key; a reader that has the index (DCP ``storage_data``) fetches only the frames it needs and
checks each against the index entry (offset, length, raw length, checksum, index), which also
detects frames swapped between objects when the data is not encrypted. With encryption, the AEAD
associated data is ``FORMAT | version | attempt | object | frame_index | raw_len | chain``.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Iterator

import xxhash

from ..errors import IntegrityError, KeyMismatchError, UnsupportedFormatError
from . import stages
from .crypto import FORMAT, FrameCipher

MAGIC = b"CKF1"
_FIXED = struct.Struct("<4sHHQQQQ")
FIXED_LEN = _FIXED.size  # 40
_Q = struct.Struct("<Q")
MAX_CODEC_LEN = 1024


def xxh3(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def xxh128(data) -> int:
    """XXH3-128 of ``data``: the identity of a write item's raw bytes for incremental saves
    (docs/FORMAT.md, "References")."""
    return xxhash.xxh3_128_intdigest(data)


def xxh128_stream():
    """A streaming XXH3-128 hasher (``update(bytes)``, ``intdigest()``)."""
    return xxhash.xxh3_128()


def xxh3_stream():
    """A streaming XXH3-64 hasher (``update(bytes)``, ``intdigest()``)."""
    return xxhash.xxh3_64()


@dataclasses.dataclass(frozen=True)
class FrameRef:
    """Where one frame lives in its object and what it must hash to.

    ``offset``/``length`` in bytes within the object (header included); ``raw_len`` decoded bytes;
    ``xxh3`` XXH3-64 of the stored payload; ``index`` the frame's position in the object.
    """

    offset: int
    length: int
    raw_len: int
    xxh3: int
    index: int


@dataclasses.dataclass(frozen=True)
class FrameHeader:
    index: int
    raw_len: int
    stored_len: int
    payload_xxh3: int
    chain: str
    header_len: int


def aad(version: str, attempt: str, obj: str, index: int, raw_len: int, chain: str) -> bytes:
    return b"|".join(
        [FORMAT, version.encode(), attempt.encode(), obj.encode(), b"%d" % index, b"%d" % raw_len, chain.encode()]
    )


def build_header(index: int, raw_len: int, payload, chain: str) -> tuple[bytes, int]:
    cb = chain.encode("ascii")
    h = xxh3(payload)
    head = _FIXED.pack(MAGIC, FIXED_LEN + len(cb) + 8, len(cb), index, raw_len, len(payload), h) + cb
    return head + _Q.pack(xxh3(head)), h


def parse_header(buf, what: str) -> FrameHeader:
    """Parse and verify a header at the start of ``buf`` (which may hold more bytes)."""
    if len(buf) < FIXED_LEN + 8:
        raise IntegrityError(f"{what}: truncated frame header", object=what)
    magic, header_len, codec_len, index, raw_len, stored_len, ph = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise IntegrityError(f"{what}: bad frame magic {bytes(magic)!r}", object=what)
    if codec_len > MAX_CODEC_LEN or header_len != FIXED_LEN + codec_len + 8 or len(buf) < header_len:
        raise IntegrityError(f"{what}: corrupt frame header (lengths)", object=what)
    (hh,) = _Q.unpack_from(buf, FIXED_LEN + codec_len)
    if xxh3(memoryview(buf)[: FIXED_LEN + codec_len]) != hh:
        raise IntegrityError(f"{what}: frame header checksum mismatch", object=what)
    try:
        chain = bytes(buf[FIXED_LEN : FIXED_LEN + codec_len]).decode("ascii")
    except UnicodeDecodeError:
        raise IntegrityError(f"{what}: frame header codec is not ASCII", object=what) from None
    return FrameHeader(index, raw_len, stored_len, ph, chain, header_len)


class FrameCodec:
    """Encodes and decodes frames of one attempt of one version.

    ``cipher`` is None for unencrypted versions. ``level`` is the zstd level (1 = fastest; the
    default because save time is training time lost). ``compress``: ``"auto"`` tries zstd (or the
    byte-grouping float codec for float dtypes) and keeps it only when it saves ≥ 3 %.
    """

    def __init__(self, version: str, attempt: str, cipher: FrameCipher | None, *, compress: str = "auto", level: int = 1):
        self.version = version
        self.attempt = attempt
        self.cipher = cipher
        self.compress = compress
        self.level = level

    # -- encode ---------------------------------------------------------------------------------
    def encode(self, obj: str, index: int, raw, float_width: int = 0, cell=None, nonfinite: int = 0,
               counted: list | None = None) -> tuple[bytes, object, int]:
        """Encode one frame. Returns ``(header, payload, payload_xxh3)``; write header then payload.

        ``raw``: a bytes-like of the item's bytes (C order); ``float_width``: element size in bytes
        when the data are IEEE floats (enables byte-grouping), else 0; ``cell``: a
        ``bytegroup.PlanCell`` shared by the frames of one tensor (the plan is decided once).
        ``nonfinite``, ``counted``: the byte-grouping split counts the frame's non-finite elements on
        its way (``bytegroup.encode_parts``) and appends the count to ``counted`` when it did.
        """
        raw = memoryview(raw).cast("B")
        raw_len = len(raw)
        payload: object = raw
        parts = None
        chain: list[str] = []
        if self.compress != "none" and raw_len >= 64:
            payload, chain, parts = _compress(raw, self.level, float_width, cell, self.cipher is not None,
                                              nonfinite, counted)
        cs = "|".join(chain)
        if self.cipher is not None:
            ad = aad(self.version, self.attempt, obj, index, raw_len, cs)
            payload = self.cipher.encrypt_parts(*parts, ad) if parts is not None else self.cipher.encrypt(payload, ad)
            cs = f"{cs}|aesgcm/1" if cs else "aesgcm/1"
        head, h = build_header(index, raw_len, payload, cs)
        return head, payload, h

    # -- decode ---------------------------------------------------------------------------------
    def decode(self, obj: str, buf, ref: FrameRef | None, out=None, *, checked: bool = False):
        """Verify and decode one frame held whole in ``buf``; returns the raw bytes.

        Checks, in order: header checksum, agreement with ``ref`` (index, raw length, payload
        checksum, total length), payload checksum, AEAD tag, decoded length. Any failure raises
        :class:`IntegrityError` naming ``obj``.

        ``out``: a writable byte buffer of exactly the frame's raw length (a destination tensor's
        memory) to decode into instead of fresh memory; it is returned. Nothing is written into it
        before the header and the payload checksum have verified; the last stage writes straight
        into it (AES-GCM decryption, zstd, byte-group merge), so when a later check fails (the
        AEAD tag, a stage's own checks) it holds garbage and the :class:`IntegrityError` raised
        must fail the load (docs/FORMAT.md, Read rule 13). ``checked``: :meth:`check` already
        passed on these very bytes (the payload XXH3 is not computed again).
        """
        what = obj
        hd = parse_header(buf, what)
        total = hd.header_len + hd.stored_len
        self._check_ref(what, hd, ref)
        if len(buf) != total:
            raise IntegrityError(f"{what}: frame length {len(buf)} != {total}", object=what)
        payload = memoryview(buf)[hd.header_len :]
        if not checked and xxh3(payload) != hd.payload_xxh3:
            raise IntegrityError(f"{what}: frame {hd.index} payload checksum mismatch", object=what)
        return self._decode_payload(what, obj, hd, payload, out)

    def check(self, obj: str, buf, ref: FrameRef | None) -> None:
        """The checks of :meth:`decode` that need no decoding (header checksum, agreement with
        ``ref``, length, payload XXH3); raises :class:`IntegrityError`."""
        hd = parse_header(buf, obj)
        self._check_ref(obj, hd, ref)
        if len(buf) != hd.header_len + hd.stored_len:
            raise IntegrityError(f"{obj}: frame length {len(buf)} != {hd.header_len + hd.stored_len}", object=obj)
        if xxh3(memoryview(buf)[hd.header_len :]) != hd.payload_xxh3:
            raise IntegrityError(f"{obj}: frame {hd.index} payload checksum mismatch", object=obj)

    def _check_ref(self, what: str, hd: FrameHeader, ref: FrameRef | None) -> None:
        if ref is not None and (
            hd.index != ref.index or hd.raw_len != ref.raw_len or hd.payload_xxh3 != ref.xxh3
            or hd.header_len + hd.stored_len != ref.length
        ):
            raise IntegrityError(
                f"{what}: frame at offset {ref.offset} is not the frame the index names "
                f"(index {hd.index} vs {ref.index}, checksum {hd.payload_xxh3:016x} vs {ref.xxh3:016x})",
                object=what,
            )

    def _decode_payload(self, what: str, obj: str, hd: FrameHeader, payload, out):
        if hd.raw_len > stages.MAX_FRAME_RAW:
            raise IntegrityError(f"{what}: frame raw length {hd.raw_len} too large", object=what)
        if out is not None and len(out) != hd.raw_len:
            raise IntegrityError(f"{what}: frame {hd.index} holds {hd.raw_len} bytes, its destination {len(out)}", object=what)
        parsed = stages.parse_chain(hd.chain)
        data = payload
        if parsed and parsed[-1][0] == "aesgcm/1":
            if self.cipher is None:
                raise KeyMismatchError(
                    f"{what} is encrypted but no key was given; supply key=, CKPTSTORE_KEY or CKPTSTORE_KEY_FILE"
                )
            last = len(parsed) == 1
            if last and out is not None and len(payload) != hd.raw_len + 28:  # nonce(12) + tag(16)
                raise IntegrityError(f"{what}: frame {hd.index} decrypts to {len(payload) - 28} bytes, expected {hd.raw_len}", object=what)
            data = self.cipher.decrypt(  # the plaintext may sit in scratch when later stages copy it out
                data, aad(self.version, self.attempt, obj, hd.index, hd.raw_len, hd.chain.rpartition("|")[0] if "|" in hd.chain else ""), what,
                scratch=not last, out=out if last else None,
            )
            parsed = parsed[:-1]
        elif self.cipher is not None:
            raise IntegrityError(f"{what}: frame {hd.index} is not encrypted in an encrypted version", object=what)
        if any(n == "aesgcm/1" for n, _ in parsed):
            raise UnsupportedFormatError(f"{what}: aesgcm/1 must be the last stage of a chain")
        if out is not None and not parsed and data is not out:  # stored raw: one copy into place
            if len(data) != hd.raw_len:
                raise IntegrityError(f"{what}: frame {hd.index} decoded to {len(data)} bytes, expected {hd.raw_len}", object=what)
            stages.copy_into(out, data)
            return out
        for i, (name, param) in enumerate(reversed(parsed)):
            into = out if (out is not None and i == len(parsed) - 1) else None  # the last decode step
            try:
                data = stages.decode_stage(name, param, data, hd.raw_len, into)
            except IntegrityError as e:
                raise IntegrityError(f"{what}: frame {hd.index}: {e}", object=what) from None
            except (ValueError, TypeError, OverflowError, MemoryError) as e:
                raise IntegrityError(f"{what}: frame {hd.index} does not decode: {e}", object=what) from None
        if len(data) != hd.raw_len:
            raise IntegrityError(f"{what}: frame {hd.index} decoded to {len(data)} bytes, expected {hd.raw_len}", object=what)
        return data


def _compress(raw: memoryview, level: int, float_width: int, cell=None, parts_ok: bool = False, nonfinite: int = 0,
              counted: list | None = None):
    """``(payload, chain, parts)``: the compressed payload and its chain, or ``raw`` and ``[]`` when
    compression does not pay. With ``parts_ok`` a byte-grouped payload may come back as
    ``parts = (list of bytes-likes, total)`` and ``payload`` None; the caller consumes the parts
    before this thread encodes again (they may view its scratch buffer)."""
    n = len(raw)
    if float_width in (2, 4, 8) and n >= 4096 and n % float_width == 0 and stages.has_bytegroup():
        from . import bytegroup

        r = bytegroup.encode_parts(raw, float_width, cell, scratch=parts_ok, nonfinite=nonfinite, counted=counted)
        if r is not None and r[1] < n * 0.97:
            chain = [f"{bytegroup.descriptor_of(r[0][0])}:{float_width}"]
            return (None, chain, r) if parts_ok else (bytegroup._join(*r), chain, None)
        return raw, [], None
    # sample first: skip zstd quickly on incompressible data (four 32 KiB runs spread over the
    # frame, so that a frame whose start is random, a checksum column say, is not skipped whole)
    if n > (1 << 20):
        piece, step = 32 << 10, (n - (32 << 10)) // 3
        sample = b"".join(raw[i * step : i * step + piece] for i in range(4))
        if len(stages.zstd_compress(sample, level)) > len(sample) * 0.95:
            return raw, [], None
    c = stages.zstd_compress(raw, level)
    if len(c) < n * 0.97:
        return c, ["zstd/1"], None
    return raw, [], None


class FrameWalk:
    """The one frame walker: every frame of an object, in order, without an index or a key.

    ``read(offset, n) -> bytes`` reads the stored object of ``size`` bytes (``what`` names it in
    errors). Iterating yields ``(offset, header, length)`` for each frame after checking its header
    checksum, its index (0, 1, 2, …), that it ends inside the object, and its payload XXH3; the
    first bad frame raises :class:`IntegrityError`. While it walks it accumulates what a manifest
    entry records of the object: :attr:`count` frames, :attr:`raw_len` decoded bytes, and
    :meth:`digest` (XXH3-64 over the frame headers; see docs/FORMAT.md). :meth:`mismatch` compares
    them with the entry after the walk. Used by the reader (metadata object), scrub and the
    uploader.
    """

    def __init__(self, read, size: int, what: str):
        self._read, self.size, self.what = read, size, what
        self._digest = xxh3_stream()
        self.count = 0
        self.raw_len = 0
        #: ``(offset, length, index, payload_xxh3, raw_len)`` of every frame walked so far
        self.frames: list[tuple[int, int, int, int, int]] = []

    def __iter__(self) -> Iterator[tuple[int, FrameHeader, int]]:
        read, size, what = self._read, self.size, self.what
        off = 0
        while off < size:
            head = read(off, min(FIXED_LEN + 8 + MAX_CODEC_LEN, size - off))
            hd = parse_header(head, f"{what}@{off}")
            if hd.index != self.count:
                raise IntegrityError(f"{what}: frame at offset {off} has index {hd.index}, expected {self.count}", object=what)
            length = hd.header_len + hd.stored_len
            if off + length > size:
                raise IntegrityError(f"{what}: frame {hd.index} runs past the end of the object (truncated)", object=what)
            if xxh3(read(off + hd.header_len, hd.stored_len)) != hd.payload_xxh3:
                raise IntegrityError(f"{what}: frame {hd.index} payload checksum mismatch", object=what)
            self._digest.update(memoryview(head)[: hd.header_len])
            self.count += 1
            self.raw_len += hd.raw_len
            self.frames.append((off, length, hd.index, hd.payload_xxh3, hd.raw_len))
            yield off, hd, length
            off += length

    def walk(self) -> "FrameWalk":
        """Walk to the end (raises at the first bad frame); returns ``self``."""
        for _ in self:
            pass
        return self

    def digest(self) -> str:
        """XXH3-64 (16 hex digits) over the headers of the frames walked so far."""
        return f"{self._digest.intdigest():016x}"

    def mismatch(self, frames: int, digest: str, nbytes: int | None = None) -> tuple[str, str] | None:
        """``(kind, detail)`` when the walked object disagrees with its manifest entry
        (``kind``: ``"frame-count"`` or ``"digest"``), else None."""
        if self.count != frames:
            return "frame-count", f"{self.count} frames, the manifest says {frames}"
        if self.digest() != digest:
            return "digest", f"frame-header digest {self.digest()}, the manifest says {digest}"
        if nbytes is not None and self.raw_len != nbytes:
            return "digest", f"frames hold {self.raw_len} raw bytes, the manifest says {nbytes}"
        return None


def iter_frames(read, size: int, what: str) -> Iterator[tuple[int, FrameHeader, int]]:
    """Walk an object of ``size`` bytes without an index (see :class:`FrameWalk`).

    Yields ``(offset, header, payload_xxh3)``; raises :class:`IntegrityError` at the first bad frame.
    """
    for off, hd, _length in FrameWalk(read, size, what):
        yield off, hd, hd.payload_xxh3
