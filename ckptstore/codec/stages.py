"""Codec stages and their descriptors.

A *codec chain* is an ordered list of stages applied on encode (left to right) and undone on decode
(right to left). Each stage has a *descriptor*, ``"name/version"`` optionally followed by
``":param"`` (e.g. ``"bytegroup/1:2"``), recorded in every frame header, so a frame stays decodable
when defaults change (the same idea as DCP's ``_extension.py`` transform descriptors). A chain is
written as descriptors joined by ``|``; the empty chain (stored raw) is the empty string.

Descriptor registry (decode side):

==================  ===========================================================================
``zstd/1``          Zstandard frame (RFC 8878) with content size; decoded with an output cap equal
                    to the frame's raw length.
``aesgcm/1``        AES-256-GCM (NIST SP 800-38D): ``nonce(12) || ciphertext || tag(16)``; the key is
                    the version's data key, the associated data binds the frame's identity.
``bytegroup/1:W``   byte-grouping of W-byte elements into W planes (see ``bytegroup.py``).
``bytegroup/2:W``   the same with a Huffman-coded plane (plane codec 2, ``codec/_huff.c``).
==================  ===========================================================================
"""

from __future__ import annotations

import os
import threading
from typing import Callable

import zstandard

from ..errors import IntegrityError, UnsupportedFormatError

_tls = threading.local()

#: frames larger than this (raw bytes) are refused on decode (hostile-input bound)
MAX_FRAME_RAW = 1 << 31


def _cctx(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_tls, "cctx", None)
    if cache is None:
        cache = _tls.cctx = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return c


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "dctx", None)
    if d is None:
        d = _tls.dctx = zstandard.ZstdDecompressor()
    return d


def zstd_compress(data, level: int = 1) -> bytes:
    return _cctx(level).compress(data)


def zstd_decompress(data, raw_len: int) -> bytes:
    if raw_len > MAX_FRAME_RAW:
        raise IntegrityError(f"frame raw length {raw_len} exceeds the limit {MAX_FRAME_RAW}")
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"zstd frame header does not parse: {e}") from None
    if declared != raw_len:  # python-zstandard sizes its output from the frame's own claim
        raise IntegrityError(f"zstd frame declares {declared} bytes, expected {raw_len}")
    try:
        out = _dctx().decompress(data, max_output_size=raw_len, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"zstd frame does not decode: {e}") from None
    if len(out) != raw_len:
        raise IntegrityError(f"zstd frame decoded to {len(out)} bytes, expected {raw_len}")
    return out


def zstd_decompress_into(data, raw_len: int, out) -> None:
    """:func:`zstd_decompress` into ``out`` (a writable byte buffer of exactly ``raw_len`` bytes)
    instead of fresh memory: the same checks (declared content size, one whole frame, no extra
    data), through a stream reader's ``readinto`` (which releases the GIL like ``decompress``)."""
    if raw_len > MAX_FRAME_RAW:
        raise IntegrityError(f"frame raw length {raw_len} exceeds the limit {MAX_FRAME_RAW}")
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"zstd frame header does not parse: {e}") from None
    if declared != raw_len:
        raise IntegrityError(f"zstd frame declares {declared} bytes, expected {raw_len}")
    mv = memoryview(data).cast("B")
    try:
        reader = _dctx().stream_reader(mv, read_across_frames=False, closefd=False)
        got = 0
        while got < raw_len:
            n = reader.readinto(out[got:])
            if not n:
                break
            got += n
        tail = reader.read(1) if got == raw_len else b""
        consumed = reader.tell()  # output position; the input position is checked below
    except zstandard.ZstdError as e:
        raise IntegrityError(f"zstd frame does not decode: {e}") from None
    if got != raw_len or tail or consumed != raw_len:
        raise IntegrityError(f"zstd frame decoded to {got} bytes or more, expected {raw_len}")
    # no extra data after the frame (decompress(allow_extra_data=False) refuses it): the frame's
    # compressed size must be the whole payload
    if _frame_end(mv) != len(mv):
        raise IntegrityError("zstd frame is followed by extra data")


