"""Pacing of a CheckpointManager's saves (``background_duty``, off by default; ckptstore/_pace.py): the
thread that runs a save pauses between the pieces of its bookkeeping so that its CPU stays within the
duty; the save commits the same bytes; the last save after a preemption signal is never paced. Real
saves, real threads, the thread's own CPU clock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore import _pace

HERE = os.path.dirname(os.path.abspath(__file__))


def _burn(cpu_s: float, piece_s: float = 0.0002) -> None:
    """Use ``cpu_s`` of this thread's CPU, passing a pace point every ``piece_s`` of it."""
    end = time.thread_time() + cpu_s
    while True:
        now = time.thread_time()
        if now >= end:
            return
        stop = min(end, now + piece_s)
        while time.thread_time() < stop:
            pass
        _pace.point()


def _in_thread(fn):
    box = {}

    def run():
        box["out"] = fn()

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    return box["out"]


def test_a_paced_thread_pauses_in_proportion_to_its_cpu():
    """duty 0.25: every piece of CPU is followed by three times as long a pause (each below the
    largest pause), so the thread's CPU is a quarter of its wall time; the budget bounds the pauses."""
    def run():
        p = _pace.Pacer(0.25, budget_s=10.0)
        _pace.install(p)
        c0, t0 = time.thread_time(), time.monotonic()
        _burn(0.04)
        cpu, wall = time.thread_time() - c0, time.monotonic() - t0
        return p.slept, cpu, wall

    slept, cpu, wall = _in_thread(run)
    # each piece was paid for at 3x (all but the last, under QUANTUM_S, and the pauses' own CPU)
    assert 3 * (cpu - 4 * _pace.QUANTUM_S) <= slept <= 3 * cpu, (slept, cpu)
    assert wall >= cpu + slept * 0.99 and cpu / wall <= 0.25 * 1.1, (wall, cpu, slept)


def test_the_pauses_of_one_save_stop_at_its_budget_and_start_again_at_the_next():
    def run():
        p = _pace.Pacer(0.01, budget_s=0.12)
        _pace.install(p)
        _burn(0.02)  # would ask for 1.98 s of pauses
        first = p.slept
        p.start()
        _burn(0.005)
        return first, p.slept

    first, second = _in_thread(run)
    assert first == pytest.approx(0.12)
    assert 0 < second <= 0.12


def test_threads_without_a_pacer_never_pause():
    def run():
        _burn(0.02)
        return _pace.current()

    t0 = time.monotonic()
    assert _in_thread(run) is None
    assert _pace.current() is None  # nor the test's own thread: install() is per thread
    assert time.monotonic() - t0 < 5.0  # 20 ms of CPU, no 50 ms pauses per ms of it


def _saves(tmp_path, gap_s: float = 0.0, **kw) -> tuple[list, dict]:
    infos = []
    sd = {"w": torch.nn.Linear(64, 64), "b": torch.arange(1000, dtype=torch.float32)}
    m = ckptstore.CheckpointManager(str(tmp_path), sd, save_on_signal=None, on_save=infos.append, **kw)
    try:
        for step in (1, 2, 3):
            m.save(step)
            time.sleep(gap_s)  # the save pauses meanwhile (waiting for it would end its pauses)
            m.wait()
    finally:
        m.close()
    log = tmp_path / "events.jsonl"
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return infos, {x["step"]: x for x in lines if x.get("kind") == "save"}


def test_paced_saves_pause_and_commit_the_same_bytes(tmp_path):
    """Saves 1 s apart: the first (no cadence known yet) is not paced; each later one pauses, at
    most a quarter of the time since the previous save was queued (about 0.25 s here)."""
    infos, lines = _saves(tmp_path, gap_s=1.0, background_duty=0.02)
    assert [i.step for i in infos] == [1, 2, 3]
    assert infos[0].paused_s == 0.0
    # a save's bookkeeping is milliseconds of CPU: at 2 % every millisecond asks for 49 ms of pauses,
    # within a quarter of the ~1 s since the previous save was queued
    assert all(0 < i.paused_s <= 0.4 for i in infos[1:]), [i.paused_s for i in infos]
    assert all(lines[s]["paused_s"] == pytest.approx(i.paused_s) for s, i in zip((1, 2, 3), infos)), lines
    assert [v.version for v in ckptstore.Store(str(tmp_path)).versions()] == ["step-1", "step-2", "step-3"]
    got = {"w": torch.nn.Linear(64, 64).state_dict(), "b": torch.zeros(1000)}
    dcp.load(got, storage_reader=ckptstore.StorageReader(str(tmp_path), version="step-3"), no_dist=True)
    assert torch.equal(got["b"], torch.arange(1000, dtype=torch.float32))


