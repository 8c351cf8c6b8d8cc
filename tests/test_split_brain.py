"""Split brain, killed writers and a hostile bucket (docs/FORMAT.md, "Superseding", Delete rule 15,
"Catalogue chain").

* Two processes supersede one name at the same moment, 20 rounds, in one local root and from two
  nodes on one S3 prefix (SeaweedFS): exactly one commits each round, the other gets
  :class:`SupersedeConflictError`, its attempt is gone at once, and every listed version loads and
  equals what its writer saved.
* A rank SIGKILLed again and again mid-save on a small tmpfs root: what each killed save left is
  reclaimed by the next save (its coordinator is provably dead, Delete rule 15) instead of after
  gc's hour of grace, so the root never fills; no committed version is touched.
"""

from __future__ import annotations

import os
import random
import time

import pytest

import ckptstore
from ckptstore.manifest import catalogue, layout

import crash_ranks
import split_ranks
from helpers import small_tmpfs

ROUNDS = 20


def _attempts(tier, version: str) -> set[str]:
    pre = layout.object_key(version, "attempts") + "/"
    return {layout.attempt_of_key(i.key) for i in tier.list(pre)} - {None}


def _check_rounds(outs: list, olds: list) -> list[int]:
    """Per round: exactly one job committed, the other was refused with SupersedeConflictError."""
    winners = []
    for i in range(len(olds)):
        got = [outs[j][i] for j in (0, 1)]
        ok = [j for j in (0, 1) if got[j][0] == "ok"]
        assert len(ok) == 1, f"round {i}: {got}"
        lost = got[1 - ok[0]]
        assert lost[0] == "error" and lost[1] == ["SupersedeConflictError"], f"round {i}: {got}"
        winners.append(ok[0])
    return winners


def _race(tmp_path, roots: list, remote, olds: list) -> list:
    bdir = tmp_path / "barriers"
    bdir.mkdir()
    jobs = [crash_ranks.Job(split_ranks.supersede_rounds, 1, roots[j], remote, len(olds), j, str(bdir), olds)
            for j in (0, 1)]
    codes = [job.wait(600) for job in jobs]
    assert all(c == {0: 0} for c in codes), codes
    outs = []
    for job in jobs:
        st, val = job.results[0]
        assert st == "ok", val
        outs.append(val)
    return outs


def test_two_processes_supersede_one_name_local(tmp_path):
    """Both jobs were told to supersede attempt A0 of ``r<i>`` (a restart of the same run on two
    nodes of one shared root): on main both ``os.replace`` the manifest and the first writer's
    readers load the second's weights; now exactly one compare-and-swap wins."""
    root = str(tmp_path / "root")
    olds = []
    for i in range(ROUNDS):
        crash_ranks.local_save(root, f"r{i}", 7, world=1)
        olds.append(catalogue.read_manifest(ckptstore.Store(root).tier("local"), f"r{i}").manifest.attempt)
    outs = _race(tmp_path, [root, root], None, olds)
    winners = _check_rounds(outs, olds)
    tier = ckptstore.Store(root).tier("local")
    for i, w in enumerate(winners):
        m = catalogue.read_manifest(tier, f"r{i}").manifest
        assert m.superseded_attempts == {olds[i]}
        # the loser's attempt was reclaimed at once: only the winner's and the superseded one are left
        assert _attempts(tier, f"r{i}") <= {m.attempt, olds[i]}, (i, _attempts(tier, f"r{i}"))
        assert not [n for n in os.listdir(os.path.join(root, layout.version_dir(f"r{i}"))) if n.startswith(".tmp-")]
    expected = {f"r{i}": [(split_ranks.round_seed(i, w), 1, False)] for i, w in enumerate(winners)}
    state, viol = crash_ranks.audit(root, None, None, expected)
    assert not viol, viol
    assert set(state["local"]) == set(expected)


