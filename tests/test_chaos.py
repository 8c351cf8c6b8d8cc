"""``ckptstore demo --chaos``: the demo's model trained unattended under a seeded schedule of real faults.

Fast checks (default suite, well under a second each): the seeded schedule (a fault every 2 minutes over
30 minutes is at least 12 faults of at least 8 kinds, the same seed gives the same schedule, every kind
runs once before any repeats), which kinds a set-up can run and why not, the option checks, and the
``disk-full`` fault's filler on a real small tmpfs (root only).

Slow (``-m slow``): a short run (75 s, three faults: a rank SIGKILLed while its save is in flight, a NaN
rolled back with ``mgr.rollback()``, an operator's ``ckptstore gc --keep-last 1`` during a save) and the
10-minute run with a fault every minute over every kind, two nodes, replicas and SeaweedFS, with the
stock-DCP peer alongside. Both require no manual step, every fault recovered, and every kept step
(losses, sample ids, weights) and the final weights and optimizer state bit-equal to a fault-free
reference. The 30-minute figure (goodput against the reference's) is docs/DEMO.md's must-show run,
not a timed test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchdata")

from helpers import small_tmpfs  # noqa: E402

from ckptstore.demo.chaos import schedule  # noqa: E402
from ckptstore.demo.chaos.inject import fill  # noqa: E402


def _all_kinds():
    ok, skipped = schedule.available(remote=True, nodes=2, replicas=1, root=True, faketime=True)
    assert not skipped
    return ok


def test_thirty_minutes_a_fault_every_two_minutes_is_at_least_12_faults_of_8_kinds():
    faults = schedule.plan(1800, 120, 1234, _all_kinds(), world_size=2, nodes=2)
    assert len(faults) >= 12
    assert len({f.kind for f in faults}) >= 8
    # every kind once (seeded order) before any repeats; never the same kind twice in a row
    n = len(schedule.KINDS)
    assert len({f.kind for f in faults[:n]}) == min(n, len(faults))
    assert all(a.kind != b.kind for a, b in zip(faults, faults[1:]))
    # jittered by at most a quarter interval, in order, the last one leaving half an interval to recover
    for i, f in enumerate(faults):
        assert abs(f.at_s - 120 * (i + 1)) <= 30 + 1e-6
        assert f.rank // 1 == f.node  # one rank per node: the rank sits on the fault's node
    assert faults[-1].at_s <= 1800 - 60
    assert [f.at_s for f in faults] == sorted(f.at_s for f in faults)


def test_the_schedule_is_a_function_of_the_seed():
    kinds = _all_kinds()
    a = schedule.plan(600, 60, 7, kinds, world_size=4, nodes=2)
    b = schedule.plan(600, 60, 7, kinds, world_size=4, nodes=2)
    c = schedule.plan(600, 60, 8, kinds, world_size=4, nodes=2)
    assert [f.to_json() for f in a] == [f.to_json() for f in b]
    assert [f.to_json() for f in a] != [f.to_json() for f in c]
    assert all(f.rank // 2 == f.node for f in a)  # two ranks per node


def test_kinds_a_set_up_cannot_run_are_named_with_the_reason():
    ok, skipped = schedule.available(remote=False, nodes=1, replicas=0, root=False, faketime=False)
    assert set(skipped) == {"node-lost", "s3-down", "disk-full", "clock-jump"}
    assert "root" in skipped["disk-full"] and "faketime" in skipped["clock-jump"]
    assert "--seaweedfs" in skipped["s3-down"]
    assert set(ok) | set(skipped) == set(schedule.KINDS)
    only, _ = schedule.available(remote=True, nodes=2, replicas=1, root=True, faketime=True, only=("nan", "preempt"))
    assert only == ["preempt", "nan"]
    # the only fault that changes the math is the NaN (its corrupt batch is skipped from then on)
    assert [k.name for k in schedule.KINDS.values() if k.changes_math] == ["nan"]


@pytest.mark.parametrize("args, message", [
    (["--chaos", "30s", "--faults", "nan,meteor"], "unknown fault kind(s) meteor"),
    (["--chaos", "30s", "--nodes", "2", "--world-size", "3"], "must be a positive multiple of --nodes"),
    (["--chaos", "30s", "--replicas", "1"], "--replicas needs --nodes 2"),
    (["--chaos", "30s", "--peer", "sideways"], "'sideways' is not one of"),
])
def test_chaos_option_errors_exit_2_before_any_work(tmp_path, args, message):
    from click.testing import CliRunner

    from ckptstore.demo.cli import demo

    r = CliRunner().invoke(demo, ["--out", str(tmp_path / "out"), *args])
    assert r.exit_code == 2 and message in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_a_restart_that_trains_no_step_before_the_stop_holds_the_final_state(tmp_path):
    """The 10-minute run's case: a generation trained to step 10 (committing step 5 only), a restart
    restored step-5 and the stop came before it trained a step. The final state is step 5 (that last
    generation's ``done`` digests), not the steps 6-10 the restart threw away."""
    from ckptstore.demo.chaos import timeline

    ev = tmp_path / "events"
    ev.mkdir()
    a, b = [], []
    for st in range(1, 11):
        a.append({"kind": "step", "rank": 0, "gen": 1, "step": st, "t0": st, "t1": st + 0.5, "t": st + 0.5,
                  "up": st + 0.5})
        if st % 5 == 0:
            a.append({"kind": "save", "rank": 0, "gen": 1, "step": st, "t": st + 0.6, "up": st + 0.6})
    a.append({"kind": "save_done", "rank": 0, "gen": 1, "step": 5, "ok": True, "t": 5.7, "up": 5.7})
    b.append({"kind": "resumed", "rank": 0, "gen": 2, "version": "step-5", "step": 5, "t0": 20, "t1": 21,
              "t": 21, "up": 21})
    b.append({"kind": "stop", "rank": 0, "gen": 2, "step": 5, "t": 21.5, "up": 21.5})
    b.append({"kind": "done", "rank": 0, "gen": 2, "step": 5, "wd": "w5", "od": "o5", "t": 22, "up": 22})
    for name, evs in (("rank0.a1000.jsonl", a), ("rank0.a1001.jsonl", b)):
        (ev / name).write_text("".join(json.dumps(e) + "\n" for e in evs))
    tl = timeline.Timeline.of(str(tmp_path), 0.0)
    assert tl.final_step() == 5
    assert sorted(tl.kept()) == [1, 2, 3, 4, 5]
    assert tl.done()[0]["wd"] == "w5"
    assert len(tl.wasted_steps()) == 5


def test_disk_full_fills_a_real_file_system_to_the_last_byte(tmp_path):
    with small_tmpfs(tmp_path / "fs", size="4m") as d:
        got = fill(d, os.path.join(d, "runaway.log"))
        assert got >= 3 << 20
        with pytest.raises(OSError) as e, open(os.path.join(d, "more"), "wb") as f:
            f.write(b"x" * 8192)
            f.flush()
            os.fsync(f.fileno())
        assert e.value.errno == 28  # ENOSPC
        os.remove(os.path.join(d, "runaway.log"))
        with open(os.path.join(d, "again"), "wb") as f:
            f.write(b"x" * 8192)


# -- the real runs (slow) ----------------------------------------------------------------------------------
def _slow(request):
    if os.environ.get("CKPTSTORE_FULL") != "1" and "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("slow: set CKPTSTORE_FULL=1 or select -m slow")


def _chaos(tmp_path, *args, timeout):
    out, summary = tmp_path / "out", tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "ckptstore.demo.cli", "--out", str(out), "--summary", str(summary), "--no-cli", *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, COLUMNS="200"))
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()  # SIGTERM: the demo stops its jobs' processes and unmounts its file systems
        try:
            stdout, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        pytest.fail(f"the chaos run took more than {timeout} s:\n{stdout[-6000:]}\n{stderr[-3000:]}")
    s = json.loads(summary.read_text()) if summary.exists() else None
    return subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr), s


