"""The torchtitan integration's subclass (``ckptstore/integrations/_titan_v0_3.py``) on a
stand-in of torchtitan's checkpointer and trainer (``tests/titan_standin.py``): the default suite
has no torchtitan. torchtitan itself: ``tests/test_torchtitan_e2e.py`` (opt-in)."""

from __future__ import annotations

import os

import pytest
import torch

import ckptstore
from ckptstore.integrations._titan_v0_3 import manager_class
from ckptstore.testing.dist import run_ranks

import titan_standin as ts

Manager = manager_class(ts.StandInCheckpointManager)


def _cfg(**kw):
    kw.setdefault("enable", True)
    kw.setdefault("interval", 2)
    kw.setdefault("last_save_model_only", False)
    return Manager.Config(**kw)


def _versions(root: str) -> list[tuple[str, bool]]:
    return [(r.version, bool(r.supersedes)) for r in ckptstore.Store(root).versions()]


def job_resume_and_timelines(rank: int, world: int, base: str, mode: str) -> dict:
    """On every rank: an uninterrupted 10-step run (checkpointing off); 6 steps saving every 2 with
    keep_latest_k=2, then a restart to 10; then ``load_step=4`` to 6 again (an abandoned timeline);
    then a restart with ``exclude_from_loading=["dataloader"]``."""
    root = os.path.join(base, "checkpoint")
    ref = ts.train(ts.StandInCheckpointManager.Config(enable=False), 10, base_folder=base)
    first = ts.train(_cfg(async_mode=mode, keep_latest_k=2), 6, base_folder=base)
    after_first = _versions(root)
    second = ts.train(_cfg(async_mode=mode, keep_latest_k=2), 10, base_folder=base)
    after_second = _versions(root)
    again = ts.train(_cfg(async_mode=mode, keep_latest_k=0, load_step=8), 10, base_folder=base)
    after_again = _versions(root)
    excl = ts.train(_cfg(async_mode=mode, keep_latest_k=0, exclude_from_loading=["dataloader"]), 11, base_folder=base)
    equal = all(torch.equal(ref["weights"][k], second["weights"][k]) for k in ref["weights"])
    for run in (first, second, again, excl):
        run.pop("weights")  # tensors do not travel back through the result queue once the rank exited
    return {"ref": ref["losses"], "first": first, "second": second, "again": again, "excl": excl,
            "after_first": after_first, "after_second": after_second, "after_again": after_again,
            "weights_equal": equal}


def _check_resume(outs):
    for o in outs:
        ref, first, second = o["ref"], o["first"], o["second"]
        assert sorted(first["losses"]) == [1, 2, 3, 4, 5, 6] and second["start"] == 7
        assert {**first["losses"], **second["losses"]} == ref  # exactly the uninterrupted run's losses
        assert o["weights_equal"]
        # ckptstore's retention (KeepLast(2) after each commit) instead of torchtitan's purge thread;
        # ckptstore's own group instead of torchtitan's dist.new_group
        assert o["after_first"] == [("step-4", False), ("step-6", False)]
        assert o["after_second"] == [("step-8", False), ("step-10", False)]
        assert first["purge_threads"] == 0 and first["groups"] == 0
        # load_step=8 with step-10 committed: training to 10 again supersedes the abandoned step-10
        assert o["again"]["start"] == 9 and o["again"]["losses"] == {9: ref[9], 10: ref[10]}
        assert o["after_again"] == [("step-8", False), ("step-10", True)]
        # exclude_from_loading: the data loader starts afresh, everything else is restored
        assert o["excl"]["start"] == 11 and o["excl"]["loader_pos"] == 1


def test_resume_retention_and_abandoned_timeline_2_ranks(tmp_path):
    _check_resume(run_ranks(job_resume_and_timelines, 2, str(tmp_path), "async", timeout=240))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["disabled", "async_with_pinned_mem"])
def test_resume_retention_and_abandoned_timeline_2_ranks_more_modes(tmp_path, mode):
    _check_resume(run_ranks(job_resume_and_timelines, 2, str(tmp_path), mode, timeout=300))


