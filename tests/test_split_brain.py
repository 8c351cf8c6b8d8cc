"""Split brain, killed writers and a hostile bucket (docs/FORMAT.md, "Superseding", Delete rule 15,
"Catalogue chain").

* Two processes supersede one name at the same moment, 20 rounds, in one local root and from two
  nodes on one S3 prefix (SeaweedFS): exactly one commits each round, the other gets
  :class:`SupersedeConflictError`, its attempt is gone at once, and every listed version loads and
  equals what its writer saved.
"""

from __future__ import annotations

import os

import pytest

import ckptstore
from ckptstore.manifest import catalogue, layout

import crash_ranks
import split_ranks

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
def test_two_nodes_supersede_one_name_s3(tmp_path, s3_url):
    """Two nodes (own roots, one bucket prefix) supersede the remote attempt A0 of ``r<i>`` at once:
    on main both remote commits overwrite; now exactly one ``If-Match`` PUT wins, the loser's
    uploads and its local copy are retracted, and every node loads the winner's version."""
    seed_root = str(tmp_path / "first")
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    olds = []
    for i in range(ROUNDS):
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