@pytest.mark.s3
@pytest.mark.parametrize("rounds", [5, pytest.param(ROUNDS, marks=pytest.mark.slow)])
def test_two_nodes_supersede_one_name_s3(tmp_path, s3_url, rounds):
    """Two nodes (own roots, one bucket prefix) supersede the remote attempt A0 of ``r<i>`` at once:
    on main both remote commits overwrite; now exactly one ``If-Match`` PUT wins, the loser's
    uploads and its local copy are retracted, and every node loads the winner's version."""
    seed_root = str(tmp_path / "first")
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    olds = []
    for i in range(rounds):  # 20 rounds in the slow set (about 30 s), 5 in the default suite
        crash_ranks.local_save(seed_root, f"r{i}", 7, world=1, remote=s3_url, durability="remote")
        olds.append(catalogue.read_manifest(ckptstore.Store(seed_root, remote=s3_url).tier("remote"),
                                            f"r{i}").manifest.attempt)
    outs = _race(tmp_path, roots, s3_url, olds)
    winners = _check_rounds(outs, olds)
    remote = ckptstore.Store(roots[0], remote=s3_url).tier("remote")
    for i, w in enumerate(winners):
        m = catalogue.read_manifest(remote, f"r{i}").manifest
        assert m.superseded_attempts == {olds[i]}
        assert _attempts(remote, f"r{i}") <= {m.attempt, olds[i]}, (i, _attempts(remote, f"r{i}"))
        # nothing the loser wrote is loadable under the name: its local copy was un-committed
        loser = ckptstore.Store(roots[1 - w]).tier("local")
        assert not loser.exists(layout.manifest_key(f"r{i}"))
    expected = {f"r{i}": [(split_ranks.round_seed(i, w), 1, False)] for i, w in enumerate(winners)}
    state, viol = crash_ranks.audit(None, s3_url, None, expected)
    assert not viol, viol
    assert set(state["remote"]) == set(expected)
    for j, root in enumerate(roots):
        mine = {v: e for v, e in expected.items() if winners[int(v[1:])] == j}
        state, viol = crash_ranks.audit(root, None, None, mine)
        assert not viol, viol


# -- killed writers (Delete rule 15) ------------------------------------------------------------------------
MiB = 1 << 20
BLOB = 1536 << 10  # one save: 1.5 MiB, incompressible


def _free(path) -> int:
    s = os.statvfs(path)
    return s.f_bavail * s.f_frsize


def _kill_loop(tmp_path, kills: int, size: str, budget_s: float | None = None, seed: int = 0) -> list[str]:
    """``kills`` saves SIGKILLed mid-write (a random frame, or just before the manifest), a committed
    save after every fourth; returns the log. The root never lacks room for the next save, and every
    committed version still loads bit-exactly."""
    rnd = random.Random(seed)
    log = []
    with small_tmpfs(tmp_path / "fs", size=size) as fs:
        root = os.path.join(fs, "root")
        assert crash_ranks.Job(split_ranks.blob_save, 1, root, "base", 1, BLOB).wait(120) == {0: 0}
        committed = {"base": 1}
        low = _free(fs)
        t0 = time.monotonic()
        for k in range(kills):
            point = rnd.choice(["write.frame:%d" % rnd.randint(2, 20), "commit.manifest"])
            job = crash_ranks.Job(split_ranks.blob_save, 1, root, f"k{k}", 100 + k, BLOB,
                                  env={"CKPTSTORE_FAULT": point})
            codes = job.wait(120)
            assert codes == {0: -9}, (k, point, codes, job.results)
            low = min(low, _free(fs))
            log.append(f"kill {k} at {point}: {_free(fs) // 1024} KiB free")
            if k % 4 == 3:  # a save that commits: the root must still have room for it
                v = f"c{k}"
                job = crash_ranks.Job(split_ranks.blob_save, 1, root, v, 200 + k, BLOB)
                assert job.wait(120) == {0: 0} and job.results[0] == ("ok", ("ok", None)), (k, job.results)
                committed[v] = 200 + k
            if budget_s is not None:  # spread the kills over the budget
                time.sleep(max(0.0, (k + 1) * budget_s / kills - (time.monotonic() - t0)))
        # a last save commits, and reclaims what the last kill left
        job = crash_ranks.Job(split_ranks.blob_save, 1, root, "last", 9, BLOB)
        assert job.wait(120) == {0: 0} and job.results[0] == ("ok", ("ok", None)), job.results
        committed["last"] = 9
        st = ckptstore.Store(root)
        assert sorted(r.version for r in st.versions()) == sorted(committed)
        for v, sd in committed.items():
            assert split_ranks.blob_loads(root, v, sd, BLOB), v
        # nothing of a killed save is left, though every one is younger than gc's grace period
        tier = st.tier("local")
        left = [i.key for i in tier.list("versions/") if (layout.version_of_key(i.key) or "").startswith("k")
                and not layout.is_temporary(i.key)]
        assert not left, left
        log.append(f"lowest free: {low // 1024} KiB")
    return log


