"""gc and retention after commit against real DCP saves: crashed saves, saves in flight, crashes
of gc itself, pins, and the operator CLI's gc/show paths.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptstore
from ckptstore import gc as G
from ckptstore import retention as R
from ckptstore import scrub as S
from ckptstore.manifest import catalogue, layout
from ckptstore.manifest.schema import Manifest, ObjectEntry
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
from test_retention import T0, _records, kept, rules_st, versions_st
from conftest import REMOTES



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

    # within the grace period: v1 kept (newest); v2's leftovers go at once, since the save's writer
    # (its coordinator, on this host) is provably dead (docs/FORMAT.md, Delete rule 15)
    code, out = cli_json("gc", root, "--keep-last", "1")
    assert code == 0 and not out["result"]["failed"]
    assert {a["key"] for a in out["plan"]["actions"]} == set(leftovers)
    assert all("writer died" in a["reason"] for a in out["plan"]["actions"])
    assert files_under(root, "versions/v2/") == {}

    # after the grace period: nothing more goes, v1 stays and loads
    code, out = cli_json("gc", root, "--keep-last", "1", "--now", later(2))
    assert code == 0 and not out["result"]["failed"]
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
    # the killed save stands for one still writing: its writer record names a live process (this one),
    # so neither the next save's housekeeping nor gc reclaims it early (docs/FORMAT.md, Delete rule 15)
    from ckptstore.manifest import writers

    (rec,) = [k for k in files_under(root, "versions/v1500/") if layout.is_writer_record(k)]
    tier.put(rec, json.dumps(writers.identity()).encode())
    partial = files_under(root, "versions/v1500/")
    shards = [k for k in partial if not layout.is_writer_record(k)]
    assert len(shards) == 1 and partial[shards[0]] > 0
    w = save(root, "v1000", 1000)
    ds = G.apply_after_commit(tier, policy, w.last_manifest)
    assert [(d.version, d.keep) for d in ds] == [("v500", False), ("v1000", True)]
    assert files_under(root, "versions/v1500/") == partial  # the save in flight is not touched
    assert not os.path.exists(root / "versions" / "v500")
    st = ckptstore.Store(root)
    assert st.latest().version == "v1000"
    assert same(load(root), state(1000))

    # a newer save committed before v1000's retention ran: it is neither counted nor deleted
    save(root, "v2000", 2000)
    ds = G.apply_after_commit(tier, policy, w.last_manifest)
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
    (tmp_path / "empty").mkdir()  # an existing, empty root is an initialised (empty) store
    code, out = cli_json("scrub", tmp_path / "empty")
    assert code == 0 and out["versions"] == []
    assert cli("scrub", tmp_path / "missing").exit_code == 9  # a root that does not exist is an error


# -- Ctrl-C while close() waits for uploads ------------------------------------------------------------------------
WAIT_CHILD = r"""
import os, signal, sys, threading, time
sys.path.insert(0, sys.argv[1])
from ckptstore.dcp.upload import Uploader
from ckptstore.tiers import LocalTier
# Python's own Ctrl-C handler, even when started from a background job (which inherits SIGINT ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
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


# -- the planner over synthetic stores (real manifests, placeholder objects: gc never reads object contents) ----------------------------------------------------------------------------------------
def fake_version(tier: LocalTier, version: str, created: dt.datetime, *, step=None, user=None, pinned=False,
                 damaged=False, ranks=2, mtime=None) -> Manifest:
    attempt = f"{created.strftime('%Y%m%dT%H%M%S')}-{abs(hash(version)) % 10**12:012d}-00001"
    objs = []
    for r in ranks and range(ranks) or []:
        name = layout.shard_name(attempt, r)
        data = os.urandom(64 + r)
        tier.put(layout.object_key(version, name), data)
        objs.append(ObjectEntry(name, len(data), "0" * 16, 1, r, len(data)))
    meta_name = layout.metadata_name(attempt)
    tier.put(layout.object_key(version, meta_name), b"m" * 10)
    m = Manifest(version=version, attempt=attempt, created=created.isoformat().replace("+00:00", "Z"),
                 world_size=ranks, objects=objs, metadata_object=ObjectEntry(meta_name, 10, "0" * 16, 1, None, 10),
                 step=step, user=user or {})
    tier.put_if_absent(layout.manifest_key(version), m.to_bytes(None))
    if pinned:
        tier.put(layout.pin_key(version), b"{}")
    if damaged:
        tier.put(layout.damaged_key(version), json.dumps({"reason": "test"}).encode())
    if mtime is not None:
        for i in tier.list(layout.version_dir(version) + "/"):
            os.utime(tier.local_path(i.key), (mtime, mtime))
    return m


