"""Rank bodies and state builders for the crash, race and full-disk tests.

Module-level so that spawned ranks (``ckptstore.testing.dist``) can import them.

A *peer watchdog* makes a whole save job die together, as ``torchrun`` does: every rank writes its
pid to ``SCRATCH/pid.rN`` and, while it is inside the save, a thread polls its peers; when a peer
died (gone or zombie) without having written ``SCRATCH/done.rN``, the rank writes
``SCRATCH/watchdog.rN`` and SIGKILLs itself. So a fault armed on one rank kills the job within
~50 ms instead of leaving the other rank hanging in a collective until a timeout.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore.testing import dist

BIG_ELEMS = (9 << 20) // 4  # 9 MiB of float32 per rank: > the 8 MiB S3 part size, so a multipart upload


# ---- expected state ---------------------------------------------------------------------------
def _gen(seed: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1000 + salt)


def full_tensor(seed: int) -> torch.Tensor:
    return torch.randn(64, 96, generator=_gen(seed, 1))


def rank_tensor(seed: int, rank: int) -> torch.Tensor:
    return torch.randn(3000, generator=_gen(seed, 10 + rank)).to(torch.bfloat16)


def big_tensor(seed: int, rank: int) -> torch.Tensor:
    return torch.randn(BIG_ELEMS, generator=_gen(seed, 100 + rank))


def expected_state(seed: int, world: int = 2, big: bool = False) -> dict:
    """The logical content a ``crash_save``/``local_save`` of ``seed`` on ``world`` ranks stores."""
    sd = {
        "dt": full_tensor(seed),
        "i64": torch.arange(17, dtype=torch.int64) * (seed + 1),
        "meta": {"seed": seed, "name": f"run/ü-{seed}", "tags": ["a", "b"]},
    }
    for r in range(world):
        sd[f"r{r}.x"] = rank_tensor(seed, r)
        if big:
            sd[f"r{r}.big"] = big_tensor(seed, r)
    return sd


def blank_like(sd: dict) -> dict:
    """A destination state dict of the same structure (zeros / placeholders)."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = {"seed": -1, "name": "", "tags": ["", ""]}
    return out


