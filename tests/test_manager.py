"""``ckptstore.CheckpointManager`` — the training-loop API (real gloo ranks)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ckptstore.testing.dist import run_ranks, run_ranks_raw

import async_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _check_loop(outs, steps):
    for o in outs:
        assert o["versions"] == [f"step-{s}" for s in range(1, steps + 1)], o  # all committed, in order
        assert o["loaded"] == list(range(1, steps + 1))  # every committed version loads
        assert o["latest_step"] == steps and o["model_same"]
        assert o["stats_saves"] == steps and o["infos"] == steps
        assert "checkpoint every" in o["advice"]
    assert [o["data_rank"] for o in outs] == list(range(len(outs)))  # per-rank state came back per rank


def test_manager_saves_every_step_while_loop_runs_collectives_2_ranks(tmp_path):
    steps = 6
    _check_loop(run_ranks(async_ranks.manager_loop, 2, str(tmp_path), steps, timeout=150), steps)


@pytest.mark.slow
def test_manager_saves_every_step_while_loop_runs_collectives_4_ranks(tmp_path):
    steps = 20
    _check_loop(run_ranks(async_ranks.manager_loop, 4, str(tmp_path), steps, timeout=300), steps)


@pytest.mark.slow  # suite time: the PROCESS executor's saves are in test_async's and test_preempt's default tests
def test_manager_process_executor_every_step(tmp_path):
    """PROCESS executor, saves due every step: never two in flight, no hang, all committed in order."""
    steps = 3
    _check_loop(run_ranks(async_ranks.manager_loop, 2, str(tmp_path), steps, "process", timeout=240), steps)


@pytest.mark.slow
def test_manager_restore_after_sigkill_mid_save_is_bit_exact(tmp_path):
    root = str(tmp_path)
    codes = run_ranks_raw(async_ranks.killed_training, 2, root, 5, timeout=120)
    assert all(c == -9 for c in codes.values()), codes
    import ckptstore

    newest = ckptstore.Store(root).latest()
    assert newest is not None and 1 <= newest.step <= 5
    outs = run_ranks(async_ranks.resumed_training, 2, root, timeout=120)
    assert [o[0] for o in outs] == [newest.step] * 2, outs  # the newest committed version, on both ranks
    for _step, ok in outs:
        assert all(ok.values()), ok


def test_manager_restore_refuses_when_a_rank_sees_no_version(tmp_path):
    """Node-local roots, one rank's root lost (a replaced node) and no remote tier: restore must
    not silently start over on every rank; every rank raises VersionNotFoundError naming the
    objects that no root holds any more."""
    import shutil

    base = str(tmp_path)
    assert run_ranks(async_ranks.node_local_roots, 2, base, "save", timeout=150) == [True, True]
    shutil.rmtree(os.path.join(base, "node1"))
    outs = run_ranks(async_ranks.node_local_roots, 2, base, "restore", timeout=150)
    for o in outs:
        assert isinstance(o, str) and o.startswith("VersionNotFoundError"), outs
        assert "are on none of the roots of ranks" in o and ".ckd" in o, o  # names the lost objects


def test_manager_single_process_without_dist(tmp_path):
    import torch

    from ckptstore import CheckpointManager

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    mgr = CheckpointManager(str(tmp_path), interval_steps=2, on_save=seen.append)
    assert mgr.restore({"model": model, "optim": opt}) is None and mgr.last_restore is None
    assert [mgr.save(s, {"model": model, "optim": opt, "extra": {"lr": 0.1}}) for s in (1, 2, 3)] == [False, True, False]
    assert mgr.save(3, {"model": model, "optim": opt, "extra": {"lr": 0.1}}, force=True)
    mgr.close()
    assert [i.version for i in seen] == ["step-2", "step-3"] and all(i.local_commit_s is not None for i in seen)
    assert mgr.latest() == "step-3"
    m2 = torch.nn.Linear(4, 2)
    state = {"model": m2, "optim": torch.optim.SGD(m2.parameters(), lr=0.1), "extra": {"lr": 0.0}}
    assert CheckpointManager(str(tmp_path)).restore(state) == 3
    assert torch.equal(m2.weight, model.weight) and state["extra"] == {"lr": 0.1}
    # state in the constructor, zero-padded names, user metadata in the manifest, resume()
    import ckptstore

    m3 = torch.nn.Linear(4, 2)
    with CheckpointManager(str(tmp_path / "b"), {"model": m3}, interval_steps=5, version_format="step-{step:04d}") as mgr3:
        assert mgr3.resume() == 1
        assert mgr3.save(5, metadata={"loss": 1.5}) and not mgr3.save(6)
    rec = ckptstore.Store(str(tmp_path / "b")).get("step-0005")
    assert rec.step == 5 and ckptstore.Store(str(tmp_path / "b")).manifest("step-0005").manifest.user == {"loss": 1.5}
    mgr4 = CheckpointManager(str(tmp_path / "b"), {"model": torch.nn.Linear(4, 2)})
    assert mgr4.resume() == 6 and mgr4.last_restore.version == "step-0005" and mgr4.last_restore.rng_restored



def test_a_failed_save_raises_the_error_type_the_rank_raised(tmp_path):
    """A save that failed with a ckptstore error raises that type (and its attributes) from the next
    call, not a bare ``CkptStoreError``: ``except ckptstore.VersionExistsError`` (or
    ``StorageFullError``, ``KeyServiceError``) works around ``mgr.save``/``wait``."""
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptstore
    from ckptstore import CheckpointManager

    model = torch.nn.Linear(4, 2)
    # another writer (not this manager's restore) committed the name the manager saves next
    dcp.save({"x": torch.ones(2)}, checkpoint_id="step-2", storage_writer=ckptstore.StorageWriter(str(tmp_path)))
    mgr = CheckpointManager(str(tmp_path), {"model": model}, save_on_signal=None)
    mgr.save(2)
    with pytest.raises(ckptstore.VersionExistsError, match=r"save of step 2 \(step-2\) failed") as ei:
        mgr.wait()
    assert isinstance(ei.value, FileExistsError)
    mgr.save(3)
    mgr.close()  # the failure was raised once; later saves go on
    assert [r.version for r in ckptstore.Store(str(tmp_path)).versions()] == ["step-2", "step-3"]

def _readme_example() -> str:
    """The loop of the docs' "Training loop" page (docs/howto/training-loop.md; the README shows it too)."""
    text = open(os.path.join(ROOT, "docs", "howto", "training-loop.md")).read()
    m = re.search(r"^# Training loop.*?```python\n(.*?)```", text, re.S | re.M)
    assert m, "docs/howto/training-loop.md has no python block"
    return m.group(1)


