"""scrub, list, show and gc on node-local roots: versions saved by two
real gloo ranks, then split over two roots as a two-node save leaves them (rank 0's part on root A,
rank 1's on root B, the metadata object and the manifest — placement ``[[0], [1]]`` — on both).

Also the parallel verifier against the sequential frame walk, on windows much
smaller than a frame run so that frames straddle every read.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time

import pytest

import ckptstore
from ckptstore import scrub as S
from ckptstore.manifest import layout
from ckptstore.manifest.schema import parse
from ckptstore.tiers import LocalTier
from store_helpers import cli, cli_json, files_under, later, obj_path, save, split_store

VERSIONS = ("v0", "v1", "v2")


@pytest.fixture(scope="module")
def split_pair(tmp_path_factory):
    return split_store(tmp_path_factory.mktemp("split"), VERSIONS)


@pytest.fixture
def roots(split_pair, tmp_path):
    """A private copy of the two roots, for tests that change them."""
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(split_pair[0], a)
    shutil.copytree(split_pair[1], b)
    return str(a), str(b)


def manifest(root, v):
    with open(os.path.join(root, *layout.manifest_key(v).split("/")), "rb") as f:
        return parse(f.read(), expect_version=v).manifest


def shard(root, v, rank):
    m = manifest(root, v)
    return next(o for o in m.objects if o.rank == rank)


# -- scrub (10.6) ------------------------------------------------------------------------------------------
def test_scrub_checks_the_part_each_root_holds(split_pair):
    a, b = split_pair
    for root, index, rank in ((a, 1, 0), (b, 2, 1)):
        code, out = cli_json("scrub", root)
        assert code == 0, out
        assert [v["version"] for v in out["versions"]] == list(VERSIONS)
        for v in out["versions"]:
            assert v["status"] == "ok" and v["tier"] == "local"
            assert v["part"] == {"index": index, "count": 2, "ranks": [rank], "whole": False}
            m = manifest(root, v["version"])
            assert {o["name"] for o in v["objects"]} == {m.metadata_object.name, shard(root, v["version"], rank).name}
    r = cli("scrub", b)
    assert r.exit_code == 0 and "part 2/2: 2 objects" in r.stdout, r.stdout


def test_scrub_reports_a_lost_part_only_on_its_root(roots):
    a, b = roots
    lost = shard(b, "v1", 1).name
    os.remove(obj_path(b, "v1", lost))
    code, out = cli_json("scrub", b)
    assert code == S.EXIT_DAMAGE
    bad = {(v["version"], o["name"], o["kind"]) for v in out["versions"] for o in v["objects"] if o["status"] == "damaged"}
    assert ("v1", lost, "missing") in bad and {v for v, _n, _k in bad} == {"v1"}
    code, out = cli_json("scrub", a)
    assert code == 0 and all(v["status"] == "ok" for v in out["versions"])


def test_scrub_reports_damage_to_the_part_held(roots):
    a, _b = roots
    name = shard(a, "v2", 0).name
    p = obj_path(a, "v2", name)
    with open(p, "r+b") as f:
        f.seek(os.path.getsize(p) // 2)
        c = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([c[0] ^ 0xFF]))
    code, out = cli_json("scrub", a, "--jobs", "2")
    assert code == S.EXIT_DAMAGE
    [v2] = [v for v in out["versions"] if v["version"] == "v2"]
    assert [(o["name"], o["kind"]) for o in v2["objects"] if o["status"] == "damaged"] == [(name, "corrupt")]
    code, out = cli_json("scrub", a, "--repair")  # no other tier: marked damaged on root A only
    assert code == S.EXIT_DAMAGE
    assert ckptstore.Store(a).latest().version == "v1"
    assert ckptstore.Store(roots[1]).latest().version == "v2"


# -- list / show (10.2) ----------------------------------------------------------------------------------------
def test_list_and_show_say_which_part_a_root_holds(split_pair):
    a, b = split_pair
    for root, k, ranks in ((a, 1, [0]), (b, 2, [1])):
        recs = ckptstore.Store(root).versions()
        assert [r.version for r in recs] == list(VERSIONS)
        assert all(r.local_part is not None and r.local_part.label == f"part {k}/2" for r in recs)
        assert recs[0].tier_labels == [f"local(part {k}/2)"]
        r = cli("list", root)
        assert r.exit_code == 0 and r.stdout.count(f"local(part {k}/2)") == 3, r.stdout
        code, out = cli_json("list", root)
        assert code == 0
        for v in out["versions"]:
            assert v["tiers"] == ["local"]
            assert v["parts"] == {"local": {"index": k, "count": 2, "ranks": ranks, "whole": False}}
        code, out = cli_json("show", root, "v1")
        assert code == 0 and out["parts"]["local"]["index"] == k and out["per_tier"]["local"]["part"]["ranks"] == ranks
        r = cli("show", root, "v1")
        assert r.exit_code == 0 and f"local(part {k}/2)" in r.stdout and f"part {k}/2 (ranks" in r.stdout, r.stdout


def test_list_of_an_unsplit_version_has_no_parts(tmp_path):
    save(tmp_path, "solo", 1)
    [rec] = ckptstore.Store(tmp_path).versions()
    assert rec.local_part is None and rec.tier_labels == ["local"]
    code, out = cli_json("list", tmp_path)
    assert code == 0 and out["versions"][0]["parts"] == {} and out["versions"][0]["tiers"] == ["local"]


# -- gc (10.5) ------------------------------------------------------------------------------------------------
def test_gc_on_one_root_prunes_its_own_parts_only(roots):
    a, b = roots
    before_a = files_under(a)
    code, out = cli_json("gc", b, "--keep-last", "1", "--dry-run")
    assert code == 0
    decisions = {d["version"]: d["keep"] for d in out["plan"]["tiers"]["local"]["decisions"]}
    assert decisions == {"v0": False, "v1": False, "v2": True}
    code, out = cli_json("gc", b, "--keep-last", "1")
    assert code == 0 and out["result"]["failed"] == []
    left = files_under(b)
    assert not any(k.startswith(("versions/v0/", "versions/v1/")) for k in left), left
    m2 = manifest(b, "v2")
    assert {layout.object_key("v2", o.name) for o in (m2.metadata_object, shard(b, "v2", 1))} <= set(left)
    assert files_under(a) == before_a  # the other root is never touched
    assert [r.version for r in ckptstore.Store(b).versions()] == ["v2"]
    assert [r.version for r in ckptstore.Store(a).versions()] == list(VERSIONS)
    assert cli("scrub", b).exit_code == 0 and cli("scrub", a).exit_code == 0
    # the rest of the plan: the missing objects of the other group are no garbage, no problem
    code, out = cli_json("gc", b, "--keep-last", "1", "--now", later(2))
    assert code == 0 and out["plan"]["actions"] == [] and out["plan"]["problems"] == []


def test_gc_deletes_old_probes_only(roots):
    a, _b = roots
    pdir = os.path.join(a, "probes")
    shutil.rmtree(pdir, ignore_errors=True)  # the fixture's saves left their (fresh) probes
    os.makedirs(pdir)
    names = ("r0.old1", "r1.fresh", "notes.txt", "put-if-absent.00ff00ff00ff00ff", ".tmp-0a1b2c3d4e5f6a7b",
             ".tmp-fresh00000000")
    for name in names:
        with open(os.path.join(pdir, name), "w") as f:
            f.write("x")
    old = time.time() - 2 * 3600
    # a conditional-write probe left by a killed process (docs/FORMAT.md, "Conditional writes"), and
    # the temp file of a probe write a killed job left (before: kept forever)
    for name in ("r0.old1", "notes.txt", "put-if-absent.00ff00ff00ff00ff", ".tmp-0a1b2c3d4e5f6a7b"):
        os.utime(os.path.join(pdir, name), (old, old))
    before = files_under(a, "versions/")
    code, out = cli_json("scrub", a)
    assert code == 0
    code, out = cli_json("list", a)
    assert code == 0 and len(out["versions"]) == 3
    code, out = cli_json("gc", a)
    assert code == 0
    probes = [x for x in out["plan"]["actions"] if x["kind"] == "probe"]
    assert sorted(x["key"] for x in probes) == ["probes/.tmp-0a1b2c3d4e5f6a7b", "probes/put-if-absent.00ff00ff00ff00ff",
                                                "probes/r0.old1"]
    assert sorted(os.listdir(pdir)) == [".tmp-fresh00000000", "notes.txt", "r1.fresh"]
    assert files_under(a, "versions/") == before


# -- S3: the remote tier holds whole versions -------------------------------------------------------------------
@pytest.mark.s3
def test_split_roots_with_remote_repair_and_missing_manifest_copy(tmp_path, s3_url):
    a, b = split_store(tmp_path, ("v0", "v1"), remote=s3_url)
    remote = ckptstore.Store(None, remote=s3_url).remote
    # the remote copy carries the placement too (as the writer records it)
    for v in ("v0", "v1"):
        with open(os.path.join(a, *layout.manifest_key(v).split("/")), "rb") as f:
            remote.put(layout.manifest_key(v), f.read())
    code, out = cli_json("scrub", b, "--remote", s3_url)
    assert code == 0, out
    parts = {(v["tier"], v["version"]): v["part"] for v in out["versions"]}
    assert parts["local", "v1"] == {"index": 2, "count": 2, "ranks": [1], "whole": False}
    assert parts["remote", "v1"]["whole"] is True and parts["remote", "v1"]["ranks"] == [0, 1]
    code, out = cli_json("list", b, "--remote", s3_url)
    assert [v["parts"] for v in out["versions"]] == [{"local": {"index": 2, "count": 2, "ranks": [1], "whole": False}}] * 2
    assert cli("list", b, "--remote", s3_url).stdout.count("local(part 2/2)+remote") == 2
    # B loses its shard of v1: repaired from the remote tier, object by object
    lost = shard(b, "v1", 1)
    p = obj_path(b, "v1", lost.name)
    with open(p, "r+b") as f:
        f.truncate(lost.size // 2)
    code, out = cli_json("scrub", b, "--remote", s3_url, "--repair")
    assert code == S.EXIT_REPAIRED, out
    [o] = [o for v in out["versions"] for o in v["objects"] if o["status"] == "repaired"]
    assert o["name"] == lost.name and o["repaired_from"] == "remote"
    assert os.path.getsize(p) == lost.size and cli("scrub", b).exit_code == 0
    assert not os.path.exists(obj_path(b, "v1", shard(a, "v1", 0).name))  # only B's part is restored
    # B's manifest copy of v1 is missing (a crash before the copy): gc keeps B's part
    os.remove(os.path.join(b, *layout.manifest_key("v1").split("/")))
    code, out = cli_json("gc", b, "--remote", s3_url, "--now", later(2))
    assert code == 0
    assert not [x for x in out["plan"]["actions"]
                if x["tier"] == "local" and x["op"] == "delete" and x["key"].startswith("versions/v1/")]
    assert os.path.getsize(p) == lost.size
    kept = [s for s in out["plan"]["survivors"] if s["tier"] == "local" and s["key"].startswith("versions/v1/")]
    assert kept and all("manifest copy is missing" in s["reason"] for s in kept)


# -- the parallel verifier against the sequential walk ------------------------------------------------------------
@pytest.mark.parametrize("jobs,mapped,ahead", [(1, True, None), (3, True, None), (2, False, None),
                                               (2, True, "sendfile"), (1, True, "preadv")])
def test_parallel_verify_agrees_with_sequential_walk(tmp_path, monkeypatch, jobs, mapped, ahead):
    """Every corrupt byte gets the sequential walk's verdict, whichever way the object is read: its
    windows mapped or read into buffers, locally or by ranged GETs, and mapped with the read-ahead
    thread filling the page cache ahead of the walker (by ``sendfile`` to /dev/null, or by ``preadv``
    where ``sendfile`` is refused)."""
    real_sendfile, real_preadv = os.sendfile, os.preadv
    calls = {"sendfile": 0, "preadv": 0}

    def sendfile(out, fd, off, n):
        calls["sendfile"] += 1
        if ahead == "preadv":
            raise OSError(22, "Invalid argument")
        return real_sendfile(out, fd, off, n)

    def preadv(fd, bufs, off, *flags):
        calls["preadv"] += 1
        return real_preadv(fd, bufs, off, *flags)

    import ckptstore.scrub.read as R

    monkeypatch.setattr(os, "sendfile", sendfile)
    monkeypatch.setattr(os, "preadv", preadv)
    if ahead:  # steps smaller than a window, and little room ahead: the walker waits on the thread
        monkeypatch.setattr(R, "_AHEAD_STEP", 3_000)
        monkeypatch.setattr(S, "LOCAL_AHEAD", 8_000)
    save(tmp_path, "v", 3)
    m = manifest(str(tmp_path), "v")
    entry = m.objects[0]
    key = layout.object_key("v", entry.name)
    path = obj_path(tmp_path, "v", entry.name)
    good = open(path, "rb").read()
    tier = LocalTier(str(tmp_path))
    monkeypatch.setattr(S, "LOCAL_CHUNK", 10_000)  # frames of ~4 KiB straddle most windows
    monkeypatch.setattr(S, "REMOTE_PART", 7_000)
    monkeypatch.setattr(S, "LOCAL_MMAP", mapped)

    class Remote(LocalTier):  # the remote read path (ranged GETs) over the same file
        def local_path(self, key):
            return None

    remote = Remote(str(tmp_path))
    offsets = sorted({0, 5, 41, 60, len(good) // 3, len(good) // 2, len(good) - 9, len(good) - 1} |
                     {i * 997 for i in range(1, len(good) // 997, 7)})
    with S.Verifier(jobs) as v:
        for off in [None] + offsets:
            data = bytearray(good)
            if off is not None:
                data[off] ^= 0x40
            with open(path, "wb") as f:
                f.write(data)
            ref = S.verify_stream(lambda o, n: memoryview(bytes(data))[o:o + n], len(data), entry)
            for t in (tier, remote):
                oc = S.check_object(t, "local", "v", entry, verifier=v)
                assert (oc.kind, oc.detail) == ref[:2], (off, t)
                if ref[0] is None:
                    assert oc.frames == ref[2] and oc.status == S.OK
    assert not [t for t in threading.enumerate() if t.name == "ckptstore-scrub-readahead"]
    if ahead == "sendfile":
        assert calls["sendfile"] > 0
    if ahead == "preadv":  # refused once per object read, then read into a buffer
        assert calls["preadv"] > calls["sendfile"] > 0
    if ahead is None:
        assert calls["sendfile"] == 0
    with open(path, "wb") as f:
        f.write(good[:-10])
    assert S.check_object(tier, "local", "v", entry).kind == "truncated"
    assert S.check_object(tier, "local", "v", dataclasses.replace(entry, name=entry.name + "x")).kind == "missing"
    assert tier.exists(key)