def same_state(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.dtype != y.dtype or x.shape != y.shape:
                return False
            if bytes(x.contiguous().reshape(-1).view(torch.uint8).numpy()) != bytes(
                y.contiguous().reshape(-1).view(torch.uint8).numpy()
            ):
                return False
        elif x != y:
            return False
    return True


def local_save(root, version, seed, *, world=2, big=False, **kw):
    """In-process (no process group) save of the same logical content a ``world``-rank save has."""
    sd = expected_state(seed, world, big)
    w = ckptstore.StorageWriter(root, step=seed, **kw)
    dcp.save(sd, checkpoint_id=version, storage_writer=w)
    w.close()
    return sd


def load_state(root, version, seed, *, world=2, big=False, **kw) -> bool:
    """Load ``version`` in-process and compare bit-exactly with ``expected_state(seed)``."""
    exp = expected_state(seed, world, big)
    tgt = blank_like(exp)
    dcp.load(tgt, checkpoint_id=version, storage_reader=ckptstore.StorageReader(root, **kw))
    return same_state(tgt, exp)


# ---- peer watchdog ----------------------------------------------------------------------------
def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


class Watchdog:
    def __init__(self, scratch: str, rank: int, world: int):
        self.scratch, self.rank, self.world = scratch, rank, world
        os.makedirs(scratch, exist_ok=True)
        with open(os.path.join(scratch, f"pid.r{rank}"), "w") as f:
            f.write(str(os.getpid()))
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        pids: dict[int, int] = {}
        while not self._stop.wait(0.02):
            for r in range(self.world):
                if r == self.rank:
                    continue
                if r not in pids:
                    try:
                        with open(os.path.join(self.scratch, f"pid.r{r}")) as f:
                            pids[r] = int(f.read())
                    except (FileNotFoundError, ValueError):
                        continue
                if _dead(pids[r]) and not os.path.exists(os.path.join(self.scratch, f"done.r{r}")):
                    open(os.path.join(self.scratch, f"watchdog.r{self.rank}"), "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)

    def done(self) -> None:
        open(os.path.join(self.scratch, f"done.r{self.rank}"), "w").close()
        self._stop.set()


# ---- a fast rank runner ------------------------------------------------------------------------
_PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "ckptstore", "ckptstore.cli",
            "ckptstore.testing.dist", "crash_ranks"]


def _start_method() -> str:
    return "spawn" if os.environ.get("CKPTSTORE_SPAWN") == "1" else "forkserver"


class Job(dist.Ranks):
    """:class:`ckptstore.testing.dist.Ranks` forked from a ``forkserver`` that has torch and
    ckptstore imported already (``CKPTSTORE_SPAWN=1``: plain spawn)."""

    def __init__(self, fn, world: int, *args, env: dict | list | None = None):
        super().__init__(fn, world, *args, env=env, start_method=_start_method(), preload=_PRELOAD)

    def wait(self, timeout: float = 60) -> dict[int, int]:
        return super().wait(timeout)


def run_ranks_fast(fn, world: int, *args, env: dict | list | None = None, timeout: float = 60) -> dict[int, int]:
    """``ckptstore.testing.dist.run_ranks_raw`` (killed ranks tolerated, ``{rank: exitcode}``) with
    the ranks forked from the preloaded forkserver (see :class:`Job`)."""
    return Job(fn, world, *args, env=env).wait(timeout)


def _cli_entry(args, env, out):
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from ckptstore.cli import main

    main([str(a) for a in args], prog_name="ckptstore")


def run_cli_fast(args: list, env: dict, out: str, timeout: float = 120) -> tuple[int, str]:
    """Run the ``ckptstore`` CLI in a child process (forked from the preloaded forkserver, or a
    fresh interpreter with ``CKPTSTORE_SPAWN=1``); returns ``(exit code, stdout+stderr)``.
    A child killed by a fault point exits with -9."""
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in ("CKPTSTORE_FAULT", "RANK")}
    if os.environ.get("CKPTSTORE_SPAWN") == "1":
        code = "import sys; from ckptstore.cli import main; sys.exit(main())"
        p = subprocess.run([sys.executable, "-c", code, *map(str, args)], env={**base, **env}, capture_output=True,
                           text=True, timeout=timeout)
        return p.returncode, p.stdout + p.stderr
    p = dist.context("forkserver", _PRELOAD).Process(target=_cli_entry, args=(args, {**base, **env}, out))
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
    with open(out, errors="replace") as f:
        return p.exitcode, f.read()


# ---- rank bodies --------------------------------------------------------------------------------
def _rank_state(rank, world, seed, big):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = expected_state(seed, world, big)
    sd = {
        "dt": distribute_tensor(full["dt"], mesh, [Shard(0)]),
        "i64": full["i64"],
        "meta": full["meta"],
        f"r{rank}.x": full[f"r{rank}.x"],
    }
    if big:
        sd[f"r{rank}.big"] = full[f"r{rank}.big"]
    return sd


def crash_save(rank, world, root, version, seed, opts):
    """One save of ``version`` under the peer watchdog; the fault comes from CKPTSTORE_FAULT.

    ``opts``: ``scratch`` (dir), ``remote``, ``durability``, ``key``, ``big``, ``frame_size``,
    ``compression``, ``start_at`` (time.time() to wait for: lines two jobs up).
    """
    wd = Watchdog(opts["scratch"], rank, world)
    sd = _rank_state(rank, world, seed, opts.get("big", False))
    w = ckptstore.StorageWriter(
        root,
        remote=opts.get("remote"),
        durability=opts.get("durability", "local"),
        key=opts.get("key"),
        step=seed,
        frame_size=opts.get("frame_size", 4096),
        compression=opts.get("compression", "auto"),
        overwrite=opts.get("overwrite", False),
        upload_timeout=30,
    )
    if opts.get("start_at"):
        time.sleep(max(0.0, opts["start_at"] - time.time()))
    try:
        dcp.save(sd, checkpoint_id=version, storage_writer=w)
        w.close()
        out = ("ok", None)
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        out = ("error", _describe(e))
    wd.done()
    return out


