"""What S3 proves end to end, on every remote tier against its real server (SeaweedFS,
fake-gcs-server, Azurite): save → upload → the local roots gone → restore from the remote tier only
(and ``ckptstore list --remote``); scrub and repair, gc and retention on the remote tier; two writers
racing to commit one version — exactly one commits. A few representative cases run by default; the
broader sweep (more world sizes, S3 where tests/test_s3_dcp.py already covers it) is marked slow."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore import scrub as S
from ckptstore.manifest import layout
from ckptstore.testing.dist import run_ranks

import dcp_ranks
from helpers import bits_equal, load
from store_helpers import cli, cli_json

from conftest import REMOTES

ALL = REMOTES
NEW = [r for r in REMOTES if r != "s3"]  # S3's own versions of these cases: tests/test_s3_dcp.py, test_gc.py, test_scrub.py
# the default suite runs the long restore/manager cases on GCS (and S3), Azure's in the slow set (suite < 15 min)
NEW_DEFAULT = [pytest.param(r, marks=pytest.mark.slow) if r == "az" else r for r in NEW]


def _tiers(url):
    return [(r.version, sorted(r.tiers)) for r in ckptstore.Store("", remote=url).versions()]


@pytest.mark.parametrize("remote_url", NEW_DEFAULT, indirect=True)
def test_remote_only_restore_after_local_loss(tmp_path, remote_url):
    """2 ranks save with durability="remote" (streamed part uploads, remote commit), the local
    root is removed, 1 rank restores bit-exact from the remote tier alone; the CLI lists it there."""
    root = str(tmp_path / "nvme")
    key = os.urandom(32)
    assert run_ranks(dcp_ranks.s3_save, 2, root, remote_url, "v1", 5, "remote", key) == [("ok", None)] * 2
    assert [(r.version, sorted(r.tiers)) for r in ckptstore.Store(root, remote=remote_url).versions()] == \
        [("v1", ["local", "remote"])]
    shutil.rmtree(root)
    assert _tiers(remote_url) == [("v1", ["remote"])]
    assert all(run_ranks(dcp_ranks.s3_load, 1, root, remote_url, "v1", 5, key))
    res = cli("list", root, "--remote", remote_url, "--json")
    assert res.exit_code == 0, res.output
    (v,) = json.loads(res.stdout)["versions"]
    assert v["version"] == "v1" and v["tiers"] == ["remote"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("remote_url", ALL, indirect=True)
def test_remote_only_restore_resharded_sweep(tmp_path, remote_url, world):
    root = str(tmp_path / "nvme")
    assert run_ranks(dcp_ranks.s3_save, 2, root, remote_url, "v1", 7, "local") == [("ok", None)] * 2
    shutil.rmtree(root)
    assert all(run_ranks(dcp_ranks.s3_load, world, root, remote_url, "v1", 7))


@pytest.mark.parametrize("remote_url", NEW, indirect=True)
def test_scrub_repair_and_gc_on_the_remote_tier(tmp_path, remote_url, monkeypatch):
    """Versions staged by the writer; a remote object damaged behind the tier's back is found by
    ``scrub --deep``, repaired from the local copy, and ``gc`` keeps the newest remotely."""
    monkeypatch.chdir(tmp_path)
    root = str(tmp_path / "root")
    states = {}
    for step, v in enumerate(("v1", "v2", "v3")):
        states[v] = {"w": torch.randn(300_000), "step": step}
        w = ckptstore.StorageWriter(root, remote=remote_url, durability="remote", step=step)
        dcp.save(states[v], checkpoint_id=v, storage_writer=w)
        w.close()
    st = ckptstore.Store(root, remote=remote_url)
    assert [sorted(r.tiers) for r in st.versions()] == [["local", "remote"]] * 3
    code, out = cli_json("scrub", "", "--remote", remote_url, "--deep")
    assert code == S.EXIT_CLEAN, out
    m = st.manifest("v2").manifest
    k = layout.object_key("v2", m.objects[0].name)
    good = st.remote.get(k)
    st.remote.put(k, good[:100] + bytes([good[100] ^ 1]) + good[101:])  # one flipped bit, planted remotely
    code, out = cli_json("scrub", root, "--remote", remote_url, "--deep")
    assert code == S.EXIT_DAMAGE
    damaged = {(v["tier"], o["name"]) for v in out["versions"] for o in v["objects"] if o["status"] == "damaged"}
    assert damaged == {("remote", m.objects[0].name)}
    code, out = cli_json("scrub", root, "--remote", remote_url, "--repair")
    assert code == S.EXIT_REPAIRED and st.remote.get(k) == good
    code, out = cli_json("gc", "", "--remote", remote_url, "--keep-last", "1", "--grace", "0")
    assert code == 0, out
    assert _tiers(remote_url) == [("v3", ["remote"])]
    assert not [i.key for i in st.remote.list("versions/") if not i.key.startswith("versions/v3/")]
    shutil.rmtree(root)
    got = load({"w": torch.zeros(300_000), "step": -1}, root, "v3", remote=remote_url)
    assert bits_equal(got["w"], states["v3"]["w"]) and got["step"] == 2


_RACER = textwrap.dedent("""
    import sys, time, torch, torch.distributed.checkpoint as dcp, ckptstore
    root, url, go = sys.argv[1:4]
    sd = {"w": torch.full((50_000,), float(len(root)))}
    w = ckptstore.StorageWriter(root, remote=url, durability="remote", upload_timeout=120)
    while time.time() < float(go):  # both writers commit at about the same moment
        time.sleep(0.005)
    try:
        dcp.save(sd, checkpoint_id="v1", storage_writer=w)
        print("COMMITTED")
    except BaseException as e:
        print("REFUSED", type(e).__name__, "already exists" in str(e))
    try:
        w.close()
    except BaseException:
        pass
