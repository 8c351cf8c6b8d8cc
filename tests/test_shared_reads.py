"""Read once, verify, relay (docs/FORMAT.md, Read rule 11): bytes several ranks need — a DDP-replicated
weight, a stored chunk a resharded load splits, the manifest and the DCP metadata object — are read
from the remote tier (or a peer's root) by one rank, verified there, and relayed to the others as
stored; every receiver verifies them again before use.

The plan is a pure function (``ckptstore.dcp._peers.plan``), tested here on the restore choice's real
``View`` with a simulator of its rounds. The S3 cases run real gloo ranks against SeaweedFS behind
the request- and byte-counting proxy (tests/counting_proxy.py): the GET bytes of an S3-only restore
(every rank's root empty) equal the stored bytes, at 2 ranks, at 4 (resharded) and — slow — at 8.
"""

from __future__ import annotations

import os
import shutil
import types
import uuid

import pytest

import ckptstore
from ckptstore.choice import View
from ckptstore.codec import FrameRef
from ckptstore.dcp import _peers
from ckptstore.manifest.objsets import ObjSet
from ckptstore.testing.dist import patched_environ, run_ranks

import shared_read_ranks as sr

FAST = dict(start_method="forkserver", preload=sr.PRELOAD)
V, A = "v", "20260101T000000-000000000000-00001"


# -- the plan (pure) --------------------------------------------------------------------------------
def view(world: int, held: dict, remote_ok: bool = True) -> View:
    """A restore choice's view of ``world`` ranks, each with a root of its own; ``held[i]``: object
    names rank i's root holds (the job report of ckptstore/choice.py)."""
    roots = [{"root": f"/r{i}", "leader": i, "committed": {}, "invalid": {},
              "held": {V: {A: ObjSet.of_names(A, held.get(i, ())).to_json()}}} for i in range(world)]
    job = {"ranks": [[i, i] for i in range(world)], "roots": roots, "manifests": {}, "remote": None}
    objs = ObjSet.of_names(A, {o for h in held.values() for o in h} | {obj(i) for i in range(world)})
    return View(V, A, job, remote_ok, objects=objs)


def obj(i: int) -> str:
    return f"attempts/{A}/r{i:05d}.ckd"


