"""The event log (ckptstore.events), its goodput accounting (ckptstore.goodput, table-tested), the
metrics text (ckptstore.metrics: parsed by prometheus_client's own parsers) and the commands that
read them (``ckptstore goodput``, the durable lag in ``list``/``show``). The manager cases run a real
single-process CheckpointManager (and a real SeaweedFS remote); multi-rank and torchrun cases are in
tests/test_preempt.py and tests/test_demo.py."""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import subprocess
import sys

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_prometheus

from ckptstore import events, goodput
from ckptstore.metrics import Metrics

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "ckptstore.cli", *args], capture_output=True, text=True, env=env)


# -- the log file ------------------------------------------------------------------------------------
def _writer(path, n, tag):
    log = events.EventLog(path, a=tag)
    for i in range(n):
        log.append("progress", step=i, pad="x" * 300)
    log.close()


def test_appends_from_several_processes_never_interleave(tmp_path):
    path = str(tmp_path / "events.jsonl")
    ctx = mp.get_context("fork")
    ps = [ctx.Process(target=_writer, args=(path, 300, f"p{i}")) for i in range(4)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    with open(path, "rb") as f:
        evs, bad = events.parse(f)
    assert bad == 0 and len(evs) == 1200
    for tag in ("p0", "p1", "p2", "p3"):
        assert [e["step"] for e in evs if e["a"] == tag] == list(range(300))  # each writer's lines whole, in order


def test_a_torn_last_line_is_skipped_and_the_next_append_starts_a_new_line(tmp_path):
    path = str(tmp_path / "events.jsonl")
    events.append(path, "save", step=1)
    with open(path, "ab") as f:
        f.write(b'{"ev":1,"kind":"save","t":12.5,"st')  # a process killed mid-write
    assert [e["step"] for e in events.read_events(path)] == [1]
    events.append(path, "save", step=2)
    assert [e["step"] for e in events.read_events(path)] == [1, 2]
    assert events.read_events(path)[0]["ev"] == events.FORMAT


# -- goodput: a pure function of the lines, table-tested ---------------------------------------------
def _attempt(a, t0, start, steps, *, step_s=1.0, interval=5, blocked=0.5, restore=None, crash_after=None, close=True,
             proc_start=None, preempt_at=None):
    """Lines of one attempt: opens at ``t0``, restores ``restore`` (step) taking 2 s, trains steps
    ``start+1..steps`` at ``step_s`` each plus ``blocked`` per save; dies after step ``crash_after``."""
    out = [{"kind": "open", "t": t0, "a": a, "rank": 0, "proc_start": t0 - 3 if proc_start is None else proc_start,
            "interval_steps": interval}]
    t = t0 + 2.0
    out.append({"kind": "restore", "t": t, "a": a, "rank": 0, "t0": t0, "seconds": 2.0,
                "outcome": "restored" if restore else "none", "step": restore, "version": restore and f"step-{restore}"})
    for s in range(start + 1, steps + 1):
        t += step_s
        due = s % interval == 0 or s == preempt_at
        if due:
            t += blocked
            out.append({"kind": "progress", "t": t, "a": a, "rank": 0, "step": s, "save": f"step-{s}", "blocked_s": blocked})
            out.append({"kind": "save", "t": t + 0.2, "a": a, "rank": 0, "step": s, "version": f"step-{s}",
                        "outcome": "committed", "blocked_s": blocked, "local_commit_s": 0.7, "durable_lag_s": 3.0,
                        "logical_bytes": 100, "stored_bytes": 60, "uploaded_bytes": 60})
        else:
            out.append({"kind": "progress", "t": t, "a": a, "rank": 0, "step": s})
        if s == preempt_at:
            out.append({"kind": "preempt", "t": t, "a": a, "rank": 0, "step": s, "saved": True, "seconds": blocked})
            break
        if s == crash_after:
            return out, t
    if close:
        out.append({"kind": "close", "t": t + 1.0, "a": a, "rank": 0, "t0": t, "seconds": 1.0})
        t += 1.0
    return out, t


def test_goodput_of_a_clean_run():
    evs, t_end = _attempt("a", 100.0, 0, 20)
    evs = [{"kind": "launch", "t": 95.0}] + evs + [{"kind": "exit", "t": t_end + 2}]
    r = goodput.account(evs)
    assert r.useful == pytest.approx(20.0) and r.blocked == pytest.approx(4 * 0.5) and r.lost == 0
    assert r.startup == pytest.approx(102.0 - 95.0) and r.recovery == 0 and r.restarts == 0
    assert r.wall == pytest.approx(t_end + 2 - 95.0)
    assert r.other == pytest.approx(1.0 + 2.0)  # close() and the launcher's shutdown
    assert r.goodput == pytest.approx(20.0 / r.wall) and r.steps == 20 and r.step_time == pytest.approx(1.0)


def test_goodput_crash_then_restart_counts_lost_work_and_recovery():
    a0, t_crash = _attempt("a", 100.0, 0, 40, crash_after=13, close=False)  # saves 5, 10; dies after 13
    a1, _ = _attempt("b", t_crash + 10.0, 10, 20, restore=10, proc_start=t_crash + 4.0)
    r = goodput.account(a0 + a1)
    assert r.restarts == 1 and r.failures == 1 and r.attempts[0].ended == "crashed"
    assert r.lost == pytest.approx(3 * 1.0)  # steps 11-13, redone
    assert r.lost_work() == [{"attempt": "a", "ended": "crashed", "lost_s": pytest.approx(3.0), "lost_steps": 3,
                              "kept_to_step": 10}]
    assert r.recovery == pytest.approx(10.0 + 2.0)  # crash -> the restore's end
    assert (r.restart, r.init, r.load) == (pytest.approx(4.0), pytest.approx(6.0), pytest.approx(2.0))
    assert r.useful == pytest.approx(20.0) and r.steps == 20
    assert r.blocked == pytest.approx(4 * 0.5)  # saves 5, 10 (kept) and 15, 20


def test_goodput_in_googles_buckets_sums_to_the_wall(tmp_path):
    """``google_buckets``: ml-goodput-measurement's BadputType buckets from the same accounting, summing to
    the wall time; ``ckptstore goodput --buckets google|both`` prints them, ``--json`` holds them."""
    a0, t_crash = _attempt("a", 100.0, 0, 40, crash_after=13, close=False)
    a1, t_end = _attempt("b", t_crash + 10.0, 10, 20, restore=10, proc_start=t_crash + 4.0)
    evs = [{"kind": "launch", "t": 95.0}] + a0 + a1 + [{"kind": "exit", "t": t_end + 2}]
    r = goodput.account(evs)
    g = goodput.google_buckets(r)
    assert g["productive"] == pytest.approx(20.0) and g["checkpoint_save"] == pytest.approx(2.0)
    assert g["wasted_progress"] == pytest.approx(3.0)  # steps 11-13, redone
    assert g["infrastructure_recovery"] == pytest.approx(4.0)  # the crash -> the next process started
    assert g["checkpoint_restore"] == pytest.approx(2.0)
    assert g["other"] == pytest.approx(r.init + r.startup + r.other) and g["other"] > 0
    assert sum(g[k] for k, _label in goodput.GOOGLE_BUCKETS) == pytest.approx(r.wall) == pytest.approx(g["wall"])
    assert g["goodput"] == pytest.approx(r.goodput)
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in evs))
    p = _cli("goodput", str(path), "--buckets", "google")
    assert p.returncode == 0, p.stderr
    assert "WASTED_PROGRESS_FROM_DISRUPTION" in p.stdout and "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION" in p.stdout
    assert "useful training" not in p.stdout
    p = _cli("goodput", str(path), "--buckets", "both")
    assert "useful training" in p.stdout and "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME" in p.stdout
    p = _cli("goodput", str(path), "--json")
    assert json.loads(p.stdout)["google"]["wasted_progress"] == pytest.approx(3.0)