def put_garbage(tier: LocalTier, key: str, mtime: float, size: int = 7) -> None:
    tier.put(key, b"g" * size)
    os.utime(tier.local_path(key), (mtime, mtime))


def files(root) -> set[str]:
    out = set()
    for d, _dn, fns in os.walk(root):
        for f in fns:
            out.add(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"))
    return out


def test_plan_and_apply_synthetic(tmp_path):
    t = LocalTier(tmp_path)
    now = T0 + dt.timedelta(days=3)
    old = (now - dt.timedelta(hours=5)).timestamp()
    young = (now - dt.timedelta(minutes=5)).timestamp()
    ms = {}
    for i in range(5):
        ms[f"v{i}"] = fake_version(t, f"v{i}", T0 + dt.timedelta(hours=i), step=i * 100, pinned=(i == 0), damaged=(i == 1),
                                   mtime=old)
    att = ms["v4"].attempt
    # garbage: an aborted attempt of a new version (old and young), a superseded attempt of v4,
    # temp files, an upload marker, a leftover damage mark, an empty dir
    put_garbage(t, "versions/v9/attempts/20260101T000000-aaaaaaaaaaaa-00001/r00000.ckd", old)
    put_garbage(t, "versions/v8/attempts/20260101T000000-bbbbbbbbbbbb-00001/r00000.ckd", young)
    put_garbage(t, "versions/v4/attempts/20250101T000000-cccccccccccc-00001/r00000.ckd", old)
    put_garbage(t, "versions/v4/.tmp-0123456789abcdef", old)
    put_garbage(t, f"versions/v4/attempts/{att}/uploaded.r00000.json", old)
    put_garbage(t, "versions/v7/damaged.json", old)
    put_garbage(t, "stray.txt", old)
    os.makedirs(tmp_path / "versions" / "v6" / "attempts" / "x")
    os.utime(tmp_path / "versions" / "v6" / "attempts" / "x", (old, old))
    policy = R.RetentionPolicy(per_tier={"local": [R.KeepLast(2)]})
    before = files(tmp_path)

    p1 = G.plan([G.collect(t, "local")], policy, now, 3600)
    p2 = G.plan([G.collect(t, "local")], policy, now, 3600)
    assert p1.to_json() == p2.to_json()  # the dry run's plan is the real run's plan
    assert files(tmp_path) == before  # planning touches nothing
    d = {x.version: x for x in p1.decisions["local"]}
    assert [v for v, x in d.items() if not x.keep] == ["v1", "v2"]
    assert R.REASON_PINNED in d["v0"].reasons
    # every un-commit comes before every object deletion
    ops = [a.op for a in p1.actions]
    assert ops.index("delete") > max(i for i, o in enumerate(ops) if o == "uncommit")
    deleted = {a.key for a in p1.actions if a.op == "delete"}
    assert "versions/v1/damaged.json" in deleted
    assert "versions/v9/attempts/20260101T000000-aaaaaaaaaaaa-00001/r00000.ckd" in deleted
    assert "versions/v4/attempts/20250101T000000-cccccccccccc-00001/r00000.ckd" in deleted
    assert "versions/v4/.tmp-0123456789abcdef" in deleted
    assert f"versions/v4/attempts/{att}/uploaded.r00000.json" in deleted
    assert "versions/v7/damaged.json" in deleted
    surv = {s.key: s.reason for s in p1.survivors}
    assert "younger than the grace period" in surv["versions/v8/attempts/20260101T000000-bbbbbbbbbbbb-00001/r00000.ckd"]
    assert "stray.txt" not in deleted and "stray.txt" not in surv  # outside versions/: not even listed
    assert [a.key for a in p1.actions if a.op == "rmdir"] == ["versions/v6/attempts/x"]

    res = G.apply({"local": t}, p1)
    assert res.ok and not res.skipped
    assert res.applied == p1.actions
    after = files(tmp_path)
    for v in ("v0", "v3", "v4"):
        m = ms[v]
        assert layout.manifest_key(v) in after
        assert all(layout.object_key(v, o.name) in after for o in m.all_objects())
    assert "versions/v0/pinned" in after
    assert not any(k.startswith(("versions/v1/", "versions/v2/", "versions/v9/", "versions/v7/", "versions/v6/")) for k in after)
    assert not os.path.exists(tmp_path / "versions" / "v6")
    assert "stray.txt" in after
    # idempotent: a second run finds nothing more to do
    p3 = G.plan([G.collect(t, "local")], policy, now, 3600)
    assert p3.actions == []


def test_apply_rechecks_pin_and_reattempt(tmp_path):
    t = LocalTier(tmp_path)
    for i in range(3):
        fake_version(t, f"v{i}", T0 + dt.timedelta(hours=i))
    now = T0 + dt.timedelta(days=1)
    p = G.plan([G.collect(t, "local")], R.RetentionPolicy(rules=[R.KeepLast(1)]), now, 0)
    assert sorted(G.plan([G.collect(t, "local")], R.RetentionPolicy(rules=[R.KeepLast(1)]), now, 0).deleted_versions["local"]) == ["v0", "v1"]
    # meanwhile: v0 gets pinned and v1 is re-committed by another attempt
    t.put(layout.pin_key("v0"), b"{}")
    t.delete(layout.manifest_key("v1"))
    m1 = fake_version(t, "v1", T0 + dt.timedelta(hours=5))
    res = G.apply({"local": t}, p)
    skipped = {(a.op, a.version) for a, _why in res.skipped}
    assert ("uncommit", "v0") in skipped and ("uncommit", "v1") in skipped
    assert t.exists(layout.manifest_key("v0")) and t.exists(layout.manifest_key("v1"))
    assert all(t.exists(layout.object_key("v1", o.name)) for o in m1.all_objects())
    # the objects of v0 were not deleted either (their un-commit was skipped)
    assert not any(a.version == "v0" for a in res.applied)


def test_garbage_that_changed_is_skipped(tmp_path):
    t = LocalTier(tmp_path)
    key = "versions/v9/attempts/20260101T000000-aaaaaaaaaaaa-00001/r00000.ckd"
    put_garbage(t, key, (T0 - dt.timedelta(hours=3)).timestamp())
    p = G.plan([G.collect(t, "local")], None, T0, 3600)
    assert [a.key for a in p.actions] == [key]
    with open(t.local_path(key), "ab") as f:  # still being written
        f.write(b"more")
    res = G.apply({"local": t}, p)
    assert res.skipped and "changed since the plan" in res.skipped[0][1]
    assert t.exists(key)


def test_invalid_manifest_dir_left_alone(tmp_path):
    t = LocalTier(tmp_path)
    fake_version(t, "v0", T0, mtime=(T0 - dt.timedelta(days=1)).timestamp())
    fake_version(t, "v1", T0 + dt.timedelta(hours=1))
    path = t.local_path(layout.manifest_key("v0"))
    data = bytearray(open(path, "rb").read())
    data[30] ^= 1
    open(path, "wb").write(bytes(data))
    p = G.plan([G.collect(t, "local")], R.RetentionPolicy(rules=[R.KeepLast(1)]), T0 + dt.timedelta(days=2), 0)
    assert p.actions == []
    assert p.problems and p.problems[0][1] == layout.manifest_key("v0")
    assert all("invalid" in s.reason for s in p.survivors)


def test_a_manifest_changed_between_scans_is_read_as_it_is_now(tmp_path):
    """Retention scans the root after every commit and does not parse bytes it parsed before; a
    manifest whose bytes changed since (another attempt committed under the name, a flipped bit) is
    what the next scan sees, never the earlier parse."""
    t = LocalTier(tmp_path)
    fake_version(t, "v0", T0)
    fake_version(t, "v1", T0 + dt.timedelta(hours=1))
    first = catalogue.scan(t)
    assert catalogue.scan(t)["v0"].manifest.attempt == first["v0"].manifest.attempt
    path = t.local_path(layout.manifest_key("v0"))
    os.remove(path)
    again = fake_version(t, "v0", T0 + dt.timedelta(hours=2))  # another attempt under the same name
    assert again.attempt != first["v0"].manifest.attempt
    assert catalogue.scan(t)["v0"].manifest.attempt == again.attempt
    data = bytearray(open(path, "rb").read())
    data[30] ^= 1
    open(path, "wb").write(bytes(data))
    problems: list = []
    assert set(catalogue.scan(t, problems)) == {"v1"}
    assert problems and problems[0][1] == layout.manifest_key("v0")


def test_pin_in_one_tier_protects_in_all(tmp_path):
    a, b = LocalTier(tmp_path / "a"), LocalTier(tmp_path / "b")
    for i in range(3):
        fake_version(a, f"v{i}", T0 + dt.timedelta(hours=i), pinned=(i == 0))
        fake_version(b, f"v{i}", T0 + dt.timedelta(hours=i))
    p = G.plan([G.collect(a, "local"), G.collect(b, "remote")], R.RetentionPolicy(rules=[R.KeepLast(1)]), T0 + dt.timedelta(days=1), 0)
    assert p.deleted_versions == {"local": ["v1"], "remote": ["v1"]}


def test_versions_not_yet_uploaded_are_kept_locally(tmp_path):
    local, remote = LocalTier(tmp_path / "l"), LocalTier(tmp_path / "r")
    for i in range(4):
        fake_version(local, f"v{i}", T0 + dt.timedelta(hours=i))
        if i < 2:
            fake_version(remote, f"v{i}", T0 + dt.timedelta(hours=i))
    policy = R.RetentionPolicy(rules=[R.KeepLast(1)])
    p = G.plan([G.collect(local, "local"), G.collect(remote, "remote")], policy, T0 + dt.timedelta(days=1), 0)
    assert p.deleted_versions == {"local": ["v0", "v1"], "remote": ["v0"]}
    v2 = next(d for d in p.decisions["local"] if d.version == "v2")
    assert v2.keep and "not yet committed in the remote tier (its upload may be pending)" in v2.reasons
    # without the remote tier in the run, the local rules alone decide
    p = G.plan([G.collect(local, "local")], policy, T0 + dt.timedelta(days=1), 0)
    assert p.deleted_versions == {"local": ["v0", "v1", "v2"]}
    ds = G.apply_after_commit(local, policy, catalogue.read_manifest(local, "v3").manifest,
                              protect={"v2": "upload pending"})
    assert kept(ds) == ["v2", "v3"] and "upload pending" in ds[2].reasons


def test_multipart_uploads_aborted_after_grace(tmp_path):
    class UploadsTier(LocalTier):
        """A local tier that also tracks multipart uploads (as the S3 tier does)."""

        supports_multipart = True

        def __init__(self, root, uploads):
            super().__init__(root)
            self.uploads = uploads
            self.aborted = []

        def list_multipart_uploads(self, prefix=""):
            return [u for u in self.uploads if u[0].startswith(prefix)]

        def abort_multipart_upload(self, key, upload_id):
            self.aborted.append((key, upload_id))

    now = T0
    t = UploadsTier(tmp_path, [("versions/v1/attempts/a-1/r00000.ckd", "old", now - dt.timedelta(hours=2)),
                               ("versions/v1/attempts/a-1/r00001.ckd", "new", (now - dt.timedelta(minutes=1)).timestamp())])
    p, res = G.run({"remote": t}, None, now=now, grace=3600)
    assert [(a.op, a.upload_id) for a in p.actions] == [("abort-upload", "old")]
    assert t.aborted == [("versions/v1/attempts/a-1/r00000.ckd", "old")]
    assert any("in progress" in s.reason for s in p.survivors)


def test_apply_after_commit_window(tmp_path):
    t = LocalTier(tmp_path)
    ms = [fake_version(t, f"v{i}", T0 + dt.timedelta(hours=i)) for i in range(4)]
    # a newer save committed before the retention of v2 ran: it is neither counted nor deleted
    ds = G.apply_after_commit(t, R.RetentionPolicy(rules=[R.KeepLast(1)]), ms[2])
    assert [d.version for d in ds] == ["v0", "v1", "v2"]
    assert kept(ds) == ["v2"]
    assert {r.version for r in catalogue.merge({"local": catalogue.scan(t)})} == {"v2", "v3"}
    assert "just committed" in ds[-1].reasons
    # a pin in another tier protects the version here too
    other = LocalTier(tmp_path / "other")
    m4 = fake_version(t, "v4", T0 + dt.timedelta(hours=4))
    fake_version(other, "v3", T0 + dt.timedelta(hours=3), pinned=True)
    ds = G.apply_after_commit(t, R.RetentionPolicy(rules=[R.KeepLast(1)]), m4, others={"remote": other})
    assert kept(ds) == ["v3", "v4"] and R.REASON_PINNED in ds[1].reasons
    ds = G.apply_after_commit(t, R.RetentionPolicy(rules=[R.KeepLast(1)]), m4)
    assert kept(ds) == ["v4"]
    # no rule for this tier: nothing happens
    assert G.apply_after_commit(t, R.RetentionPolicy(per_tier={"remote": [R.KeepLast(1)]}), m4) == []
    assert G.apply_after_commit(t, None, m4) == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(versions_st, rules_st, st.lists(st.tuples(st.integers(0, 9), st.integers(0, 7200)), max_size=6), st.integers(0, 7200))
def test_property_dry_run_plan_equals_applied_plan(tmp_path_factory, spec, rules, garbage, grace):
    root = tmp_path_factory.mktemp("prop")
    t = LocalTier(root)
    vs = _records(spec)
    now = T0 + dt.timedelta(days=10)
    ms = {}
    for r in vs:
        ms[r.version] = fake_version(t, r.version, r.created, step=r.step, user=r.user, pinned=r.pinned,
                                     damaged=r.damaged, ranks=1, mtime=(now - dt.timedelta(hours=3)).timestamp())
    for i, (v, age) in enumerate(garbage):
        put_garbage(t, f"versions/g{v}/attempts/20260101T000000-{i:012d}-00001/r00000.ckd", now.timestamp() - age)
    policy = R.RetentionPolicy(rules=rules)
    dry = G.plan([G.collect(t, "local")], policy, now, grace)
    real = G.plan([G.collect(t, "local")], policy, now, grace)
    assert dry.to_json() == real.to_json()
    res = G.apply({"local": t}, real)
    assert res.ok and res.applied == real.actions
    left = catalogue.merge({"local": catalogue.scan(t)})
    keep = [d.version for d in real.decisions["local"] if d.keep]
    assert [r.version for r in left] == keep
    if vs:
        assert max(vs, key=lambda r: r.order).version in keep
    assert {r.version for r in vs if r.pinned} <= set(keep)
    for r in left:  # every surviving committed version still has all its objects
        assert all(t.exists(layout.object_key(r.version, o.name)) for o in ms[r.version].all_objects())
    for i, (v, age) in enumerate(garbage):
        key = f"versions/g{v}/attempts/20260101T000000-{i:012d}-00001/r00000.ckd"
        assert t.exists(key) == (age < grace)
    assert G.plan([G.collect(t, "local")], policy, now, grace).actions == []


# -- S3-only gc: an absent or empty local tier protects nothing remotely -------------------------------------------
@pytest.mark.parametrize("local", ["none", "empty-string", "empty-root"])
def test_gc_without_a_local_tier_deletes_remotely(tmp_path, monkeypatch, local):
    """s1–s6 committed remotely; gc keep-last 1, grace 0, from a place without a local copy (no root,
    ``''``, or a node whose local root is empty) deletes s1–s5 remotely."""
    remote = LocalTier(tmp_path / "remote")
    remote.name = "remote"
    for i in range(1, 7):
        fake_version(remote, f"s{i}", T0 + dt.timedelta(hours=i))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # '' must not open the current directory as the local tier
    root = {"none": None, "empty-string": "", "empty-root": tmp_path / "empty"}[local]
    st = ckptstore.Store(root, remote=remote)
    if local != "empty-root":
        assert st.local is None and list(st.tiers) == ["remote"]
    p, res = G.run(st.tiers, R.RetentionPolicy(rules=[R.KeepLast(1)]), now=T0 + dt.timedelta(days=1), grace=0)
    assert res.ok
    assert p.deleted_versions["remote"] == ["s1", "s2", "s3", "s4", "s5"], [
        (d.version, d.reasons) for d in p.decisions["remote"]]
    assert [r.version for r in st.versions()] == ["s6"]
    assert not os.listdir(cwd)


# -- drop: remove one version on request (a damaged newest version included) ---------------------------------------
def test_drop_removes_a_damaged_newest_version(tmp_path):
    from ckptstore.errors import CkptStoreError, VersionNotFoundError

    local, remote = LocalTier(tmp_path / "l"), LocalTier(tmp_path / "r")
    remote.name = "remote"
    ms = {}
    for i in range(4):
        ms[f"v{i}"] = fake_version(local, f"v{i}", T0 + dt.timedelta(hours=i))
        fake_version(remote, f"v{i}", T0 + dt.timedelta(hours=i))
    local.put(layout.damaged_key("v3"), json.dumps({"reason": "r00000.ckd: corrupt", "attempt": ms["v3"].attempt}).encode())
    st = ckptstore.Store(tmp_path / "l", remote=remote)
    assert st.latest().version == "v2"
    # retention never removes the newest committed version, damaged or not
    p, _ = G.run(st.tiers, R.RetentionPolicy(rules=[R.KeepLast(1)]), now=T0 + dt.timedelta(days=1), grace=0, dry_run=True)
    assert "v3" not in p.deleted_versions["local"]

    p = G.plan_drop(st, "v3")
    ops = [(a.tier, a.op) for a in p.actions]
    assert ops[:2] == [("local", "uncommit"), ("remote", "uncommit")]  # every un-commit before any deletion
    assert all(op == "delete" for _t, op in ops[2:])
    assert p.deleted_versions == {"local": ["v3"], "remote": ["v3"]}
    res = G.apply(st.tiers, p)
    assert res.ok and not res.skipped and res.applied == p.actions
    assert [r.version for r in st.versions()] == ["v0", "v1", "v2"] and st.latest().version == "v2"
    assert not any(k.startswith("versions/v3/") for k in files(tmp_path / "l") | files(tmp_path / "r"))

    # pinned: refused unless forced; forced, the pin goes with the version
    st.pin("v2")
    with pytest.raises(CkptStoreError, match="pinned"):
        G.plan_drop(st, "v2")
    res = G.apply(st.tiers, G.plan_drop(st, "v2", force=True))
    assert res.ok and [r.version for r in st.versions()] == ["v0", "v1"]
    assert not any(k.startswith("versions/v2/") for k in files(tmp_path / "l") | files(tmp_path / "r"))

    # one tier only
    res = G.apply(st.tiers, G.plan_drop(st, "v1", tiers=["local"]))
    assert res.ok and [(r.version, sorted(r.tiers)) for r in st.versions()] == [("v0", ["local", "remote"]), ("v1", ["remote"])]

    # a version whose manifest no longer parses: its directory goes, manifest first
    path = local.local_path(layout.manifest_key("v0"))
    with open(path, "r+b") as f:
        f.seek(30)
        f.write(b"#")
    p = G.plan_drop(st, "v0", tiers=["local"])
    assert p.actions[0].key == layout.manifest_key("v0") and len(p.actions) == 4
    assert G.apply(st.tiers, p).ok and not any(k.startswith("versions/v0/") for k in files(tmp_path / "l"))

    with pytest.raises(VersionNotFoundError):
        G.plan_drop(st, "nope")


def test_retention_after_commit_waits_for_uploads(tmp_path):
    """Locally, retention after a commit keeps what the remote tier does not hold yet: a version whose
    upload is running (even when a newer one was committed remotely first), the newest two not known
    remotely while the remote catalogue cannot be read (bounded: a long outage never fills the root);
    a pin in the remote tier protects here too, once the remote catalogue can be read."""
    from ckptstore.errors import TransientStorageError
    from ckptstore.testing.faulty_tier import FaultyTier

    local, remote = LocalTier(tmp_path / "l"), LocalTier(tmp_path / "r")
    remote.name = "remote"
    ms = [fake_version(local, f"v{i}", T0 + dt.timedelta(hours=i)) for i in range(5)]
    for i in (0, 2, 3):
        fake_version(remote, f"v{i}", T0 + dt.timedelta(hours=i), pinned=(i == 0))
    policy = R.RetentionPolicy(rules=[R.KeepLast(1)])
    down = FaultyTier(remote, {"get": (lambda key: key.endswith(layout.MANIFEST), TransientStorageError("injected: 503"))})
    other = LocalTier(tmp_path / "l2")  # the same five versions on another root
    ms2 = [fake_version(other, f"v{i}", T0 + dt.timedelta(hours=i)) for i in range(5)]
    ds = G.apply_after_commit(other, policy, ms2[4], others={"remote": down})
    assert kept(ds) == ["v3", "v4"]  # remote unknown: the newest two wait for their uploads (v0's remote pin is not seen)
    ds = G.apply_after_commit(local, policy, ms[4], others={"remote": remote}, in_flight={"v1"})
    assert kept(ds) == ["v0", "v1", "v4"]
    assert R.REASON_PINNED in ds[0].reasons and "not yet committed in the remote tier" in ds[1].reasons[0]
    ds = G.apply_after_commit(local, policy, ms[4], others={"remote": remote})
    assert kept(ds) == ["v0", "v4"]  # v1's upload is over: older than v3 remotely, not waited for
    assert [r.version for r in ckptstore.Store(tmp_path / "l").versions()] == ["v0", "v4"]


@pytest.mark.parametrize("remote_url", REMOTES, indirect=True)
def test_gc_remote_only(tmp_path, monkeypatch, remote_url):
    """The same through a real remote prefix (S3, GCS, Azure): ``Store('', remote=URL)`` has no local tier."""
    s3_url = remote_url
    monkeypatch.chdir(tmp_path)
    st = ckptstore.Store("", remote=s3_url)
    assert list(st.tiers) == ["remote"]
    for i in range(1, 7):
        fake_version(st.remote, f"s{i}", T0 + dt.timedelta(hours=i))
    p, res = G.run(st.tiers, R.RetentionPolicy(rules=[R.KeepLast(1)]), now=T0 + dt.timedelta(days=1), grace=0)
    assert res.ok and p.deleted_versions == {"remote": ["s1", "s2", "s3", "s4", "s5"]}
    assert [r.version for r in st.versions()] == ["s6"]
    assert not [i.key for i in st.remote.list("versions/") if not i.key.startswith("versions/s6/")]


def test_a_lease_keeps_what_a_save_in_flight_references_until_it_expires(tmp_path):
    """Delete rule 13: ``drop`` un-commits a version but keeps the objects a live lease names (and says
    why in its plan); once the lease is older than the lease time, gc deletes it and those objects."""
    from ckptstore.manifest import leases

    root = str(tmp_path)
    for v in ("v1", "v2"):
        dcp.save({"w": torch.randn(1000)}, checkpoint_id=v, storage_writer=ckptstore.StorageWriter(root))
    t = LocalTier(root)
    m1 = catalogue.read_manifest(t, "v1").manifest
    obj = layout.object_key("v1", m1.objects[0].name)
    lease = leases.write(t, "v3", "20261201T000000-000000000000-00001", "r00000", [obj])
    st = ckptstore.Store(root)
    plan = G.plan_drop(st, "v1")
    assert obj not in {a.key for a in plan.actions}
    assert any(s.key == obj and "leased by the save of 'v3' in flight" in s.reason for s in plan.survivors), plan.survivors
    assert G.apply(st.tiers, plan).ok
    assert [r.version for r in ckptstore.Store(root).versions()] == ["v2"] and t.exists(obj)
    _plan, res = G.run(st.tiers, None, grace=0)  # the lease is younger than the lease time: kept
    assert res.ok and t.exists(obj) and t.exists(lease)
    old = t.stat(lease).mtime - leases.TTL - 1
    os.utime(t.local_path(lease), (old, old))  # its save died more than the lease time ago
    _plan, res = G.run(st.tiers, None, grace=0)
    assert res.ok and not t.exists(obj) and not t.exists(lease)


# -- superseded attempts (docs/FORMAT.md, Delete rule 12) -------------------------------------------------
def _attempt_dirs(root: str) -> dict[str, list[str]]:
    """``{version dir name: [attempt dirs]}`` on disk."""
    out = {}
    vroot = os.path.join(root, "versions")
    for v in sorted(os.listdir(vroot)):
        adir = os.path.join(vroot, v, "attempts")
        out[v] = sorted(os.listdir(adir)) if os.path.isdir(adir) else []
    return out


def test_retention_reclaims_superseded_attempts_once_no_manifest_references_them(tmp_path):
    """A rewind (``restore(version="step-0")``, torchtitan's ``--checkpoint.load-step``) then saves
    under retention: the abandoned attempts of ``step-1`` and ``step-2`` go with the retention run of
    the commit that superseded them — before, they stayed (a whole checkpoint each) until a
    ``ckptstore gc`` an hour later — except an object the abandoned ``step-2`` still references
    (incremental), which goes once ``step-2`` is superseded too. ``gc`` deletes such objects without
    waiting for the grace period."""
    from ckptstore import CheckpointManager

    root = str(tmp_path)
    state = {"base": torch.arange(4096.0), "x": torch.zeros(256), "y": torch.zeros(256)}
    with CheckpointManager(root, {"s": state}, incremental=True, save_rng=False) as mgr:
        for step in (0, 1, 2):
            state["x"].fill_(step)
            if step == 1:
                state["y"].fill_(1)  # y changes at step 1 only: step-2 references step-1's object
            mgr.save(step)
            mgr.wait()
    old = {v: ckptstore.Store(root).get(v).attempt for v in ("step-1", "step-2")}
    m2 = catalogue.read_manifest(LocalTier(root), "step-2").manifest
    assert any(r.version == "step-1" for r in m2.refs)  # the abandoned step-2 references old step-1's object
    keep = R.RetentionPolicy([R.KeepLast(10)])
    with CheckpointManager(root, {"s": state}, incremental=True, save_rng=False, retention=keep) as mgr:
        assert mgr.restore(version="step-0") == 0
        state["x"].fill_(11)
        mgr.save(1)
        mgr.wait()
        dirs = _attempt_dirs(root)
        new1 = ckptstore.Store(root).get("step-1").attempt
        assert dirs["step-1"] == sorted([new1, old["step-1"]]), dirs  # the referenced object is kept ...
        kept_old = os.listdir(os.path.join(root, "versions", "step-1", "attempts", old["step-1"]))
        assert kept_old == [r.name.split("/")[-1] for r in m2.refs if r.version == "step-1"], kept_old
        mgr.save(2)  # ... until step-2 is superseded too: then nothing of the old timeline is left
        mgr.wait()
    dirs = _attempt_dirs(root)
    assert dirs == {"step-0": [ckptstore.Store(root).get("step-0").attempt],
                    "step-1": [new1], "step-2": [ckptstore.Store(root).get("step-2").attempt]}, dirs
    assert _scrub_deep(root) == 0


def _scrub_deep(root: str) -> int:
    from click.testing import CliRunner

    from ckptstore.cli import main

    return CliRunner().invoke(main, ["scrub", root, "--deep"], catch_exceptions=False).exit_code


def test_gc_deletes_a_superseded_attempt_without_the_grace_period(tmp_path):
    """Without retention in the job, ``ckptstore gc`` (default grace 1 h) reclaims a superseded attempt
    at once: it was committed before it was superseded, nothing writes to it (Delete rule 12); an
    aborted attempt of the same age still waits for the grace period."""
    from ckptstore import CheckpointManager

    root = str(tmp_path)
    model = torch.nn.Linear(64, 64)
    with CheckpointManager(root, {"model": model}, save_rng=False) as mgr:
        for s in (1, 2):
            mgr.save(s)
    with CheckpointManager(root, {"model": model}, save_rng=False) as mgr:
        assert mgr.restore(version="step-1") == 1
        mgr.save(2)
    rec = ckptstore.Store(root).get("step-2")
    (old,) = [a for a, _ in rec.supersedes]
    put_garbage(LocalTier(root), "versions/step-9/attempts/20260101T000000-aaaaaaaaaaaa-00001/r00000.ckd",
                dt.datetime.now().timestamp())
    p, res = G.run({"local": LocalTier(root)}, None)
    gone = {a.key for a in p.actions}
    assert gone and all(f"/attempts/{old}/" in k for k in gone), gone
    assert all("Delete rule 12" in a.reason for a in p.actions)
    assert res.ok and _attempt_dirs(root)["step-2"] == [rec.attempt]
    assert any("younger than the grace period" in s.reason for s in p.survivors if "step-9" in s.key)