def frames(n: int, start: int = 0, size: int = 1000) -> list:
    return [FrameRef(start + k * size, size, 4 * size, k, start // size + k) for k in range(n)]


def plans(world: int, wants) -> list:
    """Load plans whose read items are ``(object, [FrameRef])`` pairs (``wants(rank)``)."""
    return [types.SimpleNamespace(items=list(wants(i))) for i in range(world)]


def simulate(xps: list, world: int) -> dict:
    """Run the rounds of ``xps`` (group rank = global rank here) in Python: every send must carry a
    chunk its sender holds before the round; returns ``{rank: {(object, offset)}}`` received or read."""
    have = {i: set() for i in range(world)}
    for i, xp in enumerate(xps):
        if xp is not None:
            for k in xp.read:
                have[i].update((o, f.offset) for o, f in xp.chunks[k].frames)
    rounds = sorted({s[0] for xp in xps if xp is not None for s in xp.steps})
    for rnd in rounds:
        before = {i: set(h) for i, h in have.items()}
        sends = {}
        for i, xp in enumerate(xps):
            for r, peer, send, ks in (xp.steps if xp else ()):
                if r == rnd and send:
                    got = [(o, f.offset) for k in ks for o, f in xp.chunks[k].frames]
                    assert set(got) <= before[i], f"rank {i} sends in round {rnd} what it does not hold yet"
                    sends[(i, peer)] = got
        for i, xp in enumerate(xps):
            for r, peer, send, ks in (xp.steps if xp else ()):
                if r == rnd and not send:
                    want = [(o, f.offset) for k in ks for o, f in xp.chunks[k].frames]
                    assert sends.pop((peer, i)) == want, "both sides must list the same chunks in the same order"
                    have[i].update(want)
        assert not sends, f"sends nobody receives: {sorted(sends)}"
    return have


def test_s3_only_a_replicated_item_is_read_by_one_rank_and_relayed_down_a_tree():
    world = 8
    rep = frames(3)  # the replicated weight: in rank 0's object, every rank needs it
    shard = {i: frames(2, start=10_000) for i in range(world)}  # each rank's own shard, in its own object

    def wants(i):
        yield obj(0), rep
        yield obj(i), shard[i]

    xps = _peers.plan(view(world, {}), plans(world, wants), lambda ri: ri)
    readers = [i for i, xp in enumerate(xps) if xp and xp.read]
    assert len(readers) == 1  # one chunk: one rank reads it from the remote tier
    xp = xps[readers[0]]
    assert [xp.chunks[k].origin for k in xp.read] == [None]
    have = simulate(xps, world)
    for i in range(world):
        assert {(obj(0), f.offset) for f in rep} <= have[i]
        assert not {(obj(i), f.offset) for f in shard[i]} & have[i]  # one rank needs it: read by that rank
    sends = [sum(1 for s in x.steps if s[2]) for x in xps if x]
    assert max(sends) <= 2  # a binary tree: nobody sends a chunk more than twice
    assert max(s[0] for x in xps for s in x.steps) == 3  # 8 ranks: 3 rounds


def test_many_chunks_spread_their_reads_over_the_ranks():
    world = 4
    rep = frames(40, size=1 << 20)  # 40 MiB replicated: three chunks of at most 16 MiB

    xps = _peers.plan(view(world, {}), plans(world, lambda i: [(obj(0), rep)]), lambda ri: ri)
    reads = [len(x.read) for x in xps]
    assert sum(reads) == 3 and max(reads) == 1  # each chunk read once, by different ranks
    assert all(len(x.chunks) == 3 for x in xps)
    have = simulate(xps, world)
    assert all(len(h) == 40 for h in have.values())


def test_a_peer_root_serves_a_chunk_once_to_every_rank_that_lacks_it():
    world = 5  # ranks 0, 1 hold their objects; 2, 3, 4 are a replaced node (empty roots)
    held = {0: {obj(0)}, 1: {obj(1)}}
    rep = frames(2)
    xps = _peers.plan(view(world, held, remote_ok=False), plans(world, lambda i: [(obj(0), rep)]), lambda ri: ri)
    assert xps[0].read and [c.origin for c in xps[0].chunks] == [0]  # rank 0 reads its root for the others
    assert all(not (x and x.read) for x in xps[1:])
    assert sum(1 for s in xps[0].steps if s[2]) <= 2
    have = simulate(xps, world)
    assert all({(obj(0), f.offset) for f in rep} <= have[i] for i in range(1, world))


def test_a_resharded_load_reads_each_stored_frame_once():
    """Saved by 2 ranks, loaded by 4: each stored chunk is split between two loading ranks, whose
    items overlap in the middle frame; that frame has an audience of two and is read once."""
    world = 4
    stored = {0: frames(3), 1: frames(3)}

    def wants(i):
        s = i // 2  # ranks 0, 1 load halves of rank 0's chunk; 2, 3 of rank 1's
        fr = stored[s]
        yield obj(s), (fr[:2] if i % 2 == 0 else fr[1:])

    xps = _peers.plan(view(world, {}), plans(world, wants), lambda ri: ri)
    shared = [(o, f.offset) for x in xps if x for k in x.read for o, f in x.chunks[k].frames]
    assert sorted(shared) == sorted([(obj(0), 1000), (obj(1), 1000)])  # only the middle frames are shared


def test_a_root_the_ranks_share_is_read_once_when_the_view_knows_it():
    """Ranks 0-3 share one root (``View.root_id``), 4-5 another: what several ranks of one shared root
    need is read there by one of them and relayed; without root ids every rank reads its own root."""
    world = 6
    held = {i: {obj(0), obj(1)} for i in range(world)}
    rep = frames(2)
    v = view(world, held)
    xps = _peers.plan(v, plans(world, lambda i: [(obj(0), rep)]), lambda ri: ri)
    assert xps == [None] * world  # unknown: every rank reads its own root
    v.root_id = lambda i: "shared-a" if i < 4 else "shared-b"
    xps = _peers.plan(v, plans(world, lambda i: [(obj(0), rep)]), lambda ri: ri)
    readers = [i for i, x in enumerate(xps) if x and x.read]
    assert len(readers) == 2 and readers[0] < 4 <= readers[1]  # one per shared root
    assert all(x.chunks[0].origin == r for r in readers for x in [xps[r]])  # read from the reader's root
    have = simulate(xps, world)
    assert all({(obj(0), f.offset) for f in rep} <= have[i] for i in range(world))
    for i, x in enumerate(xps):  # relayed within each root's ranks only
        assert all((peer < 4) == (i < 4) for _r, peer, _s, _k in x.steps)


def test_plan_per_rank_does_not_grow_with_ranks():
    """What each rank is sent (its chunks and messages) stays the same from 16 to 1,024 ranks."""
    sizes = {}
    for world in (16, 1024):
        rep = frames(6, size=4 << 20)  # 24 MiB replicated: two chunks

        def wants(i):
            yield obj(0), rep
            yield obj(i), frames(2, start=1 << 30)

        xps = _peers.plan(view(world, {}), plans(world, wants), lambda ri: ri)
        sizes[world] = max(len(x.chunks) + len(x.steps) for x in xps)
    assert sizes[1024] <= sizes[16] + 2, sizes  # +1 message per chunk per tree level of no rank's own


def test_nothing_shared_means_no_exchange():
    world = 3
    xps = _peers.plan(view(world, {}), plans(world, lambda i: [(obj(i), frames(2))]), lambda ri: ri)
    assert xps == [None] * world
    xps = _peers.plan(view(world, {}), plans(world, lambda i: [(obj(i), frames(2))]), lambda ri: ri, make_group=True)
    assert xps == [None] * world  # nothing to exchange: no group either


# -- S3-only restores against SeaweedFS ---------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(seaweed, tmp_path_factory):
    """A version saved by 2 ranks (each its own root) into SeaweedFS behind the counting proxy."""
    from counting_proxy import CountingProxy

    if not seaweed.running:
        seaweed.start()
    base = str(tmp_path_factory.mktemp("shared"))
    proxy = CountingProxy(seaweed.endpoint)
    env = {**seaweed.env, "AWS_ENDPOINT_URL": proxy.endpoint, "AWS_CONFIG_FILE": os.devnull,
           "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_EC2_METADATA_DISABLED": "true"}
    url = f"s3://ckptstore-test/shared-{uuid.uuid4().hex[:12]}/"
    run_ranks(sr.save, 2, base, url, "v2", env=env, timeout=300, **FAST)
    yield types.SimpleNamespace(base=base, proxy=proxy, env=env, url=url)
    proxy.close()


def stored_bytes(saved, version: str) -> int:
    """The stored bytes of ``version``'s objects (metadata object included), from its manifest."""
    with patched_environ(saved.env):
        m = ckptstore.Store(None, remote=saved.url).manifest(version).manifest
    return sum(o.size for o in m.all_objects())


def restore(saved, world: int, version: str, tag: str, corrupt=None, roots=None) -> tuple[list, dict]:
    saved.proxy.reset()
    outs = run_ranks(sr.load, world, saved.base, saved.url, version, 0, tag, corrupt, roots, env=saved.env,
                     timeout=300, **FAST)
    return outs, saved.proxy.summary()


@pytest.mark.s3
def test_an_s3_only_restore_downloads_the_stored_bytes_once_whatever_the_number_of_ranks(saved):
    """Every rank's root empty: a 1 MiB replicated weight plus sharded DTensors, saved by 2 ranks,
    restored by 2 and by 4 (resharded). Before: 2.66 MB then 5.33 MB of GET bytes (every rank read
    the replicated weight, the manifest and the metadata object); now the stored bytes, once."""
    stored = stored_bytes(saved, "v2")
    got = {}
    for world in (2, 4):
        outs, counts = restore(saved, world, "v2", f"n{world}")
        for o in outs:
            assert all(o["ok"].values()), o["ok"]
            assert o["stats"]["fallback_reads"] == 0 and o["left"] == []
        got[world] = counts
        print(f"S3-only restore of a 2-rank save on {world} ranks: {counts['object_get_bytes']} object GET bytes "
              f"({counts['get_bytes']} with manifests and listings), {stored} stored; "
              f"peer bytes per rank {[o['stats']['peer_bytes'] for o in outs]}")
        assert counts["object_get_bytes"] == stored, (counts, stored)  # every stored byte once
        assert sum(o["stats"]["remote_bytes"] for o in outs) <= counts["get_bytes"]
    assert got[4]["get_bytes"] <= 1.3 * got[2]["get_bytes"]
    assert got[4]["manifest_gets"] == got[2]["manifest_gets"]  # the manifest is read once, by one rank


@pytest.mark.s3
def test_bytes_damaged_after_the_senders_check_are_caught_by_every_receiver(saved):
    """The sending ranks flip a byte of everything they send after verifying it (the manifest, the
    metadata object, every chunk): every receiver detects it, reads those bytes from the remote tier
    itself, and loads bit-exact values; nothing unverified is used."""
    outs, counts = restore(saved, 3, "v2", "corrupt", corrupt="sender")
    for o in outs:
        assert all(o["ok"].values()), o["ok"]
    receivers = [o for o in outs if o["stats"]["peer_bytes"] > 0]
    assert len(receivers) >= 2
    assert all(o["stats"]["fallback_reads"] >= 1 for o in receivers)  # every damaged chunk caught
    assert all(o["stats"]["fallback_reads"] >= 2 for o in outs[1:])  # and the manifest, from rank 0
    assert counts["object_get_bytes"] > stored_bytes(saved, "v2")  # they read it themselves


@pytest.mark.s3
def test_a_damaged_copy_in_the_serving_ranks_root_is_caught_there(saved, tmp_path):
    """Rank r's root holds the object with the replicated weight; the other saving rank's root and a
    third rank's (new, empty) root lack it, so r reads it for both. One byte of r's copy is flipped:
    r detects it while verifying, reads the remote copy instead (warned, counted) and sends that; the
    receivers never see the damaged bytes. Only that object's frames come from the remote tier."""
    roots = [str(tmp_path / f"r{i}") for i in range(3)]
    for i in range(2):
        shutil.copytree(os.path.join(saved.base, "save-v2", f"r{i}"), roots[i])
    with patched_environ(saved.env):
        md = ckptstore.StorageReader(roots[0], remote=saved.url).read_metadata()
    loc = next(loc for idx, loc in md.storage_data.items() if idx.fqn == "rep")
    holder = int(loc.object[-9:-4])
    path = os.path.join(roots[holder], "versions", "v2", *loc.object.split("/"))
    data = bytearray(open(path, "rb").read())
    data[loc.frames[0].offset + loc.frames[0].length // 2] ^= 0x01
    open(path, "wb").write(bytes(data))

    outs, counts = restore(saved, 3, "v2", "peer", roots=roots)
    for o in outs:
        assert all(o["ok"].values()), o["ok"]
    assert outs[holder]["stats"]["fallback_reads"] >= 1  # the serving rank caught it
    for i in range(3):
        if i != holder:
            assert outs[i]["stats"]["fallback_reads"] == 0  # the others never got the damaged bytes
            assert outs[i]["stats"]["peer_bytes"] > 0
    assert 0 < counts["object_get_bytes"] <= sum(f.length for f in loc.frames) + (1 << 20)


@pytest.mark.slow
@pytest.mark.s3
def test_s3_only_restore_at_2_and_8_ranks(saved):
    """The issue's figure: saved and restored by 2 ranks, then by 8 (own save); and 2 -> 8 resharded.
    Before: 1.77 MB at 2 ranks and 7.05 MB at 8 ranks of GET bytes."""
    run_ranks(sr.save, 8, saved.base, saved.url, "v8", env=saved.env, timeout=600, **FAST)
    got = {}
    for world, version in ((2, "v2"), (8, "v8"), (8, "v2")):
        outs, counts = restore(saved, world, version, f"s{world}")
        assert all(all(o["ok"].values()) for o in outs)
        got[(world, version)] = counts
        print(f"S3-only restore of {version} on {world} ranks: {counts}")
        assert counts["object_get_bytes"] == stored_bytes(saved, version)
    assert got[(8, "v8")]["get_bytes"] <= 1.3 * got[(2, "v2")]["get_bytes"]
    assert got[(8, "v2")]["get_bytes"] <= 1.3 * got[(2, "v2")]["get_bytes"]
