"""What a new user meets in the first hour (single process, no dist), each a test that failed before:
errors that say what to do, the options the docs name, one spelling of version names."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.utils import CheckpointException

import ckptstore


def _save(root, version: str, value: float = 1.0, **kw) -> None:
    w = ckptstore.StorageWriter(str(root), **kw)
    dcp.save({"w": torch.full((4,), value)}, checkpoint_id=version, storage_writer=w)


def _load_error(root, version: str, **kw) -> Exception:
    with pytest.raises(CheckpointException) as ei:
        dcp.load({"w": torch.zeros(4)}, checkpoint_id=version, storage_reader=ckptstore.StorageReader(str(root), **kw))
    return ei.value.failures[0][0] if hasattr(ei.value, "failures") else ei.value


# -- version names outside a manager's scope, and typos ------------------------------------------------------
def test_an_explicit_version_outside_the_managers_names_says_so_and_how_to_reach_it(tmp_path):
    """``restore(version="model-1")`` on a manager of ``step-N`` names: before, "is not committed on
    any root of this job" although ``model-1`` is committed; now: outside this manager's names, and
    the two ways to load it."""
    _save(tmp_path, "model-1")
    mgr = ckptstore.CheckpointManager(str(tmp_path), {"m": {"w": torch.zeros(4)}})
    try:
        with pytest.raises(ckptstore.VersionNotFoundError) as ei:
            mgr.restore(version="model-1")
        msg = str(ei.value)
        assert "'model-1' is committed, but it is outside this manager's names (names step-N)" in msg, msg
        assert "prefix=" in msg and "checkpoint_id='model-1'" in msg, msg
        assert mgr.restore() is None  # the manager's own choice still sees nothing of its names
    finally:
        mgr.close()
    state = {"w": torch.zeros(4)}
    with ckptstore.CheckpointManager(str(tmp_path), {"w": state}, prefix="model-", save_rng=False) as m2:
        pass
    dcp.load(state, checkpoint_id="model-1", storage_reader=ckptstore.StorageReader(str(tmp_path)))
    assert torch.equal(state["w"], torch.ones(4))


def test_a_name_typo_in_python_gets_the_clis_near_misses(tmp_path):
    """One helper (``errors.version_not_found``) for the CLI and the Python loads: a manager's
    ``restore(version=...)`` and ``dcp.load`` through ``StorageReader`` name the closest committed
    version (before: no hint in Python)."""
    _save(tmp_path, "step-000180", 180.0)
    _save(tmp_path, "warmup-1")
    e = _load_error(tmp_path, "step-00018")
    assert isinstance(e, ckptstore.VersionNotFoundError) and "did you mean 'step-000180'?" in str(e), e
    with ckptstore.CheckpointManager(str(tmp_path), {"w": torch.zeros(4)}, version_format="step-{step:06d}") as mgr:
        with pytest.raises(ckptstore.VersionNotFoundError, match="did you mean 'step-000180'"):
            mgr.restore(version="step-00018")


# -- key_file= wherever the CLI and torchtitan take a key file ---------------------------------------------------
def test_key_file_is_accepted_by_writer_reader_store_and_manager(tmp_path):
    """``StorageWriter(key_file=...)`` was a ``TypeError`` with no hint while ``--key-file`` and
    torchtitan's ``key_file`` take one: the writer, the reader, ``Store`` and ``CheckpointManager``
    accept it (the file ``ckptstore keygen`` writes), and refuse it together with ``key=``."""
    import base64
    import os

    kf = tmp_path / "master.key"
    key = os.urandom(32)
    kf.write_bytes(base64.b64encode(key) + b"\n")
    root = tmp_path / "store"
    _save(root, "v1", 3.0, key_file=str(kf))
    assert ckptstore.Store(str(root), key_file=kf).manifest("v1").manifest.encrypted
    sd = {"w": torch.zeros(4)}
    dcp.load(sd, checkpoint_id="v1", storage_reader=ckptstore.StorageReader(str(root), key_file=kf))
    assert torch.equal(sd["w"], torch.full((4,), 3.0))
    e = _load_error(root, "v1", key=os.urandom(32))
    assert isinstance(e, ckptstore.KeyMismatchError), e  # encrypted with that file's key, not another
    with ckptstore.CheckpointManager(str(tmp_path / "m"), {"w": sd}, key_file=str(kf), save_rng=False) as mgr:
        mgr.save(1)
    with ckptstore.CheckpointManager(str(tmp_path / "m"), {"w": {"w": torch.zeros(4)}}, key=key, save_rng=False) as mgr:
        assert mgr.restore() == 1
    with pytest.raises(ValueError, match="not both"):
        ckptstore.StorageWriter(str(root), key=key, key_file=kf)
    with pytest.raises(ckptstore.KeyMismatchError, match="cannot read key file"):
        ckptstore.StorageReader(str(root), key_file=tmp_path / "missing.key")


# -- one spelling of version names; order never depends on it ------------------------------------------------------
def test_unpadded_names_order_by_step_everywhere(tmp_path):
    """``step-N`` unpadded (the manager's, torchtitan's and the README's spelling) in a store saved out
    of name order: ``list`` (text and JSON), ``latest()``, retention (``gc --keep-last``), ``scrub``
    and the near misses follow the steps, never the names' string order (``step-100`` < ``step-9``)."""
    import json

    from click.testing import CliRunner

    from ckptstore.cli import main

    def cli(*args):
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)

    for step in (100, 9, 10):
        _save(tmp_path, f"step-{step}", float(step), step=step)
    assert [r.version for r in ckptstore.Store(str(tmp_path)).versions()] == ["step-9", "step-10", "step-100"]
    assert ckptstore.Store(str(tmp_path)).latest().version == "step-100"
    listed = [v["version"] for v in json.loads(cli("list", tmp_path, "--json").stdout)["versions"]]
    assert listed == ["step-9", "step-10", "step-100"]
    text = cli("list", tmp_path).stdout
    assert text.index("step-9 ") < text.index("step-10 ") < text.index("step-100 "), text
    r = cli("scrub", tmp_path)
    assert r.exit_code == 0 and r.stdout.index("step-9") < r.stdout.index("step-100"), r.stdout
    plan = json.loads(cli("gc", tmp_path, "--keep-last", "2", "--dry-run", "--json").stdout)["plan"]
    assert [a["version"] for a in plan["actions"] if a["op"] == "uncommit"] == ["step-9"]
    e = _load_error(tmp_path, "step-1000")
    assert "did you mean one of 'step-100', 'step-10'?" in str(e), e  # closest first


