"""Async saves as training uses them — overlapping saves through one writer, and the
PROCESS executor with a remote tier (uploads never lost, failures never silent)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import ckptstore
from ckptstore.manifest import layout
from ckptstore.testing.dist import run_ranks

import async_ranks


def test_overlapping_thread_saves_through_one_writer(tmp_path):
    """2 ranks, one StorageWriter, 5 async saves each started before the previous one resolved
    (each on its own process group, the documented requirement for DCP's collectives): all commit
    with their own values, although the loop overwrites the tensors right after each call."""
    root = str(tmp_path)
    outs = run_ranks(async_ranks.overlapping_saves, 2, root, 5, timeout=300)
    for errors, got in outs:
        assert errors == []
        assert got == {i: (True, True) for i in range(5)}
    assert sorted(v.version for v in ckptstore.Store(root).versions()) == [f"s{i}" for i in range(5)]


def test_back_pressure_bounds_staged_copies():
    import threading

    import torch

    from ckptstore.dcp.staging import Stager

    st = Stager(max_staged=2, timeout=30)
    a = st.stage({"t": torch.ones(1000)})
    b = st.stage({"t": torch.ones(1000)})
    assert st.staged == 2
    done = []
    th = threading.Thread(target=lambda: done.append(st.stage({"t": torch.ones(1000)})))
    th.start()
    th.join(0.3)
    assert not done  # the third copy waits for an earlier save
    st.release(a["t"].untyped_storage().data_ptr())  # save "a" has written its data
    th.join(10)
    assert done and st.staged == 2
    # the cached set belonged to "a": the third save may reuse it, "b" keeps its own buffers
    assert done[0]["t"].data_ptr() == a["t"].data_ptr() and b["t"].data_ptr() != a["t"].data_ptr()
    del b
    assert st.staged == 1  # a staged copy nobody holds any more frees its ticket


# ---- PROCESS executor and uploads (S3) -----------------------------------------------------------
def _ro_env():
    from ckptstore.testing import seaweed as sw

    return {"AWS_ACCESS_KEY_ID": sw.READONLY_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": sw.READONLY_SECRET_KEY}


def _remote_versions(url):
    from ckptstore.tiers.s3 import S3Tier

    t = S3Tier(url)
    return sorted(i.key for i in t.list("versions/") if i.key.endswith("/manifest.json"))


@pytest.mark.s3
# the PROCESS case in the slow set (suite time): PROCESS saves reach S3 in test_read_only_credentials_are_never_silent
@pytest.mark.parametrize("s3_server,kind", [pytest.param("seaweedfs", "process", marks=pytest.mark.slow), ("seaweedfs", "thread"),
                                            pytest.param("moto", "process", marks=pytest.mark.slow)],
                         indirect=["s3_server"])
def test_durability_local_upload_reaches_s3_after_close(tmp_path, s3_url, kind):
    outs = run_ranks(async_ranks.process_save_s3, 2, str(tmp_path), s3_url, "v1", kind, timeout=180)
    assert all(o["future"] == "ok" and o["close"] == "ok" for o in outs), outs
    assert _remote_versions(s3_url) == [layout.manifest_key("v1")]
    st = ckptstore.Store(None, remote=s3_url)
    assert st.latest().version == "v1"


@pytest.mark.s3
@pytest.mark.parametrize("kind", ["process", "thread"])
def test_read_only_credentials_are_never_silent(tmp_path, s3_url, kind):
    outs = run_ranks(async_ranks.process_save_s3, 2, str(tmp_path), s3_url, "v1", kind, env=_ro_env(), timeout=180)
    text = repr(outs)
    # the version is committed locally; the failed upload is reported by the future or by close()
    assert any("UploadError" in o["close"] or "error" in o["future"] for o in outs), text
    assert outs[0]["close"].startswith("error: UploadError"), text
    assert "v1" in outs[0]["close"], text
    assert _remote_versions(s3_url) == []
    assert [v.version for v in ckptstore.Store(str(tmp_path)).versions()] == ["v1"]


@pytest.mark.s3
def test_process_executor_exit_without_close_is_loud(tmp_path, s3_url, s3_env):
    """A training script that neither waits for the future nor calls close(): at exit the failed
    upload is reported on stderr, naming the version."""
    script = textwrap.dedent(
        f"""
        import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        import ckptstore
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:{_port()}")
        w = ckptstore.StorageWriter({str(tmp_path)!r}, remote={s3_url!r}, upload_timeout=30)
        dcp.async_save({{"x": torch.ones(1000)}}, checkpoint_id="v1", storage_writer=w,
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        print("training done", flush=True)
        """
    )
    env = {**os.environ, **s3_env, **_ro_env(), "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert "training done" in p.stdout, p.stderr[-3000:]
    assert "NOT uploaded before exit" in p.stderr and "v1" in p.stderr, p.stderr[-3000:]
    assert _remote_versions(s3_url) == []


def _port():
    from ckptstore.testing.dist import free_port

    return free_port()
