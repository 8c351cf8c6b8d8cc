"""A full local disk mid-save.

With a real small file system (an 8 MiB tmpfs, mounted when the tests run as root — skipped
otherwise) and with an errno-level wrapper (always): the free space is set, by a filler file or a
byte budget, to every level from "nothing fits" to "everything fits", in page steps, and a save is
attempted at each level. Expected at every level:

* the save commits completely (and loads bit-exactly), or fails with a clear
  :class:`ckptstore.StorageFullError` (inside DCP's ``CheckpointException``) and nothing else;
* the failed attempt is not visible (``Store.versions()`` lists only the earlier versions), and the
  earlier versions still load bit-exactly and scrub clean;
* gc past the grace period leaves no garbage, and the free space is back to what it was before
  the attempt.
"""

from __future__ import annotations

import datetime as dt
import errno
import os

import pytest
import torch.distributed.checkpoint as dcp

import ckptstore

import crash_ranks
from helpers import small_tmpfs

PAGE = 4096
RESULTS: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def full_disk_report():
    yield
    if RESULTS:
        print("\n\nfull disk:\n" + "\n".join(f"  {r}" for r in RESULTS) + "\n")


@pytest.fixture
def tmpfs(tmp_path):
    with small_tmpfs(tmp_path / "fs", size="8m") as d:
        yield d


def _free(path) -> int:
    s = os.statvfs(path)
    return s.f_bavail * s.f_frsize


def _set_free(fs: str, filler: str, want: int) -> int:
    """Resize ``filler`` so that ``want`` bytes (rounded down to pages) stay free; returns the free space."""
    cur = os.path.getsize(filler) if os.path.exists(filler) else 0
    target = max(0, cur + _free(fs) - want)
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY)
    try:
        os.ftruncate(fd, 0)
        if target:
            os.posix_fallocate(fd, 0, target)
    finally:
        os.close(fd)
    return _free(fs)


def _save(root, version, seed, key=None):
    sd = crash_ranks.expected_state(seed)
    w = ckptstore.StorageWriter(root, key=key, step=seed, frame_size=4096)
    dcp.save(sd, checkpoint_id=version, storage_writer=w)


def _full_errors(e: BaseException) -> list:
    return crash_ranks._describe(e)


def _run_gc(root):
    from ckptstore import gc as _gc

    st = ckptstore.Store(root)
    _plan, res = _gc.run(st.tiers, None, now=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2), grace=3600)
    assert res.ok, res.failed
    return crash_ranks.garbage(st.local)


def _check_earlier(root, versions: dict, key=None):
    from ckptstore import scrub as _scrub

    st = ckptstore.Store(root)
    assert [r.version for r in st.versions()] == list(versions)
    for v, seed in versions.items():
        assert crash_ranks.load_state(root, v, seed, key=key, allow_unencrypted=True), v
    rep = _scrub.scrub(st, deep=True, key=key)
    assert rep.exit_code == 0, _scrub.format_report(rep)


@pytest.mark.parametrize("key", [None, bytes(range(32))], ids=["plain", "encrypted"])
def test_tmpfs_full_at_every_level(tmpfs, key):
    root = os.path.join(tmpfs, "root")
    filler = os.path.join(tmpfs, "filler")
    _save(root, "v0", 0, key)
    committed = {"v0": 0}
    # how much one more save takes on this file system
    before = _free(tmpfs)
    _save(root, "probe", 9, key)
    need = before - _free(tmpfs)
    assert need > 0
    from ckptstore import gc as _gc

    st = ckptstore.Store(root)
    _gc.remove_version(st.local, "probe", st.manifest("probe", "local").manifest)
    assert _gc_ok(root)
    outcomes = []
    for i, free in enumerate(range(0, need + 2 * PAGE, PAGE)):
        got = _set_free(tmpfs, filler, free)
        v = f"v{i + 1}"
        try:
            _save(root, v, 1, key)
            ok = True
        except BaseException as e:  # noqa: BLE001
            ok = False
            errs = _full_errors(e)
            assert errs and all(n == "StorageFullError" for n, _t, _m in errs), errs
            assert all("full" in m and "gc" in m for _n, _t, m in errs), errs
        if ok:
            committed[v] = 1
            outcomes.append(f"{got // PAGE}p:committed")
            assert crash_ranks.load_state(root, v, 1, key=key)
        else:
            outcomes.append(f"{got // PAGE}p:full")
        _check_earlier(root, committed, key)
        assert _run_gc(root) == []
        if not ok:
            assert _free(tmpfs) == got, "gc did not give back the space of the failed attempt"
        if ok and len([o for o in outcomes if o.endswith("committed")]) >= 2:
            break
    assert outcomes[0].endswith("full") and outcomes[-1].endswith("committed")
    RESULTS.append(f"tmpfs 8 MiB ({'encrypted' if key else 'plain'}), one save needs {need // PAGE} pages; free pages → "
                   f"outcome: {' '.join(outcomes)}; every failure a StorageFullError, nothing partial listed, earlier "
                   "versions intact, gc gave all space back")


