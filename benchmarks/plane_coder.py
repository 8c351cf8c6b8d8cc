"""The exponent plane's entropy coder: ckptstore's Huffman coder (plane codec 2, codec/_huff.c)
against zstd as bytegroup sets it up (a literal coder), on the planes a save meets.

    python benchmarks/plane_coder.py [--mib 1] [--reps 20]

Per dataset, one plane of --mib MiB (a 2 MiB bf16 frame's exponent plane is 1 MiB): stored/raw ratio,
encode and decode GB/s of plane on one thread (best of --reps), for Huffman (C), zstd, and the numpy
decoder that readers without the C module use. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from ckptstore.codec import bytegroup, stages


def best(fn, reps: int) -> tuple[float, object]:
    t, r = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        r = fn()
        t = min(t, time.perf_counter() - t0)
    return t, r


def planes(n: int) -> dict[str, np.ndarray]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, dt, width, scale in (("bf16 ~ N(0, 0.02) exponent", torch.bfloat16, 2, 0.02),
                                   ("fp16 ~ N(0, 0.02) exponent", torch.float16, 2, 0.02),
                                   ("fp32 Adam exp_avg_sq-like exponent", torch.float32, 4, 1e-3)):
        x = torch.randn(n, generator=g) * scale
        if "exp_avg_sq" in name:
            x = x * x
        u = x.to(dt).view({2: torch.int16, 4: torch.int32}[width]).numpy().view({2: np.uint16, 4: np.uint32}[width])
        out[name] = np.ascontiguousarray(bytegroup._split(u, width, bytegroup.TRANSFORM_ROTL1)[width - 1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    huff = bytegroup._huff
    if huff is None:
        raise SystemExit("ckptstore.codec._huff is not built (no C compiler at install)")
    n = int(a.mib * (1 << 20))
    cctx = bytegroup._cctx()
    work = np.empty(huff.WORK_BYTES, dtype=np.uint8)
    print(f"{'plane':38} {'coder':8} {'ratio':>7} {'enc GB/s':>9} {'dec GB/s':>9}")
    for name, p in planes(n).items():
        dst = np.empty(huff.bound(n), dtype=np.uint8)
        # a tensor's first frame (its alphabet empty), and with the whole plane's histogram
        tf, _ = best(lambda: huff.encode(p, dst, work, np.zeros(32, np.uint8)), a.reps)
        tw, mw = best(lambda: huff.encode(p, dst, work, np.zeros(32, np.uint8), True), a.reps)
        alphabet = np.zeros(32, dtype=np.uint8)
        te, m = best(lambda: huff.encode(p, dst, work, alphabet), a.reps)
        coded = dst[:m].copy()
        out = np.empty(n, dtype=np.uint8)
        td, _ = best(lambda: huff.decode(coded, out), a.reps)
        assert np.array_equal(out, p)
        tn, got = best(lambda: bytegroup.huff_decode_numpy(coded, n), 2)
        assert np.array_equal(got, p)
        tze, z = best(lambda: cctx.compress(p), a.reps)
        tzd, _ = best(lambda: stages.zstd_decompress_into(z, n, memoryview(out)), a.reps)  # as bytegroup does
        print(f"{name:38} {'huffman':8} {m / n:7.4f} {n / te / 1e9:9.2f} {n / td / 1e9:9.2f}  (a tensor's first frame: "
              f"encode {n / tf / 1e9:.2f} GB/s; whole histogram {mw / n:.4f} at {n / tw / 1e9:.2f} GB/s; "
              f"numpy decode {n / tn / 1e6:.1f} MB/s)")
        print(f"{'':38} {'zstd':8} {len(z) / n:7.4f} {n / tze / 1e9:9.2f} {n / tzd / 1e9:9.2f}")


if __name__ == "__main__":
    main()