def _describe(e: BaseException) -> list:
    """``[(type name, is CkptStoreError, message)]`` of the per-rank errors inside ``e``."""
    from torch.distributed.checkpoint.api import CheckpointException

    errs = [x for x, _tb in e.failures.values()] if isinstance(e, CheckpointException) else [e]
    return [(type(x).__name__, isinstance(x, ckptstore.CkptStoreError), str(x)) for x in errs]


# ---- the post-crash audit ----------------------------------------------------------------------
def _tier_stores(root, remote):
    out = {}
    if root is not None:
        out["local"] = (root, None)
    if remote is not None:
        out["remote"] = (None, remote)
    return out


def match_content(root, remote, version, candidates, key) -> tuple[int | None, str]:
    """Load ``version`` from exactly one tier and return the index of the candidate content
    (``(seed, world, big)``) it equals bit-exactly, or ``(None, why)``."""
    last = "no candidate matched"
    for i, (seed, world, big) in enumerate(candidates):
        try:
            if load_state(root, version, seed, world=world, big=big, remote=remote, key=key, allow_unencrypted=True):
                return i, ""
            last = f"content differs from candidate {i}"
        except BaseException as e:  # noqa: BLE001
            return None, "load failed: " + "; ".join(f"{n}: {m[:300]}" for n, _ok, m in _describe(e))
    return None, last


def garbage(tier) -> list[str]:
    """Objects under ``versions/`` that no committed manifest of ``tier`` references, plus
    incomplete multipart uploads and (local) empty directories below a version directory."""
    from ckptstore.manifest import catalogue, layout

    entries = catalogue.scan(tier)
    ref = {layout.CATALOGUE_HEAD, layout.REMOTE_HEAD_COPY}  # the keyed catalogue head (docs/FORMAT.md): layout, not garbage
    for v, e in entries.items():
        d = layout.version_dir(v) + "/"
        ref |= {d + layout.MANIFEST, d + layout.PINNED, d + layout.DAMAGED}
        ref |= {d + o.name for o in e.manifest.all_objects()}
    left = sorted(i.key for i in tier.list("") if i.key not in ref)
    if tier.supports_multipart:
        left += [f"multipart upload {u.key} ({u.upload_id})" for u in tier.list_multipart_uploads("")]
    left += ["empty dir " + d.key for d in tier.list_empty_dirs(layout.VERSIONS + "/")]
    return left


def audit(root, remote, key, expected: dict, *, run_gc: bool = True, scrub_deep: bool = True) -> tuple[dict, list[str]]:
    """Check the store after a crash. ``expected``: version → list of acceptable contents
    ``(seed, world, big)``. Returns ``(state, violations)`` where ``state[tier][version]`` is the
    index of the content found. Checks, per tier: every listed version is expected and loads
    bit-exactly from that tier alone; a deep scrub is clean; gc past the grace period succeeds and
    leaves no garbage; afterwards every version still loads and scrub is still clean.
    """
    import datetime as dt

    viol: list[str] = []
    state: dict = {}

    def check_loads(phase):
        for tname, (r, rem) in _tier_stores(root, remote).items():
            st = ckptstore.Store(r, remote=rem)
            recs = st.versions()
            state[tname] = {}
            for rec in recs:
                if rec.version not in expected:
                    viol.append(f"{phase}: {tname}: unexpected version {rec.version!r} listed")
                    continue
                idx, why = match_content(r, rem, rec.version, expected[rec.version], key)
                state[tname][rec.version] = idx
                if idx is None:
                    viol.append(f"{phase}: {tname}: listed version {rec.version!r} does not load bit-exactly: {why}")
            if st.problems:
                viol.append(f"{phase}: {tname}: invalid manifests: {st.problems}")

    def check_scrub(phase):
        try:
            from ckptstore import scrub as _scrub
        except ImportError:
            return
        rep = _scrub.scrub(ckptstore.Store(root, remote=remote), deep=scrub_deep, key=key)
        if rep.exit_code != 0:
            viol.append(f"{phase}: scrub exit {rep.exit_code}: {rep.damage() or _scrub.format_report(rep)}")

    check_loads("after crash")
    check_scrub("after crash")
    if run_gc:
        try:
            from ckptstore import gc as _gc
        except ImportError:
            _gc = None
        if _gc is not None:
            st = ckptstore.Store(root, remote=remote)
            now = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2)
            _plan, res = _gc.run(st.tiers, None, now=now, grace=3600)
            if not res.ok:
                viol.append(f"gc failed: {[(a.key, str(e)) for a, e in res.failed]}")
            for tname, t in st.tiers.items():
                left = garbage(t)
                if left:
                    viol.append(f"after gc: {tname}: garbage left: {left[:8]}")
            before = {t: dict(v) for t, v in state.items()}
            check_loads("after gc")
            if state != before:
                viol.append(f"gc changed the committed versions: {before} -> {state}")
            check_scrub("after gc")
    return state, viol


