"""Per-rank body of the two-node ``torchrun`` tests (tests/test_multinode.py).

Run by ``python -m torch.distributed.run ... tests/multinode_ranks.py PHASE [options]`` on every
rank. The rank's local root comes from the environment (``CKPT_ROOT``): every rank of one node agent
gets the same directory, the agents of different "nodes" get different ones (node-local NVMe
simulated on one host). Each rank writes one JSON result, ``<--out>/<PHASE>-rank<R>.json``, and
exits 0 once the phase ran, also when the phase's ckptstore call raised: the test process decides
what was expected. A harness failure (bad arguments, an exception outside the phase) exits 1.

Phases:

``save``    ``dcp.save`` of :func:`state` for each name in ``--versions`` through one
            ``ckptstore.StorageWriter(root, remote=, retention=, durability=)``, then ``close()``.
``load``    ``dcp.load`` through ``ckptstore.StorageReader(root, remote=)`` with no version (the
            newest version every rank can load), into a blank state of this world size (a
            resharded load when it differs from ``--save-world``); compares bytes with what was
            saved and reports ``reader.stats``.
``resave``  for each durability: a fresh root ``<CKPT_ROOT>/<durability>`` and the
            same ``--remote``; saving ``--versions`` (names that exist remotely) must raise, then
            the name must load from that root with the original data (``--expect-salt``).

The saved data is a pure function of (salt, version name, rank), so a loader recomputes it:

* ``dt``          float32 (12, 8) DTensor sharded on dim 0 over all ranks (12 rows: 2, 3, 4 ranks);
* ``own.r<R>``    float32 (257,) saved by rank R only (per-rank key; its object lives on R's node);
* ``shared``      int64 (33,), the same on every rank (DCP saves one copy, on one rank's object);
* ``meta``        non-tensor: ``{"version": name, "salt": salt}`` (tells which version was loaded).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
import traceback
import zlib

ROWS, COLS, OWN = 12, 8, 257


def _seed(salt: str, version: str, what: str) -> int:
    return zlib.crc32(f"{salt}/{version}/{what}".encode())


def full_dt(salt: str, version: str):
    import torch

    g = torch.Generator().manual_seed(_seed(salt, version, "dt"))
    return torch.randn(ROWS, COLS, generator=g)


def own(salt: str, version: str, rank: int):
    import torch

    g = torch.Generator().manual_seed(_seed(salt, version, f"own{rank}"))
    return torch.randn(OWN, generator=g)


def shared(salt: str, version: str):
    import torch

    g = torch.Generator().manual_seed(_seed(salt, version, "shared"))
    return torch.randint(-(2**40), 2**40, (33,), generator=g, dtype=torch.int64)


def own_keys(rank: int, world: int, save_world: int) -> list[int]:
    """Saved ranks whose ``own.r<i>`` this rank loads: ``i % world == rank`` (every key, once)."""
    return [i for i in range(save_world) if i % world == rank]


def state(salt: str, version: str, rank: int, world: int, save_world: int, *, blank: bool = False) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    fill = torch.zeros_like if blank else (lambda t: t)
    mesh = init_device_mesh("cpu", (world,))
    sd = {"dt": distribute_tensor(fill(full_dt(salt, version)), mesh, [Shard(0)])}
    for i in own_keys(rank, world, save_world) if blank else [rank]:
        sd[f"own.r{i}"] = fill(own(salt, version, i))
    sd["shared"] = fill(shared(salt, version))
    sd["meta"] = {"version": None, "salt": None} if blank else {"version": version, "salt": salt}
    return sd


def compare(sd: dict, salt: str, version: str, rank: int, world: int, save_world: int) -> list[str]:
    """Names of the entries of a loaded ``sd`` whose bytes differ from what (salt, version) saved."""
    import torch

    bad = []
    exp = state(salt, version, rank, world, save_world, blank=False)
    # the blank state has other per-rank keys than a saving rank: compare each loaded key
    for i in own_keys(rank, world, save_world):
        exp[f"own.r{i}"] = own(salt, version, i)
    for k, v in sd.items():
        e = exp.get(k)
        if k == "meta":
            if v != {"version": version, "salt": salt}:
                bad.append(f"meta={v!r}")
            continue
        a = v.to_local() if hasattr(v, "to_local") else v
        b = e.to_local() if hasattr(e, "to_local") else e
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
            bad.append(k)
    return bad


def describe(exc: BaseException) -> list[dict]:
    """Per failing rank: the exception types along the cause chain and the message.

    A DCP ``CheckpointException`` carries one wrapped exception per failing rank; anything else is
    reported as this rank's own.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        items = [(r, e) for r, (e, _tb) in sorted(exc.failures.items())]
    else:
        items = [(None, exc)]
    out = []
    for r, e in items:
        types, msgs, seen = [], [], set()
        cur: BaseException | None = e
        while cur is not None and id(cur) not in seen:
            seen.add(id(cur))
            types.append(type(cur).__name__)
            msgs.append(str(cur)[:600])
            cur = cur.__cause__ or cur.__context__
        out.append({"rank": r, "types": types, "message": " <- ".join(msgs)})
    return out


def _writer(root: str, a, durability: str):
    import ckptstore
    from ckptstore.retention import KeepLast, RetentionPolicy

    per_tier = {"local": [KeepLast(a.keep_local)]}
    if a.remote:
        per_tier["remote"] = [KeepLast(a.keep_remote)]
    return ckptstore.StorageWriter(
        root, remote=a.remote or None, durability=durability, retention=RetentionPolicy(per_tier=per_tier),
        frame_size=4096,
    )