def test_stock_standin_keeps_torchtitans_behaviour(tmp_path):
    """The stand-in is torchtitan's flow with DCP's file-system writer: a loss-equal resume, a purge
    thread and a gloo group of its own (what the subclass replaces); as in torchtitan, the last
    step's save skips the purge."""
    base = str(tmp_path)
    cfg = ts.StandInCheckpointManager.Config
    ref = ts.train(cfg(enable=False), 6, base_folder=base)
    first = ts.train(cfg(enable=True, interval=2, keep_latest_k=2, last_save_model_only=False), 4, base_folder=base)
    second = ts.train(cfg(enable=True, interval=2, keep_latest_k=2, last_save_model_only=False), 6, base_folder=base)
    assert first["purge_threads"] == 1 and second["start"] == 5
    assert {**first["losses"], **second["losses"]} == ref["losses"]
    assert sorted(os.listdir(os.path.join(base, "checkpoint"))) == ["step-2", "step-4", "step-6"]


def test_model_only_step_0_seed_then_training(tmp_path):
    """A seed checkpoint (``save(0, last_step=True)``, model only) is loaded model-only: the weights
    come back, the optimizer and loader start fresh (its version holds no other key)."""
    base = str(tmp_path)
    torch.manual_seed(0)
    seed_run = ts.train(_cfg(last_save_model_only=True, keep_latest_k=0), 0, base_folder=base)
    assert seed_run["losses"] == {}
    mgr_cfg = _cfg(last_save_model_only=True, keep_latest_k=0)
    # the stand-in trainer's save loop never runs for 0 steps: make the seed checkpoint as torchtitan's
    # --checkpoint.create-seed-checkpoint does
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.25)
    opt = ts.Optimizers(model)
    ck = mgr_cfg.build(dataloader=ts.Loader(0, 1), model_parts=[model], optimizers=opt,
                       lr_schedulers=ts.Schedulers(opt, 10), states={"train_state": ts.TrainState()}, base_folder=base)
    ck.save(curr_step=0, last_step=True)
    ck.close()
    assert _versions(os.path.join(base, "checkpoint")) == [("step-0", False)]
    run = ts.train(_cfg(keep_latest_k=0), 2, base_folder=base)
    assert run["start"] == 1 and sorted(run["losses"]) == [1, 2]
    # the first loss is the seed's model on batch 0, not a fresh initialisation's
    x, y = ts.Loader(0, 1).next()
    assert run["losses"][1] == pytest.approx(torch.nn.functional.mse_loss(model(x), y).item(), abs=0)


def test_fresh_start_and_initial_load_path(tmp_path):
    """Nothing committed: torchtitan's own branches run — a fresh start, or ``initial_load_path`` (a
    stock DCP folder, read by DCP's file-system reader, model only)."""
    import torch.distributed.checkpoint as dcp

    fresh = ts.train(_cfg(keep_latest_k=0), 1, base_folder=str(tmp_path / "a"))
    assert fresh["start"] == 1
    src = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    with torch.no_grad():
        for p in src.parameters():
            p.fill_(-0.5)
    dcp.save(dict(src.state_dict()), checkpoint_id=str(tmp_path / "init"))
    run = ts.train(_cfg(keep_latest_k=0, initial_load_path=str(tmp_path / "init")), 1, base_folder=str(tmp_path / "b"))
    x, y = ts.Loader(0, 1).next()
    assert run["start"] == 1
    assert run["losses"][1] == pytest.approx(torch.nn.functional.mse_loss(src(x), y).item(), abs=0)


def test_close_waits_for_the_save_in_flight(tmp_path):
    """An async save staged just before ``close()`` is committed when ``close()`` returns."""
    base = str(tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = ts.Optimizers(model)
    ck = _cfg(async_mode="async", keep_latest_k=0).build(
        dataloader=ts.Loader(0, 1), model_parts=[model], optimizers=opt, lr_schedulers=ts.Schedulers(opt, 10),
        states={"train_state": ts.TrainState()}, base_folder=base)
    assert ck.save(curr_step=2)
    ck.close()
    assert _versions(os.path.join(base, "checkpoint")) == [("step-2", False)]


def test_load_step_that_is_not_committed_is_a_clear_error(tmp_path):
    ts.train(_cfg(keep_latest_k=0), 2, base_folder=str(tmp_path))
    with pytest.raises(ckptstore.VersionNotFoundError, match="step-4"):
        ts.train(_cfg(keep_latest_k=0, load_step=4), 6, base_folder=str(tmp_path))


def test_folder_that_is_a_uri_is_refused():
    with pytest.raises(ckptstore.CkptStoreError, match="remote"):
        ts.train(_cfg(keep_latest_k=0, folder="s3://bucket/ckpt"), 1, base_folder="")


# -- preemption under torchtitan: the next step boundary, not the next due save ----------------------------
def _preempt_job(base, steps: int, kill_at: int, interval: int, nproc: int = 0):
    import json
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "titan_preempt_job.py")
    args = [str(base), str(steps), str(kill_at), str(interval)]
    cmd = ([sys.executable, script] if not nproc else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]), OMP_NUM_THREADS="1")
    p = subprocess.run(cmd + args, capture_output=True, text=True, timeout=300, env=env)
    outs = []
    for r in range(max(1, nproc)):
        with open(os.path.join(base, f"rank{r}.json")) as f:
            outs.append(json.load(f))
    return p, outs