def test_goodput_two_restarts_count_both_and_give_the_lost_work_distribution():
    a0, t0 = _attempt("a", 100.0, 0, 40, crash_after=13, close=False)
    a1, t1 = _attempt("b", t0 + 10, 10, 40, restore=10, crash_after=27, close=False)
    a2, _ = _attempt("c", t1 + 10, 25, 40, restore=25)
    r = goodput.account(a2 + a0 + a1)  # order of the lines does not matter
    assert r.restarts == 2 and r.failures == 2
    assert [w["lost_steps"] for w in r.lost_work()] == [3, 2]
    d = r.lost_distribution()
    assert d["count"] == 2 and d["max"] == pytest.approx(3.0) and d["min"] == pytest.approx(2.0)
    assert r.steps == 40 and r.useful == pytest.approx(40.0)
    assert r.recovery == pytest.approx(2 * 12.0)
    assert r.advice is None and "pass --mtbf" in r.advice_note  # two crashes: too few to measure the MTBF
    r = goodput.account(a0 + a1 + a2, mtbf_s=3600.0)
    assert r.mtbf_source == "given" and r.advice.interval_s > 0
    r = goodput.account(a0 + a1 + a2, min_failures=2)
    running = sum(a.end_wall - a.proc_start for a in r.attempts)
    assert r.mtbf_source == "observed" and r.mtbf_s == pytest.approx(running / 2)
    assert r.advice.interval_steps is not None and r.advice.current_interval_s == pytest.approx(5 * r.step_time)


