"""A root of many versions: a save does not re-read the versions that did not change, and what did
change in an old version (a pin, an un-commit, a damage mark, a manifest rewritten in place, one
committed by another process) is seen by the next listing and the next retention pass
(ckptstore/manifest/catalogue.py, ``_Settled``; docs/FORMAT.md, "Listing a local root")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import ckptstore
from ckptstore import gc as G
from ckptstore.manifest import catalogue, layout
from ckptstore.retention import KeepLast, RetentionPolicy
from ckptstore.tiers.local import LocalTier

SETTLE_S = catalogue._Settled.SETTLE_NS / 1e9 + 0.2


def _manager(root, **kw):
    return ckptstore.CheckpointManager(root, {"w": torch.nn.Linear(4, 4)}, interval_steps=1, save_rng=False,
                                       save_on_signal=None, event_log=False, **kw)


def _manifest_reads(monkeypatch, cls=LocalTier):
    """The manifest keys read through any ``cls`` tier from now on, and its uncounted ``get``."""
    reads = []
    get = cls.get

    def counted(self, key, *a, **kw):
        if key.endswith("/" + layout.MANIFEST):
            reads.append(key)
        return get(self, key, *a, **kw)

    monkeypatch.setattr(cls, "get", counted)
    return reads, get


def test_a_save_reads_no_manifest_of_old_versions(tmp_path, monkeypatch):
    """40 versions of another series and 6 of this one, settled: a save with retention (keep-last 3)
    and its housekeeping read the manifest it commits and the one retention deletes, none of the 44
    others, and a listing after it reads only the new one (on main every
    save read every manifest of the root up to three times: the commit-sequence hint, the killed
    writers' look, retention)."""
    root = str(tmp_path / "root")
    other = _manager(root, prefix="other-")
    for s in range(1, 41):
        other.save(s)
        other.wait()
    other.close()
    m = _manager(root, prefix="step-", retention=RetentionPolicy(rules=(KeepLast(3),)))
    for s in range(1, 7):
        m.save(s)
        m.wait()
    assert [r.version for r in ckptstore.Store(root).versions() if r.version.startswith("step-")] == ["step-4", "step-5", "step-6"]
    time.sleep(SETTLE_S)
    # this process's listing and commit-sequence hint read them once (a running job's saves do)
    assert len(ckptstore.Store(root).versions()) == 43 and catalogue.max_seq(LocalTier(root)) is not None
    reads, _get = _manifest_reads(monkeypatch)
    m.save(7)
    m.wait()
    m.close()
    # the one it commits, and the one retention deletes (un-committed after a check of its manifest)
    old = [k for k in reads if k not in (layout.manifest_key("step-7"), layout.manifest_key("step-4"))]
    assert not old, old
    n = len(reads)
    recs = ckptstore.Store(root).versions()
    assert [r.version for r in recs if r.version.startswith("step-")] == ["step-5", "step-6", "step-7"] and len(recs) == 43
    assert reads[n:] == [layout.manifest_key("step-7")]  # the listing: only the one not settled yet


def test_changes_to_settled_versions_are_seen(tmp_path):
    """After a listing held the versions' entries: a pin, an un-commit, a damage mark, a manifest
    rewritten in place (a flipped byte) and a version committed by another process are all seen by
    the next listing; retention then keeps the pinned version."""
    root = str(tmp_path / "root")
    m = _manager(root)
    for s in range(1, 6):
        m.save(s)
        m.wait()
    m.close()
    time.sleep(SETTLE_S)
    st = ckptstore.Store(root)
    assert [r.version for r in st.versions()] == [f"step-{s}" for s in range(1, 6)]
    assert not any(r.pinned or r.damaged for r in st.versions())
    tier = st.tier("local")
    st.pin("step-1")
    tier.delete(layout.manifest_key("step-2"))  # an un-commit (what gc does first)
    tier.put(layout.damaged_key("step-3"), json.dumps({"attempt": st.get("step-3").attempt, "reason": "test"}).encode())
    path = tier.local_path(layout.manifest_key("step-4"))
    with open(path, "r+b") as f:  # a flipped byte, in place: the manifest's checksum fails
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x20]))
    code = ("import sys, torch, ckptstore\n"
            "m = ckptstore.CheckpointManager(sys.argv[1], {'w': torch.nn.Linear(4, 4)}, interval_steps=1, save_rng=False,"
            " save_on_signal=None, event_log=False)\n"
            "m.save(6); m.wait(); m.close()\n")
    subprocess.run([sys.executable, "-c", code, root], check=True, timeout=120)
    st = ckptstore.Store(root)
    recs = {r.version: r for r in st.versions()}
    assert sorted(recs) == ["step-1", "step-3", "step-5", "step-6"]
    assert recs["step-1"].pinned and recs["step-3"].damaged and not recs["step-5"].damaged
    assert [p[1] for p in st.problems] == [layout.manifest_key("step-4")]
    # retention (keep-last 1) after the next commit keeps the pinned one, and the newest
    m = _manager(root, retention=RetentionPolicy(rules=(KeepLast(1),)))
    m.save(7)
    m.wait()
    m.close()
    left = [r.version for r in ckptstore.Store(root).versions()]
    assert "step-1" in left and "step-7" in left and "step-5" not in left and "step-6" not in left


