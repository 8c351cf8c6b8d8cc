"""Recovery that never needs a person (docs/FORMAT.md, "Restore choice", "Superseding", "Order").

Each case is a fault around the newest checkpoint that once stopped ``resume()`` (or the next
``save``) until somebody ran ``ckptstore drop`` on every node; each test runs the real job again
after the fault, as a scheduler restarts it, and asserts what the job then sees: which version it
restored, what ``last_restore`` says was skipped and why, that model/optimizer/scheduler/data/RNG
state equals the restored step's bit for bit, and that the loop's next saves commit.

2-rank cases run real gloo ranks (forked from a preloaded forkserver), each rank with its own root
(node-local disks, ``tests/recovery_ranks.py``).
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch

import ckptstore
from ckptstore.manifest import catalogue, layout
from ckptstore.testing.dist import run_ranks
from ckptstore.tiers import LocalTier

import recovery_ranks as rr
from store_helpers import cli

FAST = {"start_method": "forkserver", "preload": rr.PRELOAD}


def job(base, saves, remote=None, mgr=None, version=None, attempts=None):
    return run_ranks(rr.job, 2, str(base), saves, remote, mgr, version, attempts, timeout=240, **FAST)


def shard(base, rank: int, version: str, of_rank: int | None = None) -> str:
    """The path of rank ``of_rank``'s (default ``rank``) object of ``version`` in ``rank``'s root."""
    root = rr.root_of(str(base), rank)
    m = catalogue.read_manifest(LocalTier(root), version).manifest
    o = next(o for o in m.objects if o.rank == (rank if of_rank is None else of_rank))
    return os.path.join(root, *layout.object_key(version, o.name).split("/"))


def flip_byte(path: str, at: int = 300) -> None:
    b = bytearray(open(path, "rb").read())
    b[min(at, len(b) - 1)] ^= 0x10
    open(path, "wb").write(b)


def check_resumed(outs, start: int, skipped: list[tuple[str, str]]):
    """Both ranks resumed at ``start`` (restored step ``start - 1``) with the state of that step,
    and ``last_restore.skipped`` names ``skipped`` = [(version, kind), ...] in order."""
    for o in outs:
        assert o["start"] == start, outs
        r = o["restore"]
        assert r["version"] == f"step-{start - 1}", r
        assert [(s["version"], s["kind"]) for s in r["skipped"]] == skipped, r["skipped"]
        assert all(o["same"].values()), o["same"]  # model, optim, sched, data position, RNG: bit-exact


# -- kind 1 + 2: damaged, missing, unverifiable newest version; the loop moves on ---------------------
def test_loop_survives_damage_mark_missing_object_and_flipped_byte(tmp_path):
    """2 ranks, node-local roots, no remote tier. After each fault the job is simply started again:
    it restores the newest version every rank can load and verify, and its next 3 saves commit —
    the first of them under the skipped name, which it supersedes."""
    base = tmp_path
    outs = job(base, 3)  # steps 1, 2, 3
    assert [o["saved"] for o in outs] == [[1, 2, 3]] * 2

    # (a) rank 1's step-3 object replaced by a well-formed object of another save; scrub --repair on
    # root B (rank 1's node) marks step-3 damaged there. Root A's copy stays unmarked.
    shutil.copyfile(shard(base, 1, "step-1"), shard(base, 1, "step-3"))
    r = cli("scrub", rr.root_of(str(base), 1), "--repair")
    assert r.exit_code == 10 and "marked damaged" in r.output, r.output
    for _ in range(2):  # "every time": the same decision on every restart, no manual step
        outs = job(base, 0)
        check_resumed(outs, 3, [("step-3", "damaged")])
        assert outs[0]["restore"]["skipped"][0]["where"].startswith("the root of rank 1")
    outs = job(base, 3)  # saves 3 (superseding the damaged step-3), 4, 5
    check_resumed(outs, 3, [("step-3", "damaged")])
    for o in outs:
        vs = {v: sup for v, _a, sup in o["versions"]}
        assert list(vs) == ["step-1", "step-2", "step-3", "step-4", "step-5"], o["versions"]
        assert len(vs["step-3"]) == 1  # the new step-3 names the attempt it superseded
    assert "supersedes" in cli("list", rr.root_of(str(base), 1)).output

    # (b) rank 1's object of step-5 deleted on its root (no other copy anywhere)
    os.remove(shard(base, 1, "step-5"))
    outs = job(base, 3)  # restores step-4; saves 5, 6, 7
    check_resumed(outs, 5, [("step-5", "missing")])
    assert "r00001.ckd" in outs[0]["restore"]["skipped"][0]["reason"]

    # (c) one byte of rank 1's step-7 object flipped: found only while loading
    flip_byte(shard(base, 1, "step-7"))
    outs = job(base, 3)  # restores step-6; saves 7, 8, 9
    check_resumed(outs, 7, [("step-7", "unverified")])
    sk = outs[1]["restore"]["skipped"][0]
    assert "r00001.ckd" in sk["object"] and "step-7" in sk["reason"] and "node1" in sk["reason"], sk
    for o in outs:
        assert [v for v, _a, _s in o["versions"]][-3:] == ["step-7", "step-8", "step-9"]
    outs = job(base, 0)
    check_resumed(outs, 10, [])


class _Records(list):
    """The ``ckptstore`` logger's records while in ``with`` (the suite runs with ``-p no:logging``)."""

    def __enter__(self):
        import logging

        self._h = logging.Handler(logging.WARNING)
        self._h.emit = self.append
        logging.getLogger("ckptstore").addHandler(self._h)
        return self

    def __exit__(self, *exc):
        import logging

        logging.getLogger("ckptstore").removeHandler(self._h)