def _check_preempted(p, outs, root, saved_step: int, before: tuple = ()):
    for o in outs:
        assert o["exit"] == 143 and o["saved"] == f"step-{saved_step}", (o, p.stderr[-3000:])
        assert o["reached"] == saved_step  # it stopped at that step boundary: no step trained after it
        assert o["t_end"] - outs[0]["t_signal"] < 10, o  # well within the 30 s grace period
        assert "Resume by running the same torchtitan command again" in o["message"], o["message"]
        assert "mgr.resume()" not in o["message"]
    assert "ended the process" not in p.stderr and "grace period over" not in p.stderr, p.stderr[-3000:]
    assert _versions(root) == [(v, False) for v in before] + [(f"step-{saved_step}", False)]


def test_sigterm_saves_the_next_step_boundary_not_the_next_interval(tmp_path):
    """``--checkpoint.interval 100``, SIGTERM at step 3 (one process): step 3 is saved and the process
    exits 143 at once, with a message in torchtitan's terms (before: training went on to the next due
    save — step 100, or the watchdog ended it after 27 s with nothing saved); the next run resumes at 4."""
    base = tmp_path / "run"
    base.mkdir()
    p, outs = _preempt_job(base, 40, 3, 100)
    assert p.returncode == 143, p.stderr[-3000:]
    _check_preempted(p, outs, str(base / "checkpoint"), 3)
    p, outs = _preempt_job(base, 5, -1, 100)
    assert p.returncode == 0 and outs[0]["start"] == 4, (outs, p.stderr[-3000:])


@pytest.mark.slow
def test_sigterm_to_one_rank_under_torchrun_saves_the_same_step_on_both(tmp_path):
    """Two ranks under ``torchrun``, interval 4, SIGTERM to rank 0 at step 5: both ranks learn it at
    the next step's ``save()`` call and save step 6 (before: step 8 or later, and "Resume with
    mgr.resume()")."""
    base = tmp_path / "run"
    base.mkdir()
    p, outs = _preempt_job(base, 40, 5, 4, nproc=2)
    _check_preempted(p, outs, str(base / "checkpoint"), 6, before=("step-4",))


def test_a_rewind_with_keep_latest_k_leaves_no_abandoned_attempt_on_disk(tmp_path):
    """``--checkpoint.load-step 4`` on a store holding step-6, then saves to 14 with
    ``--checkpoint.keep-latest-k 2``: the abandoned step-6 attempt goes with the retention of the
    commit that superseded it (before: 56 MiB stayed after the new step-6 was deleted, until a
    ``ckptstore gc`` the section never mentioned); only step-12 and step-14 remain on disk."""
    base = str(tmp_path)
    root = os.path.join(base, "checkpoint")
    ts.train(_cfg(keep_latest_k=0), 6, base_folder=base)
    old6 = ckptstore.Store(root).get("step-6").attempt
    run = ts.train(_cfg(keep_latest_k=2, load_step=4), 6, base_folder=base)
    assert run["start"] == 5
    adir = os.path.join(root, "versions", "step-6", "attempts")
    assert old6 not in os.listdir(adir)  # reclaimed by the commit's retention, not an hour later
    ts.train(_cfg(keep_latest_k=2), 14, base_folder=base)
    assert _versions(root) == [("step-12", False), ("step-14", False)]
    assert sorted(os.listdir(os.path.join(root, "versions"))) == ["step-12", "step-14"]
