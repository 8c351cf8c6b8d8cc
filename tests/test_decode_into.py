"""Frames decoded straight into a destination buffer (docs/FORMAT.md, Read rule 13): the same bytes
as a decode into fresh memory for every chain, and every failure still an IntegrityError."""

from __future__ import annotations

import os

import numpy as np
import pytest
import zstandard

from ckptstore.codec import stages
from ckptstore.codec.crypto import FrameCipher
from ckptstore.codec.frame import FrameCodec, build_header
from ckptstore.errors import IntegrityError


def _datas():
    rng = np.random.default_rng(3)
    bf16 = (rng.standard_normal(300_000).astype(np.float32) * 0.02).view(np.uint32) >> 16
    fp32 = (rng.standard_normal(100_000).astype(np.float32) * 1e-3)
    return {
        "bf16": (bf16.astype(np.uint16).tobytes(), 2),
        "fp32": (fp32.tobytes(), 4),
        "zeros": (bytes(1 << 20), 0),
        "random": (os.urandom(200_001), 0),
        "text": (b"checkpoint " * 50_000, 0),
        "tiny": (b"abc", 0),
    }


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "aesgcm"])
@pytest.mark.parametrize("compress", ["auto", "none"])
@pytest.mark.parametrize("name", list(_datas()))
def test_decode_into_gives_the_bytes_of_a_fresh_decode(name, compress, encrypted):
    raw, width = _datas()[name]
    codec = FrameCodec("v1", "a1", FrameCipher(os.urandom(32)) if encrypted else None, compress=compress)
    head, payload, _h = codec.encode("obj", 0, raw, width)
    frame = bytes(head) + bytes(payload)
    want = bytes(codec.decode("obj", frame, None))
    out = bytearray(len(raw))
    got = codec.decode("obj", frame, None, out=memoryview(out))
    assert want == raw and bytes(out) == raw and bytes(got) == raw


def test_a_frame_whose_tag_fails_raises_after_writing_into_place():
    """The AEAD tag is checked as the last bytes are decrypted into the destination: a frame whose
    checksum matches its (re-made) header but whose ciphertext was altered must still raise."""
    raw = os.urandom(100_000)
    codec = FrameCodec("v1", "a1", FrameCipher(os.urandom(32)), compress="none")
    head, payload, _h = codec.encode("obj", 0, raw)
    bad = bytearray(payload)
    bad[5000] ^= 0x01
    head2, _ = build_header(0, len(raw), bad, "aesgcm/1")
    out = bytearray(len(raw))
    with pytest.raises(IntegrityError, match="authentication failed"):
        codec.decode("obj", head2 + bytes(bad), None, out=memoryview(out))


def test_a_destination_of_another_length_is_refused():
    raw = os.urandom(10_000)
    codec = FrameCodec("v1", "a1", None, compress="none")
    head, payload, _h = codec.encode("obj", 0, raw)
    with pytest.raises(IntegrityError, match="destination"):
        codec.decode("obj", bytes(head) + bytes(payload), None, out=memoryview(bytearray(9_999)))


def test_a_damaged_payload_writes_nothing_into_place():
    raw = os.urandom(50_000)
    codec = FrameCodec("v1", "a1", None, compress="none")
    head, payload, _h = codec.encode("obj", 0, raw)
    frame = bytearray(bytes(head) + bytes(payload))
    frame[-10] ^= 0x40
    out = bytearray(len(raw))
    with pytest.raises(IntegrityError, match="checksum"):
        codec.decode("obj", bytes(frame), None, out=memoryview(out))
    assert out == bytearray(len(raw))


@pytest.mark.parametrize("case", ["extra", "truncated", "wrong-size"])
def test_zstd_into_keeps_the_checks_of_zstd(case):
    data = b"abc" * 100_000 + os.urandom(1000)
    c = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(data)
    n = len(data)
    if case == "extra":
        c += b"\0"
    elif case == "truncated":
        c = c[:-3]
    else:
        n -= 1
    with pytest.raises(IntegrityError):
        stages.zstd_decompress_into(c, n, memoryview(bytearray(n)))
