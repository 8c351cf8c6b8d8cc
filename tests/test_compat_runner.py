"""``tests/compat/run_torch_dcp_tests.py`` and its shim report product gaps only: the runner's own
faults (FsspecWriter rebased onto the shim, URL ids like ``"abc://…"`` accepted, the checkpoint id
reported as the version ``dcp``) are gone, and ``validate_checkpoint_id`` takes a ``Path``."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

import ckptstore

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
COMPAT = os.path.join(HERE, "compat")

# What PyTorch's tests check of FileSystemWriter/Reader that the shim once broke, in their own
# words (test_save_load_api.py::test_auto_detect on CPU, test_compatibility.py::test_storage_meta),
# plus FsspecWriter's own base class. Runs as a file of PyTorch-style tests.
MINI = '''
import os, tempfile
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
import torch.distributed.checkpoint as dcp


def test_auto_detect(tmp_path):
    sd = {"a": torch.arange(4.0)}
    dcp.save(sd, checkpoint_id=os.path.join(tmp_path, "first"))
    dcp.load(sd, checkpoint_id=os.path.join(tmp_path, "first"))
    with patch.object(dcp.FileSystemReader, "validate_checkpoint_id", return_value=False):
        with patch.object(dcp.FileSystemWriter, "validate_checkpoint_id", return_value=False):
            dcp.save(sd, checkpoint_id=os.path.join(tmp_path, "second"))  # FsspecWriter
            dcp.load(sd, checkpoint_id=os.path.join(tmp_path, "second"))
    with pytest.raises(RuntimeError, match="Cannot detect"):
        dcp.save(sd, checkpoint_id="abc://abc.abc")
    with pytest.raises(RuntimeError, match="Cannot detect"):
        dcp.load(sd, checkpoint_id="abc://abc.abc")


def test_storage_meta(tmp_path):
    writer = dcp.FileSystemWriter(str(tmp_path))
    dcp.save({"a": torch.zeros(4, 4)}, storage_writer=writer)
    reader = dcp.FileSystemReader(str(tmp_path))
    meta = reader.read_metadata().storage_meta
    assert str(meta.checkpoint_id) == str(tmp_path)
    assert meta.save_id == writer.save_id and meta.load_id == reader.load_id


def test_path_ids(tmp_path):
    assert dcp.FileSystemWriter.validate_checkpoint_id(Path(tmp_path))
    assert dcp.FileSystemReader.validate_checkpoint_id(Path(tmp_path))
    dcp.save({"a": torch.ones(3)}, checkpoint_id=Path(tmp_path) / "p")
    sd = {"a": torch.zeros(3)}
    dcp.load(sd, checkpoint_id=Path(tmp_path) / "p")
    assert sd["a"].sum() == 3


def test_fsspec_writer_keeps_dcps_base():
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    assert issubclass(FsspecWriter, filesystem.FileSystemWriter)
    assert issubclass(FsspecReader, filesystem.FileSystemReader)
    assert filesystem.FileSystemWriter.__module__ == "torch.distributed.checkpoint.filesystem"


def test_the_swap_is_active():
    import ckptstore
    active = os.environ.get("CKPTSTORE_DCP_SHIM") == "1"
    assert issubclass(dcp.FileSystemWriter, ckptstore.StorageWriter) is active
    assert issubclass(dcp.FileSystemReader, ckptstore.StorageReader) is active
'''


def test_validate_checkpoint_id_takes_a_path_as_reset_does(tmp_path):
    for cls in (ckptstore.StorageWriter, ckptstore.StorageReader):
        assert cls.validate_checkpoint_id(pathlib.Path("step-1"))
        assert cls.validate_checkpoint_id("step-1")
        assert not cls.validate_checkpoint_id(pathlib.Path(".."))  # not a version name
        assert not cls.validate_checkpoint_id(42)
    w = ckptstore.StorageWriter(tmp_path)
    w.reset(pathlib.Path("step-1"))
    assert w.version == "step-1"


@pytest.mark.slow
def test_runner_reports_only_product_gaps(tmp_path):
    """The runner over PyTorch-style tests of the shim's former faults: every case passes on DCP's
    own writer and with ckptstore, and the runner exits 0."""
    tests = tmp_path / "torch_tests"
    tests.mkdir()
    (tests / "test_mini_dcp.py").write_text(textwrap.dedent(MINI))
    p = subprocess.run([sys.executable, os.path.join(COMPAT, "run_torch_dcp_tests.py"), str(tests)],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=REPO))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "ckptstore: 5 cases run, 5 passed, 0 failed" in out, out[-4000:]
    assert "ckptstore passes 5 of those 5" in out, out[-4000:]


def test_expected_differences_match_the_junit_ids():
    sys.path.insert(0, COMPAT)
    try:
        import run_torch_dcp_tests as runner
    finally:
        sys.path.remove(COMPAT)
    why = runner.expected_difference("distributed.checkpoint.e2e.test_e2e_save_and_load.TestE2ESaveAndLoad::test_partial_load")
    assert why and "allow_partial_load" in why
    assert runner.expected_difference("test_e2e_save_and_load.TestE2ESaveAndLoad::test_overwrite") is None


@pytest.mark.parametrize("shim", [pytest.param("0", marks=pytest.mark.slow), "1"])
def test_mini_suite_in_process_environment(tmp_path, shim):
    """The same file under pytest directly, with and without the swap (what the runner does twice)."""
    f = tmp_path / "test_mini_dcp.py"
    f.write_text(textwrap.dedent(MINI))
    env = dict(os.environ, CKPTSTORE_DCP_SHIM=shim,
               PYTHONPATH=os.pathsep.join([os.path.join(COMPAT, "shim"), REPO, os.path.join(COMPAT, "fallback")]))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                        "--rootdir", str(tmp_path), str(f)], capture_output=True, text=True, env=env, timeout=300,
                       cwd=str(tmp_path))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]


# A PyTorch-style multi-process test whose ranks die of a load error (DCP's CheckpointException is a
# BaseException, which MultiProcessTestCase's rank wrapper does not catch: the parent only sees the
# exit code, "Scalars are not equal!")
MULTI = '''
import os, tempfile
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.testing._internal.common_distributed import MultiProcessTestCase


class TestRankDies(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def test_load_of_a_missing_checkpoint(self):
        dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size, init_method=f"file://{self.file_name}")
        d = os.path.join(tempfile.gettempdir(), "ckptstore-compat-missing", "nothing-here")
        os.makedirs(os.path.dirname(d), exist_ok=True)
        dcp.load({"a": torch.zeros(3)}, checkpoint_id=d)
'''


def test_rank_exception_is_found_in_a_ranks_output():
    sys.path.insert(0, COMPAT)
    try:
        import run_torch_dcp_tests as runner
    finally:
        sys.path.remove(COMPAT)
    out = ("AssertionError: Scalars are not equal!\n\nExpected 0 but got 1.\n"
           "Traceback (most recent call last):\n  File ...\n"
           "torch.distributed.checkpoint.api.CheckpointException: CheckpointException ranks:dict_keys([0, 1])\n"
           "Traceback (most recent call last): (RANK 0)\n  File ...\n"
           "ckptstore.errors.VersionNotFoundError: version 'dcp' is not committed in any root of this job\n")
    assert runner.rank_exception(out).startswith("ckptstore.errors.VersionNotFoundError: version 'dcp'")
    assert runner.rank_exception("AssertionError: Scalars are not equal!") is None


@pytest.mark.slow
def test_runner_shows_a_ranks_real_exception(tmp_path):
    """A rank's failure is reported with the rank's exception (before: only ``AssertionError: Scalars
    are not equal!``, the exit code; the real error only in the captured output)."""
    tests = tmp_path / "torch_tests"
    tests.mkdir()
    (tests / "test_multi_dcp.py").write_text(textwrap.dedent(MULTI))
    p = subprocess.run([sys.executable, os.path.join(COMPAT, "run_torch_dcp_tests.py"), "--shim-only", str(tests)],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=REPO))
    out = p.stdout + p.stderr
    line = next((ln for ln in out.splitlines() if "rank's exception:" in ln), None)
    assert line is not None and "version 'dcp' is not committed" in line, out[-4000:]
