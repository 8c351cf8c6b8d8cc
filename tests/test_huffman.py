"""The Huffman coder of exponent planes: plane codec 2 of ``bytegroup/2`` (docs/FORMAT.md, "Codec stages";
layout in ckptstore/codec/_huff.c). Its C encoder and decoder, the numpy decoder that readers without
the C module use, and the payload decoder's handling of hostile codec 2 planes."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.codec import bytegroup, stages
from ckptstore.errors import IntegrityError
from helpers import mutated

huff = bytegroup._huff
pytestmark = pytest.mark.skipif(huff is None, reason="ckptstore.codec._huff not built (no C compiler at install)")
HEAD = bytegroup.HUFF_HEAD


def encode(plane: np.ndarray, alphabet: np.ndarray | None = None) -> bytes | None:
    """The coded plane, or None when the coder leaves it to zstd."""
    dst = np.empty(huff.bound(plane.shape[0]), dtype=np.uint8)
    a = np.zeros(32, dtype=np.uint8) if alphabet is None else alphabet
    m = huff.encode(np.ascontiguousarray(plane), dst, np.empty(huff.WORK_BYTES, dtype=np.uint8), a)
    return None if m < 0 else dst[:m].tobytes()


def decode_both(coded: bytes, count: int) -> tuple[bytes | str, bytes | str]:
    """(C result, numpy result): the decoded bytes, or the ValueError's message."""
    out = []
    for fn in (lambda: _c_decode(coded, count), lambda: bytegroup.huff_decode_numpy(coded, count).tobytes()):
        try:
            out.append(fn())
        except ValueError as e:
            out.append(f"error: {e}")
    return out[0], out[1]


def _c_decode(coded: bytes, count: int) -> bytes:
    o = np.empty(count, dtype=np.uint8)
    huff.decode(coded, o)
    return o.tobytes()


def exponent_plane(n: int, scale: float = 0.02, seed: int = 0) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * scale).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return bytegroup._split(x, 2, bytegroup.TRANSFORM_ROTL1)[1].copy()


