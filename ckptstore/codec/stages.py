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


# Decoders for stages that need no key: descriptor name -> fn(data, param, raw_len) -> bytes.
# ``raw_len`` is the length the *whole chain* decodes to; stage-level lengths are implied.
_DECODERS: dict[str, Callable[[bytes, str, int], bytes]] = {}


def register_decoder(name: str, fn: Callable[[bytes, str, int], bytes]) -> None:
    _DECODERS[name] = fn


register_decoder("zstd/1", lambda data, param, raw_len: zstd_decompress(data, raw_len))


def parse_chain(chain: str) -> list[tuple[str, str]]:
    """``"bytegroup/1:2|zstd/1"`` → ``[("bytegroup/1", "2"), ("zstd/1", "")]``; validates names."""
    if chain == "":
        return []
    out = []
    for desc in chain.split("|"):
        name, _, param = desc.partition(":")
        if name != "aesgcm/1" and name not in _DECODERS:
            raise UnsupportedFormatError(
                f"unknown codec {desc!r}; this ckptstore release knows "
                f"{sorted(list(_DECODERS) + ['aesgcm/1'])}; upgrade ckptstore to read it"
            )
        out.append((name, param))
    return out


def decode_stage(name: str, param: str, data: bytes, raw_len: int) -> bytes:
    return _DECODERS[name](data, param, raw_len)


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
