"""The byte-grouping float codec ``bytegroup/1`` (ckptstore/codec/bytegroup.py).

Round trips are bit-exact for every float format and bit pattern; the decoder treats its input as
hostile and raises IntegrityError (and nothing else) for anything malformed.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import tracemalloc

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.codec import bytegroup, stages
from ckptstore.codec.frame import FrameCodec, parse_header
from ckptstore.errors import IntegrityError, UnsupportedFormatError
from helpers import mutated

HEAD = bytegroup.HEAD_LEN
PLANE = 9  # codec u8 + stored_len u64
#: how a large exponent plane is coded: Huffman where the C coder is built, else zstd
EXPONENT_CODEC = bytegroup.CODEC_HUFF if bytegroup.HUFF else bytegroup.CODEC_ZSTD


def roundtrip(raw: bytes, width: int) -> memoryview:
    payload = bytegroup.encode(memoryview(raw), width, 1)
    assert payload is not None
    out = stages.decode_stage(bytegroup.descriptor_of(payload), str(width), payload, len(raw))
    assert len(out) == len(raw)
    assert bytes(out) == raw
    return payload


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def plane_table(payload) -> list[tuple[int, int]]:
    b = bytes(payload)
    w = b[3]
    return [struct.unpack_from("<BQ", b, HEAD + PLANE * k) for k in range(w)]


def decode(payload, param, raw_len):
    name = bytegroup.descriptor_of(payload) if len(payload) >= 3 else bytegroup.DESCRIPTOR
    return stages.decode_stage(name, param, payload, raw_len)


# -- registration and contract ----------------------------------------------------------------------


def test_registered_with_stages():
    assert stages.parse_chain("bytegroup/1:2|zstd/1") == [("bytegroup/1", "2"), ("zstd/1", "")]
    assert stages.parse_chain("bytegroup/2:4|aesgcm/1") == [("bytegroup/2", "4"), ("aesgcm/1", "")]
    with pytest.raises(UnsupportedFormatError, match="upgrade ckptstore"):
        stages.parse_chain("bytegroup/3:2")  # a later layout: refused by name, before any byte is read


def test_descriptor_names_the_layout():
    """A payload with a Huffman-coded plane is ``bytegroup/2`` (layout 2); under the other name it is
    refused, so a reader never takes one layout for the other."""
    g = torch.Generator().manual_seed(4)
    raw = tensor_bytes((torch.randn(1 << 18, generator=g) * 0.02).to(torch.bfloat16))
    payload = bytegroup.encode(raw, 2, 1)
    small = bytegroup.encode(raw[: 2 * 1000], 2, 1)  # planes below HUFF_MIN: zstd, layout 1
    assert bytegroup.descriptor_of(small) == "bytegroup/1" and bytes(small)[2] == 1
    if not bytegroup.HUFF:
        pytest.skip("the C Huffman coder is not built")
    assert bytegroup.descriptor_of(payload) == "bytegroup/2" and bytes(payload)[2] == 2
    with pytest.raises(IntegrityError, match="layout version 2 where the descriptor says 1"):
        stages.decode_stage("bytegroup/1", "2", payload, len(raw))
    with pytest.raises(IntegrityError, match="layout version 1 where the descriptor says 2"):
        stages.decode_stage("bytegroup/2", "2", small, 2000)
    head, body, _ = FrameCodec("v1", "a1", None).encode("obj", 0, memoryview(raw), float_width=2)
    assert parse_header(head, "obj").chain == "bytegroup/2:2"


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("extra", [1, 3, 5, 7])
def test_odd_lengths_are_refused(width, extra):
    if extra % width == 0:
        pytest.skip("not odd for this width")
    raw = bytes(range(256)) * 4 + bytes(extra)
    assert len(raw) % width
    assert bytegroup.encode(memoryview(raw), width, 1) is None


@pytest.mark.parametrize("width", [0, 3, 5, 16, -2])
def test_unsupported_width_is_refused(width):
    assert bytegroup.encode(b"\0" * 64, width, 1) is None


# -- round trips ----------------------------------------------------------------------------------------

FLOATS = [
    (torch.bfloat16, 2),
    (torch.float16, 2),
    (torch.float32, 4),
    (torch.float64, 8),
    (torch.float8_e4m3fn, 1),
    (torch.float8_e5m2, 1),
]


@pytest.mark.parametrize("dtype,width", FLOATS, ids=[str(d) for d, _ in FLOATS])
@pytest.mark.parametrize("n", [1, 3, 1000, 70_001, 300_000])
def test_roundtrip_normal_weights(dtype, width, n):
    g = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=g) * 0.02).to(dtype)
    roundtrip(tensor_bytes(t), width)


def test_bf16_weights_compress_exponent_plane_only():
    g = torch.Generator().manual_seed(0)
    raw = tensor_bytes((torch.randn(1 << 20, generator=g) * 0.02).to(torch.bfloat16))
    payload = roundtrip(raw, 2)
    table = plane_table(payload)
    assert table[0] == (bytegroup.CODEC_RAW, 1 << 20)  # sign + mantissa: incompressible
    assert table[1][0] == EXPONENT_CODEC  # exponent
    assert len(payload) < 0.75 * len(raw)  # a sanity bound; the benchmark measures the real ratio
    assert bytes(payload)[4] == bytegroup.TRANSFORM_ROTL1


def test_fp32_from_bf16_low_planes_collapse():
    g = torch.Generator().manual_seed(1)
    t = torch.randn(1 << 18, generator=g).to(torch.bfloat16).to(torch.float32)
    payload = roundtrip(tensor_bytes(t), 4)
    table = plane_table(payload)
    # the low 16 bits are zero; rotating would move the sign bit into plane 0, so the sample picks
    # no transform and both low planes collapse
    assert bytes(payload)[4] == bytegroup.TRANSFORM_NONE
    assert all(c == bytegroup.CODEC_ZSTD and n < 1000 for c, n in table[:2])
    assert len(payload) < 0.36 * t.numel() * 4


@pytest.mark.parametrize("dtype,width", [(torch.bfloat16, 2), (torch.float16, 2)])
def test_every_16_bit_pattern(dtype, width):
    """All 65536 patterns (NaNs with every payload, ±Inf, ±0, denormals), in order and shuffled."""
    pats = np.arange(1 << 16, dtype="<u2")
    roundtrip(pats.tobytes(), width)
    rng = np.random.default_rng(0)
    roundtrip(rng.permutation(np.tile(pats, 3)).tobytes(), width)
    # and as floats, NaN payloads survive a tensor round trip bit-exactly
    t = torch.from_numpy(pats.view(np.int16).copy()).view(dtype)
    back = torch.frombuffer(bytearray(decode(bytegroup.encode(tensor_bytes(t), 2, 1), "2", t.numel() * 2)), dtype=dtype)
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))


@pytest.mark.parametrize("width,dt", [(4, "<u4"), (8, "<u8")])
def test_special_values_wide(width, dt):
    rng = np.random.default_rng(width)
    fl = np.float32 if width == 4 else np.float64
    specials = np.array(
        [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, np.finfo(fl).tiny / 4, -np.finfo(fl).tiny / 3,
         np.finfo(fl).max, np.finfo(fl).min, np.finfo(fl).smallest_subnormal],
        dtype=fl,
    ).view(dt)
    exp_all_ones = np.array(0x7F800000 if width == 4 else 0x7FF0000000000000, dtype=dt)
    nan_payloads = (rng.integers(1, 1 << 20, 5000).astype(dt) | exp_all_ones) ^ (
        rng.integers(0, 2, 5000).astype(dt) << np.array(8 * width - 1, dtype=dt)
    )
    raw = np.concatenate([np.tile(specials, 500), nan_payloads, rng.integers(0, 2**63, 4000).astype(dt)])
    roundtrip(rng.permutation(raw).tobytes(), width)


@pytest.mark.parametrize("width", bytegroup.WIDTHS)
@pytest.mark.parametrize("n", [0, 1, 2, 7, 63, 64, 65, 4096, 200_000])
def test_all_zeros_and_tiny(width, n):
    raw = bytes(n * width)
    payload = roundtrip(raw, width)
    if n >= 4096:
        assert len(payload) < 0.01 * len(raw) + 200
    raw = bytes([0x5A]) * (n * width)
    roundtrip(raw, width)


@pytest.mark.parametrize("width", bytegroup.WIDTHS)
def test_transform_none_payloads_decode(width):
    """Layout v1 allows transform 0 for every width; the decoder must read it."""
    g = torch.Generator().manual_seed(7)
    raw = tensor_bytes(torch.randn(100_003 * width, generator=g).to(torch.bfloat16))[: 100_003 * width]
    payload = bytegroup._encode(raw, width, bytegroup.TRANSFORM_NONE)
    assert bytes(payload)[4] == 0
    assert bytes(decode(payload, str(width), len(raw))) == raw


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_input_buffer_types(kind):
    raw = tensor_bytes(torch.randn(5000).to(torch.bfloat16))
    payload = bytegroup.encode(kind(raw), 2, 1)
    assert bytes(decode(kind(bytes(payload)), "2", len(raw))) == raw


def test_unaligned_input():
    raw = tensor_bytes(torch.randn(5001).to(torch.float32))
    buf = bytearray(1) + bytearray(raw)
    payload = bytegroup.encode(memoryview(buf)[1:], 4, 1)
    assert bytes(decode(memoryview(bytes(payload) + b"x")[:-1], "4", len(raw))) == raw


def test_output_is_immutable_bytes_like():
    raw = tensor_bytes(torch.randn(5000).to(torch.bfloat16))
    payload = bytegroup.encode(raw, 2, 1)
    out = decode(payload, "2", len(raw))
    for x in (payload, out):
        assert memoryview(x).readonly and memoryview(x).format == "B" and memoryview(x).contiguous
    assert b"".join([out, out]) == raw + raw


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.sampled_from(bytegroup.WIDTHS), data=st.binary(max_size=3000), transform=st.sampled_from([0, 1]))
def test_property_random_bytes(width, data, transform):
    data = data[: len(data) - len(data) % width]
    if transform == 1 and width == 1:
        transform = 0
    payload = bytegroup._encode(data, width, transform)
    assert bytes(decode(payload, str(width), len(data))) == data


@settings(max_examples=60, deadline=None)
@given(
    width=st.sampled_from([2, 4]),
    values=st.lists(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF, 0x3F, 0xC0]), min_size=1, max_size=64),
    reps=st.integers(1, 3000),
)
def test_property_structured_bytes(width, values, reps):
    """Low-entropy and repetitive data (the compressed-plane path) round-trip too."""
    data = bytes(values) * reps
    data = data[: len(data) - len(data) % width]
    assert bytes(decode(bytegroup.encode(data, width, 1), str(width), len(data))) == data


# -- the one-pass C split/merge (codec/_planes.c) against the numpy reference --------------------------

needs_native = pytest.mark.skipif(not bytegroup.NATIVE, reason="ckptstore.codec._planes not built (no C compiler at install)")


def test_native_kernels_are_built_where_required():
    """CI sets CKPTSTORE_REQUIRE_NATIVE=1: an install that silently fell back to numpy fails there."""
    if os.environ.get("CKPTSTORE_REQUIRE_NATIVE") != "1":
        pytest.skip("CKPTSTORE_REQUIRE_NATIVE is not set")
    assert bytegroup.NATIVE, "the C split/merge did not build: is a C compiler installed?"
    assert bytegroup.HUFF, "the C Huffman coder did not build: is a C compiler installed?"


@needs_native
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.sampled_from(bytegroup.WIDTHS), data=st.binary(max_size=4000), transform=st.sampled_from([0, 1]), skew=st.integers(0, 7))
def test_native_split_and_merge_equal_numpy(width, data, transform, skew):
    """Same planes from the same elements, and the same elements back, on unaligned buffers too."""
    data = data[: len(data) - len(data) % width]
    n = len(data) // width
    buf = np.zeros(len(data) + skew, dtype=np.uint8)[skew:]  # unaligned for skew % width != 0
    buf[:] = np.frombuffer(data, dtype=np.uint8)
    x = buf.view(bytegroup._UINT[width])
    ref = bytegroup._split_numpy(x, width, transform, np.empty((width, n), dtype=np.uint8))
    got = bytegroup._split(x, width, transform)
    assert got.tobytes() == ref.tobytes()
    planes = [np.frombuffer(ref[k].tobytes(), dtype=np.uint8) for k in range(width)]  # read-only planes
    out = np.full(len(data) + skew, 0xA5, dtype=np.uint8)[skew:]
    bytegroup._merge(planes, n, width, transform, out)
    assert out.tobytes() == data
    ref_out = bytegroup._merge_numpy(planes, n, width, transform, np.empty(n, dtype=bytegroup._UINT[width]))
    assert ref_out.tobytes() == data


@needs_native
def test_native_kernels_refuse_bad_arguments():
    native = bytegroup._native
    x = np.arange(16, dtype=np.uint8)
    with pytest.raises(ValueError, match="width"):
        native.split(x, np.empty(16, np.uint8), 3, 0)
    with pytest.raises(ValueError, match="transform"):
        native.split(x, np.empty(16, np.uint8), 2, 2)
    with pytest.raises(ValueError, match="too small"):
        native.split(x, np.empty(15, np.uint8), 2, 0)
    with pytest.raises(ValueError, match="2 planes for width 4"):
        native.merge([x, x], np.empty(16, np.uint8), 4, 0)
    with pytest.raises(ValueError, match="plane 1 has 7 bytes"):
        native.merge([x[:8], x[:7]], np.empty(16, np.uint8), 2, 0)
    with pytest.raises((TypeError, BufferError)):
        native.merge([x[:8], x[:8]], bytes(16), 2, 0)  # out must be writable


def test_numpy_fallback_when_native_is_off(tmp_path):
    """CKPTSTORE_NATIVE=0 (or an install without a compiler) decodes what the C kernels encoded,
    Huffman-coded exponent plane included."""
    raw = tensor_bytes(torch.randn(70_001, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16))
    payload = bytegroup.encode(raw, 2, 1)
    assert plane_table(payload)[1][0] == EXPONENT_CODEC
    (tmp_path / "p").write_bytes(bytes(payload))
    code = (
        "import sys; from ckptstore.codec import bytegroup, stages; assert not bytegroup.NATIVE; "
        "p = open(sys.argv[1], 'rb').read(); raw = stages.decode_stage(bytegroup.descriptor_of(p), '2', p, int(sys.argv[2])); "
        "sys.stdout.buffer.write(bytes(raw))"
    )
    env = dict(os.environ, CKPTSTORE_NATIVE="0")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "p"), str(len(raw))], env=env, capture_output=True, check=True)
    assert r.stdout == raw


def test_threads_encode_and_decode_concurrently():
    g = torch.Generator().manual_seed(3)
    raws = [tensor_bytes((torch.randn(200_000, generator=g) * s).to(torch.bfloat16)) for s in (0.01, 1, 100, 1e-30)]
    expected = [bytes(bytegroup.encode(r, 2, 1)) for r in raws]
    errors = []

    def work(i):
        try:
            for _ in range(5):
                for r, e in zip(raws, expected):
                    p = bytegroup.encode(r, 2, 1)
                    assert bytes(p) == e
                    assert bytes(decode(p, "2", len(r))) == r
        except BaseException as ex:  # noqa: BLE001
            errors.append(ex)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


# -- hostile payloads ---------------------------------------------------------------------------------


def _sample_payload(n=50_000, width=2):
    g = torch.Generator().manual_seed(11)
    dtype = {2: torch.bfloat16, 4: torch.float32}[width]
    raw = tensor_bytes((torch.randn(n, generator=g) * 0.02).to(dtype))
    payload = bytes(bytegroup.encode(raw, width, 1))
    assert [c for c, _ in plane_table(payload)].count(bytegroup.CODEC_ZSTD) >= 1
    return raw, payload


def expect_integrity(payload, param, raw_len):
    with pytest.raises(IntegrityError):
        decode(payload, param, raw_len)


def only_integrity_or_right_length(payload, param, raw_len):
    try:
        out = decode(payload, param, raw_len)
    except IntegrityError:
        return None
    assert len(out) == raw_len
    return out


def test_truncated_payloads():
    raw, payload = _sample_payload(5000)
    for cut in list(range(0, 80)) + list(range(80, len(payload), 97)) + [len(payload) - 1]:
        expect_integrity(payload[:cut], "2", len(raw))


def test_trailing_bytes():
    raw, payload = _sample_payload()
    expect_integrity(payload + b"\0", "2", len(raw))


@pytest.mark.parametrize("param", ["", "3", "02", "2 ", "x", "16", "-2", "0"])
def test_bad_param(param):
    raw, payload = _sample_payload()
    expect_integrity(payload, param, len(raw))


def test_param_width_mismatch():
    raw, payload = _sample_payload()
    expect_integrity(payload, "4", len(raw))
    expect_integrity(payload, "1", len(raw))


@pytest.mark.parametrize("delta", [-2, -1, 1, 2, 1 << 40])
def test_wrong_raw_len(delta):
    raw, payload = _sample_payload()
    expect_integrity(payload, "2", len(raw) + delta)


def test_raw_len_beyond_limit():
    expect_integrity(b"BG\x01\x02\x01\0\0\0" + struct.pack("<Q", 1 << 40), "2", 1 << 41)


def _patch(payload: bytes, off: int, fmt: str, value) -> bytes:
    b = bytearray(payload)
    struct.pack_into(fmt, b, off, value)
    return bytes(b)


@pytest.mark.parametrize(
    "off,fmt,value",
    [
        (0, "<2s", b"GB"),  # magic
        (2, "<B", 0),  # layout version
        (2, "<B", 2),
        (3, "<B", 4),  # width
        (4, "<B", 2),  # transform
        (4, "<B", 255),
        (5, "<B", 1),  # reserved
        (7, "<B", 0x80),
        (8, "<Q", 0),  # count
        (8, "<Q", 25_001),
        (8, "<Q", 1 << 62),
        (8, "<Q", (1 << 64) - 1),
        (HEAD, "<B", 2),  # plane 0 codec
        (HEAD, "<B", 1),  # plane 0 claims zstd but holds raw bytes
        (HEAD + 1, "<Q", 49_999),  # plane 0 stored_len
        (HEAD + 1, "<Q", 1 << 63),
        (HEAD + PLANE, "<B", 0),  # plane 1 (zstd) claims raw
        (HEAD + PLANE + 1, "<Q", 0),
        (HEAD + PLANE + 1, "<Q", 1),
        (HEAD + PLANE + 1, "<Q", (1 << 64) - 1),
    ],
)
def test_bad_header_fields(off, fmt, value):
    raw, payload = _sample_payload()
    assert plane_table(payload)[0][0] == bytegroup.CODEC_RAW and plane_table(payload)[1][0] == bytegroup.CODEC_ZSTD
    with pytest.raises(IntegrityError):  # under the descriptor the writer recorded
        stages.decode_stage(bytegroup.DESCRIPTOR, "2", _patch(payload, off, fmt, value), len(raw))


def test_every_header_bit_flip():
    """Flipping any bit of the header or plane table gives IntegrityError or, at worst, output of
    the right length (the frame checksum above this layer catches the rest); never another error."""
    raw, payload = _sample_payload(5000)
    for i in range(HEAD + 2 * PLANE):
        for bit in range(8):
            b = bytearray(payload)
            b[i] ^= 1 << bit
            only_integrity_or_right_length(bytes(b), "2", len(raw))


def test_transform_flip_is_detected_only_by_content():
    raw, payload = _sample_payload()
    out = only_integrity_or_right_length(_patch(payload, 4, "<B", 0), "2", len(raw))
    assert out is not None and bytes(out) != raw  # structurally valid; the frame checksum guards it


def _zstd_plane_bounds(payload):
    table = plane_table(payload)
    w = len(table)
    off = HEAD + PLANE * w
    for k, (codec, stored) in enumerate(table):
        if codec == bytegroup.CODEC_ZSTD:
            return k, off, stored
        off += stored
    raise AssertionError("no zstd plane")


def test_zstd_plane_declaring_huge_content_size_is_refused_before_allocating(monkeypatch):
    monkeypatch.setattr(bytegroup, "_huff", None)  # a writer without the C Huffman coder: zstd planes
    raw, payload = _sample_payload(200_000)
    k, off, stored = _zstd_plane_bounds(payload)
    plane = payload[off : off + stored]
    params = zstandard.get_frame_parameters(plane)
    assert params.content_size == 200_000
    fhd = plane[4]
    fcs_flag = fhd >> 6
    single = (fhd >> 5) & 1
    assert fcs_flag in (2, 3)
    fcs_off = 5 + (0 if single else 1) + [0, 1, 2, 4][fhd & 3]
    b = bytearray(payload)
    if fcs_flag == 2:
        struct.pack_into("<I", b, off + fcs_off, 0xFFFFFFF0)
    else:
        struct.pack_into("<Q", b, off + fcs_off, 1 << 62)
    tracemalloc.start()
    try:
        expect_integrity(bytes(b), "2", len(raw))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(raw) + (1 << 20)


def test_zstd_plane_garbage_and_wrong_frames(monkeypatch):
    monkeypatch.setattr(bytegroup, "_huff", None)  # a writer without the C Huffman coder: zstd planes
    raw, payload = _sample_payload(100_000)
    k, off, stored = _zstd_plane_bounds(payload)
    count = len(raw) // 2
    rng = np.random.default_rng(5)

    def with_plane(new: bytes) -> bytes:
        b = bytearray(payload[:off] + new + payload[off + stored :])
        struct.pack_into("<Q", b, HEAD + PLANE * k + 1, len(new))
        return bytes(b)

    # well-formed table, plane replaced by: random bytes, a frame of the wrong size, a frame without
    # content size, two frames, a truncated frame, a frame with a corrupted block
    cases = [
        rng.integers(0, 256, stored, dtype=np.uint8).tobytes(),
        zstandard.ZstdCompressor().compress(bytes(count - 1)),
        zstandard.ZstdCompressor().compress(bytes(count + 1)),
        zstandard.ZstdCompressor(write_content_size=False).compress(bytes(count)),
        zstandard.ZstdCompressor().compress(bytes(count // 2)) * 2,
        payload[off : off + stored - 7],
        b"\x28\xb5\x2f\xfd",
        b"\x50\x2a\x4d\x18" + struct.pack("<I", 4) + b"abcd",  # a skippable frame
    ]
    corrupt = bytearray(payload[off : off + stored])
    for i in range(20, len(corrupt), max(1, len(corrupt) // 50)):
        corrupt[i] ^= 0xFF
    cases.append(bytes(corrupt))
    for new in cases:
        expect_integrity(with_plane(new), "2", len(raw))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_property_mutated_payloads(data):
    """Random mutations anywhere: IntegrityError or right-length output, nothing else."""
    raw, payload = _CACHED
    only_integrity_or_right_length(mutated(data.draw, payload, (1, 6)), "2", len(raw))


_CACHED = _sample_payload(3000)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.sampled_from(["1", "2", "4", "8"]), st.integers(0, 4000))
def test_property_arbitrary_input(blob, param, raw_len):
    only_integrity_or_right_length(blob, param, raw_len)
    only_integrity_or_right_length(b"BG\x01" + bytes([int(param)]) + blob, param, raw_len)


# -- through the frame codec --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,width", [(torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4)])
@pytest.mark.parametrize("encrypted", [False, True])
def test_frame_roundtrip(dtype, width, encrypted):
    from ckptstore.codec.crypto import FrameCipher

    cipher = FrameCipher(bytes(range(32))) if encrypted else None
    codec = FrameCodec("v1", "a1", cipher)
    g = torch.Generator().manual_seed(2)
    raw = tensor_bytes((torch.randn(100_000, generator=g) * 0.02).to(dtype))
    head, payload, h = codec.encode("obj", 3, memoryview(raw), float_width=width)
    hd = parse_header(head, "obj")
    layout = 2 if bytegroup.HUFF else 1  # 100,000 elements: an exponent plane past HUFF_MIN
    expected_chain = f"bytegroup/{layout}:{width}" + ("|aesgcm/1" if encrypted else "")
    assert hd.chain == expected_chain
    assert hd.raw_len == len(raw) and hd.stored_len == len(payload) < 0.97 * len(raw)
    frame = bytes(head) + bytes(payload)
    assert bytes(codec.decode("obj", frame, None)) == raw
    # a flipped payload byte is caught by the frame checksum
    bad = bytearray(frame)
    bad[len(head) + len(payload) // 2] ^= 1
    with pytest.raises(IntegrityError):
        codec.decode("obj", bytes(bad), None)


def test_frame_incompressible_floats_stay_raw():
    codec = FrameCodec("v1", "a1", None)
    raw = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
    head, payload, _ = codec.encode("obj", 0, memoryview(raw), float_width=2)
    assert parse_header(head, "obj").chain == ""
    assert bytes(codec.decode("obj", bytes(head) + bytes(payload), None)) == raw


def test_frame_with_hostile_bytegroup_payload_raises_integrity_error():
    """A payload that passes the frame checksum (a buggy or malicious writer) but is malformed."""
    from ckptstore.codec.frame import build_header

    codec = FrameCodec("v1", "a1", None)
    raw, payload = _sample_payload()
    bad = _patch(payload, HEAD + PLANE + 1, "<Q", 3)
    head, _ = build_header(0, len(raw), bad, "bytegroup/1:2")
    with pytest.raises(IntegrityError):
        codec.decode("obj", head + bad, None)


@pytest.mark.parametrize("encrypted", [False, True])
def test_tensor_plan_is_shared_but_each_frame_still_compresses_what_pays(encrypted):
    """One plan per tensor (PlanCell): the first frame (noisy bf16) plans the mantissa plane raw;
    a later all-zero frame of the same tensor must still come out tiny, and every frame decodes
    bit-exactly (the plan changes nothing a reader sees)."""
    from ckptstore.codec.crypto import FrameCipher

    codec = FrameCodec("v1", "a1", FrameCipher(bytes(range(32))) if encrypted else None)
    g = torch.Generator().manual_seed(5)
    frame = 1 << 20  # elements per frame (2 MiB of bf16)
    t = (torch.randn(3 * frame, generator=g) * 0.02).to(torch.bfloat16)
    t[frame : 2 * frame] = 0  # the middle frame is all zeros
    raw = tensor_bytes(t)
    cell = bytegroup.PlanCell()
    stored = []
    for i in range(3):
        chunk = memoryview(raw)[i * 2 * frame : (i + 1) * 2 * frame]
        head, payload, _ = codec.encode("obj", i, chunk, 2, cell)
        stored.append(len(payload))
        assert bytes(codec.decode("obj", bytes(head) + bytes(payload), None)) == bytes(chunk)
    assert cell.plan is not None and cell.plan.zstd == (False, True)  # decided by frame 0: mantissa raw
    assert stored[1] < 0.01 * 2 * frame  # zeros: both planes compressed despite the plan
    assert 0.6 * 2 * frame < stored[0] < 0.7 * 2 * frame and 0.6 * 2 * frame < stored[2] < 0.7 * 2 * frame