def _recovered_bit_exact(p, s):
    assert s is not None, p.stdout[-8000:] + p.stderr[-3000:]
    injected = [f for f in s["faults"] if f["at_s"] is not None]
    assert s["manual_steps"] == 0, s["manual"]
    assert all(f["recovered_s"] is not None for f in injected), [(f["kind"], f["note"]) for f in injected]
    be = s["bit_exact"]
    assert be["equal"], be
    assert be["steps_compared"] == be["steps_kept"] > 0
    assert be["final_weights_equal"] and be["final_optimizer_equal"]
    return injected


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_short_chaos_run_recovers_from_three_faults_bit_exact(tmp_path, request):
    """75 s, a fault every 20 s: a rank SIGKILLed with its save in flight, a NaN (skipped batch, rollback),
    an operator's gc during a save; no peer. The reference skips the NaN's batch from the start."""
    _slow(request)
    p, s = _chaos(tmp_path, "--chaos", "75s", "--fault-every", "20", "--faults", "kill-rank-save,nan,gc-during-save",
                  "--peer", "none", "--seed", "3", timeout=1000)
    injected = _recovered_bit_exact(p, s)
    assert sorted(f["kind"] for f in injected) == ["gc-during-save", "kill-rank-save", "nan"]
    nan = next(f for f in injected if f["kind"] == "nan")
    assert nan["changes_math"] and s["bit_exact"]["reference_skips_batches"]
    assert s["peer"] is None
    assert 0 < s["goodput"] < 1 and 0 < s["reference_goodput"] < 1


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_ten_minutes_a_fault_every_minute_two_nodes_replicas_seaweedfs(tmp_path, request):
    """The 10-minute version of docs/DEMO.md's must-show run: every kind this machine can run (13 as
    root with libfaketime), manual steps 0, bit-exact, the stock-DCP peer alongside reported (where it
    stopped, if it did). Goodput is reported; the ≥ 80 % of the reference's figure is the 30-minute run's."""
    _slow(request)
    p, s = _chaos(tmp_path, "--chaos", "10m", "--fault-every", "60", "--nodes", "2", "--replicas", "1", "--seaweedfs",
                  "--seed", "1234", timeout=3300)
    injected = _recovered_bit_exact(p, s)
    assert len(injected) >= 8 and len({f["kind"] for f in injected}) >= 8
    assert s["goodput"] > 0 and s["goodput_ratio"] is not None
    peer = s["peer"]
    assert peer is not None and 0 <= peer["goodput"] < 1
    assert peer["kept_going"] or peer["stopped_at"]["reason"]
    assert all(c["ok"] for c in s["checks"] if "goodput ≥" not in c["name"]), s["checks"]