def test_goodput_preempted_run_loses_nothing_and_a_fallback_loses_a_whole_attempt():
    a0, t0 = _attempt("a", 100.0, 0, 40, preempt_at=12)
    a1, _ = _attempt("b", t0 + 30, 12, 20, restore=12)
    r = goodput.account(a0 + a1)
    assert r.attempts[0].ended == "preempted" and r.preemptions == 1 and r.failures == 0
    assert r.lost == 0 and r.steps == 20 and r.useful == pytest.approx(20.0)
    # the next attempt fell back to step 5 (step-10 was damaged): everything after step 5 is redone
    a0, t0 = _attempt("a", 100.0, 0, 40, crash_after=13, close=False)
    a1, t1 = _attempt("b", t0 + 5, 10, 40, restore=10, crash_after=12, close=False)
    a2, _ = _attempt("c", t1 + 5, 5, 20, restore=5)
    r = goodput.account(a0 + a1 + a2)
    assert [w["kept_to_step"] for w in r.lost_work()] == [5, 5]
    assert r.attempts[0].lost == pytest.approx(8 * 1.0 + 0.5)  # steps 6-13 and the save of step 10
    assert r.attempts[1].useful == 0 and r.attempts[1].lost == pytest.approx(2 * 1.0)  # all it did: steps 11, 12
    assert r.steps == 20


def test_goodput_counts_the_steps_a_rollback_redoes_as_lost():
    """``mgr.rollback()`` (a NaN loss) restores an earlier step inside the same attempt: the steps after it
    were redone, so they are lost work and the rollback's restore is recovery, not useful training (before:
    one attempt, nothing lost, the redone steps and the restore counted useful)."""
    evs, t = _attempt("a", 100.0, 0, 12, close=False)  # saves 5, 10; the loss of step 12 is NaN
    t_rb0, t_rb1 = t + 0.1, t + 1.6
    evs.append({"kind": "restore", "t": t_rb1, "a": "a", "rank": 0, "t0": t_rb0, "seconds": 1.5, "outcome": "restored",
                "step": 10, "version": "step-10", "rollback": True})
    tt = t_rb1
    for s in range(11, 21):
        tt += 1.0
        if s % 5 == 0:
            tt += 0.5
            evs.append({"kind": "progress", "t": tt, "a": "a", "rank": 0, "step": s, "save": f"step-{s}", "blocked_s": 0.5})
        else:
            evs.append({"kind": "progress", "t": tt, "a": "a", "rank": 0, "step": s})
    evs.append({"kind": "close", "t": tt + 1.0, "a": "a", "rank": 0, "t0": tt, "seconds": 1.0})
    r = goodput.account(evs)
    assert r.restarts == 0 and r.failures == 0 and r.rollbacks == 1
    assert r.lost == pytest.approx(2.0 + 0.1)  # steps 11-12 (and the NaN check before the rollback began)
    assert r.lost_work() == [{"attempt": "a", "ended": "rolled back", "lost_s": pytest.approx(2.1), "lost_steps": 2,
                              "kept_to_step": 10}]
    assert r.load == pytest.approx(1.5) and r.restart == 0 and r.recovery == pytest.approx(1.5)
    assert r.useful == pytest.approx(20.0) and r.steps == 20 and r.blocked == pytest.approx(4 * 0.5)
    assert goodput.google_buckets(r)["wasted_progress"] == pytest.approx(2.1)


