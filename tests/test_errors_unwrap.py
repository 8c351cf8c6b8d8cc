"""Errors where users catch them: a typed ckptstore error raised inside ``dcp.save``/``dcp.load``
reaches the caller inside torch's ``CheckpointException`` (a ``BaseException``, one traceback per
rank); ``ckptstore.errors.unwrap``/``typed()``, the manager and the integrations give it back typed,
with the ``CheckpointException`` as ``__cause__`` printed as one line per failed rank
(docs/howto/errors.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptstore
from ckptstore.errors import rank_failures, summary, typed, unwrap
from ckptstore.testing.dist import run_ranks

import errors_ranks  # noqa: E402 - tests/ is on sys.path (conftest)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
KEY_A, KEY_B = b"a" * 32, b"b" * 32


def _saved(root, key=KEY_A, version="v1"):
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=version, storage_writer=ckptstore.StorageWriter(str(root), key=key))


def test_a_wrong_key_on_load_is_caught_by_its_type(tmp_path):
    _saved(tmp_path)
    with pytest.raises(ckptstore.KeyMismatchError) as ei:
        with typed():
            dcp.load({"w": torch.zeros(4)}, checkpoint_id="v1",
                     storage_reader=ckptstore.StorageReader(str(tmp_path), key=KEY_B))
    e = ei.value
    assert isinstance(e, ckptstore.CkptStoreError) and isinstance(e, Exception)
    assert isinstance(e.__cause__, CheckpointException) and list(e.__cause__.failures) == [0]
    assert "Traceback" not in str(e.__cause__) and str(e.__cause__).startswith("rank 0: KeyMismatchError: ")
    assert "\n" not in str(e.__cause__)


def test_a_missing_version_is_caught_by_except_exception(tmp_path):
    _saved(tmp_path)

    @typed()
    def load(version):
        dcp.load({"w": torch.zeros(4)}, checkpoint_id=version,
                 storage_reader=ckptstore.StorageReader(str(tmp_path), key=KEY_A))

    try:
        load("v9")
    except Exception as e:  # noqa: BLE001 - the point: a plain `except Exception` catches it
        caught = e
    assert isinstance(caught, ckptstore.VersionNotFoundError) and isinstance(caught, FileNotFoundError)
    assert "'v9' is not committed" in str(caught)
    load("v1")  # no error: nothing changes


def test_unwrap_takes_the_lowest_ranks_typed_error_and_leaves_others_alone():
    full, key = ckptstore.StorageFullError("disk full"), ckptstore.KeyMismatchError("wrong key")
    exc = CheckpointException("read_metadata", {2: (RuntimeError("boom"), None), 3: (full, None), 1: (key, None)})
    assert unwrap(exc) is key  # rank 1 < rank 3; rank 2's RuntimeError is not a ckptstore error
    assert [r for r, _ in rank_failures(exc)] == [1, 2, 3]
    assert summary(exc).splitlines() == ["rank 1: KeyMismatchError: wrong key", "rank 2: RuntimeError: boom",
                                         "rank 3: StorageFullError: disk full"]
    same = CheckpointException("x", {0: (ckptstore.StorageFullError("full"), None), 1: (ckptstore.StorageFullError("full"), None)})
    assert summary(same) == "ranks 0, 1: StorageFullError: full"
    plain = CheckpointException("x", {0: (RuntimeError("planner"), None)})
    assert unwrap(plain) is plain  # nothing typed: unchanged, so `raise unwrap(e)` re-raises it
    with pytest.raises(CheckpointException):
        with typed():
            raise plain
    with pytest.raises(ValueError):
        with typed():
            raise ValueError("not DCP's")
    chained = RuntimeError("outer")
    chained.__cause__ = key
    assert unwrap(chained) is key
    assert unwrap(key) is key


def test_the_manager_restore_raises_the_typed_error(tmp_path):
    m = torch.nn.Linear(2, 2)
    with ckptstore.CheckpointManager(str(tmp_path), {"model": m}, interval_steps=1, key=KEY_A, save_on_signal=None) as mgr:
        mgr.save(1)
    with pytest.raises(ckptstore.KeyMismatchError) as ei:
        with ckptstore.CheckpointManager(str(tmp_path), {"model": m}, interval_steps=1, key=KEY_B,
                                         save_on_signal=None) as mgr:
            mgr.restore()
    assert isinstance(ei.value.__cause__, CheckpointException)
    assert "Traceback" not in str(ei.value.__cause__)


def test_the_manager_save_error_is_typed_and_one_line(tmp_path):
    dcp.save({"x": torch.ones(2)}, checkpoint_id="step-2", storage_writer=ckptstore.StorageWriter(str(tmp_path)))
    mgr = ckptstore.CheckpointManager(str(tmp_path), {"model": torch.nn.Linear(2, 2)}, save_on_signal=None)
    mgr.save(2, force=True)
    with pytest.raises(ckptstore.VersionExistsError) as ei:
        mgr.wait()
    assert "Traceback" not in str(ei.value) and "\n" not in str(ei.value)
    assert isinstance(ei.value.__cause__, CheckpointException)
    mgr.close()


def test_an_uncaught_error_prints_one_line_per_rank_not_a_traceback_per_rank(tmp_path):
    _saved(tmp_path)
    script = ("import torch, torch.distributed.checkpoint as dcp, ckptstore\n"
              "with ckptstore.errors.typed():\n"
              f"    dcp.load({{'w': torch.zeros(4)}}, checkpoint_id='v1', storage_reader=ckptstore.StorageReader({str(tmp_path)!r}))\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == 1
    assert "(RANK 0)" not in p.stderr, p.stderr  # DCP's per-rank traceback
    assert p.stderr.count("Traceback") == 1, p.stderr
    assert "ckptstore.errors.RankFailures: rank 0: KeyMismatchError: " in p.stderr
    assert p.stderr.rstrip().splitlines()[-1].startswith("ckptstore.errors.KeyMismatchError: ")


def test_two_ranks_catch_the_same_typed_error(tmp_path):
    out = run_ranks(errors_ranks.wrong_key_and_missing_version, 2, str(tmp_path), timeout=300)
    for r in out:
        assert r["key"] == "KeyMismatchError" and r["key_cause"] == "RankFailures", r
        assert r["key_cause_ranks"] == [0, 1]
        lines = r["key_cause_text"].splitlines()
        assert len(lines) <= 2 and all(ln.startswith(("rank 0: ", "rank 1: ", "ranks 0, 1: ")) for ln in lines), lines
        assert r["missing"] == "VersionNotFoundError" and "'v9'" in r["missing_text"]
        assert r["manager"] == "KeyMismatchError" and "Traceback" not in r["manager_cause_text"]
    assert out[0]["key_cause_text"] == out[1]["key_cause_text"]  # every rank reports the same
