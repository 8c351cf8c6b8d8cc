"""gc, retention after commit, scrub and the operator CLI against real DCP saves.

Crashes are real: a child process (or one rank of four) arms ``CKPTSTORE_FAULT`` and SIGKILLs
itself at a named point of the save; gc uses an explicit ``now`` (``--now``) or ``grace=0`` instead
of sleeping.
"""

from __future__ import annotations

import base64
import datetime as dt
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

import ckptstore
from ckptstore import gc as G
from ckptstore import retention as R
from ckptstore import scrub as S
from ckptstore.cli import main as cli_main
from ckptstore.manifest import layout
from ckptstore.testing.dist import run_ranks_raw
from ckptstore.tiers import LocalTier

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
from test_gc_scrub import state
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


# -- 3./4. four ranks --------------------------------------------------------------------------------------------
def rank_state(rank: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return {f"r{rank}": torch.randn(8192, generator=g), "shared": torch.arange(seed, seed + 50)}


def all_ranks_state(seed: int, world: int = 4) -> dict:
    sd = {}
    for r in range(world):
        sd.update(rank_state(r, seed))
    return sd


def _ranks_body(rank, world, root, snap, faults):
    import torch.distributed as dist

    import ckptstore._faults

    for seed, version in ((0, "v0"), (1, "v1")):
        w = ckptstore.StorageWriter(root, step=seed, frame_size=4096)
        dcp.save(rank_state(rank, seed), checkpoint_id=version, storage_writer=w)
    dist.barrier()
    if rank == 0:
        shutil.copytree(root, snap)
    dist.barrier()
    # arm this rank's fault for the third save only (the fault module reads its spec once)
    if rank in faults:
        os.environ["CKPTSTORE_FAULT"] = faults[rank]
    importlib.reload(ckptstore._faults)
    w = ckptstore.StorageWriter(root, step=2, frame_size=4096)
    dcp.save(rank_state(rank, 2), checkpoint_id="v2", storage_writer=w)
    return True


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    base = tmp_path_factory.mktemp("ranks")
    root, snap = base / "store", base / "snap"
    saved = os.environ.pop("CKPTSTORE_FAULT", None)
    try:
        faults = {0: "write.frame:1", 2: "write.frame:4"}
        codes = run_ranks_raw(_ranks_body, 4, str(root), str(snap), faults, timeout=150)
    finally:
        if saved is not None:
            os.environ["CKPTSTORE_FAULT"] = saved
    return root, snap, codes


def load_ranks(root, version=None, *, remote=None):
    sd = {k: torch.zeros_like(v) for k, v in all_ranks_state(0).items()}
    dcp.load(sd, storage_reader=ckptstore.StorageReader(root, remote=remote, version=version))
    return sd


def test_four_ranks_two_killed_mid_save(four_ranks):
    root, _snap, codes = four_ranks
    assert codes[0] == -signal.SIGKILL and codes[2] == -signal.SIGKILL, codes
    st = ckptstore.Store(root)
    assert [r.version for r in st.versions()] == ["v0", "v1"]  # nothing new listed
    assert st.latest().version == "v1" and st.latest().world_size == 4
    v2 = files_under(root, "versions/v2/")
    by_rank = {k.rsplit("/", 1)[1]: n for k, n in v2.items()}
    assert by_rank["r00000.ckd"] == 0  # rank 0 died right after creating its file
    full = LocalTier(root).stat(layout.object_key("v1", st.manifest("v1").manifest.objects[2].name)).size
    assert 0 < by_rank["r00002.ckd"] < full  # rank 2 died half-way
    assert not any(k.endswith(("manifest.json", "metadata.ckd")) for k in v2)
    assert same(load_ranks(root), all_ranks_state(1))  # the previous version loads

    rep = S.scrub(st)
    assert rep.exit_code == S.EXIT_CLEAN and rep.damage() == []
    assert {(v.version, v.status) for v in rep.versions} == {("v0", "ok"), ("v1", "ok")}

    before = files_under(root)
    code, out = cli_json("gc", root)  # grace not passed: nothing goes
    assert code == 0 and out["plan"]["actions"] == [] and files_under(root) == before
    code, out = cli_json("gc", root, "--now", later(2))
    assert code == 0
    removed = {a["key"] for a in out["plan"]["actions"] if a["op"] == "delete"}
    assert removed == set(v2)  # exactly the failed attempt's files
    assert files_under(root) == {k: n for k, n in before.items() if k not in v2}
    assert same(load_ranks(root, "v0"), all_ranks_state(0))


def _damage(root, version, name, how):
    p = obj_path(root, version, name)
    if how == "truncate":
        with open(p, "r+b") as f:
            f.truncate(os.path.getsize(p) - 1)
    elif how == "zero":
        with open(p, "r+b") as f:
            f.seek(1000)
            f.write(b"\0" * 4096)
    else:
        os.unlink(p)


def test_scrub_repairs_from_the_other_tier(four_ranks, tmp_path):
    """Local tier + a second tier (a LocalTier standing in as remote): damage in both, repaired."""
    _root, snap, _codes = four_ranks
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(snap, a)
    shutil.copytree(snap, b)
    remote = LocalTier(b)
    remote.name = "remote"
    st = ckptstore.Store(a, remote=remote)
    m = st.manifest("v1").manifest
    r0, r1, r2 = (o.name for o in m.objects[:3])
    _damage(a, "v1", r0, "truncate")
    _damage(a, "v1", r1, "zero")
    _damage(b, "v1", r2, "delete")
    expected = {("local", "v1", r0, "truncated"), ("local", "v1", r1, "corrupt"), ("remote", "v1", r2, "missing")}
    for deep in (False, True):
        rep = S.scrub(st, deep=deep)
        assert set(rep.damage()) == expected and rep.exit_code == S.EXIT_DAMAGE
    assert st.latest().version == "v1"  # not marked without --repair
    rep = S.scrub(st, repair=True)
    assert rep.exit_code == S.EXIT_REPAIRED, S.format_report(rep)
    assert {(o.tier, o.name, o.repaired_from) for v in rep.versions for o in v.objects if o.status == "repaired"} == {
        ("local", r0, "remote"), ("local", r1, "remote"), ("remote", r2, "local")}
    for deep in (False, True):
        rep = S.scrub(st, deep=deep)
        assert rep.exit_code == S.EXIT_CLEAN and rep.damage() == []
    assert same(load_ranks(a, "v1"), all_ranks_state(1))
    assert same(load_ranks(None, "v1", remote=remote), all_ranks_state(1))
    assert not any(".tmp-" in k for k in files_under(a))


def test_scrub_local_only_marks_damaged(four_ranks, tmp_path):
    _root, snap, _codes = four_ranks
    root = tmp_path / "s"
    shutil.copytree(snap, root)
    st = ckptstore.Store(root)
    m = st.manifest("v1").manifest
    r0, r1, r2 = (o.name for o in m.objects[:3])
    _damage(root, "v1", r0, "truncate")
    _damage(root, "v1", r1, "zero")
    _damage(root, "v1", r2, "delete")
    code, out = cli_json("scrub", root)
    assert code == S.EXIT_DAMAGE
    kinds = {(o["name"], o["kind"]) for v in out["versions"] for o in v["objects"] if o["status"] == "damaged"}
    assert kinds == {(r0, "truncated"), (r1, "corrupt"), (r2, "missing")}
    assert {v["version"]: v["status"] for v in out["versions"]} == {"v0": "ok", "v1": "damaged"}

    code, out = cli_json("scrub", root, "--repair")  # no other tier: cannot repair → marked damaged
    assert code == S.EXIT_DAMAGE
    v1 = next(v for v in out["versions"] if v["version"] == "v1")
    assert v1["mark"] == "marked damaged"
    mark = json.loads((root / "versions" / "v1" / "damaged.json").read_bytes())
    assert mark["attempt"] == m.attempt and set(mark["objects"]) == {r0, r1, r2} and "truncated" in mark["reason"]
    assert st.latest().version == "v0"  # latest() skips it
    with pytest.raises(BaseException) as ei:
        load_ranks(root, "v1")
    assert "damaged" in str(ei.value)
    assert same(load_ranks(root), all_ranks_state(0))
    code, out = cli_json("show", root, "v1")
    assert code == 0 and out["damaged"] is True and "truncated" in out["per_tier"]["local"]["damage_reason"]
    r = cli("show", root, "v1")
    assert "damaged" in r.stdout and "DAMAGED" in r.stdout
    # the mark stays through later scrubs; a second scrub --repair does not rewrite it
    code, out = cli_json("scrub", root, "--repair", "--version", "v1")
    assert code == S.EXIT_DAMAGE and [v["version"] for v in out["versions"]] == ["v1"]
    assert any(i["kind"] == "marked" for i in out["versions"][0]["issues"])


def test_scrub_clears_stale_mark_and_repair_crash(tmp_path):
    root = tmp_path / "s"
    save(root, "v1", 1)
    t = LocalTier(root)
    t.put(layout.damaged_key("v1"), json.dumps({"reason": "old", "attempt": "someoldattempt", "deep": True}).encode())
    assert ckptstore.Store(root).latest().version == "v1"  # a mark naming another attempt does not apply
    code, out = cli_json("scrub", root)
    assert code == S.EXIT_DAMAGE and "verifies clean now" in out["versions"][0]["issues"][0]["detail"]
    # a crash before the repair write changes nothing
    env = {**os.environ, "CKPTSTORE_FAULT": "scrub.repair"}
    rc = subprocess.run([sys.executable, "-m", "ckptstore.cli", "scrub", str(root), "--repair"], env=env,
                        capture_output=True, timeout=120).returncode
    assert rc == -signal.SIGKILL and t.exists(layout.damaged_key("v1"))
    code, out = cli_json("scrub", root, "--repair")
    assert code == S.EXIT_REPAIRED and out["versions"][0]["mark"] == "mark removed"
    assert ckptstore.Store(root).latest().version == "v1"
    assert cli("scrub", root).exit_code == S.EXIT_CLEAN


def test_scrub_deep_encrypted(tmp_path):
    root = tmp_path / "s"
    key = os.urandom(32)
    keyfile = tmp_path / "key"
    keyfile.write_bytes(base64.b64encode(key))
    save(root, "v1", 1, key=key)
    env = {"CKPTSTORE_KEY": None, "CKPTSTORE_KEY_FILE": None}
    assert cli("scrub", root, env=env).exit_code == S.EXIT_CLEAN  # shallow needs no key
    code, out = cli_json("scrub", root, "--deep", env=env)
    assert code == S.EXIT_UNCHECKED and out["versions"][0]["issues"][0]["kind"] == "key"
    code, out = cli_json("scrub", root, "--deep", "--key-file", keyfile, env=env)
    assert code == S.EXIT_CLEAN and out["versions"][0]["deep"] is True
    wrong = tmp_path / "wrong"
    wrong.write_bytes(os.urandom(32))
    assert cli("scrub", root, "--deep", "--key-file", wrong, env=env).exit_code == S.EXIT_UNCHECKED
    code, out = cli_json("show", root, "v1")
    assert out["encrypted"] is True and out["key_id"] == ckptstore.codec.key_id(key)

    # damage the wrapped data key but keep the manifest's checksum seal valid
    path = root / "versions" / "v1" / "manifest.json"
    magic, body, seal, _ = path.read_bytes().split(b"\n")
    d = json.loads(body)
    wk = bytearray(base64.b64decode(d["encryption"]["wrapped_key"]))
    wk[20] ^= 1
    d["encryption"]["wrapped_key"] = base64.b64encode(bytes(wk)).decode()
    body = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    s = json.loads(seal)
    from ckptstore.manifest.schema import seal_checksum

    s["xxh3"] = seal_checksum(body, s.get("hmac_sha256"))
    path.write_bytes(b"\n".join([magic, body, json.dumps(s, sort_keys=True).encode()]) + b"\n")
    assert cli("scrub", root, env=env).exit_code == S.EXIT_CLEAN
    code, out = cli_json("scrub", root, "--deep", "--key-file", keyfile, env=env)
    assert code == S.EXIT_DAMAGE
    assert [(i["kind"], i["status"]) for i in out["versions"][0]["issues"]] == [("key", "damaged")]


def test_scrub_invalid_manifest_and_missing_version(tmp_path):
    root = tmp_path / "s"
    save(root, "v1", 1)
    save(root, "v2", 2)
    p = root / "versions" / "v1" / "manifest.json"
    data = bytearray(p.read_bytes())
    data[40] ^= 1
    p.write_bytes(bytes(data))
    code, out = cli_json("scrub", root)
    assert code == S.EXIT_DAMAGE
    assert [(v["version"], v["issues"][0]["kind"]) for v in out["versions"] if v["status"] == "damaged"] == [("v1", "manifest")]
    assert cli("scrub", root, "--version", "nope").exit_code == 3
    assert cli("show", root, "nope").exit_code == 3


@pytest.mark.s3
def test_scrub_repairs_with_s3(four_ranks, tmp_path, request):
    pytest.importorskip("ckptstore.tiers.s3")
    s3_url = request.getfixturevalue("s3_url")
    _root, snap, _codes = four_ranks
    root = tmp_path / "s"
    shutil.copytree(snap, root)
    st = ckptstore.Store(root, remote=s3_url)
    remote = st.remote
    local = st.local
    for v in ("v0", "v1"):  # stage both versions to S3 as the remote commit does: objects, then manifest
        m = st.manifest(v, "local").manifest
        for o in m.all_objects():
            k = layout.object_key(v, o.name)
            remote.put_file(k, local.local_path(k), size=o.size)
        remote.put_if_absent(layout.manifest_key(v), local.get(layout.manifest_key(v)))
    assert [sorted(r.tiers) for r in st.versions()] == [["local", "remote"]] * 2
    m = st.manifest("v1").manifest
    r0, r1, r2 = (o.name for o in m.objects[:3])
    _damage(root, "v1", r0, "truncate")
    _damage(root, "v1", r1, "zero")
    remote.delete(layout.object_key("v1", r2))
    code, out = cli_json("scrub", root, "--remote", s3_url)
    assert code == S.EXIT_DAMAGE
    got = {(v["tier"], o["name"], o["kind"]) for v in out["versions"] for o in v["objects"] if o["status"] == "damaged"}
    assert got == {("local", r0, "truncated"), ("local", r1, "corrupt"), ("remote", r2, "missing")}
    code, out = cli_json("scrub", root, "--remote", s3_url, "--repair")
    assert code == S.EXIT_REPAIRED
    code, out = cli_json("scrub", root, "--remote", s3_url, "--deep")
    assert code == S.EXIT_CLEAN
    assert same(load_ranks(root, "v1"), all_ranks_state(1))
    assert same(load_ranks(None, "v1", remote=s3_url), all_ranks_state(1))
    # gc across both tiers: local keeps 1, remote keeps 2
    code, out = cli_json("gc", root, "--remote", s3_url, "--local-keep-last", "1", "--remote-keep-last", "2", "--grace", "0")
    assert code == 0
    assert out["plan"]["tiers"]["local"]["rules"] == "keep-last 1"
    assert [r.version for r in ckptstore.Store(root).versions()] == ["v1"]
    assert [sorted(r.tiers) for r in ckptstore.Store(root, remote=s3_url).versions()] == [["remote"], ["local", "remote"]]
    # an incomplete multipart upload (a crashed upload) is aborted once older than the grace period
    key = "versions/v9/attempts/20260101T000000-aaaaaaaaaaaa-00001/r00000.ckd"
    remote.client.create_multipart_upload(Bucket=remote.bucket, Key=remote.prefix + key)
    code, out = cli_json("gc", root, "--remote", s3_url)
    assert code == 0 and [a["key"] for a in out["plan"]["actions"]] == []
    assert any(s["key"] == key and "in progress" in s["reason"] for s in out["plan"]["survivors"])
    junk = "versions/v8/attempts/20260101T000000-bbbbbbbbbbbb-00001/r00003.ckd"  # a crashed attempt's object
    remote.put(junk, b"x" * 100)
    code, out = cli_json("gc", root, "--remote", s3_url, "--now", later(2))
    assert code == 0 and [(a["op"], a["key"]) for a in out["plan"]["actions"]] == [("delete", junk), ("abort-upload", key)]
    assert out["result"]["applied"] == out["plan"]["actions"]
    assert list(remote.list_multipart_uploads("versions/")) == [] and not remote.exists(junk)


def test_scrub_unreachable_tier_is_not_checked(tmp_path, monkeypatch):
    s3 = pytest.importorskip("ckptstore.tiers.s3")
    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}.items():
        monkeypatch.setenv(k, v)
    root = tmp_path / "s"
    save(root, "v1", 1)
    dead = s3.S3Tier("s3://bucket/p/", endpoint_url="http://127.0.0.1:9", max_attempts=1, connect_timeout=1)
    rep = S.scrub(ckptstore.Store(root, remote=dead))
    assert rep.exit_code == S.EXIT_UNCHECKED and rep.unreachable and rep.unreachable[0][0] == "remote"
    assert [(v.tier, v.status) for v in rep.versions] == [("local", "ok")]


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