def test_goodput_reads_one_rank_of_a_shared_log_and_skips_torn_lines(tmp_path):
    evs, _ = _attempt("a", 100.0, 0, 10)
    other = [dict(e, rank=1, a="z") for e in evs]
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in evs + other) + '{"kind": "progress", "t": 1')
    p = _cli("goodput", str(path), "--json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["attempts"] == 1 and rep["skipped_lines"] == 1 and rep["steps"] == 10
    assert "1 torn or unreadable line" in p.stderr
    p = _cli("goodput", str(tmp_path))  # ROOT: its events.jsonl
    assert p.returncode == 0 and "goodput = useful / wall" in p.stdout and "steps kept" in p.stdout, p.stdout
    p = _cli("goodput", str(tmp_path / "nowhere"))
    assert p.returncode == 9 and "no event log" in p.stderr


# -- metrics text --------------------------------------------------------------------------------------
def _families(text, openmetrics=False):
    parse = parse_openmetrics if openmetrics else parse_prometheus
    return {f.name: f for f in parse(text)}


def test_metrics_text_parses_with_prometheus_client_in_both_formats():
    m = Metrics(rank=3)
    evs, _ = _attempt("a", 100.0, 0, 10)
    for e in evs:
        m.observe(e)
    m.observe({"kind": "restore", "t": 1.0, "outcome": "restored", "seconds": 2.5, "restore_count": 1,
               "skipped": [{"version": "step-9", "kind": "damaged"}]})
    m.observe({"kind": "preempt", "t": 2.0, "saved": True, "seconds": 4.25})
    for om in (False, True):
        fam = _families(m.text(openmetrics=om), om)
        saves = {s.labels["outcome"]: s.value for s in fam["ckptstore_saves"].samples if s.name.endswith("_total")}
        assert saves == {"committed": 2.0} and fam["ckptstore_saves"].type == "counter"
        assert {s.labels["kind"]: s.value for s in fam["ckptstore_saved_bytes"].samples
                if s.name.endswith("_total")} == {"logical": 200.0, "stored": 120.0, "uploaded": 120.0}
        assert fam["ckptstore_durable_lag_seconds"].samples[0].value == 3.0
        assert fam["ckptstore_step"].samples[0].value == 10.0 and fam["ckptstore_step"].samples[0].labels == {"rank": "3"}
        assert [s.labels["kind"] for s in fam["ckptstore_restore_skipped_versions"].samples if s.name.endswith("_total")] == ["damaged"]
        assert fam["ckptstore_preempt_seconds"].samples[0].value == 4.25
        assert fam["ckptstore_restore_count"].samples[0].value == 1.0


# -- a real manager (one process): every save, restore and gc is a line; metrics; callback -------------
def _manager_run(root, remote=None, steps=6, **kw):
    import torch

    import ckptstore

    model = torch.nn.Linear(8, 8)
    got = []
    with ckptstore.CheckpointManager(root, {"model": model}, remote=remote, interval_steps=2, on_event=got.append,
                                     metrics_file=os.path.join(root, "prom", "ckptstore.prom"), progress_s=0,
                                     retention=kw.pop("retention", None), **kw) as mgr:
        for step in range(mgr.resume(), steps + 1):
            model.weight.data += 1
            mgr.save(step)
        mgr.wait()
        text = mgr.metrics_text()
    return got, text, mgr


def test_manager_logs_every_save_restore_retention_and_exports_metrics(tmp_path):
    from ckptstore.retention import KeepLast, RetentionPolicy

    root = str(tmp_path / "store")
    got, text, mgr = _manager_run(root, retention=RetentionPolicy(per_tier={"local": [KeepLast(2)]}))
    assert mgr.event_log == events.default_path(root)
    lines = events.read_events(mgr.event_log)
    assert [e["kind"] for e in lines] == [e["kind"] for e in got]  # on_event saw every line, in order
    saves = [e for e in lines if e["kind"] == "save"]
    assert [e["version"] for e in saves] == ["step-2", "step-4", "step-6"] and all(e["outcome"] == "committed" for e in saves)
    for e in saves:
        assert e["ranks"] == 1 and e["blocked_s"] > 0 and e["write_s"] > 0 and e["commit_s"] > 0
        assert e["logical_bytes"] > 8 * 8 * 4 + 8 * 4 and e["stored_bytes"] > 0  # the model and the RNG state
        assert e["durable_lag_s"] is None and e["uploaded_bytes"] is None  # no remote tier
    gcs = [e for e in lines if e["kind"] == "gc"]
    assert [e["deleted"] for e in gcs] == [["step-2"]] and gcs[0]["source"] == "retention"
    assert [e["kind"] for e in lines[:2]] == ["open", "restore"] and lines[1]["outcome"] == "none"
    assert lines[-1]["kind"] == "close"
    fam = _families(text)
    assert {s.labels["outcome"]: s.value for s in fam["ckptstore_saves"].samples} == {"committed": 3.0}
    assert fam["ckptstore_gc_deleted_versions"].samples[0].value == 1.0
    with open(os.path.join(root, "prom", "ckptstore.prom")) as f:  # the textfile collector's file, whole
        assert _families(f.read())["ckptstore_last_save_step"].samples[0].value == 6.0
    assert not glob.glob(os.path.join(root, "prom", "*.part"))
    # the next run's restore is a line too, and ckptstore goodput reads both runs
    got2, _text, _m = _manager_run(root, steps=8)
    r = [e for e in got2 if e["kind"] == "restore"][0]
    assert r["outcome"] == "restored" and r["version"] == "step-6" and r["step"] == 6 and r["skipped"] == []
    p = _cli("goodput", root, "--json")
    rep = json.loads(p.stdout)
    assert p.returncode == 0 and rep["attempts"] == 2 and rep["steps"] == 8 and rep["saves"]["committed"] == 4


def test_restore_line_records_what_the_choice_passed_over(tmp_path):
    root = str(tmp_path / "store")
    _manager_run(root)
    shard = sorted(glob.glob(os.path.join(root, "versions", "step-6", "**", "*.ckd"), recursive=True))
    shard = [p for p in shard if "metadata" not in os.path.basename(p)][0]
    with open(shard, "r+b") as f:  # one flipped byte in the newest version's shard
        f.seek(200)
        b = f.read(1)
        f.seek(200)
        f.write(bytes([b[0] ^ 0xFF]))
    got, _t, mgr = _manager_run(root, steps=6)
    r = [e for e in got if e["kind"] == "restore"][0]
    assert r["version"] == "step-4" and [(s["version"], s["kind"]) for s in r["skipped"]] == [("step-6", "unverified")]
    assert r["restore_count"] == 0 and r["remote_error"] is None


def test_list_and_show_give_the_last_saves_durable_lag(tmp_path, s3_url):
    root = str(tmp_path / "store")
    _manager_run(root, remote=s3_url, steps=4)
    saves = sorted((e for e in events.read_events(events.default_path(root)) if e["kind"] == "save"), key=lambda e: e["step"])
    assert saves[-1]["durable_lag_s"] > saves[-1]["local_commit_s"] > 0 and saves[-1]["uploaded_bytes"] == saves[-1]["stored_bytes"]
    p = _cli("list", root, "--remote", s3_url)
    assert p.returncode == 0, p.stderr
    assert f"last save: step-4 (committed), durable lag {saves[-1]['durable_lag_s']:.1f} s" in p.stdout, p.stdout
    p = _cli("list", root, "--remote", s3_url, "--json")
    assert json.loads(p.stdout)["last_save"]["durable_lag_s"] == pytest.approx(saves[-1]["durable_lag_s"])
    p = _cli("show", root, "step-2", "--remote", s3_url)
    assert f"durable lag:    {saves[0]['durable_lag_s']:.1f} s" in p.stdout, p.stdout