""")


@pytest.mark.slow  # default suite: tests/test_races.py (S3) and the conformance suite's put-if-absent race (every tier)
@pytest.mark.parametrize("remote_url", ALL, indirect=True)
def test_two_writers_racing_to_commit_one_version(tmp_path, remote_url):
    """Two jobs (own local roots, one remote prefix) save version v1 at once: the remote commit
    (put-if-absent, docs/FORMAT.md "Conditional writes") lets exactly one through; the other is told
    the version exists, and the remote manifest is the winner's."""
    import time

    go = str(time.time() + 8.0)  # after both interpreters have imported torch
    roots = [str(tmp_path / "a"), str(tmp_path / "bb")]
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, r, remote_url, go], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in roots]
    outs = [p.communicate(timeout=300) for p in procs]
    said = [o.strip().splitlines()[-1] if o.strip() else e[-2000:] for o, e in outs]
    assert sorted(s.split()[0] for s in said) == ["COMMITTED", "REFUSED"], said
    assert any(s.startswith("REFUSED") and s.endswith("True") for s in said), said
    winner = roots[[s.startswith("COMMITTED") for s in said].index(True)]
    remote = ckptstore.Store("", remote=remote_url).remote
    assert remote.get(layout.manifest_key("v1")) == ckptstore.Store(winner).local.get(layout.manifest_key("v1"))
    got = load({"w": torch.zeros(50_000)}, str(tmp_path / "none"), "v1", remote=remote_url)
    assert torch.equal(got["w"], torch.full((50_000,), float(len(winner))))


@pytest.mark.parametrize("remote_url", NEW_DEFAULT, indirect=True)
def test_manager_local_first_then_remote_only(tmp_path, remote_url):
    """CheckpointManager with a remote tier and its options: a restore reads the local root (no
    remote GET of data), and with the root gone the newest version comes from the remote tier alone;
    retention (keep-last 2) is applied in the remote tier after each commit."""
    from ckptstore.retention import KeepLast, RetentionPolicy

    root = str(tmp_path / "root")
    state = {"w": torch.zeros(100_000), "n": 0}
    with ckptstore.CheckpointManager(root, state, remote=remote_url, interval_steps=1, durability="remote",
                                     retention=RetentionPolicy(rules=(KeepLast(2),)), save_rng=False,
                                     remote_options={"max_concurrency": 4}) as m:
        for step in (1, 2, 3):
            state["w"] = torch.full((100_000,), float(step))
            state["n"] = step
            m.save(step)
            m.wait()
    assert [v for v, _t in _tiers(remote_url)] == ["step-2", "step-3"]
    target = {"w": torch.zeros(100_000), "n": -1}
    with ckptstore.CheckpointManager(root, target, remote=remote_url, save_rng=False) as m:
        assert m.restore() == 3 and target["n"] == 3 and torch.equal(target["w"], torch.full((100_000,), 3.0))
        assert m.last_restore.reads.get("remote_reads", 0) == 0  # local first
    shutil.rmtree(root)
    target = {"w": torch.zeros(100_000), "n": -1}
    with ckptstore.CheckpointManager(root, target, remote=remote_url, save_rng=False) as m:
        assert m.restore() == 3 and torch.equal(target["w"], torch.full((100_000,), 3.0))
        assert m.last_restore.reads.get("remote_reads", 0) > 0