def test_killed_writers_do_not_fill_the_root(tmp_path):
    """8 kills on a 7 MiB tmpfs (room for the committed versions and about two saves in flight): on
    main the third or fourth killed save's objects fill the root (they wait for gc's hour of grace)
    and the next save fails with StorageFullError."""
    log = _kill_loop(tmp_path, kills=8, size="12m", seed=1)
    print("\n".join(log))


@pytest.mark.slow
def test_killed_writers_30_kills_in_10_minutes(tmp_path):
    log = _kill_loop(tmp_path, kills=30, size="20m", budget_s=540, seed=2)
    print("\n".join(log))


def test_writer_verdict_rule():
    """Provably dead only on this host, boot and PID namespace: the pid gone, or reused (another start
    time); the same pid and start time is alive; anything from elsewhere may live."""
    import subprocess
    import sys

    from ckptstore.manifest import writers

    me = writers.identity()
    assert writers.verdict(me) == writers.ALIVE
    assert writers.verdict({**me, "start": me["start"] + 1}) == writers.DEAD  # the pid now belongs to another process
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert writers.verdict({**me, "pid": p.pid}) == writers.DEAD  # gone
    assert writers.verdict({**me, "host": "elsewhere"}) == writers.UNKNOWN
    assert writers.verdict({**me, "boot_id": "another boot"}) == writers.UNKNOWN
    assert writers.verdict({**me, "pidns": 1}) == writers.UNKNOWN
    assert writers.verdict({"pid": "x"}) == writers.UNKNOWN and writers.verdict(None) == writers.UNKNOWN


def test_gc_reclaims_a_dead_writers_attempt_before_the_grace_period(tmp_path):
    """``ckptstore gc`` (grace 1 h) deletes the attempt of a killed save at once, and leaves alone an
    attempt whose writer is alive or on another host: those wait for the grace period."""
    import json

    from ckptstore import gc as _gc
    from ckptstore.manifest import writers

    root = str(tmp_path / "root")
    assert crash_ranks.Job(split_ranks.blob_save, 1, root, "base", 1, 256 << 10).wait(120) == {0: 0}
    job = crash_ranks.Job(split_ranks.blob_save, 1, root, "killed", 2, 256 << 10, env={"CKPTSTORE_FAULT": "write.frame:3"})
    assert job.wait(120) == {0: -9}
    tier = ckptstore.Store(root).tier("local")
    (dead_attempt,) = _attempts(tier, "killed")
    # two more in-flight attempts: one of this (live) process, one written on another host
    for name, rec in (("alive", writers.identity()), ("other", {**writers.identity(), "host": "node-b"})):
        a = layout.new_attempt()
        tier.put(layout.object_key(name, layout.shard_name(a, 0)), b"x" * 1000)
        tier.put(layout.object_key(name, layout.writer_record_name(a)), json.dumps(rec).encode())
    plan, res = _gc.run(ckptstore.Store(root).tiers, None, grace=3600)
    assert res.ok, res.failed
    gone = {a.key for a in plan.actions}
    assert gone and all(layout.attempt_of_key(k) == dead_attempt for k in gone), gone
    assert not _attempts(tier, "killed")
    assert _attempts(tier, "alive") and _attempts(tier, "other")
    assert split_ranks.blob_loads(root, "base", 1, 256 << 10)


