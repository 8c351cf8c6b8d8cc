"""Helpers shared by tests/test_gc.py and tests/test_scrub.py: real DCP saves, crashing saves in a
child process, the CLI through click's runner, and a file listing of a root.

Crashes are real: a child process arms ``CKPTSTORE_FAULT`` and SIGKILLs itself at a named point of
the save; gc uses an explicit ``now`` (``--now``) or ``grace=0`` instead of sleeping.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys

import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

import ckptstore
from ckptstore.cli import main as cli_main
from ckptstore.manifest import layout

HERE = os.path.dirname(os.path.abspath(__file__))
UTC = dt.timezone.utc

# -- helpers ------------------------------------------------------------------------------------------------
def state(seed: int, n: int = 8192) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.randint(0, 1 << 30, (257,), generator=g), "meta": {"seed": seed}}


def empty_state(n: int = 8192) -> dict:
    return {"w": torch.zeros(n), "b": torch.zeros(257, dtype=torch.int64), "meta": {"seed": -1}}


def same(a: dict, b: dict) -> bool:
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            if v.dtype != b[k].dtype or not torch.equal(v.view(torch.uint8) if v.dtype.is_floating_point else v,
                                                         b[k].view(torch.uint8) if v.dtype.is_floating_point else b[k]):
                return False
        elif v != b[k]:
            return False
    return True


def save(root, version, seed, *, asynchronous=False, **kw) -> ckptstore.StorageWriter:
    w = ckptstore.StorageWriter(root, step=kw.pop("step", seed), frame_size=kw.pop("frame_size", 4096), **kw)
    if asynchronous:
        dcp.async_save(state(seed), checkpoint_id=version, storage_writer=w).result()
    else:
        dcp.save(state(seed), checkpoint_id=version, storage_writer=w)
    return w


def load(root, version=None, *, remote=None, key=None, n=8192) -> dict:
    sd = empty_state(n)
    dcp.load(sd, storage_reader=ckptstore.StorageReader(root, remote=remote, key=key, version=version))
    return sd


CHILD = r"""
import sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, sys.argv[1])
import torch.distributed.checkpoint as dcp
import ckptstore
from store_helpers import state
root, version, seed = sys.argv[2], sys.argv[3], int(sys.argv[4])
w = ckptstore.StorageWriter(root, step=seed, frame_size=4096)
dcp.async_save(state(seed), checkpoint_id=version, storage_writer=w).result()
"""


def crashing_save(root, version, seed, fault: str) -> int:
    env = {**os.environ, "CKPTSTORE_FAULT": fault}
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "-c", CHILD, HERE, str(root), version, str(seed)], env=env, timeout=180,
                          capture_output=True).returncode


def cli(*args, env=None):
    r = CliRunner().invoke(cli_main, [str(a) for a in args], env=env, catch_exceptions=False)
    return r


def cli_json(*args, env=None):
    r = cli(*args, "--json", env=env)
    return r.exit_code, json.loads(r.stdout)


def files_under(root, prefix="") -> dict[str, int]:
    out = {}
    for d, _dn, fns in os.walk(root):
        for f in fns:
            rel = os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
            if rel.startswith(prefix):
                out[rel] = os.path.getsize(os.path.join(d, f))
    return out


def later(hours: float) -> str:
    return (dt.datetime.now(UTC) + dt.timedelta(hours=hours)).isoformat()


def obj_path(root, version, name) -> str:
    return os.path.join(root, *layout.object_key(version, name).split("/"))



# -- versions split over two node-local roots (docs/FORMAT.md "Placement") ---------------------------
def split_rank_state(rank: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return {f"r{rank}": torch.randn(8192, generator=g), "shared": torch.arange(seed, seed + 50)}


def _split_save_body(rank, world, root, versions, remote):
    import ckptstore as _c

    for i, v in enumerate(versions):
        w = _c.StorageWriter(root, remote=remote, step=i, frame_size=4096)
        dcp.save(split_rank_state(rank, i), checkpoint_id=v, storage_writer=w)
        w.close()
    return True


def split_version(root_a, root_b, version: str, *, move_ranks=(1,)) -> None:
    """Turn ``version``, saved whole into ``root_a`` by ranks 0 and 1, into a version split over
    two roots as a two-node save leaves it: ``move_ranks``' shard objects moved to ``root_b`` (same
    relative path), the metadata object copied, and the manifest re-sealed with placement
    ``[[0], [1]]`` (unencrypted store) and written into both roots."""
    import dataclasses as _dc
    import shutil as _sh

    from ckptstore.manifest.schema import parse

    mkey = layout.manifest_key(version)
    pa = os.path.join(str(root_a), *mkey.split("/"))
    with open(pa, "rb") as f:
        m = parse(f.read(), expect_version=version).manifest
    moved = [o for o in m.objects if o.rank in set(move_ranks)]
    for o in [m.metadata_object, *moved]:
        src, dst = obj_path(root_a, version, o.name), obj_path(root_b, version, o.name)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        (_sh.move if o in moved else _sh.copy2)(src, dst)
    data = _dc.replace(m, placement=[[0], [1]]).to_bytes(None)
    for root in (root_a, root_b):
        p = os.path.join(str(root), *mkey.split("/"))
        os.makedirs(os.path.dirname(p), exist_ok=True)
        tmp = p + ".tmp-split"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, p)


def split_store(base, versions=("v0", "v1", "v2"), *, remote=None) -> tuple[str, str]:
    """Two real gloo ranks save ``versions`` into ``base/a`` (and ``remote``, whole), then each
    version is split: rank 1's part moves to ``base/b``. Returns ``(root_a, root_b)``."""
    from ckptstore.testing.dist import run_ranks

    root_a, root_b = os.path.join(str(base), "a"), os.path.join(str(base), "b")
    run_ranks(_split_save_body, 2, root_a, list(versions), remote, timeout=240)
    os.makedirs(root_b, exist_ok=True)
    for v in versions:
        split_version(root_a, root_b, v)
    return root_a, root_b


def load_split(roots, version=None, *, remote=None) -> dict:
    """Load ``version`` of the two-rank split state in this process from ``roots`` (one of them; a
    rank's shard not there is read from ``remote`` when given)."""
    sd = {k: torch.zeros_like(v) for k, v in {**split_rank_state(0, 0), **split_rank_state(1, 0)}.items()}
    dcp.load(sd, storage_reader=ckptstore.StorageReader(roots, remote=remote, version=version))
    return sd