# -- the front page (README.md) and the docs site --------------------------------------------------------
def _repo() -> str:
    import os

    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_is_a_front_page_and_its_quick_start_runs_as_written(tmp_path):
    """README.md stays short (≤ 250 lines) and keeps the two commands; its quick start (save, list,
    load) and its wrong-key example run as written (the store path moved into tmp_path)."""
    import os
    import re
    import subprocess
    import sys

    text = open(os.path.join(_repo(), "README.md")).read()
    assert len(text.splitlines()) <= 250
    assert "bash scripts/demo.sh" in text and "bash scripts/test.sh" in text
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    quick, wrong_key = blocks[0], blocks[1]
    assert len(quick.strip().splitlines()) <= 20, quick
    code = (quick.replace('"/tmp/ckpt-quickstart"', repr(str(tmp_path / "store"))) + "\n"
            + wrong_key.replace('"/tmp/ckpt-keys"', repr(str(tmp_path / "keys"))))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=str(tmp_path),
                       env=dict(os.environ, PYTHONPATH=_repo()))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("step-100 100 ") and "wrong key: version 'v1'" in p.stdout
    assert "Traceback" not in p.stderr and "torch.distributed is disabled" not in p.stderr


def test_every_readme_link_to_a_file_exists():
    import os
    import re

    text = open(os.path.join(_repo(), "README.md")).read()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", text) if not t.startswith("http")]
    assert targets and all(os.path.exists(os.path.join(_repo(), t)) for t in targets), targets


def test_the_getting_started_page_runs_as_written(tmp_path):
    """docs/getting-started.md: the quick start, then its typed-error example (a missing version caught
    by ``except ckptstore.VersionNotFoundError``), as one script."""
    import os
    import re
    import subprocess
    import sys

    text = open(os.path.join(_repo(), "docs", "getting-started.md")).read()
    quick, missing = re.findall(r"```python\n(.*?)```", text, re.S)[:2]
    code = (quick + "\n" + missing).replace('"/tmp/ckpt-quickstart"', repr(str(tmp_path / "store")))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=str(tmp_path),
                       env=dict(os.environ, PYTHONPATH=_repo()))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "version 'step-999' is not committed" in p.stdout and "Traceback" not in p.stderr