def test_single_process_resume_past_a_corrupt_newest_version(tmp_path):
    """A new user's first try: one process, the newest version corrupt. resume() restores the one
    before and warns once, naming version, object and root; the next save supersedes the name."""
    from ckptstore import CheckpointManager

    root = str(tmp_path)
    model = torch.nn.Linear(32, 32)
    with CheckpointManager(root, {"model": model}) as mgr:
        for s in (1, 2):
            with torch.no_grad():
                model.weight.fill_(s)
            mgr.save(s)
    m = catalogue.read_manifest(LocalTier(root), "step-2").manifest
    flip_byte(os.path.join(root, *layout.object_key("step-2", m.objects[0].name).split("/")))
    fresh = torch.nn.Linear(32, 32)
    with CheckpointManager(root, {"model": fresh}) as mgr, _Records() as records:
        assert mgr.resume() == 2
        assert torch.all(fresh.weight == 1)  # step-1's values, not a mix
        info = mgr.last_restore
        assert info.version == "step-1" and [s.version for s in info.skipped] == ["step-2"]
        assert info.skipped[0].object == m.objects[0].name
        warned = [r.getMessage() for r in records if "step-2" in r.getMessage()]
        assert len(warned) == 1 and m.objects[0].name in warned[0] and root in warned[0], warned
        mgr.save(2)  # the corrupt name is superseded, not refused
    rec = ckptstore.Store(root).get("step-2")
    assert rec.attempt != m.attempt and [a for a, _ in rec.supersedes] == [m.attempt]
    old_dir = os.path.join(root, *layout.object_key("step-2", layout.attempt_dir(m.attempt)).split("/"))
    assert os.path.isdir(old_dir)
    assert cli("gc", root, "--grace", "0").exit_code == 0  # gc reclaims the superseded attempt by the usual rules
    assert not os.path.exists(old_dir) and ckptstore.Store(root).get("step-2").attempt == rec.attempt
    # a plain writer still refuses a healthy existing version
    import torch.distributed.checkpoint as dcp

    with pytest.raises(BaseException) as ei:
        dcp.save({"x": torch.ones(2)}, checkpoint_id="step-2", storage_writer=ckptstore.StorageWriter(root))
    assert "already exists" in str(ei.value)


def test_restore_older_version_then_resave_newer_name(tmp_path):
    """restore(version=older) (torchtitan's --checkpoint.load-step): the abandoned newer names are
    superseded by the loop's next saves instead of raising VersionExistsError."""
    from ckptstore import CheckpointManager

    root = str(tmp_path)
    model = torch.nn.Linear(8, 8)
    with CheckpointManager(root, {"model": model}) as mgr:
        for s in (1, 2, 3):
            mgr.save(s)
    with CheckpointManager(root, {"model": model}) as mgr:
        assert mgr.restore(version="step-1") == 1
        assert mgr.save(2) and mgr.save(3)  # both supersede the abandoned timeline
        mgr.wait()
    recs = {r.version: r for r in ckptstore.Store(root).versions()}
    assert all(recs[v].supersedes and "abandoned" in recs[v].supersedes[0][1] for v in ("step-2", "step-3"))