@pytest.mark.parametrize("kw", [{}, {"background_duty": None}, {"background_duty": 1}], ids=["default", "None", "1"])
def test_by_default_saves_are_not_paced(tmp_path, kw):
    infos, lines = _saves(tmp_path, gap_s=0.2, **kw)
    assert [i.paused_s for i in infos] == [0.0] * 3
    assert [lines[s]["paused_s"] for s in (1, 2, 3)] == [0.0] * 3


def test_paced_saves_leave_the_random_modules_stream_alone(tmp_path):
    """A training loop seeds, saves and restores ``random``'s state (the torchft tier records it per
    step): a paced save's random first pause draws from a generator of its own."""
    import random

    random.seed(0)
    want = [random.random() for _ in range(3)]
    random.seed(0)
    infos, _lines = _saves(tmp_path, gap_s=0.3, background_duty=0.02)
    assert any(i.paused_s > 0 for i in infos), [i.paused_s for i in infos]
    assert [random.random() for _ in range(3)] == want


def test_waiting_for_a_paced_save_ends_its_pauses(tmp_path):
    """``wait()`` (and ``close()``, and the save after a preemption signal) wait for no pauses: a
    save given seconds of budget ends them once someone waits for it."""
    infos = []
    m = ckptstore.CheckpointManager(str(tmp_path), {"w": torch.nn.Linear(64, 64)}, save_on_signal=None,
                                    background_duty=0.001, event_log=False, on_save=infos.append)
    try:
        m.save(1)
        m.wait()
        time.sleep(8.5)  # the next save's budget: 2 s (a quarter of the gap, at most MAX_BUDGET_S)
        m.save(2)
        time.sleep(0.3)  # its pauses begin (0.2 s each at duty 0.001)
        t0 = time.monotonic()
        m.wait()
        took = time.monotonic() - t0
    finally:
        m.close()
    assert 0 < infos[1].paused_s < 1.0 and took < 1.0, (infos[1].paused_s, took)
    assert [v.version for v in ckptstore.Store(str(tmp_path)).versions()] == ["step-1", "step-2"]


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, True, "0.5"])
def test_a_duty_outside_0_to_1_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="background_duty"):
        ckptstore.CheckpointManager(str(tmp_path), {"w": torch.zeros(2)}, save_on_signal=None, background_duty=bad)


PREEMPTED = """
import json, os, signal, sys, time, torch, ckptstore
seen = []
m = ckptstore.CheckpointManager(sys.argv[1], {"w": torch.nn.Linear(64, 64)}, interval_steps=2, grace_s=20,
                                background_duty=0.02, on_save=lambda info: seen.append([info.step, info.paused_s > 0]))
try:
    for step in range(1, 10):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        m.save(step)
        if step == 2:
            m.wait(); time.sleep(1.0)
        if step == 4:
            time.sleep(1.0); m.wait()
except ckptstore.errors.Preempted as e:
    print(json.dumps({"seen": seen, "saved": e.saved, "step": e.step}), flush=True)
    raise
"""


def test_the_last_save_after_sigterm_is_not_paced(tmp_path):
    """Steps 2 and 4 save in the background (the first unpaced: no cadence yet; step 4 paced);
    SIGTERM before step 5: step 5 is saved unpaced (within the grace period, as fast as it can) and
    the process exits 143."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
    p = subprocess.run([sys.executable, "-c", PREEMPTED, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 143, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["saved"] and got["step"] == 5
    assert got["seen"] == [[2, False], [4, True], [5, False]], got
    assert ckptstore.Store(str(tmp_path)).latest().version == "step-5"