def save_many(rank, world, jobs):
    """Save several versions in one job: ``jobs`` = list of dicts with ``root``, ``version``,
    ``seed`` and StorageWriter options (``remote``, ``durability``, ``key``, ``compression``,
    ``frame_size``)."""
    for j in jobs:
        j = dict(j)
        root, version, seed = j.pop("root"), j.pop("version"), j.pop("seed")
        sd = _rank_state(rank, world, seed, j.pop("big", False))
        j.setdefault("frame_size", 4096)
        w = ckptstore.StorageWriter(root, step=seed, **j)
        dcp.save(sd, checkpoint_id=version, storage_writer=w)
        w.close()
    return True


# ---- pausing a save at a named point (races) ------------------------------------------------------
def wait_for(path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)


def _install_pauses(pauses: list, rank: int) -> None:
    """``pauses``: ``[(point, nth, rank or None, dir, tag)]``. At the nth pass of ``point`` (on
    ``rank``), write ``dir/paused.<tag>.r<rank>`` and wait for ``dir/go.<tag>``."""
    from ckptstore import _faults

    real = _faults.point
    counts: dict = {}
    lock = threading.Lock()

    def point(name: str) -> None:
        for (pt, nth, prank, d, tag) in pauses:
            if pt == name and (prank is None or prank == rank):
                with lock:
                    counts[tag] = counts.get(tag, 0) + 1
                    hit = counts[tag] == nth
                if hit:
                    open(os.path.join(d, f"paused.{tag}.r{rank}"), "w").close()
                    wait_for(os.path.join(d, f"go.{tag}"), 60)
        real(name)

    _faults.point = point


def _install_barrier(barrier_dir: str, job: str, parties: int, tier_cls: str) -> None:
    """Make the manifest put-if-absent of ``tier_cls`` ("local" or "s3") wait until ``parties``
    jobs reached it: two racing saves then really collide at the commit point."""
    if tier_cls == "local":
        from ckptstore.tiers.local import LocalTier as cls
    else:
        from ckptstore.tiers.s3 import S3Tier as cls
    real = cls.put_if_absent

    def put_if_absent(self, key, data):
        if key.endswith("/manifest.json"):
            open(os.path.join(barrier_dir, f"ready.{job}"), "w").close()
            deadline = time.monotonic() + 30
            while len([n for n in os.listdir(barrier_dir) if n.startswith("ready.")]) < parties:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.002)
        return real(self, key, data)

    cls.put_if_absent = put_if_absent


def race_save(rank, world, root, version, seed, opts):
    """A save that may pause (``opts["pauses"]``) or meet another job at the manifest
    (``opts["barrier"] = (dir, job, parties, "local"|"s3")``). Returns ("ok"|"error", details)."""
    if opts.get("pauses"):
        _install_pauses(opts["pauses"], rank)
    if opts.get("barrier"):
        _install_barrier(*opts["barrier"])
    sd = _rank_state(rank, world, seed, opts.get("big", False))
    w = ckptstore.StorageWriter(root, remote=opts.get("remote"), durability=opts.get("durability", "local"),
                                key=opts.get("key"), step=seed, frame_size=4096, upload_timeout=30)
    try:
        dcp.save(sd, checkpoint_id=version, storage_writer=w)
        w.close()
        return ("ok", None)
    except BaseException as e:  # noqa: BLE001
        return ("error", _describe(e))