# -- kind 6: a manager resumes its own versions --------------------------------------------------------
def test_prefix_scopes_discovery_retention_and_resume(tmp_path):
    from ckptstore import CheckpointManager
    from ckptstore.retention import KeepLast, RetentionPolicy

    root = str(tmp_path)
    model, loader = torch.nn.Linear(4, 4), {"pos": 0}
    keep1 = RetentionPolicy([KeepLast(1)])
    with CheckpointManager(root, {"model": model}, prefix="model-", retention=keep1) as mm, \
            CheckpointManager(root, {"loader": loader}, prefix="loader-", retention=keep1) as lm:
        for s in (1, 2, 3):
            lm.save(s, {"loader": {"pos": s * 10}})
            lm.wait()
        for s in (4, 5, 6):
            mm.save(s)
            mm.wait()
    names = [r.version for r in ckptstore.Store(root).versions()]
    assert names == ["loader-3", "model-6"], names  # each policy pruned only its own names
    state = {"loader": {"pos": -1}}
    with CheckpointManager(root, state, prefix="loader-") as lm:
        assert lm.resume() == 4 and state["loader"] == {"pos": 30} and lm.last_restore.version == "loader-3"
        assert lm.latest() == "loader-3"


# -- kind 12: a restart loop is visible and bounded ------------------------------------------------------
def test_restart_loop_is_counted_and_fall_back_after_skips_it(tmp_path):
    from ckptstore import CheckpointManager

    root = str(tmp_path)
    model = torch.nn.Linear(4, 4)
    with CheckpointManager(root, {"model": model}) as mgr:
        mgr.save(1)
        mgr.save(2)
    counts = []
    for _ in range(3):  # the job dies after every resume, before it saves anything
        with CheckpointManager(root, {"model": model}, fall_back_after=3) as mgr:
            mgr.resume()
            counts.append((mgr.last_restore.version, mgr.last_restore.restore_count))
    assert counts == [("step-2", 0), ("step-2", 1), ("step-2", 2)]
    with CheckpointManager(root, {"model": model}, fall_back_after=3) as mgr:
        assert mgr.resume() == 2  # step-2 restored 3 times in a row: the previous one now
        info = mgr.last_restore
        assert info.version == "step-1" and [(s.version, s.kind) for s in info.skipped] == [("step-2", "restarts")]
        mgr.save(2)  # a new step-2 (supersedes) ends the loop
    with CheckpointManager(root, {"model": model}, fall_back_after=3) as mgr:
        mgr.resume()
        assert mgr.last_restore.version == "step-2" and mgr.last_restore.restore_count == 0
    log = [json.loads(x) for x in open(os.path.join(root, layout.RESTORE_LOG))]
    assert [e["version"] for e in log] == ["step-2"] * 3 + ["step-1", "step-2"]


# -- kind 4: clocks lie, steps do not ----------------------------------------------------------------------
_SAVE = """
import sys, torch, torch.distributed.checkpoint as dcp, ckptstore
root, name, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
dcp.save({"x": torch.full((4,), float(step))}, checkpoint_id=name, storage_writer=ckptstore.StorageWriter(root, step=None if step < 0 else step))
"""


def _save_with_clock(root, name, step, offset=None, with_step=True):
    import subprocess
    import sys

    cmd = [sys.executable, "-c", _SAVE, root, name, str(step if with_step else -1)]
    if offset:
        if shutil.which("faketime") is None:
            pytest.skip("needs libfaketime's 'faketime' (Debian package faketime: scripts/test.sh installs it when "
                        "run as root with apt-get; README, 'The two commands')")
        cmd = ["faketime", "-f", offset] + cmd
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def test_a_skewed_clock_never_reorders_versions_or_deletes_the_last_save(tmp_path):
    """s1, then s2 from a host whose clock is 2 h ahead, then s3: order s1 < s2 < s3 in list,
    latest() is s3, KeepLast(1) keeps s3; the future commit time is flagged."""
    from ckptstore import gc
    from ckptstore.retention import KeepLast, RetentionPolicy

    root = str(tmp_path)
    _save_with_clock(root, "s1", 1)
    _save_with_clock(root, "s2", 2, offset="+2h")
    _save_with_clock(root, "s3", 3)
    st = ckptstore.Store(root)
    recs = st.versions()
    assert [r.version for r in recs] == ["s1", "s2", "s3"]
    assert recs[1].in_future and not recs[2].in_future
    assert recs[1].created > recs[2].created  # the clocks disagree; the order does not
    assert st.latest().version == "s3"
    assert "future-time" in cli("list", root).output
    plan, _res = gc.run(st.tiers, RetentionPolicy([KeepLast(1)]), dry_run=False)
    assert [r.version for r in ckptstore.Store(root).versions()] == ["s3"]