def _gc_ok(root) -> bool:
    return _run_gc(root) == []


@pytest.fixture
def tmpfs_inodes(tmp_path):
    with small_tmpfs(tmp_path / "fsi", size="8m", nr_inodes=200) as d:
        yield d


def _free_inodes(path) -> int:
    return os.statvfs(path).f_favail


def test_tmpfs_out_of_inodes_at_every_level(tmpfs_inodes):
    """Out of inodes (directories and files cannot be created): same guarantees as a full disk."""
    fs = tmpfs_inodes
    root = os.path.join(fs, "root")
    _save(root, "v0", 0)
    fill = os.path.join(fs, "fill")
    os.mkdir(fill)
    committed = {"v0": 0}
    outcomes = []
    fillers: list = []
    for free in range(0, 10):
        while _free_inodes(fs) > free:
            p = os.path.join(fill, f"f{len(fillers)}")
            open(p, "w").close()
            fillers.append(p)
        while _free_inodes(fs) < free and fillers:
            os.unlink(fillers.pop())
        got = _free_inodes(fs)
        v = f"v{free + 1}"
        try:
            _save(root, v, 1)
            ok = True
        except BaseException as e:  # noqa: BLE001
            ok = False
            errs = _full_errors(e)
            assert errs and all(n == "StorageFullError" for n, _t, _m in errs), (free, errs)
        outcomes.append(f"{got}i:{'committed' if ok else 'full'}")
        if ok:
            committed[v] = 1
        _check_earlier(root, committed)
        assert _run_gc(root) == []
        if not ok:
            assert _free_inodes(fs) == got, "gc did not give back the inodes of the failed attempt"
        else:
            break
    assert outcomes[0].endswith("full") and outcomes[-1].endswith("committed"), outcomes
    RESULTS.append(f"tmpfs out of inodes: free inodes → outcome: {' '.join(outcomes)}; every failure a StorageFullError")


# ---- without a mount: ENOSPC / EDQUOT from a wrapper around the local tier's files --------------
class _Budget:
    def __init__(self, nbytes: int, err: int):
        self.left = nbytes
        self.err = err


class _BudgetFile:
    """A file whose writes fail with ``budget.err`` once the budget is spent (as a full disk does)."""

    def __init__(self, f, budget: _Budget):
        self._f = f
        self._b = budget

    def write(self, data):
        n = len(memoryview(data).cast("B"))
        if n > self._b.left:
            k = self._b.left
            self._b.left = 0
            if k:
                self._f.write(memoryview(data).cast("B")[:k])
            raise OSError(self._b.err, os.strerror(self._b.err))
        self._b.left -= n
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return self._f.__exit__(*a)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
def test_wrapper_full_at_every_level(tmp_path, monkeypatch, err):
    import builtins

    import ckptstore.tiers.local as local_mod

    root = str(tmp_path / "root")
    _save(root, "v0", 0)
    budget = _Budget(1 << 60, err)
    real_open = builtins.open

    def budget_open(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        return _BudgetFile(f, budget) if any(c in mode for c in "wax+") else f

    monkeypatch.setattr(local_mod, "open", budget_open, raising=False)
    _save(root, "x000", 1)  # same content and name length as the sweep's saves
    need = (1 << 60) - budget.left
    budget.left = 1 << 60
    from ckptstore import gc as _gc

    st = ckptstore.Store(root)
    _gc.remove_version(st.local, "x000", st.manifest("x000", "local").manifest)
    committed = {"v0": 0}
    outcomes = []
    step = max(1, need // 24)
    # (the compressed metadata object varies by a few bytes from save to save: +256 bytes of slack)
    for i, b in enumerate(list(range(0, need - 256, step)) + [need + 256]):
        budget.left = b
        v = f"v{i + 1:03d}"
        try:
            _save(root, v, 1)
            ok = True
        except BaseException as e:  # noqa: BLE001
            ok = False
            errs = _full_errors(e)
            assert errs and all(n == "StorageFullError" for n, _t, _m in errs), (b, errs)
        budget.left = 1 << 60
        outcomes.append("C" if ok else "F")
        if ok:
            committed[v] = 1
        _check_earlier(root, committed)
        assert _run_gc(root) == []
    assert outcomes[0] == "F" and outcomes[-1] == "C"
    assert "".join(outcomes) == "F" * outcomes.count("F") + "C" * outcomes.count("C"), outcomes
    RESULTS.append(f"errno {errno.errorcode[err]} wrapper: {len(outcomes)} budgets from 0 to {need} bytes: "
                   f"{outcomes.count('F')} StorageFullError, {outcomes.count('C')} committed (with the full budget); "
                   "nothing partial listed, earlier versions intact, gc left no garbage")
