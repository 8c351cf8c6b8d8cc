"""gc and retention after commit against real DCP saves: crashed saves, saves in flight, crashes
of gc itself, pins, and the operator CLI's gc/show paths.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore import gc as G
from ckptstore import retention as R
from ckptstore import scrub as S
from ckptstore.manifest import layout
from ckptstore.tiers import LocalTier
from store_helpers import (
    UTC,
    cli,
    cli_json,
    crashing_save,
    files_under,
    later,
    load,
    same,
    save,
    state,
)


# -- 1. keep-last 1, second save killed before its manifest ---------------------------------------------------
def test_keep_last_1_save_killed_before_manifest(tmp_path):
    root = tmp_path / "s"
    save(root, "v1", 1, asynchronous=True)
    assert crashing_save(root, "v2", 2, "commit.manifest") == -signal.SIGKILL
    leftovers = files_under(root, "versions/v2/")
    assert leftovers and not any(k.endswith("manifest.json") for k in leftovers)
    st = ckptstore.Store(root)
    assert [r.version for r in st.versions()] == ["v1"] and st.latest().version == "v1"
    assert same(load(root), state(1))

    # within the grace period: v1 kept (newest), v2's leftovers kept (maybe a save in flight)
    code, out = cli_json("gc", root, "--keep-last", "1")
    assert code == 0
    assert out["plan"]["actions"] == []
    surv = {s["key"]: s["reason"] for s in out["plan"]["survivors"]}
    assert set(leftovers) <= set(surv) and all("younger than the grace period" in surv[k] for k in leftovers)
    assert files_under(root, "versions/v2/") == leftovers

    # after the grace period: the leftovers go, v1 stays and loads
    code, out = cli_json("gc", root, "--keep-last", "1", "--now", later(2))
    assert code == 0 and not out["result"]["failed"]
    assert {a["key"] for a in out["plan"]["actions"]} == set(leftovers)
    assert files_under(root, "versions/v2/") == {} and not os.path.exists(root / "versions" / "v2")
    assert [d["version"] for d in out["plan"]["tiers"]["local"]["decisions"] if d["keep"]] == ["v1"]
    assert same(load(root), state(1))


# -- 2. keep-last 1 with a save every step: v1000 commits while v1500 is still writing ----------------------------
def test_keep_last_1_while_next_save_is_writing(tmp_path):
    root = tmp_path / "s"
    tier = LocalTier(root)
    policy = R.RetentionPolicy(rules=[R.KeepLast(1)])
    save(root, "v500", 500)
    assert crashing_save(root, "v1500", 1500, "write.frame:3") == -signal.SIGKILL
    partial = files_under(root, "versions/v1500/")
    assert len(partial) == 1 and list(partial.values())[0] > 0
    w = save(root, "v1000", 1000)
    ds = R.apply_after_commit(tier, policy, w.last_manifest)
    assert [(d.version, d.keep) for d in ds] == [("v500", False), ("v1000", True)]
    assert files_under(root, "versions/v1500/") == partial  # the save in flight is not touched
    assert not os.path.exists(root / "versions" / "v500")
    st = ckptstore.Store(root)
    assert st.latest().version == "v1000"
    assert same(load(root), state(1000))

    # a newer save committed before v1000's retention ran: it is neither counted nor deleted
    save(root, "v2000", 2000)
    ds = R.apply_after_commit(tier, policy, w.last_manifest)
    assert [(d.version, d.keep) for d in ds] == [("v1000", True)]
    assert [r.version for r in st.versions()] == ["v1000", "v2000"]
    assert same(load(root, "v1000"), state(1000)) and same(load(root), state(2000))

    p, res = G.run({"local": tier}, None, now=dt.datetime.now(UTC) + dt.timedelta(hours=2))
    assert {a.key for a in p.actions if a.op == "delete"} == set(partial) and res.ok


# -- 5. dry run == real run; gc during a save in flight -------------------------------------------------------------
def test_gc_dry_run_matches_real_run(tmp_path):
    root = tmp_path / "s"
    for i in range(4):
        save(root, f"v{i}", i * 100, user_metadata={"loss": [0.5, 0.1, 0.4, 0.3][i]})
    save(root, "v9", 900)  # ... whose commit is then undone: what a crash just before the manifest leaves
    os.unlink(root / "versions" / "v9" / "manifest.json")
    args = ["gc", root, "--keep-last", "1", "--keep-best", "1", "--metric", "loss", "--now", later(3)]
    r = cli(*args, "--dry-run")
    assert r.exit_code == 0, r.output
    assert "would remove" in r.stdout and "keep-best 1 by min loss: loss=0.1, 1st best" in r.stdout
    before = files_under(root)
    code, dry = cli_json(*args, "--dry-run")
    assert files_under(root) == before and dry["result"] is None and dry["dry_run"] is True
    code, real = cli_json(*args)
    assert code == 0
    assert dry["plan"] == real["plan"]
    assert real["result"]["applied"] == real["plan"]["actions"]
    assert [r.version for r in ckptstore.Store(root).versions()] == ["v1", "v3"]
    assert not os.path.exists(root / "versions" / "v9")
    assert same(load(root, "v1"), state(100)) and same(load(root), state(300))


def test_gc_while_a_save_is_in_flight(tmp_path):
    root = tmp_path / "s"
    save(root, "v0", 0)
    tier = LocalTier(root)
    big = {"w": torch.randn(12 << 20), "b": torch.arange(5)}
    errors = []

    def saver():
        try:
            w = ckptstore.StorageWriter(root, step=1, frame_size=256 << 10, threads=1)
            dcp.save(big, checkpoint_id="big", storage_writer=w)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=saver)
    th.start()
    seen_in_flight = 0
    runs = 0
    policy = R.RetentionPolicy(rules=[R.KeepLast(1)])
    while th.is_alive():
        p, res = G.run({"local": tier}, policy)
        runs += 1
        assert res.ok
        assert not any(a.key.startswith("versions/big/") for a in p.actions)
        assert not [d for d in p.decisions["local"] if not d.keep and d.version == "big"]
        seen_in_flight += any(s.key.startswith("versions/big/") for s in p.survivors)
    th.join()
    assert not errors, errors
    assert seen_in_flight > 0, f"gc never overlapped the save ({runs} runs)"
    p, res = G.run({"local": tier}, policy)  # once committed, the older version goes (maybe already did)
    assert res.ok and [r.version for r in ckptstore.Store(root).versions()] == ["big"]
    out = {"w": torch.zeros(12 << 20), "b": torch.zeros(5, dtype=torch.int64)}
    dcp.load(out, storage_reader=ckptstore.StorageReader(root))
    assert torch.equal(out["w"].view(torch.int32), big["w"].view(torch.int32)) and torch.equal(out["b"], big["b"])


@pytest.mark.parametrize("fault", ["gc.uncommit:2", "gc.delete:3"])
def test_gc_crash_never_leaves_a_committed_version_incomplete(tmp_path, fault):
    root = tmp_path / "s"
    for i in range(4):
        save(root, f"v{i}", i)
    env = {**os.environ, "CKPTSTORE_FAULT": fault}
    rc = subprocess.run([sys.executable, "-m", "ckptstore.cli", "gc", str(root), "--keep-last", "1", "--grace", "0"],
                        env=env, capture_output=True, timeout=120).returncode
    assert rc == -signal.SIGKILL
    st = ckptstore.Store(root)
    assert cli("scrub", root).exit_code == S.EXIT_CLEAN  # every still-committed version is complete
    assert st.latest().version == "v3"
    code, out = cli_json("gc", root, "--keep-last", "1", "--grace", "0")
    assert code == 0 and not out["result"]["failed"]
    assert [r.version for r in st.versions()] == ["v3"]
    assert set(files_under(root)) == {layout.manifest_key("v3")} | {
        layout.object_key("v3", o.name) for o in st.manifest("v3").manifest.all_objects()}
    assert same(load(root), state(3))


# -- 6. pins ------------------------------------------------------------------------------------------------------
def test_pinned_survives_every_policy_until_unpinned(tmp_path):
    root = tmp_path / "s"
    for i in range(3):
        save(root, f"v{i}", i * 1000, user_metadata={"loss": 1.0 - i / 10})
    code, out = cli_json("pin", root, "v0")
    assert code == 0 and out == {"version": "v0", "pinned": True, "tiers": ["local"]}
    assert ckptstore.Store(root).get("v0").pinned
    for flags in (["--keep-last", "1"], ["--keep-within", "0s"], ["--keep-best", "1", "--metric", "loss", "--mode", "max"],
                  ["--keep-every-steps", "100000"], ["--local-keep-last", "0"]):
        code, out = cli_json("gc", root, *flags, "--grace", "0", "--dry-run")
        d = {x["version"]: x for x in out["plan"]["tiers"]["local"]["decisions"]}
        assert d["v0"]["keep"] and "pinned" in d["v0"]["reasons"], flags
    code, out = cli_json("gc", root, "--keep-last", "1", "--grace", "0")
    assert [r.version for r in ckptstore.Store(root).versions()] == ["v0", "v2"]
    assert cli("show", root, "v0").stdout.count("pinned") >= 1
    code, out = cli_json("unpin", root, "v0")
    assert code == 0 and out["pinned"] is False
    code, out = cli_json("gc", root, "--keep-last", "1", "--grace", "0")
    assert [r.version for r in ckptstore.Store(root).versions()] == ["v2"]
    assert cli("pin", root, "v0").exit_code == 3  # gone


# -- CLI odds and ends --------------------------------------------------------------------------------------------
def test_cli_show_and_usage_errors(tmp_path):
    root = tmp_path / "s"
    save(root, "v1", 7, user_metadata={"loss": 0.25, "note": "x"})
    code, out = cli_json("show", root, "v1", "--objects")
    assert code == 0
    assert out["step"] == 7 and out["world_size"] == 1 and out["tiers"] == ["local"] and out["encrypted"] is False
    assert out["user"] == {"loss": 0.25, "note": "x"} and out["objects"] == 2 and len(out["object_list"]) == 2
    assert out["nbytes"] > 0 and out["stored_bytes"] > 0 and out["compression_ratio"] > 0 and out["codecs"]
    r = cli("show", root, "v1")
    assert r.exit_code == 0 and "world size:" in r.stdout and "not encrypted" in r.stdout
    assert cli("gc", root, "--keep-best", "2").exit_code == 2  # needs --metric
    assert cli("gc", root, "--keep-within", "soon").exit_code == 2
    assert cli("gc", root, "--grace", "x").exit_code == 2
    assert cli("gc", root, "--keep-last", "-1").exit_code == 2
    r = cli("gc", root, "--dry-run")
    assert r.exit_code == 0 and "no retention rule given" in r.stdout
    r = cli("scrub", root)
    assert r.exit_code == 0 and "OK" in r.stdout
    code, out = cli_json("scrub", tmp_path / "empty")
    assert code == 0 and out["versions"] == []


# -- Ctrl-C while close() waits for uploads ------------------------------------------------------------------------
WAIT_CHILD = r"""
import os, signal, sys, threading, time
sys.path.insert(0, sys.argv[1])
from ckptstore.dcp.upload import Uploader
from ckptstore.tiers import LocalTier
up = Uploader(LocalTier(sys.argv[2]), LocalTier(sys.argv[3]), threads=2, timeout=60)
for i in range(2):
    up._submit(f"job {i}", lambda: time.sleep(6))
threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
t0 = time.monotonic()
try:
    left = up.wait(timeout=60)
except KeyboardInterrupt:
    print(f"INTERRUPTED after {time.monotonic() - t0:.1f} s", flush=True)
    os._exit(0)
print(f"RETURNED after {time.monotonic() - t0:.1f} s: {left}", flush=True)
os._exit(1)
"""


def test_ctrl_c_while_waiting_for_uploads_propagates(tmp_path):
    """SIGINT during ``Uploader.wait`` (what ``StorageWriter.close()`` runs) raises KeyboardInterrupt at
    once; it is not recorded as a failed upload while the wait goes on."""
    r = subprocess.run([sys.executable, "-c", WAIT_CHILD, os.path.dirname(os.path.dirname(ckptstore.__file__)),
                        str(tmp_path / "l"), str(tmp_path / "r")], capture_output=True, text=True, timeout=60)
    line = (r.stdout.strip().splitlines() or [r.stderr[-500:]])[-1]
    print(line)
    assert r.returncode == 0 and line.startswith("INTERRUPTED"), line
    assert float(line.split()[2]) < 3.0, line


def test_a_job_raising_keyboard_interrupt_is_not_collected(tmp_path):
    from ckptstore.dcp.upload import Uploader

    up = Uploader(LocalTier(tmp_path / "l"), LocalTier(tmp_path / "r"), threads=1, timeout=10)

    def job():
        raise KeyboardInterrupt

    up._submit("job", job)
    with pytest.raises(KeyboardInterrupt):
        up.wait(timeout=10)
    up.shutdown()