def test_killed_writers_look_is_rate_limited_and_renewed(tmp_path, monkeypatch):
    """The save path looks for killed writers' attempts at its first save in a root, then at most once
    per ``RECLAIM_EVERY_S``, and again right after a failed save: a killed save's attempt made in
    between waits for the next look, then goes without gc's grace period."""
    root = str(tmp_path / "root")
    monkeypatch.setattr(G, "_reclaim_looked", {})
    m = _manager(root)
    m.save(1)
    m.wait()
    tier = ckptstore.Store(root).tier("local")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    from ckptstore.manifest import writers

    attempt = layout.new_attempt()
    tier.put(layout.object_key("killed", layout.shard_name(attempt, 0)), b"x" * 1000)
    tier.put(layout.object_key("killed", layout.writer_record_name(attempt)),
             json.dumps({**writers.identity(), "pid": dead.pid}).encode())

    def left():
        return [i.key for i in tier.list(layout.version_dir("killed") + "/")]

    m.save(2)
    m.wait()
    assert len(left()) == 2  # within RECLAIM_EVERY_S of the first look: not looked at again
    monkeypatch.setattr(G, "RECLAIM_EVERY_S", 0.0)
    m.save(3)
    m.wait()
    assert left() == []
    m.close()
    assert [r.version for r in ckptstore.Store(root).versions()] == ["step-1", "step-2", "step-3"]


def test_held_entries_are_bounded_by_the_bytes_read(tmp_path, monkeypatch):
    """What a process holds of a root is bounded by the bytes of the files it was read from: a root of
    many large manifests does not fill memory, and a listing pass over a root larger than the bound
    keeps the part held that fits (a plain LRU would evict, on every pass, what the next pass needs);
    entries unused for ``IDLE_S`` make room."""
    monkeypatch.setattr(catalogue._Settled, "LIMIT_BYTES", 64 << 10)
    held = catalogue._Settled()
    paths = []
    for i in range(20):
        p = tmp_path / f"m{i}"
        p.write_bytes(b"x" * 7000)
        paths.append(str(p))
    time.sleep(SETTLE_S)
    calls = []

    def read(i):
        return lambda: calls.append(i) or i

    fits = (64 << 10) // (7000 + 256)
    for _ in range(2):
        calls.clear()
        assert [held.get(("k", i), (p,), read(i)) for i, p in enumerate(paths)] == list(range(20))
        assert held._bytes <= 64 << 10 and len(held._held) == fits
    assert calls == list(range(fits, 20))  # the second pass: the first ones held, the rest read
    monkeypatch.setattr(catalogue._Settled, "IDLE_S", 0.0)  # now every entry counts as unused
    calls.clear()
    held.get(("k", 19), (paths[19],), read(19))
    held.get(("k", 19), (paths[19],), read(19))
    assert calls == [19] and ("k", 0) not in held._held  # the oldest made room
    p = tmp_path / "m19"
    p.write_bytes(b"y" * 7000)  # rewritten: read again, and not held until it settles
    calls.clear()
    held.get(("k", 19), (str(p),), read(19))
    held.get(("k", 19), (str(p),), read(19))
    assert calls == [19, 19]