def test_readme_training_loop_example_runs_as_written(tmp_path):
    """The README's 5-line example (save in the loop + resume), run as written inside a tiny
    training script, twice: the second run restores step 1000 and continues from step 1001."""
    example = _readme_example()
    lines = [ln for ln in example.strip().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(lines) <= 5, example
    script = (
        "import torch\n"
        "model = torch.nn.Linear(8, 2)\n"
        "optimizer = torch.optim.AdamW(model.parameters())\n"
        "def train_step():\n"
        "    model(torch.randn(4, 8)).sum().backward(); optimizer.step(); optimizer.zero_grad()\n"
        f"root = {str(tmp_path)!r}\n"
        "import sys\nsteps = int(sys.argv[1])\n" + example
        + "\nprint('latest', mgr.latest(), 'last step', step, 'restored', mgr.last_restore)\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", script, "1001"], env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "latest step-1000 last step 1001 restored None" in p.stdout, p.stdout  # saved at 500, 1000
    p = subprocess.run([sys.executable, "-c", script, "1002"], env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    # the second run restored step 1000 and ran only steps 1001 and 1002
    assert "latest step-1000 last step 1002 restored RestoreInfo(version='step-1000', step=1000" in p.stdout, p.stdout


def test_advise_young_daly_and_command():
    import math

    from click.testing import CliRunner

    from ckptstore.advise import advise, goodput, optimal_interval
    from ckptstore.cli import main as cli_main
    from ckptstore.retention import parse_duration

    c, m = 10.0, 6 * 3600.0
    assert abs(advise(cost_s=c, mtbf_s=m).young_s - math.sqrt(2 * c * m)) < 1e-9  # Young 1974
    t = optimal_interval(c, m)
    assert abs(t - math.sqrt(2 * c * m)) / t < 0.03  # Daly's refinement stays close for C << M
    assert goodput(t, c, m) > max(goodput(t / 3, c, m), goodput(3 * t, c, m))  # it is the optimum
    assert parse_duration("6h") == m and parse_duration("90m") == 5400 and parse_duration("45") == 45
    a = advise(cost_s=2.0, mtbf_s=m, restart_s=120, step_time_s=0.5)
    assert a.interval_steps == round(a.interval_s / 0.5) and 0.9 < a.goodput < 1.0
    r = CliRunner().invoke(cli_main, ["advise", "--mtbf", "6h", "--cost", "2", "--restart", "120", "--step-time", "0.5"])
    assert r.exit_code == 0 and "checkpoint every" in r.output and "steps" in r.output, r.output
    r = CliRunner().invoke(cli_main, ["advise", "--mtbf", "soon", "--cost", "2"])
    assert r.exit_code == 2 and "not a duration" in r.output


def test_interval_none_saves_only_when_forced_and_builds_a_callable_state_only_then(tmp_path):
    """``interval_steps=None`` (a framework decides when to save, as torchtitan's checkpointer): a
    plain ``save(step)`` saves nothing and does not build the state it is given as a callable;
    ``force=True`` builds it once and saves."""
    import torch

    import ckptstore

    built = []

    def state():
        built.append(1)
        return {"w": torch.ones(3)}

    with ckptstore.CheckpointManager(str(tmp_path), interval_steps=None, save_rng=False) as mgr:
        assert [mgr.save(s, state) for s in (1, 2, 100)] == [False] * 3 and built == []
        assert mgr.save(3, state, force=True) and built == [1]
    assert [r.version for r in ckptstore.Store(str(tmp_path)).versions()] == ["step-3"]
    with pytest.raises(ValueError, match="or None"):
        ckptstore.CheckpointManager(str(tmp_path / "x"), interval_steps=0)