# -- the catalogue chain (docs/FORMAT.md, "Catalogue chain") -------------------------------------------------
CHAIN_KEY = bytes(range(32))


def _chain_env() -> dict:
    import base64

    return {"CKPTSTORE_KEY": base64.b64encode(CHAIN_KEY).decode()}


def _keyed_save(root, remote, version, seed, supersede=None):
    import torch.distributed.checkpoint as dcp

    w = ckptstore.StorageWriter(root, remote=remote, key=CHAIN_KEY, durability="remote", step=seed)
    if supersede:
        w.save_options(version, supersede=supersede)
    dcp.save(crash_ranks.expected_state(seed, 1), checkpoint_id=version, storage_writer=w)
    w.close()


def _bucket(s3_url):
    import boto3

    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    return boto3.client("s3"), bucket, prefix


def _fresh_choice(tmp_path, s3_url, name="fresh"):
    """The restore choice of a node that has only the bucket (a replacement node: what resume() uses)."""
    fresh = tmp_path / name
    fresh.mkdir()
    return ckptstore.Store(str(fresh), remote=s3_url, key=CHAIN_KEY).choose()


@pytest.mark.s3
def test_chain_detects_deleted_newest_version_s3(tmp_path, s3_url):
    """Someone who can write the bucket but has no key deletes the newest version's objects (manifest
    included) with boto3: on main every remaining manifest verifies and a restore silently goes back
    to v2. Now list and scrub exit 15 naming the missing version, and the restore loads v2 with a
    ``missing-newest`` record at the head of what it skipped."""
    from store_helpers import cli

    root = str(tmp_path / "root")
    for i in (1, 2, 3):
        _keyed_save(root, s3_url, f"v{i}", i)
    assert cli("list", root, "--remote", s3_url, env=_chain_env()).exit_code == 0
    s3, bucket, prefix = _bucket(s3_url)
    gone = s3.list_objects_v2(Bucket=bucket, Prefix=prefix + layout.version_dir("v3") + "/")["Contents"]
    s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": o["Key"]} for o in gone]})

    r = cli("list", "", "--remote", s3_url, env=_chain_env())
    assert r.exit_code == 15 and "missing-newest" in r.output and "'v3'" in r.output, r.output
    r = cli("scrub", "", "--remote", s3_url, env=_chain_env())
    assert r.exit_code == 15 and "missing-newest" in r.output, r.output
    # restore (resume's choice) on a node with only the bucket: falls back to v2, loudly, without a person
    view = _fresh_choice(tmp_path, s3_url)
    assert view.version == "v2"
    assert [(s.version, s.kind) for s in view.skipped][:1] == [("v3", "missing-newest")]
    assert crash_ranks.load_state("", "v2", 2, world=1, remote=s3_url, key=CHAIN_KEY)
    # the node's own root keeps a copy of the remote head: a deleted remote head too is seen from there
    s3.delete_object(Bucket=bucket, Key=prefix + layout.CATALOGUE_HEAD)
    r = cli("list", root, "--remote", s3_url, env=_chain_env())
    assert r.exit_code == 15 and "remote tier (missing-newest)" in r.output, r.output


@pytest.mark.s3
def test_chain_detects_a_replayed_older_manifest_s3(tmp_path, s3_url):
    """An older manifest of a name (the attempt a later save superseded; its objects still in the
    bucket) is put back over the newer one: on main the restore loads the old weights under the name.
    Now list and scrub exit 15 (``rolled-back``) and the restore skips that copy."""
    from store_helpers import cli

    root = str(tmp_path / "root")
    _keyed_save(root, s3_url, "v1", 1)
    _keyed_save(root, s3_url, "v2", 2)
    s3, bucket, prefix = _bucket(s3_url)
    mkey = prefix + layout.manifest_key("v2")
    old = s3.get_object(Bucket=bucket, Key=mkey)["Body"].read()
    old_attempt = catalogue.read_manifest(ckptstore.Store(root).tier("local"), "v2").manifest.attempt
    _keyed_save(root, s3_url, "v2", 5, supersede={old_attempt: "retrained"})
    assert _fresh_choice(tmp_path, s3_url, "before").version == "v2"
    s3.put_object(Bucket=bucket, Key=mkey, Body=old)  # the replay

    r = cli("list", "", "--remote", s3_url, env=_chain_env())
    assert r.exit_code == 15 and "rolled-back" in r.output, r.output
    r = cli("scrub", "", "--remote", s3_url, env=_chain_env())
    assert r.exit_code == 15 and "rolled-back" in r.output, r.output
    view = _fresh_choice(tmp_path, s3_url)
    assert view.version == "v1"
    assert [(s.version, s.attempt, s.kind) for s in view.skipped] == [("v2", old_attempt, "rolled-back")]