@pytest.mark.s3
def test_a_remote_listing_fetches_only_manifests_it_has_not_read(tmp_path, s3_url, monkeypatch):
    """On S3 (whose listing carries each manifest's MD5, docs/FORMAT.md "Tiers" rule 3) a second
    listing of the bucket's versions fetches no manifest: each is known by its listed MD5. A pin
    made meanwhile is seen, and a manifest replaced under the same name is fetched again."""
    from ckptstore.tiers.s3.tier import S3Tier

    m = _manager(str(tmp_path / "root"), remote=s3_url, durability="remote")
    for s in range(1, 4):
        m.save(s)
        m.wait()
    m.close()
    gets, real = _manifest_reads(monkeypatch, S3Tier)
    st = ckptstore.Store(None, remote=s3_url)
    assert [r.version for r in st.versions()] == ["step-1", "step-2", "step-3"]
    gets.clear()
    st.pin("step-2")
    recs = {r.version: r for r in ckptstore.Store(None, remote=s3_url).versions()}
    assert sorted(recs) == ["step-1", "step-2", "step-3"] and recs["step-2"].pinned and not recs["step-1"].pinned
    assert gets == []
    remote = st.remote
    remote.put(layout.manifest_key("step-3"), real(remote, layout.manifest_key("step-1")))  # another manifest's bytes
    problems: list = []
    assert sorted(catalogue.scan(remote, problems)) == ["step-1", "step-2"]
    assert gets == [layout.manifest_key("step-3")] and len(problems) == 1


def test_the_newest_save_stays_latest_after_an_overwrite_and_a_clock_step(tmp_path, monkeypatch):
    """Versions saved without a step order by commit sequence (docs/FORMAT.md, "Order"): after `b` is
    overwritten by another process, a save made while this host's clock stands 10 minutes behind
    still orders after it — the commit-sequence hint sees the overwritten manifest, though this
    process held `b`'s first one."""
    import torch.distributed.checkpoint as dcp

    from ckptstore.dcp import _plan
    from ckptstore.manifest import order

    root = str(tmp_path / "root")

    def save(v, **kw):
        dcp.save({"w": torch.ones(4)}, storage_writer=ckptstore.StorageWriter(root, version=v, **kw))

    for v in ("a", "b", "c"):
        save(v)
    time.sleep(SETTLE_S)
    save("d")  # its hint reads and holds a, b, c
    code = ("import sys, torch, torch.distributed.checkpoint as dcp, ckptstore\n"
            "dcp.save({'w': torch.zeros(4)}, storage_writer=ckptstore.StorageWriter(sys.argv[1], version='b', overwrite=True))\n")
    subprocess.run([sys.executable, "-c", code, root], check=True, timeout=120)
    real = order.next_seq
    monkeypatch.setattr(_plan, "next_seq", lambda hints: real(hints, now_us=int(time.time() * 1e6) - 600_000_000))
    save("e")
    recs = ckptstore.Store(root).versions()
    assert [r.version for r in recs][-2:] == ["b", "e"] and ckptstore.Store(root).latest().version == "e"


