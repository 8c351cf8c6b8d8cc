"""scrub (and the crash recovery it checks) against real DCP saves: four real ranks, two of them
SIGKILLed mid-save; damage in one tier repaired from the other; marks; encrypted deep checks;
unreachable tiers.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore import gc as G
from ckptstore import scrub as S
from ckptstore.manifest import layout
from ckptstore.testing.dist import run_ranks_raw
from ckptstore.tiers import LocalTier
from store_helpers import (
    cli,
    cli_json,
    files_under,
    later,
    obj_path,
    same,
    save,
)


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
    # grace not passed: the failed attempt goes anyway, since its coordinator (rank 0) was killed and is
    # provably dead (docs/FORMAT.md, Delete rule 15); nothing else goes
    code, out = cli_json("gc", root)
    assert code == 0 and {a["key"] for a in out["plan"]["actions"]} == set(v2)
    code, out = cli_json("gc", root, "--now", later(2))
    assert code == 0
    removed = {a["key"] for a in out["plan"]["actions"] if a["op"] == "delete"}
    probes = {k for k in before if k.startswith("probes/")}  # the saves' root probes, old by then
    assert removed == probes  # the failed attempt's files went before; now the probes
    assert files_under(root) == {k: n for k, n in before.items() if k not in v2 and k not in probes}
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
    assert "marked DAMAGED by scrub" in r.stdout and "DAMAGED: " in r.stdout and "truncated" in r.stdout
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
    assert cli("scrub", root, "--deep", "--key-file", wrong, env=env).exit_code == S.EXIT_KEY  # 5 (was 12)
    code, out = cli_json("show", root, "v1")
    assert out["encrypted"] is True and out["key_id"] == ckptstore.codec.key_id(key)

    # damage the wrapped data key but keep the manifest's checksum seal valid
    path = root / "versions" / "v1" / "manifest.json"
    from ckptstore.manifest.schema import frame, split_file

    body, s = split_file(path.read_bytes())
    d = json.loads(body)
    wk = bytearray(base64.b64decode(d["encryption"]["wrapped_key"]))
    wk[20] ^= 1
    d["encryption"]["wrapped_key"] = base64.b64encode(bytes(wk)).decode()
    body = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    from ckptstore.manifest.schema import seal_checksum

    s["xxh3"] = seal_checksum(body, s.get("hmac_sha256"))
    path.write_bytes(frame(body, s))
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



# -- a transient storage error is not damage (docs/FORMAT.md, Read rule 5) ------------------------------------------
def test_transient_error_on_a_manifest_is_not_damage(tmp_path):
    """One manifest that cannot be read right now (503 after the tier's retries): ``latest()`` does not
    fall back to the older version, ``scrub`` says "could not check" (12), not "damaged" (10), and gc
    refuses to plan rather than treat the version directory as an invalid commit."""
    from ckptstore.errors import TransientStorageError
    from ckptstore.testing.faulty_tier import FaultyTier

    root = tmp_path / "s"
    save(root, "v1", 1)
    save(root, "v2", 2)
    flaky = FaultyTier.transient_get(LocalTier(root), layout.manifest_key("v2"))
    st = ckptstore.Store(root)
    st.local = flaky  # its reads of v2's manifest fail transiently
    with pytest.raises(TransientStorageError):
        st.latest()
    with pytest.raises(TransientStorageError):
        st.versions()
    rep = S.scrub({"local": flaky})
    assert rep.exit_code == S.EXIT_UNCHECKED, S.format_report(rep)
    assert rep.damage() == [] and not any(v.status == "damaged" for v in rep.versions)
    with pytest.raises(TransientStorageError):
        G.collect(flaky, "local")
    # a load without a version does not resume from v1 either
    with pytest.raises(BaseException) as ei:
        dcp.load({"w": torch.zeros(8192)}, storage_reader=ckptstore.StorageReader(None, remote=flaky))
    assert "503" in str(ei.value)
    # once the storage answers again, nothing was marked or skipped
    assert ckptstore.Store(root).latest().version == "v2"
    assert S.scrub(ckptstore.Store(root)).exit_code == S.EXIT_CLEAN


def test_transient_error_on_the_metadata_object_is_not_damage_even_with_repair(tmp_path):
    """``scrub --deep --repair`` whose read of a version's DCP metadata object fails transiently (503
    after the tier's retries): "could not check" (12), nothing marked damaged (no ``damaged.json``),
    and the next scrub, with the storage answering, is clean (docs/FORMAT.md, Read rule 5)."""
    from ckptstore.testing.faulty_tier import FaultyTier

    root = tmp_path / "s"
    save(root, "v1", 1)
    flaky = FaultyTier.transient_get(LocalTier(root), lambda k: k.endswith("/" + layout.METADATA_OBJECT))
    rep = S.scrub({"local": flaky}, deep=True, repair=True)
    assert flaky.calls.get("get"), "the metadata object was never read"
    assert rep.exit_code == S.EXIT_UNCHECKED, S.format_report(rep)
    assert rep.damage() == [] and not any(v.status == "damaged" for v in rep.versions)
    assert not (root / layout.damaged_key("v1")).exists()
    assert S.scrub(ckptstore.Store(root), deep=True).exit_code == S.EXIT_CLEAN