@pytest.mark.s3
def test_chain_accepts_gc_and_drop_s3(tmp_path, s3_url):
    """Deletions by gc (retention) and drop (with the key) extend the chain: nothing is flagged."""
    from store_helpers import cli

    root = str(tmp_path / "root")
    for i in (1, 2, 3, 4):
        _keyed_save(root, s3_url, f"v{i}", i)
    env = _chain_env()
    r = cli("gc", root, "--remote", s3_url, "--keep-last", "2", env=env)
    assert r.exit_code == 0, r.output
    r = cli("drop", root, "--remote", s3_url, "v4", "--yes", env=env)
    assert r.exit_code == 0, r.output
    for where in (root, ""):
        r = cli("list", where, "--remote", s3_url, env=env)
        assert r.exit_code == 0 and "chain" not in r.output, r.output
        assert cli("scrub", where, "--remote", s3_url, env=env).exit_code == 0
    assert [v.version for v in ckptstore.Store(root, remote=s3_url).versions()] == ["v3"]
    view = _fresh_choice(tmp_path, s3_url)
    assert view.version == "v3" and not view.skipped
    # and the chain goes on: a save after the drop is not flagged either
    _keyed_save(root, s3_url, "v5", 5)
    assert cli("list", root, "--remote", s3_url, env=env).exit_code == 0


def test_chain_findings_rule():
    """The pure rule (docs/FORMAT.md, "Catalogue chain"): a gone head, an older attempt under the head's
    name or under a later commit's ``prev``, a dropped version back; a legitimately newer commit is fine."""
    from ckptstore.manifest import chain

    class M:
        def __init__(self, attempt, n, prev=None):
            self.attempt, self.chain = attempt, {"n": n, "prev": prev}

    def head(v, a, n, dropped=False):
        return chain.Head(n, v, a, n, dropped, {}, "", b"")

    link = {"version": "a", "attempt": "A2", "n": 2}
    ok = {"a": M("A2", 2), "b": M("B3", 3, link)}
    assert chain.findings(ok, [head("b", "B3", 3)], "remote") == []
    kinds = lambda fs: sorted((f.kind, f.version, f.attempt) for f in fs)  # noqa: E731
    assert kinds(chain.findings({"a": M("A2", 2)}, [head("b", "B3", 3)], "remote")) == [("missing-newest", "b", "B3")]
    assert kinds(chain.findings({"a": M("A1", 1), "b": M("B3", 3, link)}, [head("b", "B3", 3)], "remote")) == [
        ("rolled-back", "a", "A1")]
    assert kinds(chain.findings({"a": M("A2", 2), "b": M("B1", 1)}, [head("b", "B3", 3)], "remote")) == [
        ("rolled-back", "b", "B1")]
    assert kinds(chain.findings({"b": M("B3", 3)}, [head("b", "B3", 3, dropped=True)], "local")) == [
        ("rolled-back", "b", "B3")]
    # the name superseded later (a higher n), a head behind a newer commit: nothing to report
    assert chain.findings({"a": M("A4", 4), "b": M("B3", 3, link)}, [head("b", "B3", 3)], "local") == []
    assert chain.findings({"a": M("A2", 2), "c": M("C4", 4)}, [head("b", "B3", 3)], "local") == []
    assert chain.findings({"a": M("A2", 2)}, [], "local") == []
