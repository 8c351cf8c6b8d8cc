"""The priority of a CheckpointManager's saves (``background_nice``, off by default;
ckptstore/_manager/save_queue.py, "Background priority"): when set, the thread that runs the saves, and
the frame encoders it starts, lower their own CPU priority; the training thread keeps its own; the last
save after a preemption signal runs at the process's priority. Real saves, real threads, the kernel's
nice values read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import ckptstore
from ckptstore.dcp import _frames

HERE = os.path.dirname(os.path.abspath(__file__))
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _observed(monkeypatch, tmp_path, **kw) -> tuple[list, list, int]:
    """Save twice; the nice values of the threads that reported the saves and that encoded frames."""
    reported, encoded = [], []
    real = _frames._encode

    def encode(*a, **k):  # the real encoder runs; only its thread and nice value are noted
        encoded.append((threading.current_thread().name.split("_")[0], _nice()))
        return real(*a, **k)

    monkeypatch.setattr(_frames, "_encode", encode)
    before = _nice()
    # 16 KiB of weights in 4 KiB frames: the first frame is encoded by the save thread, the others by encoders
    m = ckptstore.CheckpointManager(str(tmp_path), {"w": torch.nn.Linear(64, 64)}, save_on_signal=None,
                                    event_log=False, on_save=lambda info: reported.append(_nice()), frame_size=4096, **kw)
    try:
        for step in (1, 2):
            m.save(step)
            m.wait()
        assert _nice() == before  # the training thread is never lowered
    finally:
        m.close()
    assert [v.version for v in ckptstore.Store(str(tmp_path)).versions()] == ["step-1", "step-2"]
    assert {t for t, _n in encoded} == {"ckptstore-manager", "ckptstore-enc"}, encoded
    return reported, [n for _t, n in encoded], before


@linux
def test_saves_run_at_the_lowest_priority_and_training_keeps_its_own(monkeypatch, tmp_path):
    reported, encoded, before = _observed(monkeypatch, tmp_path, background_nice=19)
    assert reported == [min(19, before + 19)] * 2
    assert encoded and set(encoded) == {min(19, before + 19)}  # the encoder threads inherit it


@linux
@pytest.mark.parametrize("kw", [{}, {"background_nice": 0}], ids=["default", "0"])
def test_by_default_and_with_0_saves_run_at_the_process_priority(monkeypatch, tmp_path, kw):
    monkeypatch.delenv("CKPTSTORE_BACKGROUND_NICE", raising=False)
    reported, encoded, before = _observed(monkeypatch, tmp_path, **kw)
    assert reported == [before] * 2 and set(encoded) == {before}


@linux
def test_a_partial_increment_adds_to_the_process_nice_value(monkeypatch, tmp_path):
    reported, _enc, before = _observed(monkeypatch, tmp_path, background_nice=5)
    assert reported == [min(19, before + 5)] * 2


@linux
def test_the_environment_sets_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv("CKPTSTORE_BACKGROUND_NICE", "3")
    reported, _enc, before = _observed(monkeypatch, tmp_path)
    assert reported == [min(19, before + 3)] * 2


@pytest.mark.parametrize("bad", [-1, 20, 2.5, True, "19"])
def test_a_nice_increment_outside_0_to_19_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="background_nice"):
        ckptstore.CheckpointManager(str(tmp_path), {"w": torch.zeros(2)}, save_on_signal=None, background_nice=bad)


@pytest.mark.parametrize("bad", ["20", "low"])
def test_a_bad_environment_value_is_refused(monkeypatch, tmp_path, bad):
    monkeypatch.setenv("CKPTSTORE_BACKGROUND_NICE", bad)
    with pytest.raises(ValueError, match="BACKGROUND_NICE"):
        ckptstore.CheckpointManager(str(tmp_path), {"w": torch.zeros(2)}, save_on_signal=None)


PREEMPTED = """
import json, os, signal, sys, threading, torch, ckptstore
nice = lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
seen = []
grace = None if sys.argv[2] == "none" else float(sys.argv[2])
m = ckptstore.CheckpointManager(sys.argv[1], {"w": torch.nn.Linear(64, 64)}, interval_steps=2, grace_s=grace, background_nice=19,
                                on_save=lambda info: seen.append([info.step, nice()]))
try:
    for step in range(1, 10):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        m.save(step)
        if step == 4:
            m.wait()
except ckptstore.errors.Preempted as e:
    print(json.dumps({"main": nice(), "seen": seen, "saved": e.saved, "step": e.step}), flush=True)
    raise
"""


@linux
@pytest.mark.parametrize("grace", ["20", "none"])
def test_the_last_save_after_sigterm_runs_at_the_process_priority(tmp_path, grace):
    """Steps 2 and 4 save in the background (lowered); SIGTERM before step 5: step 5 is saved by a
    thread at the training thread's own priority, and the process exits 143 — with a grace period
    and without one (``grace_s=None``: no deadline)."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
    p = subprocess.run([sys.executable, "-c", PREEMPTED, str(tmp_path), grace], env=env, capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 143, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    main = got["main"]
    assert got["saved"] and got["step"] == 5
    assert got["seen"] == [[2, min(19, main + 19)], [4, min(19, main + 19)], [5, main]], got
    assert ckptstore.Store(str(tmp_path)).latest().version == "step-5"
