"""ckptstore as the durable tier under torchft (``ckptstore.integrations.torchft``).

The jobs are real: torchft's own lighthouse binary (``torchft_lighthouse``) and replica groups as
separate processes (``tests/torchft_groups.py``: torchft's DDP over its ``ProcessGroupGloo`` on CPU,
a torchdata ``StatefulDataLoader`` per group over its own shard, a ``DurableTier``). Groups are
killed with SIGKILL mid-step and mid-save and launched again; a whole job is killed and restarted
from ckptstore. The policies (which main version a cold start restores, the loader plan when the
number of groups changed, whether a job is live) are pure functions, table-tested here.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst

torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install 'ckptstore[torchft]')")

import ckptstore  # noqa: E402
from ckptstore.integrations import _torchft_store as st  # noqa: E402
from ckptstore.integrations import _torchft_v0_2 as ftv  # noqa: E402

import torchft_groups as tg  # noqa: E402

REPORT: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def torchft_report():
    yield
    if REPORT:
        print("\n\ntorchft figures:\n" + "\n".join(f"  {r}" for r in REPORT) + "\n")


# -- the pure policies ---------------------------------------------------------------------------
def _pos(step, batches, part=True):
    return st.Position(step, batches, part, f"{step}/{batches}".encode())


@pytest.mark.parametrize("mains, newest, want, nskipped", [
    ([5, 10], {0: 12, 1: 12, 2: 11}, 10, 0),  # every group's position reached 10
    ([5, 10], {0: 12, 1: 9, 2: 12}, 5, 1),  # group 1's positions of steps 10.. died with it
    ([5, 10], {0: 12, 1: 3, 2: 12}, 10, 0),  # group 1 left before step 5 (older than 10 - 5): not waited for
    ([5, 10, 15], {0: 14, 1: 14}, 10, 1),  # step-15 committed, no position reached it
    ([], {0: 3}, None, 0),
    ([5], {}, 5, 0),  # no loader at all
])
def test_choose_main_needs_every_active_groups_position(mains, newest, want, nskipped):
    got, skipped = st.choose_main(mains, newest, 5)
    assert got == want
    assert len(skipped) == nskipped
    if skipped:
        assert "were not saved" in skipped[0]


def test_choose_main_takes_a_lagging_group_that_was_not_in_the_steps_quorum():
    """Group 2 saved its newest position at step 7 and left; step-10 was taken by groups 0 and 1
    alone (its writer counted 2 participants, both saved a participating position at 10): group 2's
    position at 10 is its newest, so step-10 is restored. Without the proof (no count, or a count
    the saved positions do not account for) step-10 is passed over, as before."""
    newest = {0: 11, 1: 10, 2: 7}
    assert st.lagging_groups(10, newest, 5) == [2]
    at10 = {0: _pos(10, 10), 1: _pos(10, 10)}
    assert st.absent_from_quorum(2, at10)
    assert not st.absent_from_quorum(3, at10)  # group 2 was in the quorum: its position at 10 died with it
    assert not st.absent_from_quorum(None, at10)  # a main version written before the count was recorded
    assert not st.absent_from_quorum(2, {0: _pos(10, 10), 1: _pos(10, 9, part=False)})  # group 1 was healing
    assert not st.absent_from_quorum(2, {0: _pos(10, 10), 1: None})

    def proof(n):
        return lambda s, lagging: ("counted" if s == 10 and st.absent_from_quorum(n, at10) else None)

    assert st.choose_main([5, 10], newest, 5, proof(2)) == (10, [])
    got, skipped = st.choose_main([5, 10], newest, 5, proof(3))
    assert got == 5 and "group(s) 2" in skipped[0]
    assert st.choose_main([5, 10], newest, 5) == (5, skipped)  # no proof asked: as before


def test_loader_plan_three_to_two_groups_and_two_to_three():
    at = {0: _pos(10, 10), 1: _pos(10, 9), 2: _pos(10, 8)}
    # 3 -> 2: each remaining group continues its own position; group 2's is orphaned (reported)
    for g in (0, 1):
        choice, pos, orphaned = st.loader_plan(g, 2, at)
        assert (choice.how, choice.source, pos) == ("own", g, at[g])
        assert orphaned == {2: 8}
    # 2 -> 3: the new index starts from the slowest stored group's position
    at2 = {0: _pos(10, 10), 1: _pos(10, 7)}
    choice, pos, orphaned = st.loader_plan(2, 3, at2)
    assert (choice.how, choice.source, choice.batches, pos) == ("slowest", 1, 7, at2[1])
    assert orphaned == {}
    choice, pos, _ = st.loader_plan(0, 1, {})
    assert (choice.how, pos) == ("initial", None)


def test_rank_loader_plan_at_another_shape_says_what_each_rank_continues():
    """3 groups × 2 ranks stored, restarted as 2 groups × 3 ranks (docs/torchft.md, "Cold start at
    another shape"): ranks 0 and 1 continue their own positions, resharded; rank 2 (new) takes the
    slowest rank of its group; group 2's ranks are orphaned. The same shape: "own"."""
    at = {(g, r): _pos(6, 10 + 2 * g + r) for g in range(3) for r in range(2)}
    worlds = {0: 2, 1: 2, 2: 2}
    for g in (0, 1):
        for r in (0, 1):
            c, p, orphaned = st.rank_loader_plan(g, r, 2, 3, at, worlds)
            assert (c.how, c.source, c.source_rank, c.rank, p) == ("own-resharded", g, r, r, at[(g, r)])
            assert orphaned == {2: 14 + 15}
        c, p, _ = st.rank_loader_plan(g, 2, 2, 3, at, worlds)
        assert (c.how, c.source, c.source_rank, c.batches) == ("slowest", g, 0, 10 + 2 * g), c
    c, p, orphaned = st.rank_loader_plan(1, 1, 3, 2, at, worlds)
    assert (c.how, p, orphaned) == ("own", at[(1, 1)], {})
    # 1 rank per group from 2: rank 1 of every group is orphaned
    c, p, orphaned = st.rank_loader_plan(0, 0, 3, 1, at, worlds)
    assert c.how == "own-resharded" and orphaned == {"0.1": 11, "1.1": 13, "2.1": 15}


def test_position_at_is_never_newer_than_the_step_and_histories_round_trip():
    hist = [_pos(8, 8), _pos(9, 9, False), _pos(11, 10)]
    assert st.position_at(hist, 10) == hist[1]
    assert st.position_at(hist, 11) == hist[2]
    assert st.position_at(hist, 7) is None
    assert st.unpack_history(st.pack_history(hist)) == hist


@settings(max_examples=300, deadline=None)
@given(deltas=hst.lists(hst.integers(0, 7), max_size=60), start=hst.integers(0, 40), interval=hst.integers(1, 12))
def test_a_positions_version_keeps_every_position_a_restore_can_ask_for(deltas, start, interval):
    """The positions a version keeps (``due_positions``) answer every due step and the newest as the
    whole history would: the steps a cold start, a heal and a join ask for."""
    steps = [start]
    for d in deltas:
        steps.append(steps[-1] + d)
    hist = [_pos(s, i, i % 3 != 0) for i, s in enumerate(steps)]
    kept = st.due_positions(hist, interval)
    assert [p for p in hist if p in kept] == kept  # a sub-sequence, oldest first
    for d in range(0, steps[-1] + 2 * interval, interval):
        assert st.position_at(kept, d) == st.position_at(hist, d), d
    assert max(kept, key=lambda p: p.step) == max(hist, key=lambda p: p.step)
    assert len(kept) <= steps[-1] // interval - -(-steps[0] // interval) + 2  # one per due step spanned, the newest


def test_a_positions_version_of_a_due_step_window_is_a_few_positions():
    hist = [_pos(s, s) for s in range(150, 353)]  # positions_keep 2 * 100 + 2 of steps 150 … 352
    kept = st.due_positions(hist, 100)
    assert [p.step for p in kept] == [200, 300, 352]


def _loader():
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(list(range(100)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))


def _plain_loader():
    """A loader whose state is plain counters (torchft's ``DistributedSampler``, as the groups use)."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchft.data import DistributedSampler

    data = tg.Samples(400)
    sampler = DistributedSampler(data, replica_rank=1, num_replica_groups=3, group_rank=0, num_replicas=2,
                                 shuffle=True, seed=7, drop_last=True)
    return StatefulDataLoader(data, batch_size=4, sampler=sampler)


@pytest.mark.parametrize("make, encoding", [(_loader, 0), (_plain_loader, 1)], ids=["tensor-state", "plain-state"])
def test_a_position_blob_brings_back_the_loader_and_both_rngs(make, encoding):
    """Both loader-state encodings: a state holding the sampler's generator (a tensor: ``torch.save``)
    and a plain one (JSON), with a pending ``gauss_next`` in Python's state."""
    import random

    loader = make()
    it = iter(loader)
    for _ in range(5):
        next(it)
    torch.manual_seed(11)
    random.seed(12)
    random.gauss(0, 1)  # a pending gauss_next is part of Python's state
    blob = st.pack_blob(loader.state_dict(), torch.get_rng_state(), random.getstate())
    assert blob[:6] == b"CKLP\x03" + bytes((encoding,))
    want = ([_ids(next(it)) for _ in range(3)], torch.rand(4).tolist(), random.random(), random.gauss(0, 1))
    got = st.unpack_blob(blob)
    again = make()
    again.load_state_dict(got["loader"])
    it2 = iter(again)  # before the RNG is set: a loader without a generator draws its base seed (as DurableTier.batches)
    torch.set_rng_state(got["rng"]["torch"])
    random.setstate(got["rng"]["python"])
    assert ([_ids(next(it2)) for _ in range(3)], torch.rand(4).tolist(), random.random(), random.gauss(0, 1)) == want


def _ids(batch):
    return (batch[0] if isinstance(batch, (list, tuple)) else batch).tolist()


_JSONISH = hst.recursive(
    hst.none() | hst.booleans() | hst.integers() | hst.floats() | hst.text(max_size=5)
    | hst.tuples(hst.integers()),
    lambda inner: hst.lists(inner, max_size=4) | hst.dictionaries(hst.text(max_size=4) | hst.integers(), inner,
                                                                  max_size=4),
    max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(state=_JSONISH)
def test_a_position_blob_gives_back_any_loader_state_with_its_types(state):
    """Whatever the loader state holds — plain values (JSON), or a tuple, an int key, NaN or
    infinity (``torch.save``) — it comes back equal and of the same types."""
    import math
    import random

    got = st.unpack_blob(st.pack_blob(state, torch.get_rng_state(), random.getstate()))["loader"]

    def same(a, b):
        if type(a) is not type(b):
            return False
        if isinstance(a, dict):
            return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, float) and math.isnan(a):
            return math.isnan(b)
        return a == b

    assert same(state, got), (state, got)


def test_a_position_blob_of_the_earlier_layout_is_still_read():
    import io
    import random

    loader = _loader()
    it = iter(loader)
    next(it)
    buf = io.BytesIO()  # the earlier layout: one torch.save of the dict
    torch.save({"loader": loader.state_dict(), "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}},
               buf)
    want = [next(it).tolist() for _ in range(3)]
    got = st.unpack_blob(buf.getvalue())
    again = _loader()
    again.load_state_dict(got["loader"])
    it2 = iter(again)
    assert [next(it2).tolist() for _ in range(3)] == want
    assert torch.equal(got["rng"]["torch"], torch.get_rng_state())
    assert got["rng"]["python"] == random.getstate()
    # the layout before the encoding byte (CKLP\x02: the loader state always a torch.save)
    blob = st.pack_blob(_loader().state_dict(), torch.get_rng_state(), random.getstate())
    assert blob[5] == 0
    old = b"CKLP\x02" + blob[6:]
    assert torch.equal(st.unpack_blob(old)["loader"]["_sampler_iter_state"]["sampler_iter_state"]["generator"],
                       st.unpack_blob(blob)["loader"]["_sampler_iter_state"]["sampler_iter_state"]["generator"])
    assert st.unpack_blob(old)["rng"]["python"] == random.getstate()


def test_a_malformed_position_blob_raises_integrity_error():
    import random

    from ckptstore.errors import IntegrityError

    for loader in (_loader(), _plain_loader()):
        blob = st.pack_blob(loader.state_dict(), torch.get_rng_state(), random.getstate())
        bad = [blob[:n] for n in (0, 3, 5, 6, 8, 40, len(blob) // 2, len(blob) - 9, len(blob) - 1)]
        bad += [blob + b"\0", blob[:-9] + b"\x02" + blob[-8:], b"PK\x03\x04garbage", blob[:5] + b"\x07" + blob[6:],
                blob[:5] + bytes((1 - blob[5],)) + blob[6:]]  # an unknown encoding; the other one's reader
        for b in bad:
            with pytest.raises(IntegrityError):
                st.unpack_blob(b)


def test_job_is_live_from_the_lighthouse_status_page():
    # the page as torchft 0.2's templates/status.html renders it
    html = """Current quorum_id: 4 <br>
<h3>Previous Quorum</h3>
Previous quorum id: 4 <br>
<div class="member "> <b>g0:aaaa</b> <br/> Step: 17 <br/> Manager: http://h:1 <br/> </div>
<div class="member recovering"> <b>g1:bbbb</b> <br/> Step: 12 <br/> </div>
<h2>Heartbeats</h2>
<ul>
  <li class="heartbeat ">
    g0:aaaa: seen 0.05s ago
  </li>
  <li class="heartbeat old">
    g1:bbbb: seen 9.5s ago
  </li>
  <li class="heartbeat ">
    g2:cccc: seen 0.02s ago
  </li>
</ul>"""
    view = ftv.parse_status(html)
    assert view.members == {"g0:aaaa": 17, "g1:bbbb": 12}
    assert view.heartbeats == {"g0:aaaa": 0.05, "g1:bbbb": 9.5, "g2:cccc": 0.02}
    assert st.job_is_live(view.members, view.heartbeats, 1.0)[0] is True
    # the same job after every member died: a whole-job restart (g2 is a new group, not in the quorum)
    assert st.job_is_live(view.members, {"g0:aaaa": 4.0, "g1:bbbb": 9.5, "g2:cccc": 0.02}, 1.0)[0] is False
    assert st.job_is_live({}, {"g2:cccc": 0.0}, 1.0) == (False, "the lighthouse has formed no quorum yet")
    assert st.job_is_live({"g0:a": 0}, {"g0:a": 0.0}, 1.0)[0] is False  # a job starting at step 0


def _garbage(root) -> list[str]:
    """What ``ckptstore gc`` would delete as garbage in ``root`` with no grace period."""
    import datetime as dt

    from ckptstore import gc
    from ckptstore.tiers.local import LocalTier

    p = gc.plan([gc.collect(LocalTier(str(root)), "local")], None, dt.datetime.now(dt.timezone.utc), grace=0.0)
    return [a.key for a in p.actions if a.kind == "garbage"]


def test_the_kill_switch_reads_the_environment(monkeypatch):
    from ckptstore.integrations import torchft as ckft

    for v, want in (("0", False), ("off", False), ("no", False), ("1", True), ("", True)):
        monkeypatch.setenv(ckft.ENV_DISABLE, v)
        assert ckft._enabled(None) is want, v
    monkeypatch.setenv(ckft.ENV_DISABLE, "0")
    assert ckft._enabled(True) is True  # an explicit option wins


# -- the commit check (docs/FORMAT.md, Save rule 9) ----------------------------------------------
def test_a_refused_commit_check_commits_nothing_and_reclaims_its_objects(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    root = tmp_path / "root"
    asked = []

    def check(version):
        asked.append(version)
        return "replica group 0 left the quorum" if version == "step-10" else None

    w = ckptstore.StorageWriter(root, commit_check=check)
    dcp.save({"w": torch.arange(10.0)}, checkpoint_id="step-5", storage_writer=w)
    with pytest.raises(CheckpointException) as ei:
        dcp.save({"w": torch.arange(10.0)}, checkpoint_id="step-10", storage_writer=w)
    err = ei.value.failures[0][0] if isinstance(ei.value.failures[0], tuple) else ei.value.failures[0]
    assert isinstance(err, ckptstore.FencedError) and "left the quorum" in str(err)
    assert asked == ["step-5", "step-10"]
    assert [r.version for r in ckptstore.Store(root).versions()] == ["step-5"]
    # the refused attempt reclaimed its objects at once (docs/FORMAT.md, Delete rule 14): no garbage waits for gc
    assert not any(k.startswith("versions/step-10/") for k in _garbage(root)), _garbage(root)
    # the name stays free: the group that owns the step commits it
    dcp.save({"w": torch.arange(10.0)}, checkpoint_id="step-10",
             storage_writer=ckptstore.StorageWriter(root))
    assert sorted(r.version for r in ckptstore.Store(root).versions()) == ["step-10", "step-5"]


# -- real jobs ---------------------------------------------------------------------------------------
def _timeline(job, g) -> dict[int, dict]:
    """Group ``g``'s committed steps: the record of the newest launch per step."""
    out: dict[int, dict] = {}
    for rec in job.lines(g):
        if rec.get("committed"):
            out[rec["step"]] = rec
    return out


def _resumes(job, g) -> list[dict]:
    return [r["resume"] for r in job.lines(g) if "resume" in r]


def _counted_batches(job, g) -> list[list[int]]:
    tl = _timeline(job, g)
    return [tl[s]["ids"] for s in sorted(tl) if tl[s]["counted"]]


def _versions(root) -> list:
    return ckptstore.Store(root).versions()


def _check_exact_samples(job, groups, shards):
    for g in groups:
        got = _counted_batches(job, g)
        assert got == shards[g][:len(got)], f"group {g}: its batches are not its shard's order without repeat or gap"


def _cold_restart(tmp_path, *, steps, kill_at, name="cold", groups=3, settle=False):
    """Launch 0: ``groups`` groups train; every group SIGKILLs itself mid-step at ``kill_at``. Launch 1:
    all start again (a whole-job restart: the lighthouse kept running) and train to ``steps``."""
    root = tmp_path / "root"
    job = tg.Job(tmp_path, root, name=name, steps=steps, interval=5, num_groups=groups,
                 kill={str(g): [kill_at, "mid-step"] for g in range(groups)}, settle=settle)
    job.start_lighthouse()
    try:
        job.start()
        codes = job.wait(240)
        assert codes == {g: -9 for g in range(groups)}, (codes, job.tails())
        t0 = time.monotonic()
        job.start()
        codes = job.wait(240)
        assert codes == {g: 0 for g in range(groups)}, (codes, job.tails())
        restart_s = time.monotonic() - t0
    finally:
        job.close()
    return job, root, restart_s


def test_whole_job_killed_mid_step_restarts_from_ckptstore_exactly(tmp_path):
    """2 groups, 9 steps, main version every 5: every group is killed mid-step at 8 (after waiting for
    the saves started so far, so that step-5 is the newest main version); the restart
    restores the newest main version every group's position reached and continues; the steps run
    again equal the first run's bit for bit and every group's batches are its shard's, in order,
    none twice, none skipped."""
    job, root, restart_s = _cold_restart(tmp_path, steps=9, kill_at=8, groups=2, settle=True)
    shards = {g: tg.shard_order(g) for g in range(2)}
    first = {g: {r["step"]: r for r in job.lines(g) if r.get("committed") and r["launch"] == "0"} for g in range(2)}
    resumed = []
    for g in range(2):
        r0, r1 = _resumes(job, g)
        assert r0["kind"] == "fresh"
        assert r1["kind"] == "cold-start", r1
        assert r1["version"] == "step-5" and r1["writer"]["group"] == 0
        assert r1["loader"]["how"] == "own"
        resumed.append(r1["step"])
        again = {r["step"]: r for r in job.lines(g) if r.get("committed") and r["launch"] == "1"}
        assert min(again) == r1["step"] + 1 and max(again) == 9
        for s in sorted(set(again) & set(first[g])):  # the steps trained twice: the same loss, batch and RNG draw
            assert ((again[s]["loss"], again[s]["ids"], again[s]["rand"])
                    == (first[g][s]["loss"], first[g][s]["ids"], first[g][s]["rand"])), (g, s)
        assert sorted(_timeline(job, g)) == list(range(1, 10))
    assert resumed == [5, 5]
    _check_exact_samples(job, range(2), shards)
    REPORT.append(f"whole-job restart (2 groups): resumed at step 5, launch to 9 steps done in {restart_s:.1f} s; "
                  f"resume itself {max(_resumes(job, g)[1]['seconds'] for g in range(2)):.2f} s")


@pytest.mark.parametrize("ranks", [1, 2], ids=["groups-of-1", "hsdp-groups-of-2"])
def test_a_whole_job_loss_restores_the_step_a_departed_group_took_no_part_in(tmp_path, ranks):
    """2 groups (of 1 rank; of 2 FSDP2 ranks), a main version every 5. Group 1 is killed before its
    allreduce at step 8 and not launched again; group 0 trains on alone and writes step-10 (its writer
    counts 1 participant), then
    is killed mid-step at 12: the whole job is lost. Group 1's newest saved position is step 7, within
    one interval of step 10. Both groups start again: every group restores step-10 — the writer's
    count, matched by group 0's position at 10, proves group 1 took no part in step 10 — and group 1
    continues from its own position of step 7. Every group's batches are its shard's, in order, none
    twice, none skipped. Before: the cold start passed over step-10 and restored step-5 (5 more
    steps lost). With groups of 2 ranks the proof's reads are loads of both ranks together (before,
    rank 0 read alone inside the listing and the group's ranks deadlocked until the timeout)."""
    root = tmp_path / "root"
    job = tg.Job(tmp_path, root, name="away", steps=14, interval=5, num_groups=2, min_replicas=1, settle=True,
                 ranks=ranks, fsdp=ranks > 1, kill={"1": [8, "before-allreduce"], "0": [12, "mid-step"]})
    job.start_lighthouse()
    try:
        job.start()
        codes = job.wait(240)
        assert codes == {0: -9, 1: -9}, (codes, job.tails())
        assert _manifest_user(root, "step-10")["participants"] == 1
        job.start()
        codes = job.wait(240)
        assert codes == {0: 0, 1: 0}, (codes, job.tails())
    finally:
        job.close()
    for g in range(2):
        r = _resumes(job, g)[1]
        assert r["kind"] == "cold-start" and r["version"] == "step-10" and r["skipped"] == [], (g, r)
        assert r["loader"]["how"] == "own", (g, r)
    for r in range(ranks):
        away = [x["resume"] for x in job.lines(1, r) if "resume" in x][1]["loader"]
        assert away["step"] == 7 and "took no part" in away["reason"], (r, away)
        for g in range(2):  # the timeline: the newest launch of each committed step
            tl = {x["step"]: x for x in job.lines(g, r) if x.get("committed")}
            got = [tl[s]["ids"] for s in sorted(tl) if tl[s]["counted"]]
            assert got == tg.shard_order(g, r, ranks)[:len(got)], f"group {g} rank {r}: a batch skipped or drawn twice"
    assert max(_timeline(job, 1)) == 14 and sorted(_timeline(job, 0)) == list(range(1, 15))


def _launch_repeats(job, g, r=0, ranks=1) -> list[int]:
    """Per relaunch of group ``g`` (rank ``r``): how many batches it drew again; asserts that every
    launch's batches are its shard's in order and that none was skipped."""
    shard = tg.shard_order(g, r, ranks)
    launches = sorted({x["launch"] for x in job.lines(g, r) if "launch" in x})
    by_launch = [[x["ids"] for x in job.lines(g, r) if x.get("counted") and x["launch"] == n] for n in launches]
    end = len(by_launch[0])
    assert by_launch[0] == shard[:end], (g, r)
    out = []
    for got in by_launch[1:]:
        if not got:
            continue
        b = shard.index(got[0])
        assert got == shard[b:b + len(got)] and b <= end, f"group {g} rank {r} skipped batches"
        out.append(end - b)
        end = b + len(got)
    return out


def test_a_killed_group_continues_at_its_exact_position_from_its_journal(tmp_path):
    """2 groups, 20 steps, main version every 5: group 1 is SIGKILLed mid-step at step 8 and launched
    again; it joins the live job (torchft heals it from group 0) and its loader continues from its
    position after step 7, read from its journal (docs/FORMAT.md, "Journals"): its batches are its
    shard's, in order, none drawn twice, none skipped. Before the journal, the relaunch continued
    from the newest committed positions version and drew the batches after it again."""
    job, took = _job(tmp_path, tmp_path / "root", "journal", steps=20, interval=5, num_groups=2, pace_s=1.0,
                     restart_killed=True, timeout=400, kill={"1": [[8, "mid-step", "0"]]})
    assert job.launches == {0: 0, 1: 1}, job.launches
    r = _resumes(job, 1)[1]
    assert r["kind"] == "join" and r["loader"]["how"] == "peer" and r["loader"]["step"] == 7, r
    assert _launch_repeats(job, 1) == [0]
    _check_exact_samples(job, [0], {0: tg.shard_order(0)})
    lines = [json.loads(x) for x in (tmp_path / "root" / "events.jsonl").read_text().splitlines()]
    saves = {x["version"]: x for x in lines if x.get("kind") == "save" and str(x.get("version")).startswith("step-")}
    assert {"step-5", "step-10", "step-15"} <= {v.version for v in _versions(tmp_path / "root")}
    # once group 1 is back the steps take milliseconds: the last due save may find step-15's still
    # running and be skipped (reported, never waited for: docs/FORMAT.md, Save rule 9)
    assert "step-20" in {v.version for v in _versions(tmp_path / "root")} or (
        saves["step-20"]["outcome"] == "skipped" and "still running" in saves["step-20"]["error"]), saves.get("step-20")
    # the tier's saves are paced (background_duty=0.02, ckptstore/_pace.py): step-10, seconds after step-5
    # (group 1 was away), paused between the pieces of its bookkeeping; a manager's first save does not
    assert saves["step-5"]["paused_s"] == 0.0 and saves["step-10"]["paused_s"] > 0, saves
    REPORT.append(f"journal: group 1 killed at step 8 continued at its position of step 7, 0 batches repeated "
                  f"({took:.0f} s)")


def test_a_group_that_joined_a_live_job_lost_before_its_heal_continues_in_the_restarted_timeline(tmp_path):
    """2 groups, main version every 5. Group 1 is killed mid-step at 12 and launched again: its
    resume() finds group 0 alive and joins (its loader at its own newest position, step 11). Before
    its first step every replica of that live job dies (group 0 killed); group 0's relaunch finds no
    live job and cold-starts from the store (step-10). torchft heals group 1 from group 0, and with
    it the step the job's timeline restarted from (``ckptstore.timeline``): below group 1's loader
    position, so group 1's loader goes back to its position of step 10 and that step is refused
    (every group draws its batch again). Every group's batches are its shard's, in order, none
    skipped, none twice. Before: group 1 kept the loader of the timeline it had joined, a step ahead
    of the restored one, and skipped the batch in between."""
    gate = tmp_path / "go"
    job = tg.Job(tmp_path, tmp_path / "root", name="lost-join", steps=24, interval=5, num_groups=2, pace_s=0.5,
                 kill={"1": [12, "mid-step"]}, settle=True, hold={"1": str(gate)})
    job.start_lighthouse()
    try:
        job.start()
        end = time.monotonic() + 240
        while job.procs[(1, 0)].poll() is None:
            assert time.monotonic() < end, job.tails()
            time.sleep(0.05)
        del job.procs[(1, 0)]
        job.launch(1)
        while not any(x.get("launch") == "1" and "resume" in x for x in job.lines(1)):
            assert time.monotonic() < end and job.procs[(1, 0)].poll() is None, job.tails()
            time.sleep(0.05)
        job.kill_group(0)  # the live job group 1 joined is gone before group 1 took a step
        time.sleep(1.5)  # its heartbeats go stale: group 0's relaunch is a cold start
        job.launch(0)
        gate.touch()
        codes = job.wait(300)
    finally:
        job.close()
    assert codes == {0: 0, 1: 0}, (codes, job.tails())
    g0, g1 = _resumes(job, 0), _resumes(job, 1)
    assert [r["kind"] for r in g0] == ["fresh", "cold-start"], g0
    assert [r["kind"] for r in g1] == ["fresh", "join"] and g1[1]["loader"]["step"] == 11, g1
    at = g0[1]["step"]  # the step the job restarted from (step-10, or step-5 when 10's positions lagged)
    for g in range(2):  # the timeline: launch 0 up to the restored step, then launch 1
        got = [x["ids"] for x in job.lines(g) if x.get("counted") and (x["launch"] == "1" or x["step"] <= at)]
        assert got == tg.shard_order(g)[:len(got)], f"group {g}: a batch skipped or drawn twice"
    assert job.lines(1)[-1]["stats"].get("heal.timeline") == 1, job.lines(1)[-1]
    assert max(_timeline(job, 1)) == 24


@pytest.mark.slow
def test_groups_that_joined_a_live_job_lost_before_any_heal_restore_from_the_store(tmp_path):
    """3 groups, main version every 5. Groups 1 and 2 are killed (at 12 and 13, mid-step) and launched
    again; both resume() while group 0 is alive and join. Before their first step group 0 dies too, so
    no replica that held the job's state is left: groups 1 and 2 form a quorum of their own, which
    torchft starts at step 0 (it heals only from a live peer). At its first committed step, below the
    step it joined at, a group that was not healed restores the newest main version from the store as
    a cold start would (a whole-job loss); one healed from such a group learns the restored step from it
    and moves its loader back to its own position there; the two train on to the end. Each group's
    batches continue its shard from its position at the restored step: none skipped, none twice.
    Before: the job trained on from step 0 with fresh weights."""
    gate = tmp_path / "go"
    job = tg.Job(tmp_path, tmp_path / "root", name="lost-all", steps=40, interval=5, num_groups=3, pace_s=1.0,
                 kill={"1": [12, "mid-step"], "2": [13, "mid-step"]}, settle=True,
                 hold={"1": str(gate), "2": str(gate)})
    job.start_lighthouse()
    try:
        job.start()
        end = time.monotonic() + 300
        for g in (1, 2):
            while job.procs[(g, 0)].poll() is None:
                assert time.monotonic() < end, job.tails()
                time.sleep(0.05)
            del job.procs[(g, 0)]
            job.launch(g)
        for g in (1, 2):
            while not any(x.get("launch") == "1" and "resume" in x for x in job.lines(g)):
                assert time.monotonic() < end and job.procs[(g, 0)].poll() is None, job.tails()
                time.sleep(0.05)
        job.kill_group(0)  # the last replica holding the job's state
        gate.touch()
        codes = job.wait(300)
    finally:
        job.close()
    assert codes == {1: 0, 2: 0}, (codes, job.tails())
    lost = [x for g in (1, 2) for x in job.lines(g) if x.get("lost_join")]
    assert {x["resume"]["kind"] for x in lost} == {"cold-start"} and len({x["resume"]["version"] for x in lost}) == 1, lost
    at = int(lost[0]["resume"]["version"].split("-")[1])
    for g in (1, 2):
        kinds = [(x["launch"], x["resume"]["kind"]) for x in job.lines(g) if "resume" in x and not x.get("lost_join")]
        assert kinds == [("0", "fresh"), ("1", "join")], (g, kinds)
        stats = job.lines(g)[-1]["stats"]
        assert stats.get("join.lost") == 1 or stats.get("heal.timeline") == 1, (g, stats)
    for g in (1, 2):  # the timeline: launch 0 up to the restored step, then launch 1
        got = [x["ids"] for x in job.lines(g) if x.get("counted") and (x["launch"] != "0" or x["step"] <= at)]
        assert got == tg.shard_order(g)[:len(got)], f"group {g}: a batch skipped or drawn twice"
        assert max(_timeline(job, g)) == 40


def _job(tmp_path, root, name, *, restart_killed=False, groups=None, timeout=400, **cfg):
    job = tg.Job(tmp_path, root, name=name, **cfg)
    job.start_lighthouse()
    try:
        t0 = time.monotonic()
        job.start(groups)
        codes = job.wait(timeout, restart_killed=restart_killed)
        took = time.monotonic() - t0
    finally:
        job.close()
    want = {g: 0 for g in (range(job.cfg["num_groups"]) if groups is None else groups)}
    assert codes == want, (codes, job.tails())
    return job, took


def _manifest_user(root, version) -> dict:
    from ckptstore.manifest import catalogue
    from ckptstore.tiers.local import LocalTier

    return catalogue.read_manifest(LocalTier(str(root)), version).manifest.user["torchft"]


@pytest.mark.slow
def test_forty_steps_whole_job_restart_equals_an_uninterrupted_run_then_three_to_two_groups(tmp_path):
    """The must-show run: 3 groups, 40 steps, a main version every 5. Reference: the same job
    uninterrupted. Run: every group killed mid-step at 23, the whole job restarted from ckptstore; every
    group's 40 per-step losses equal the reference's bit for bit, its batches are its shard's in order
    (none twice, none skipped), torchft's step and batches_committed continue. Then a restart with 2
    groups continues 5 more steps: groups 0 and 1 their own positions, group 2's position reported
    orphaned (docs/howto/torchft.md, the loader policy)."""
    ref, ref_s = _job(tmp_path, tmp_path / "ref-root", "reference", steps=40)
    job, root, restart_s = _cold_restart(tmp_path, steps=40, kill_at=23, name="run")
    shards = {g: tg.shard_order(g) for g in range(3)}
    for g in range(3):
        want = {s: (r["loss"], r["ids"]) for s, r in _timeline(ref, g).items()}
        got = {s: (r["loss"], r["ids"]) for s, r in _timeline(job, g).items()}
        assert sorted(got) == list(range(1, 41)) and got == want, f"group {g}: the run differs from the reference"
    _check_exact_samples(job, range(3), shards)
    r1 = _resumes(job, 0)[1]
    # the newest main version whose every group's position was saved when the job died (under load a
    # positions save can lag the 10-30 ms steps by several steps: then an older one)
    assert r1["kind"] == "cold-start" and r1["version"] in ("step-20", "step-15", "step-10", "step-5")
    for g in range(3):
        final = job.lines(g)[-1]["stats"]
        assert "positions.lost-race" not in final and "main.lost-race" not in final, final
    assert _manifest_user(root, "step-40")["batches_committed"] == _manifest_user(tmp_path / "ref-root", "step-40")[
        "batches_committed"]
    # 3 -> 2 groups
    two, two_s = _job(tmp_path, root, "two-groups", steps=45, num_groups=2)
    for g in (0, 1):
        r = _resumes(two, g)[0]
        assert r["kind"] == "cold-start" and r["version"] == "step-40", r
        assert r["loader"]["how"] == "own" and r["loader"]["batches"] == len(_counted_batches(job, g))
        assert r["orphaned"] == {"2": len(_counted_batches(job, 2))}
        after = _counted_batches(two, g)
        n = len(_counted_batches(job, g))
        assert after == shards[g][n:n + len(after)] and len(after) == 5, f"group {g} did not continue its shard"
    REPORT.append(f"40 steps, 3 groups: uninterrupted {ref_s:.0f} s; killed at 23, resumed at {r1['step']} "
                  f"({r1['version']}, restore {r1['seconds']:.2f} s); all 120 per-step losses equal; 3 -> 2 groups: "
                  f"group 2's {len(_counted_batches(job, 2))} batches orphaned, groups 0/1 continue their shards")


@pytest.mark.slow
def test_groups_killed_mid_step_and_mid_save_heal_and_the_durable_tier_keeps_committing(tmp_path):
    """3 groups, 40 steps: group 1 is killed mid-step at step 3, group 0 (the writer) inside its main
    save of step 10, right before the commit point, and again mid-step at 24; each launch joins the
    live job (the durable tier is not read; torchft heals it from a peer). step-10 is never committed
    (its attempt is garbage for gc); the due steps are written by whichever group was the quorum's
    participating rank 0 (step-25 by group 1: group 0 is away or healing then); every group's
    batches are its shard's in order with no gap, a
    restarted group continuing from its newest position (its journal's: no batch drawn twice)."""
    root = tmp_path / "root"
    job, took = _job(tmp_path, root, "heal", steps=40, pace_s=2.5, restart_killed=True, timeout=600,
                     kill={"1": [[3, "mid-step", "0"]], "0": [[10, "mid-save", "0"], [24, "mid-step", "1"]]})
    assert job.launches == {0: 2, 1: 1, 2: 0}
    for g, n in ((0, "1"), (0, "2"), (1, "1")):
        r = _resumes(job, g)[int(n)]
        assert r["kind"] == "join", r
        healed = [x for x in job.lines(g) if x.get("launch") == n and x.get("committed")]
        assert healed and not healed[0]["counted"], f"group {g} did not heal at its first step (launch {n})"
    names = {v.version for v in _versions(root)}
    writers = {}
    for s in range(5, 41, 5):
        if f"step-{s}" in names:
            writers[s] = _manifest_user(root, f"step-{s}")["group"]
    assert 10 not in writers, "a group killed before the commit point committed"
    # what the killed save wrote is garbage for gc, or already reclaimed (its writer is provably dead,
    # docs/FORMAT.md Delete rule 15): nothing of it is committed or protected
    from ckptstore.tiers.local import LocalTier

    left = {i.key for i in LocalTier(str(root)).list("versions/step-10/")}
    assert left <= set(_garbage(root)), left - set(_garbage(root))
    assert writers.get(5) == 0 and writers.get(25) == 1, writers
    assert len(writers) >= 5, f"due steps not committed: {writers}"  # a save may be skipped while one runs
    for s, g in writers.items():
        assert _timeline(job, g)[s]["counted"], f"step-{s} written by group {g}, which did not take part in it"
    shards = {g: tg.shard_order(g) for g in range(3)}
    _check_exact_samples(job, [2], shards)
    repeats = {}
    for g, launches in ((0, ("0", "1", "2")), (1, ("0", "1"))):
        by_launch = [[r["ids"] for r in job.lines(g) if r.get("counted") and r["launch"] == n] for n in launches]
        end = len(by_launch[0])
        assert by_launch[0] == shards[g][:end]
        for i in range(1, len(by_launch)):
            b = shards[g].index(by_launch[i][0])
            assert by_launch[i] == shards[g][b:b + len(by_launch[i])] and b <= end, f"group {g} skipped batches"
            # it continued exactly from its newest position, its journal's: nothing drawn twice
            assert b == (_resumes(job, g)[i]["loader"]["batches"] or 0), (g, b, _resumes(job, g)[i])
            assert b == end, f"group {g} drew {end - b} batches again after relaunch {i}"
            repeats[f"g{g}.{i}"] = end - b
            end = b + len(by_launch[i])
    REPORT.append(f"heal run ({took:.0f} s): main versions by group {writers}; step-10's attempt "
                  f"garbage; batches repeated after a restart: {repeats}")


@pytest.mark.slow
def test_two_groups_racing_for_one_step_exactly_one_commits(tmp_path):
    """A partition: two groups, each the only member of its own lighthouse's quorum, both own step-5
    and reach its commit point together (a barrier in the writer's commit check). Exactly one
    commits; the other gets VersionExistsError (reported, training goes on) and deletes its
    attempt's objects (docs/FORMAT.md, Delete rule 14): nothing is left for gc."""
    root = tmp_path / "root"
    bar = str(tmp_path / "race")
    jobs = [tg.Job(tmp_path, root, name=f"side{g}", steps=6, num_groups=2, min_replicas=1, race_barrier=bar)
            for g in (0, 1)]
    try:
        for g, j in enumerate(jobs):
            j.start_lighthouse()
            j.start([g], barrier=False)
        codes = [j.wait(300) for j in jobs]
    finally:
        for j in jobs:
            j.close()
    assert codes == [{0: 0}, {1: 0}], [j.tails() for j in jobs]
    stats = [jobs[g].lines(g)[-1]["stats"] for g in (0, 1)]
    outcomes = sorted((s.get("main.committed", 0), s.get("main.lost-race", 0)) for s in stats)
    assert outcomes == [(0, 1), (1, 0)] or outcomes == [(1, 1), (2, 0)] or outcomes[0][1] == 1, stats
    winner = _manifest_user(root, "step-5")["group"]
    assert stats[winner].get("main.lost-race", 0) == 0 and stats[1 - winner]["main.lost-race"] == 1
    assert not any(k.startswith("versions/step-5/attempts/") for k in _garbage(root)), _garbage(root)
    REPORT.append(f"race for step-5: group {winner} committed, group {1 - winner} got VersionExistsError; "
                  "its attempt's objects were deleted (Delete rule 14)")


@pytest.mark.slow
@pytest.mark.s3
def test_s3_down_for_the_whole_run_never_slows_a_step_and_uploads_when_back(tmp_path, s3_url, seaweed):
    """3 groups, 20 steps, main every 5, three runs: the durable tier off (the kill switch), on with S3
    up, on with S3 (SeaweedFS) stopped for the whole run. Step times are printed side by side (not
    asserted: the machine is shared); in the outage run every main version commits locally, and once
    S3 is back (started again before the groups close) close() uploads the newest ``UPLOAD_BACKLOG``
    of them and reports nothing (an older one is skipped, docs/FORMAT.md Save rule 8)."""
    off, _ = _job(tmp_path, tmp_path / "off-root", "off", steps=20, enabled=False)
    up, _ = _job(tmp_path, tmp_path / "up-root", "up", steps=20, remote=s3_url.rstrip("/") + "-up/",
                 endpoint_url=os.environ.get("AWS_ENDPOINT_URL"))
    seaweed.stop()
    try:
        gate = tmp_path / "s3-back"
        job = tg.Job(tmp_path, tmp_path / "root", name="s3down", steps=20, remote=s3_url,
                     endpoint_url=os.environ.get("AWS_ENDPOINT_URL"), close_wait=str(gate))
        job.start_lighthouse()
        try:
            job.start()
            while not all(any(r.get("step") == 20 for r in job.lines(g)) for g in range(3)):
                time.sleep(0.2)
                assert all(p.poll() is None for p in job.procs.values()), job.tails()
            seaweed.start()
            gate.touch()
            codes = job.wait(300)
        finally:
            job.close()
        assert codes == {0: 0, 1: 0, 2: 0}, job.tails()
    finally:
        if not seaweed.running:
            seaweed.start()

    def step_times(j):
        return [r["dt"] for g in range(3) for r in j.lines(g) if "dt" in r and r["step"] > 2]

    from ckptstore.dcp.upload import UPLOAD_BACKLOG

    local = {v.version for v in _versions(tmp_path / "root") if v.version.startswith("step-")}
    remote = {v.version for v in ckptstore.Store(None, remote=s3_url).versions()}
    # the newest UPLOAD_BACKLOG main versions are uploaded; an older one may have been skipped (a newer
    # one took its place in the queue: docs/FORMAT.md, Save rule 8), which close() does not report
    newest = set(sorted(local, key=st.main_step)[-UPLOAD_BACKLOG:])
    assert len(local) >= 2 and newest <= remote, (local, remote)
    finals = [r["stats"] for g in range(3) for r in job.lines(g) if r.get("final")]
    assert finals and not any("main.not-uploaded" in s for s in finals), finals
    figs = []
    for name, j in (("off", off), ("on, S3 up", up), ("on, S3 down", job)):
        t = step_times(j)
        sd = [r["sd"] for g in range(3) for r in j.lines(g) if "sd" in r and r["step"] > 2]
        figs.append(f"{name}: median {statistics.median(t) * 1e3:.1f} ms, p90 {statistics.quantiles(t, n=10)[-1] * 1e3:.1f} ms "
                    f"(step_done median {statistics.median(sd) * 1e3:.2f} ms, max {max(sd) * 1e3:.1f} ms)")
    REPORT.append("step times (3 groups x 18 steps): " + "; ".join(figs) +
                  f"; main versions committed during the outage {sorted(local)}, uploaded at close() once S3 was back: {sorted(local & remote)}")
    print(REPORT[-1])


@pytest.mark.slow
def test_a_group_that_leaves_the_quorum_mid_save_never_commits(tmp_path):
    """One group (its own quorum) starts the main save of step-5; the save is held right before its
    commit point while the lighthouse is killed: the group's next quorum fails (it is out of the
    quorum), the held commit check then asks torchft, is refused (FencedError) and nothing is
    committed; the attempt's objects are deleted at once."""
    root = tmp_path / "root"
    job = tg.Job(tmp_path, root, name="leave", steps=200, num_groups=1, min_replicas=1, hold_commit=5,
                 quorum_timeout_s=4, pace_s=0.2, pace_always=True)
    job.start_lighthouse()
    try:
        job.start(barrier=False)
        end = time.monotonic() + 240
        while not any("hold" in r for r in job.lines(0)):
            assert time.monotonic() < end and job.procs[(0, 0)].poll() is None, job.tails()
            time.sleep(0.1)
        job.lighthouse.kill()  # the group can no longer reach its quorum
        codes = job.wait(240)
    finally:
        job.close()
    assert codes == {0: 1}, job.tails()  # the training loop itself fails: torchft lost its lighthouse
    claim = [r["claim"] for r in job.lines(0) if "claim" in r]
    assert claim and "quorum" in claim[0], job.lines(0)
    assert "step-5" not in {v.version for v in _versions(root)}
    # the refused attempt deleted its objects (docs/FORMAT.md, Delete rule 14): nothing left for gc
    assert not any(k.startswith("versions/step-5/") for k in _garbage(root)), _garbage(root)
    REPORT.append(f"left the quorum mid-save: step-5 refused ({claim[0][:90]}...)")


# -- replica groups of several ranks (HSDP: FSDP2 inside a group, torchft across groups) -----------
def _rank_timeline(job, g, r) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for rec in job.lines(g, r):
        if rec.get("committed"):
            out[rec["step"]] = rec
    return out


def test_hsdp_groups_of_two_ranks_save_every_shard_and_cold_restart_exactly(tmp_path):
    """2 replica groups × 2 ranks (FSDP2 over each group's ranks, gloo, CPU), 7 steps, a main version
    every 3: the main versions are written by both ranks of one group (a version of world size 2,
    objects from each rank), each rank's positions are saved; every rank is killed mid-step at 6
    (after the saves started so far committed) and the whole job restarts from ckptstore: it
    restores step-3, every rank continues its own position, the steps trained again have the same
    loss and batch on every rank, and no rank's batch is seen twice or skipped. On main this fails:
    ``DurableTier`` refused a group of several ranks."""
    root = tmp_path / "root"
    job = tg.Job(tmp_path, root, name="hsdp", steps=7, interval=3, num_groups=2, ranks=2, fsdp=True,
                 kill={str(g): [6, "mid-step"] for g in range(2)}, settle=True)
    job.start_lighthouse()
    try:
        job.start()
        codes = job.wait(240)
        assert codes == {0: -9, 1: -9}, (codes, job.tails())
        job.start()
        codes = job.wait(240)
        assert codes == {0: 0, 1: 0}, (codes, job.tails())
    finally:
        job.close()
    recs = {v.version: v for v in _versions(root)}
    assert {"step-3", "step-6"} <= set(recs), sorted(recs)
    assert recs["step-3"].world_size == 2  # both ranks of the writing group saved their shards
    for g in range(2):  # the tier's saves ran lowered (background_nice=19), the training thread did not
        for r in range(2):
            (end,) = [x for x in job.lines(g, r) if "save_nice" in x and x["launch"] == "1"]
            assert end["save_nice"] == [min(19, end["main_nice"] + 19)] and end["main_nice"] < 19, end
    from ckptstore.manifest import catalogue
    from ckptstore.tiers.local import LocalTier

    m = catalogue.read_manifest(LocalTier(str(root)), "step-3").manifest
    assert m.user["torchft"]["group"] == 0
    for g in range(2):
        for r in range(2):
            shard = tg.shard_order(g, r, 2)
            r0, r1 = [x["resume"] for x in job.lines(g, r) if "resume" in x]
            assert (r0["kind"], r1["kind"], r1["version"]) == ("fresh", "cold-start", "step-3"), (g, r, r1)
            assert r1["loader"]["how"] == "own" and r1["loader"]["rank"] == r and r1["loader"]["batches"] == 3, r1
            first = {x["step"]: x for x in job.lines(g, r) if x.get("committed") and x["launch"] == "0"}
            again = {x["step"]: x for x in job.lines(g, r) if x.get("committed") and x["launch"] == "1"}
            assert sorted(first) == [1, 2, 3, 4, 5] and sorted(again) == [4, 5, 6, 7], (g, r, sorted(again))
            for s in (4, 5):  # trained twice: the same loss, the same batch
                assert (again[s]["loss"], again[s]["ids"]) == (first[s]["loss"], first[s]["ids"]), (g, r, s)
            tl = _rank_timeline(job, g, r)
            got = [tl[s]["ids"] for s in sorted(tl) if tl[s]["counted"]]
            assert got == shard[:7], f"group {g} rank {r}: batches are not its shard's in order"
            final = job.lines(g, r)[-1]
            assert final.get("final") and "agreement.failed" not in final["stats"], final


@pytest.mark.slow
def test_hsdp_cold_start_of_two_groups_of_three_from_three_groups_of_two_reshards(tmp_path):
    """3 groups × 2 FSDP2 ranks train 5 steps (main every 3) and are all killed mid-step at 6; the job
    restarts as 2 groups × 3 ranks from the same store: step-3 is resharded onto 3 ranks per group
    (DCP's planner), torchft's step continues at 3, each rank's report says what its loader continues
    from (ranks 0-1 their own positions resharded, rank 2 the slowest rank of its group, group 2
    orphaned), and the new shape commits step-6 with world size 3."""
    root = tmp_path / "root"
    a = tg.Job(tmp_path, root, name="three-by-two", steps=7, interval=3, num_groups=3, ranks=2, fsdp=True,
               kill={str(g): [6, "mid-step"] for g in range(3)}, settle=True)
    a.start_lighthouse()
    try:
        a.start()
        codes = a.wait(300)
    finally:
        a.close()
    assert codes == {0: -9, 1: -9, 2: -9}, (codes, a.tails())
    b, took = _job(tmp_path, root, "two-by-three", steps=7, interval=3, num_groups=2, ranks=3, fsdp=True)
    stored = {(g, r): len([x for x in a.lines(g, r) if x.get("counted") and x["step"] <= 3]) for g in range(3)
              for r in range(2)}
    for g in range(2):
        for r in range(3):
            rep = [x["resume"] for x in b.lines(g, r) if "resume" in x][0]
            assert (rep["kind"], rep["version"], rep["step"]) == ("cold-start", "step-3", 3), rep
            want = "own-resharded" if r < 2 else "slowest"
            assert rep["loader"]["how"] == want and rep["loader"]["source"] == g, rep["loader"]
            assert rep["loader"]["batches"] == stored[(g, min(r, 1) if r < 2 else 0)], (rep["loader"], stored)
            assert rep["orphaned"] == {"2": stored[(2, 0)] + stored[(2, 1)]}, rep["orphaned"]
            steps = sorted(x["step"] for x in b.lines(g, r) if x.get("committed"))
            assert steps == [4, 5, 6, 7], (g, r, steps)
    recs = {v.version: v for v in _versions(root)}
    assert recs["step-3"].world_size == 2 and recs["step-6"].world_size == 3, {k: v.world_size for k, v in recs.items()}
    REPORT.append(f"3x2 -> 2x3 cold start: step-3 resharded onto 3 ranks per group, run to step 7 in {took:.0f} s")


@pytest.mark.slow
def test_hsdp_a_rank_killed_mid_step_and_mid_save_the_group_heals_and_the_tier_keeps_committing(tmp_path):
    """3 groups × 2 FSDP2 ranks, 30 steps, main every 5: rank 1 of group 1 is killed mid-step at step
    4, rank 0 of group 0 (the writer) inside its main save of step 10, right before the commit point.
    Each time the group's other rank is ended (as torchrun does) and the group launched again; it joins
    the live job (torchft heals both its ranks from a peer group's same ranks, to the live step), its loaders continue
    from their own newest positions. step-10 is never committed; the later due steps are committed
    (by whichever group is the quorum's participating rank 0), every one at world size 2; every rank
    of every group sees its shard in order, a restarted rank continuing from its journal's newest
    position: never a batch drawn twice, never one skipped."""
    root = tmp_path / "root"
    job, took = _job(tmp_path, root, "hsdp-heal", steps=30, interval=5, ranks=2, fsdp=True, pace_s=2.0,
                     restart_killed=True, timeout=900,
                     kill={"1": [[4, "mid-step", "0", 1]], "0": [[10, "mid-save", "0", 0]]})
    assert job.launches == {0: 1, 1: 1, 2: 0}, job.launches
    for g in (0, 1):
        for r in range(2):
            rep = [x["resume"] for x in job.lines(g, r) if "resume" in x][1]
            assert rep["kind"] == "join", rep
            healed = [x for x in job.lines(g, r) if x.get("launch") == "1" and x.get("committed")]
            died = max(x["step"] for x in job.lines(g, r) if x.get("launch") == "0" and x.get("committed"))
            # torchft healed it to the live step (use_async_quorum=False heals before the forward pass,
            # so its first step already counts)
            assert healed and healed[0]["step"] > died, (g, r, healed[:1], died)
    recs = {v.version: v for v in _versions(root)}
    writers = {s: _manifest_user(root, f"step-{s}")["group"] for s in range(5, 31, 5) if f"step-{s}" in recs}
    assert 10 not in writers, "a group killed before the commit point committed"
    assert {15, 20, 25, 30} & set(writers), f"the tier stopped committing after the faults: {writers}"
    assert all(recs[f"step-{s}"].world_size == 2 for s in writers)
    repeats = {}
    for g in range(3):
        for r in range(2):
            shard = tg.shard_order(g, r, 2)
            by_launch = [[x["ids"] for x in job.lines(g, r) if x.get("counted") and x["launch"] == n]
                         for n in sorted({x["launch"] for x in job.lines(g, r) if "launch" in x})]
            end = len(by_launch[0])
            assert by_launch[0] == shard[:end], (g, r)
            for i in range(1, len(by_launch)):
                if not by_launch[i]:
                    continue
                b = shard.index(by_launch[i][0])
                assert by_launch[i] == shard[b:b + len(by_launch[i])] and b <= end, f"group {g} rank {r} skipped"
                assert b == end, f"group {g} rank {r} drew {end - b} batches again"
                repeats[f"g{g}r{r}"] = end - b
                end = b + len(by_launch[i])
    REPORT.append(f"HSDP heal run 3x2 ({took:.0f} s): main versions by group {writers}; step-10 never committed; "
                  f"batches repeated per restarted rank {repeats}")


# -- the durable-tier transport (torchft CheckpointTransport) -------------------------------------------
@pytest.mark.slow
def test_a_group_heals_from_the_durable_tier_when_no_peer_can_serve_and_the_run_equals_an_uninterrupted_one(tmp_path):
    """2 groups, 10 steps, main every 5, both with ``DurableTransport`` (torchft's HTTP transport to
    peers first). Group 1 is killed before the allreduce of step 6, so step 6 commits nowhere and group
    0 waits at step 5 (group 1's saves so far committed before the kill); group 1's relaunch joins the live job, and its peer transfer fails (the test
    makes the peer unreachable): the transport loads step-5 from ckptstore with group 1's own loader
    position at step 5. torchft heals before the forward pass (``use_async_quorum=False``), so the math
    is that of an uninterrupted run: every per-step loss of both groups equals the reference's bit for
    bit, and every batch is its shard's, none twice, none skipped."""
    kw = dict(steps=10, interval=5, num_groups=2, transport="peer", sync_quorum=True)
    ref, _ = _job(tmp_path, tmp_path / "ref-root", "ref", **kw)
    job, took = _job(tmp_path, tmp_path / "root", "durable-heal", restart_killed=True, timeout=400,
                     kill={"1": [[6, "before-allreduce", "0"]]}, peer_fails=[1, 1], settle=True, **kw)
    assert job.launches == {0: 0, 1: 1}
    final = job.lines(1)[-1]
    assert final["transport"].get("durable") == 1 and final["stats"].get("heal.position") == 1, final
    assert [r for r in _resumes(job, 1)][1]["kind"] == "join"
    shards = {g: tg.shard_order(g) for g in range(2)}
    for g in range(2):
        want = {s: (r["loss"], r["ids"]) for s, r in _timeline(ref, g).items()}
        got = {s: (r["loss"], r["ids"]) for s, r in _timeline(job, g).items()}
        assert sorted(got) == list(range(1, 11)) and got == want, f"group {g}: the healed run differs"
    _check_exact_samples(job, range(2), shards)
    REPORT.append(f"durable heal ({took:.0f} s): group 1 healed from step-5 of ckptstore (peer unreachable), "
                  "20 per-step losses equal the uninterrupted run's")