def phase_save(a, rank, world, root, res):
    import torch.distributed.checkpoint as dcp

    w = _writer(root, a, a.durability)
    res["saved"] = []
    try:
        for i, v in enumerate(a.versions):
            t0 = time.monotonic()
            dcp.save(state(a.salt, v, rank, world, world), storage_writer=w, checkpoint_id=v)
            res["saved"].append({"version": v, "seconds": round(time.monotonic() - t0, 3)})
    finally:
        t0 = time.monotonic()
        try:
            w.close()
            res["close"] = {"ok": True, "seconds": round(time.monotonic() - t0, 3)}
        except BaseException as e:  # noqa: BLE001 - reported, the test decides
            res["close"] = {"ok": False, "errors": describe(e)}


def _load(a, rank, world, root, res, salt, expect=None):
    import torch.distributed.checkpoint as dcp

    import ckptstore

    reader = ckptstore.StorageReader(root, remote=a.remote or None, version=getattr(a, "version", None) or None)
    sd = state(salt, "?", rank, world, a.save_world, blank=True)
    t0 = time.monotonic()
    dcp.load(sd, storage_reader=reader)
    res["load_seconds"] = round(time.monotonic() - t0, 3)
    res["stats"] = dict(reader.stats)
    res["remote_reads"] = reader.stats.get("remote_reads")
    res["remote_keys"] = sorted(getattr(reader, "remote_keys", ()))
    res["reader_version"] = reader.checkpoint_id
    got = sd["meta"]["version"]
    res["loaded"] = got
    v = expect or got
    res["mismatches"] = compare(sd, salt, v, rank, world, a.save_world) if v else ["meta"]
    res["bytes_equal"] = not res["mismatches"]


def phase_load(a, rank, world, root, res):
    _load(a, rank, world, root, res, a.salt, a.expect)


def phase_resave(a, rank, world, root, res):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    res["resave"] = {}
    for durability in ("local", "remote"):
        r = res["resave"][durability] = {}
        fresh = os.path.join(root, durability)
        w = _writer(fresh, a, durability)
        for v in a.versions:
            try:
                dcp.save(state(a.salt, v, rank, world, world), storage_writer=w, checkpoint_id=v)
                r["save"] = {"ok": True}
            except BaseException as e:  # noqa: BLE001
                r["save"] = {"ok": False, "errors": describe(e)}
        try:
            w.close()
            r["close"] = {"ok": True}
        except BaseException as e:  # noqa: BLE001
            r["close"] = {"ok": False, "errors": describe(e)}
        dist.barrier()
        try:
            _load(a, rank, world, fresh, r, a.expect_salt, a.versions[-1])
        except BaseException as e:  # noqa: BLE001
            r["load_error"] = describe(e)
        dist.barrier()


PHASES = {"save": phase_save, "load": phase_load, "resave": phase_resave}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=sorted(PHASES))
    ap.add_argument("--out", required=True, help="directory for the per-rank JSON results")
    ap.add_argument("--remote", default="", help="s3://bucket/prefix, or empty for local only")
    ap.add_argument("--versions", default="v0,v1,v2,v3,v4", help="comma-separated version names to save")
    ap.add_argument("--salt", default="a", help="data salt of the saved (or expected) data")
    ap.add_argument("--expect-salt", default="a", help="resave: salt of the data the name must still hold")
    ap.add_argument("--expect", default="", help="load: version that must be loaded (default: whatever meta says)")
    ap.add_argument("--version", default="", help="load: StorageReader(version=...) (default: the newest)")
    ap.add_argument("--save-world", type=int, default=0, help="load: world size of the save (default: this one)")
    ap.add_argument("--durability", default="local", choices=("local", "remote"))
    ap.add_argument("--keep-local", type=int, default=2)
    ap.add_argument("--keep-remote", type=int, default=4)
    ap.add_argument("--pg-timeout", type=float, default=120.0, help="seconds for gloo collectives")
    a = ap.parse_args(argv)
    a.versions = [v for v in a.versions.split(",") if v]
    a.expect = a.expect or None

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    a.save_world = a.save_world or world
    root = os.environ["CKPT_ROOT"]
    res: dict = {
        "phase": a.phase, "rank": rank, "world": world, "node": int(os.environ.get("GROUP_RANK", "-1")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "-1")), "root": root, "pid": os.getpid(), "ok": True,
    }
    out = os.path.join(a.out, f"{a.phase}-rank{rank}.json")
    t0 = time.monotonic()
    dist.init_process_group("gloo", timeout=_dt.timedelta(seconds=a.pg_timeout))
    try:
        PHASES[a.phase](a, rank, world, root, res)
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        res["ok"] = False
        res["errors"] = describe(e)
        res["traceback"] = traceback.format_exc()[-4000:]
        print(f"[rank {rank}] {a.phase} raised:\n{res['traceback']}", file=sys.stderr, flush=True)
    res["seconds"] = round(time.monotonic() - t0, 3)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1, default=str)
    os.replace(tmp, out)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0


if __name__ == "__main__":
    from ckptstore._groups import exit_process

    exit_process(main())  # the result file is written: no interpreter finalisation (pytorch/pytorch #190489)