def test_without_steps_the_commit_sequence_orders_versions(tmp_path):
    root = str(tmp_path)
    _save_with_clock(root, "a", 0, with_step=False)
    _save_with_clock(root, "b", 0, offset="+2h", with_step=False)
    _save_with_clock(root, "c", 0, with_step=False)  # saw b's sequence: sorts after it
    assert [r.version for r in ckptstore.Store(root).versions()] == ["a", "b", "c"]
    assert ckptstore.Store(root).latest().version == "c"


# -- kind 3: the remote tier is unreachable at restart ---------------------------------------------------
@pytest.mark.slow  # long (15-45 s); the default suite keeps a shorter case of the same kind (suite < 15 min)
@pytest.mark.s3
def test_s3_outage_at_restart_restores_locally_then_uploads_when_back(tmp_path, s3_url, seaweed):
    """Node-local roots + S3, 3 saves; the same nodes restart while the endpoint is down: the job
    restores the newest version every rank holds locally (a warning, ``remote_error``), its next 3
    saves commit locally; once the endpoint is back, the next run's first save stages them too.
    Nothing is marked or deleted because the remote did not answer."""
    base = tmp_path
    outs = job(base, 3, remote=s3_url, attempts=2)
    assert all(o["close_error"] is None for o in outs), outs
    remote = ckptstore.Store(None, remote=s3_url)
    assert [r.version for r in remote.versions()] == ["step-1", "step-2", "step-3"]
    seaweed.stop()
    try:
        loads = run_ranks(rr.load_newest, 2, str(base), s3_url, timeout=240, **FAST)  # plain dcp.load, no version
        assert [x["version"] for x in loads] == ["step-3"] * 2 and loads[0]["remote_error"], loads
        # close() waits for the uploads at most upload_timeout seconds, then names what is not uploaded
        outs = job(base, 3, remote=s3_url, attempts=2, mgr={"upload_timeout": 15})
        check_resumed(outs, 4, [])
        assert all(o["restore"]["remote_error"] and o["restore"]["reads"]["remote_reads"] == 0 for o in outs), outs
        for o in outs:
            assert o["saved"] == [4, 5, 6] and o["close_error"] and "UploadError" in o["close_error"], o
            assert [v for v, _a, _s in o["versions"]] == [f"step-{i}" for i in range(1, 7)]
    finally:
        seaweed.start()
    assert [r.version for r in remote.versions()] == ["step-1", "step-2", "step-3"]
    outs = job(base, 1, remote=s3_url, attempts=2)  # restores step-6 locally; saves 7 and stages 4-6
    check_resumed(outs, 7, [])
    assert all(o["close_error"] is None for o in outs), outs
    recs = ckptstore.Store(None, remote=s3_url).versions()
    assert [r.version for r in recs] == [f"step-{i}" for i in range(1, 8)] and not any(r.damaged for r in recs)
    assert cli("scrub", rr.root_of(str(base), 0), "--remote", s3_url).exit_code == 0


# -- kind 10: one name, one content — also at restore ---------------------------------------------------------
def _save_values(root, value, remote=None, **kw):
    import torch.distributed.checkpoint as dcp

    w = ckptstore.StorageWriter(root, remote=remote, **kw)
    dcp.save({"x": torch.full((1000,), float(value))}, checkpoint_id="ckpt", storage_writer=w)
    w.close()


def _load_values(root, remote):
    import torch.distributed.checkpoint as dcp

    sd = {"x": torch.zeros(1000)}
    r = ckptstore.StorageReader(root, remote=remote)
    dcp.load(sd, checkpoint_id="ckpt", storage_reader=r)
    return sd["x"][0].item(), r.stats["remote_reads"]


@pytest.mark.s3
@pytest.mark.parametrize("how", ["overwrite", "local-only"])
def test_a_name_committed_elsewhere_is_never_served_from_a_stale_local_copy(tmp_path, s3_url, how):
    """Root A holds ``ckpt``; another node (root B) then commits ``ckpt`` to the shared S3 prefix —
    replacing A's upload with overwrite=True, or (A never uploaded it) as a new name. A load from
    root A returns B's tensors (read from S3), never A's stale copy; list and scrub report it."""
    a, b = str(tmp_path / "A"), str(tmp_path / "B")
    if how == "overwrite":
        _save_values(a, 1, remote=s3_url, durability="remote")
        _save_values(b, 2, remote=s3_url, durability="remote", overwrite=True)
    else:
        _save_values(a, 1)  # committed locally only
        _save_values(b, 2, remote=s3_url, durability="remote")
    value, remote_reads = _load_values(a, s3_url)
    assert value == 2.0 and remote_reads > 0
    r = cli("list", a, "--remote", s3_url)
    assert "stale:local" in r.output and "stale" in r.stderr, r.output
    r = cli("scrub", a, "--remote", s3_url)
    assert r.exit_code == 10 and "divergent" in r.output, r.output
    assert _load_values(a, None)[0] == 1.0  # without the remote tier, A's root is all there is