def test_a_directory_that_is_not_a_version_does_not_stop_saves_or_listings(tmp_path):
    """``versions/a copy`` (a file manager's copy; not a valid encoded name): saves go on, the
    listing shows the versions, the stray directory is left alone."""
    root = str(tmp_path / "root")
    m = _manager(root)
    m.save(1)
    m.wait()
    os.makedirs(os.path.join(root, "versions", "a copy", "attempts"))
    m.save(2)
    m.wait()
    m.close()
    assert [r.version for r in ckptstore.Store(root).versions()] == ["step-1", "step-2"]
    assert os.path.isdir(os.path.join(root, "versions", "a copy"))


def test_records_of_settled_versions_follow_every_change(tmp_path):
    """The records a listing builds are reused while a version's entry is unchanged
    (``catalogue._Records``): in one process, listings of the same settled root see a pin and its
    removal, a damage mark and its removal, and an overwrite by another process (its new attempt,
    seq and bytes), each in the very next listing."""
    import torch.distributed.checkpoint as dcp

    root = str(tmp_path / "root")
    for v in ("a", "b"):
        dcp.save({"w": torch.ones(4)}, storage_writer=ckptstore.StorageWriter(root, version=v))
    time.sleep(SETTLE_S)
    st = ckptstore.Store(root)

    def rec(v):
        return {r.version: r for r in ckptstore.Store(root).versions()}[v]

    first = rec("a")
    assert rec("a") is first  # unchanged: the same record
    st.pin("a", "keep")
    assert rec("a").pinned
    st.unpin("a")
    assert not rec("a").pinned
    tier = st.tier("local")
    tier.put(layout.damaged_key("a"), json.dumps({"attempt": first.attempt, "reason": "test"}).encode())
    assert rec("a").damaged
    tier.delete(layout.damaged_key("a"))
    assert not rec("a").damaged
    code = ("import sys, torch, torch.distributed.checkpoint as dcp, ckptstore\n"
            "dcp.save({'w': torch.zeros(64)}, storage_writer=ckptstore.StorageWriter(sys.argv[1], version='a', overwrite=True))\n")
    subprocess.run([sys.executable, "-c", code, root], check=True, timeout=120)
    again = rec("a")
    assert again.attempt != first.attempt and again.nbytes > first.nbytes and again.seq > first.seq
    assert dict(again.supersedes).keys() == {first.attempt}


def test_records_die_with_their_manifests():
    """A long run whose retention deletes old versions: the records merge reused for them are freed
    with their manifests (nothing but the manifests' own caches bounds what is held), while a held
    manifest's record is reused."""
    import gc

    from ckptstore.manifest.schema import Manifest, ObjectEntry

    def manifest(i):
        att = f"a{i:031x}"
        return Manifest(version=f"step-{i}", attempt=att, created="2026-01-01T00:00:00.000000Z", world_size=1,
                        objects=[ObjectEntry(f"attempts/{att}/rank-0.bin", 1 << 20, "0" * 16, 1, 0, 1 << 20)],
                        metadata_object=ObjectEntry(f"attempts/{att}/metadata.bin", 1000, "0" * 16, 1, None, 1000),
                        nbytes=1 << 20, stored_bytes=1 << 20, step=i, user={f"k{k}": k for k in range(100)}, seq=i)

    gc.collect()
    before = len(catalogue._records._held)
    live = {}
    for i in range(2000):
        live[f"step-{i}"] = catalogue.TierEntry(manifest(i), None, False, False)
        recs = catalogue.merge({"local": live})
        while len(live) > 3:  # retention deleted the oldest
            del live[next(iter(live))]
    kept = {r.version: r for r in recs}
    assert [r.version for r in catalogue.merge({"local": live})] == sorted(live, key=lambda v: int(v[5:]))
    assert all(r is kept[r.version] for r in catalogue.merge({"local": live}) if r.version in kept)
    live.clear()
    recs = kept = None
    gc.collect()
    assert len(catalogue._records._held) <= before