@st.composite
def planes(draw):
    """Byte planes a coder may meet: few values or many, skewed or flat, short or past the sampling size."""
    n = draw(st.one_of(st.integers(4, 5000), st.integers(60_000, 70_000), st.sampled_from([(256 << 10) + 7, 300_000])))
    k = draw(st.integers(2, 256))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["zipf", "uniform", "geometric"]))
    if kind == "zipf":
        v = rng.zipf(draw(st.floats(1.1, 3.0)), n) % k
    elif kind == "uniform":
        v = rng.integers(0, k, n)
    else:
        v = np.minimum(rng.geometric(draw(st.floats(0.05, 0.7)), n), 255)
    return (v + draw(st.integers(0, 255))).astype(np.uint8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(planes())
def test_property_roundtrip_c_and_numpy(plane):
    coded = encode(plane)
    if coded is None:  # one value is 3/4 of the plane: left to zstd
        counts = np.bincount(plane, minlength=256)
        assert counts.max() * 4 >= plane.shape[0] * 3 * (0.9 if plane.shape[0] >= 256 << 10 else 1)
        return
    c, n = decode_both(coded, plane.shape[0])
    assert c == plane.tobytes()
    assert n == plane.tobytes()
    assert len(coded) <= huff.bound(plane.shape[0])


def test_a_value_the_sample_missed_is_coded_and_joins_the_alphabet():
    """Planes of 256 KiB and more take their histogram from 4 KiB of every 16 KiB; a value only in the
    unsampled part still round-trips, and the tensor's alphabet learns it."""
    plane = exponent_plane(1 << 20)
    assert plane[5000] != 7 and not (plane == 7).any()
    plane[5000] = 7  # offset 5000 lies outside the sampled first 4 KiB of the first 16 KiB
    alphabet = np.zeros(32, dtype=np.uint8)
    coded = encode(plane, alphabet)
    assert coded is not None
    assert decode_both(coded, plane.shape[0]) == (plane.tobytes(), plane.tobytes())
    assert np.unpackbits(alphabet, bitorder="little")[7] == 1
    # the next frame of the tensor codes the value from the sample's histogram and the alphabet alone
    again = encode(plane, alphabet)
    assert decode_both(again, plane.shape[0])[0] == plane.tobytes()


def test_exponent_plane_codes_at_least_as_small_as_zstd():
    plane = exponent_plane(1 << 20)
    coded = encode(plane)
    z = bytegroup._cctx().compress(plane)
    assert len(coded) <= len(z) * 1.01
    assert len(coded) < 0.4 * plane.shape[0]


@pytest.mark.parametrize("fill", [0, 0x7F])
def test_a_plane_of_one_value_is_left_to_zstd(fill):
    assert encode(np.full(1 << 19, fill, dtype=np.uint8)) is None
    mostly = np.full(100_000, fill, dtype=np.uint8)
    mostly[::5] = 1  # 80 % one value
    assert encode(mostly) is None


def _streams(coded: bytes) -> list[tuple[int, int]]:
    lens = list(struct.unpack_from("<3I", coded, 129))
    lens.append(len(coded) - HEAD - sum(lens))
    offs = [HEAD + sum(lens[:k]) for k in range(4)]
    return list(zip(offs, lens))


def _lengths_field(lengths: dict[int, int]) -> bytes:
    b = bytearray(128)
    for sym, n in lengths.items():
        b[sym // 2] |= n << (4 * (sym % 2))
    return bytes(b)


@pytest.mark.parametrize(
    "case",
    [
        "short_header",
        "max_len",
        "one_symbol",
        "oversubscribed",
        "incomplete",
        "length_12",
        "stream_past_end",
        "stream_too_long_for_symbols",
        "truncated",
        "trailing_byte",
        "nonzero_padding",
        "empty_stream",
    ],
)
def test_malformed_planes_are_refused_by_c_and_numpy(case):
    plane = exponent_plane(10_001)
    coded = bytearray(encode(plane))
    count = plane.shape[0]
    if case == "short_header":
        coded = coded[: HEAD - 1]
    elif case == "max_len":
        coded[0] = 12
    elif case == "one_symbol":
        coded[1:129] = _lengths_field({3: 1})
    elif case == "oversubscribed":
        coded[1:129] = _lengths_field({0: 1, 1: 1, 2: 2})
    elif case == "incomplete":
        coded[1:129] = _lengths_field({0: 1, 1: 2})
    elif case == "length_12":  # a nibble holds up to 15; the code allows 11
        coded[1:129] = _lengths_field({0: 1, 1: 12, 2: 12})
    elif case == "stream_past_end":
        struct.pack_into("<I", coded, 129, len(coded))
    elif case == "stream_too_long_for_symbols":
        coded = bytearray(encode(np.tile(np.arange(4, dtype=np.uint8), 3)))  # 12 symbols, 3 per stream
        count = 12
        struct.pack_into("<I", coded, 129, 11 * 3 // 8 + 2)
    elif case == "truncated":
        coded = coded[:-1]
    elif case == "trailing_byte":
        coded = coded + b"\0"
    elif case == "nonzero_padding":
        off, n = _streams(bytes(coded))[3]
        last = coded[off + n - 1]
        if last == 0xFF or last & 0x80:  # find a stream whose last byte has a zero top bit
            for off, n in _streams(bytes(coded)):
                if not coded[off + n - 1] & 0x80:
                    break
        coded[off + n - 1] |= 0x80
    elif case == "empty_stream":
        struct.pack_into("<I", coded, 129, 0)
    c, n = decode_both(bytes(coded), count)
    if case == "nonzero_padding" and not c.startswith("error"):  # the padding was 8 bits short of a whole byte
        pytest.skip("every stream ended on a byte boundary")
    assert c.startswith("error"), c[:40]
    assert n.startswith("error"), n[:40]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_property_mutated_planes_agree(data):
    """Random byte changes and cuts: the C and numpy decoders refuse the same inputs and decode the
    others to the same bytes (never a crash, never a wrong length)."""
    plane = _MUTATE_PLANE
    b = mutated(data.draw, _MUTATE_CODED, (1, 4))
    c, n = decode_both(b, plane.shape[0])
    assert (isinstance(c, bytes)) == (isinstance(n, bytes))
    if isinstance(c, bytes):
        assert c == n and len(c) == plane.shape[0]


_MUTATE_PLANE = exponent_plane(6_000, seed=3)
_MUTATE_CODED = encode(_MUTATE_PLANE) if huff is not None else b""


def test_hostile_huffman_plane_in_a_payload_is_an_integrity_error():
    g = torch.Generator().manual_seed(9)
    raw = (torch.randn(1 << 17, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    payload = bytearray(bytegroup.encode(raw, 2, 1))
    table = [struct.unpack_from("<BQ", payload, bytegroup.HEAD_LEN + 9 * k) for k in range(2)]
    assert table[1][0] == bytegroup.CODEC_HUFF
    off = bytegroup.HEAD_LEN + 18 + table[0][1]
    payload[off + 5] ^= 0xFF  # the code lengths
    with pytest.raises(IntegrityError, match="huffman plane 1"):
        stages.decode_stage("bytegroup/2", "2", bytes(payload), len(raw))
    bad_len = bytearray(bytegroup.encode(raw, 2, 1))
    struct.pack_into("<Q", bad_len, bytegroup.HEAD_LEN + 9 + 1, 100)  # shorter than the plane's header
    with pytest.raises(IntegrityError, match="bad length"):
        stages.decode_stage("bytegroup/2", "2", bytes(bad_len), len(raw))


def test_encoder_refuses_small_buffers():
    plane = exponent_plane(1000)
    work = np.empty(huff.WORK_BYTES, dtype=np.uint8)
    with pytest.raises(ValueError, match="dst"):
        huff.encode(plane, np.empty(huff.bound(1000) - 1, np.uint8), work, np.zeros(32, np.uint8))
    with pytest.raises(ValueError, match="work"):
        huff.encode(plane, np.empty(huff.bound(1000), np.uint8), work[:-1], np.zeros(32, np.uint8))
    with pytest.raises(ValueError, match="alphabet"):
        huff.encode(plane, np.empty(huff.bound(1000), np.uint8), work, np.zeros(31, np.uint8))
    with pytest.raises(ValueError, match="src"):
        huff.encode(plane[:3], np.empty(huff.bound(3), np.uint8), work, np.zeros(32, np.uint8))