@pytest.mark.s3
def test_with_a_remote_tier_damaged_local_copies_are_read_from_s3(tmp_path, s3_url):
    """The same damage as above with a remote tier: nothing is skipped; the newest version loads, the
    marked copy's objects and the flipped bytes come from S3 (warned, counted)."""
    base = tmp_path
    outs = job(base, 3, remote=s3_url)
    assert all(o["close_error"] is None for o in outs), outs
    shutil.copyfile(shard(base, 1, "step-1"), shard(base, 1, "step-3"))
    assert cli("scrub", rr.root_of(str(base), 1), "--repair").exit_code == 10  # marks root B's copy (no remote given)
    flip_byte(shard(base, 0, "step-3"))
    outs = job(base, 1, remote=s3_url)
    check_resumed(outs, 4, [])
    reads = [o["restore"]["reads"] for o in outs]
    assert reads[0]["fallback_reads"] >= 1 and reads[1]["remote_reads"] >= 1, reads


# -- kind 9: resume never picks a version of another job shape unless asked to ------------------------------
def test_a_version_saved_by_another_number_of_ranks_is_skipped_unless_reshard(tmp_path):
    from ckptstore import CheckpointManager

    base = tmp_path
    os.makedirs(base / "shared")
    job(base, 2)  # a 2-rank job on one shared root: steps 1, 2
    import async_ranks

    state = async_ranks.make_state(0)
    with CheckpointManager(str(base / "shared"), state, per_rank_keys=("data",)) as m:  # 1 rank: step 3
        m.save(3, force=True)
    outs = job(base, 0)
    check_resumed(outs, 3, [("step-3", "shape")])
    assert "saved by 1 ranks, this job has 2" in outs[0]["restore"]["skipped"][0]["reason"]
    outs = run_ranks(rr.job, 2, str(base), 0, None, {"reshard": True}, None, None, timeout=240, **FAST)
    assert [o["restore"]["version"] for o in outs] == ["step-3"] * 2 and not outs[0]["restore"]["rng_restored"]


@pytest.mark.s3
def test_fallback_past_every_local_version_reaches_older_remote_ones(tmp_path, s3_url):
    """Local KeepLast(1), remote KeepLast(3): the only local version is unloadable everywhere (its
    object corrupt in both tiers) — resume() falls back to an older version only S3 still holds;
    an explicit older version loads from S3 too."""
    from ckptstore import CheckpointManager
    from ckptstore.retention import KeepLast, RetentionPolicy

    root = str(tmp_path)
    model = torch.nn.Linear(16, 16)
    policy = RetentionPolicy(per_tier={"local": [KeepLast(1)], "remote": [KeepLast(3)]})
    with CheckpointManager(root, {"model": model}, remote=s3_url, retention=policy, durability="remote") as mgr:
        for s in (1, 2, 3):
            with torch.no_grad():
                model.weight.fill_(s)
            mgr.save(s)
            mgr.wait()
    recs = ckptstore.Store(root, remote=s3_url).versions()
    assert [r.version for r in recs] == ["step-1", "step-2", "step-3"]
    assert [r.version for r in recs if "local" in r.tiers] == ["step-3"]
    m = catalogue.read_manifest(LocalTier(root), "step-3").manifest
    key = layout.object_key("step-3", m.objects[0].name)
    flip_byte(os.path.join(root, *key.split("/")))
    remote = ckptstore.Store(None, remote=s3_url).remote
    data = bytearray(remote.get(key))
    data[300] ^= 0x10
    remote.put(key, bytes(data))
    fresh = torch.nn.Linear(16, 16)
    with CheckpointManager(root, {"model": fresh}, remote=s3_url) as mgr:
        assert mgr.resume() == 3 and torch.all(fresh.weight == 2)
        assert [(s.version, s.kind) for s in mgr.last_restore.skipped] == [("step-3", "unverified")]
        assert mgr.restore(version="step-1") == 1 and torch.all(fresh.weight == 1)