def _frame_end(mv) -> int:
    """The end of the (one) zstd frame at the start of ``mv``: walks its block headers (RFC 8878,
    3.1.1: frame header, then blocks of 3-byte headers, then an optional 4-byte checksum)."""
    try:
        pos = zstandard.frame_header_size(mv)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"zstd frame header does not parse: {e}") from None
    n = len(mv)
    fhd = mv[4]
    checksum = 4 if fhd & 0x04 else 0
    while True:
        if pos + 3 > n:
            raise IntegrityError("zstd frame is truncated")
        bh = mv[pos] | (mv[pos + 1] << 8) | (mv[pos + 2] << 16)
        last, btype, bsize = bh & 1, (bh >> 1) & 3, bh >> 3
        pos += 3 + (1 if btype == 1 else bsize)  # RLE blocks store one byte
        if last:
            return pos + checksum


# Decoders for stages that need no key: descriptor name -> fn(data, param, raw_len) -> bytes.
# ``raw_len`` is the length the *whole chain* decodes to; stage-level lengths are implied.
_DECODERS: dict[str, Callable[[bytes, str, int], bytes]] = {}
# ... and the same decoders writing into a caller's buffer: fn(data, param, raw_len, out) -> None,
# ``out`` a writable byte buffer of exactly ``raw_len`` bytes (optional per stage)
_INTO: dict[str, Callable] = {}


def register_decoder(name: str, fn: Callable[[bytes, str, int], bytes], into: Callable | None = None) -> None:
    _DECODERS[name] = fn
    if into is not None:
        _INTO[name] = into


register_decoder("zstd/1", lambda data, param, raw_len: zstd_decompress(data, raw_len),
                 lambda data, param, raw_len, out: zstd_decompress_into(data, raw_len, out))


def has_bytegroup() -> bool:
    """Whether the byte-grouping float codec (``bytegroup/1``, needs numpy) is available; imports
    and registers it on first call."""
    if "bytegroup/1" not in _DECODERS:
        try:
            from . import bytegroup  # noqa: F401  (registers itself)
        except ImportError:  # pragma: no cover
            return False
    return "bytegroup/1" in _DECODERS


def parse_chain(chain: str) -> list[tuple[str, str]]:
    """``"bytegroup/1:2|zstd/1"`` → ``[("bytegroup/1", "2"), ("zstd/1", "")]``; validates names."""
    if chain == "":
        return []
    out = []
    for desc in chain.split("|"):
        name, _, param = desc.partition(":")
        if name.startswith("bytegroup/"):
            has_bytegroup()
        if name != "aesgcm/1" and name not in _DECODERS:
            raise UnsupportedFormatError(
                f"unknown codec {desc!r}; this ckptstore release knows "
                f"{sorted(list(_DECODERS) + ['aesgcm/1'])}; upgrade ckptstore to read it"
            )
        out.append((name, param))
    return out


def decode_stage(name: str, param: str, data: bytes, raw_len: int, out=None):
    """Undo one stage. With ``out`` (a writable byte buffer of ``raw_len`` bytes) the result is
    written there (straight, when the stage can) and ``out`` is returned."""
    if out is None:
        return _DECODERS[name](data, param, raw_len)
    into = _INTO.get(name)
    if into is not None:
        into(data, param, raw_len, out)
        return out
    got = _DECODERS[name](data, param, raw_len)
    if len(got) != raw_len:
        raise IntegrityError(f"{name} decoded to {len(got)} bytes, expected {raw_len}")
    copy_into(out, got)
    return out


def copy_into(out, data) -> None:
    """``out[:] = data`` for byte buffers, through numpy (which releases the GIL for large copies;
    a memoryview slice assignment holds it)."""
    import numpy as np

    np.copyto(np.frombuffer(out, dtype=np.uint8), np.frombuffer(data, dtype=np.uint8))


def env_threads(default: int | None = None) -> int:
    """Encoder/decoder threads per rank: ``CKPTSTORE_THREADS``, else the node's cores divided among
    the ranks on it (``LOCAL_WORLD_SIZE``, set by torchrun) plus one, between 2 and 8 — the
    libraries release the GIL, and one extra thread covers the time a thread spends holding it."""
    v = os.environ.get("CKPTSTORE_THREADS")
    if v:
        return max(1, int(v))
    if default:
        return default
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(2, min(8, (os.cpu_count() or 2) // local + 1))
