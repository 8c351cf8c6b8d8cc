"""Preemption (CheckpointManager(save_on_signal=, grace_s=)): a scheduler's SIGTERM leads to one last
committed save at the step the loop reached, within the grace period, and a clean exit; the resumed
run continues bit for bit. Real signals (os.kill, SIGTERM to a real ``torchrun`` agent, which
forwards it to its workers' process groups) and real gloo ranks; the job is tests/preempt_ranks.py.

Default set: one 2-rank torchrun job preempted mid-training and resumed (THREAD executor), the
README's loop as written under SIGTERM, and an in-process 2-rank job with a rank stuck longer than
the grace period. Slow: the PROCESS executor in-process (the signal reaches one rank) and under
torchrun with a save in flight and S3, a rank that ignores the signal under torchrun, and a job
that crashes twice (the event log counts both restarts).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import ckptstore
from ckptstore import events
from ckptstore.testing.dist import Ranks, run_ranks

import preempt_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "preempt_ranks.py")


class TorchrunJob:
    """One ``torchrun --nproc-per-node=2`` launch of tests/preempt_ranks.py, each worker wrapped so that
    its exit status and time are recorded (``rc.<rank>.json``)."""

    def __init__(self, d, cfg: dict, *, max_restarts: int = 0, nproc: int = 2):
        self.d = str(d)
        os.makedirs(self.d, exist_ok=True)
        self.cfg = dict(cfg, out=self.d, marks=self.d)
        self.cfg_path = os.path.join(self.d, "cfg.json")
        with open(self.cfg_path, "w") as f:
            json.dump(self.cfg, f)
        self.cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                    f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
                    WORKER, "--wrap", self.cfg_path]
        self.p = None

    def start(self) -> "TorchrunJob":
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")]))
        self.log = open(os.path.join(self.d, "torchrun.log"), "w")
        # its own session: the SIGTERM below reaches the agent only; the agent forwards it
        self.p = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def marks(self, rank: int = 0) -> list[tuple[float, str]]:
        try:
            with open(os.path.join(self.d, f"rank{rank}.marks")) as f:
                return [(float(t), w) for t, w in (ln.split(" ", 1) for ln in f.read().splitlines() if " " in ln)]
        except FileNotFoundError:
            return []

    def last_step(self, rank: int = 0) -> int:
        return max([int(w.split()[1]) for _t, w in self.marks(rank) if w.startswith("step ")] or [0])

    def wait_for(self, pred, timeout: float = 120, what: str = "") -> None:
        end = time.time() + timeout
        while not pred():
            if self.p.poll() is not None:
                raise AssertionError(f"torchrun exited ({self.p.returncode}) before {what}:\n{self.output()}")
            if time.time() > end:
                raise AssertionError(f"timed out waiting for {what}:\n{self.output()}")
            time.sleep(0.02)

    def sigterm(self) -> float:
        t = time.time()
        os.kill(self.p.pid, signal.SIGTERM)
        return t

    def wait(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()
            raise AssertionError(f"torchrun did not exit within {timeout} s:\n{self.output()}") from None
        finally:
            self.log.close()

    def output(self) -> str:
        with open(os.path.join(self.d, "torchrun.log")) as f:
            return f.read()[-6000:]

    def result(self, rank: int) -> dict:
        with open(os.path.join(self.d, f"rank{rank}.json")) as f:
            return json.load(f)

    def rc(self, rank: int) -> dict:
        with open(os.path.join(self.d, f"rc.{rank}.json")) as f:
            return json.load(f)


def _losses(out: dict, first: int, last: int) -> list[str]:
    ls = {int(k): v for k, v in out["losses"].items()}  # JSON (torchrun) or pickled (run_ranks)
    return [ls[s] for s in range(first, last + 1)]


def _preempt_events(root) -> list[dict]:
    return [e for e in events.read_events(events.default_path(root)) if e["kind"] == "preempt"]


def _check_preempted_run(job: TorchrunJob, root: str, t_kill: float, grace: float, reached: int) -> dict:
    """What every preemption must show: one step, saved by every rank, the last step trained; every
    worker exited 143 within the grace period; that version is the newest committed one."""
    res = [job.result(r) for r in (0, 1)]
    pre = [r["preempted"] for r in res]
    step = pre[0]["step"]
    assert all(p is not None and p["saved"] and p["step"] == step and p["code"] == 143 for p in pre), pre
    assert step >= reached  # at or after the step the loop was at when the signal came
    for r in res:
        assert max(int(s) for s in r["losses"]) == step, "a step was trained after the one saved"
    rcs = [job.rc(r) for r in (0, 1)]
    assert [x["rc"] for x in rcs] == [143, 143], rcs
    exits = [x["t"] - t_kill for x in rcs]
    assert max(exits) < grace, exits
    latest = ckptstore.Store(root).latest()
    assert latest.version == pre[0]["version"] and latest.step == step
    ev = _preempt_events(root)
    assert len(ev) == 1 and ev[0]["saved"] and ev[0]["step"] == step, ev
    return {"step": step, "res": res, "exits": exits, "commit_s": ev[0]["seconds"], "event": ev[0]}


def _resume_and_compare(tmp_path, cfg: dict, root: str, step: int, first: list[dict], steps: int, label: str) -> None:
    job = TorchrunJob(tmp_path / label, dict(cfg, steps=steps, save_on_signal=None)).start()
    assert job.wait(240) == 0, job.output()
    ref = preempt_ranks.reference(2, steps)
    for r in (0, 1):
        out = job.result(r)
        assert out["start"] == step + 1 and out.get("finished"), out.get("start")
        # bit for bit: the preempted run up to its save, the resumed run after it, vs an uninterrupted run
        assert _losses(first[r], 1, step) == ref[r][:step]
        assert _losses(out, step + 1, steps) == ref[r][step:]


@pytest.mark.slow  # long (15-45 s); the default suite keeps a shorter case of the same kind (suite < 15 min)
def test_sigterm_to_torchrun_agent_mid_training_saves_the_step_reached_and_resume_is_bit_exact(tmp_path):
    grace = 10.0
    root = str(tmp_path / "store")
    cfg = dict(root=root, steps=400, interval=10, step_s=0.05, grace_s=grace)
    job = TorchrunJob(tmp_path / "a", cfg).start()
    job.wait_for(lambda: job.last_step() >= 14, what="step 14")
    reached = job.last_step()
    t_kill = job.sigterm()
    rc = job.wait(grace + 30)
    agent_s = time.time() - t_kill
    got = _check_preempted_run(job, root, t_kill, grace, reached)
    assert rc == 1 and agent_s < grace  # torchrun itself exits 1 after a signal (its SignalException)
    print(f"\nSIGTERM at step {reached} -> step {got['step']} committed {got['commit_s']:.2f} s after the signal; "
          f"workers exited 143 after {max(got['exits']):.2f} s, torchrun after {agent_s:.2f} s (grace {grace:g} s)")
    _resume_and_compare(tmp_path, cfg, root, got["step"], got["res"], got["step"] + 12, "b")


def test_the_readme_loop_as_written_saves_the_step_and_exits_143_on_sigterm(tmp_path):
    """The README's 5-line loop, unchanged, in a script whose step 3 gets SIGTERM (not a save step):
    step 3 is saved, the process exits 143 without a traceback; the next run resumes at step 4."""
    import re

    text = open(os.path.join(os.path.dirname(HERE), "docs", "howto", "training-loop.md")).read()
    example = re.search(r"^# Training loop.*?```python\n(.*?)```", text, re.S | re.M).group(1)
    script = (
        "import os, signal, torch\n"
        "model = torch.nn.Linear(8, 2)\n"
        "optimizer = torch.optim.AdamW(model.parameters())\n"
        "stop_at = int(os.environ.get('STOP_AT', '0'))\n"
        "def train_step():\n"
        "    model(torch.randn(4, 8)).sum().backward(); optimizer.step(); optimizer.zero_grad()\n"
        "    if step == stop_at: os.kill(os.getpid(), signal.SIGTERM)\n"
        f"root = {str(tmp_path)!r}\n"
        "steps = 7\n" + example + "\nprint('finished at', step)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), STOP_AT="3")
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 143, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "saved step 3 (step-3)" in p.stderr and "finished" not in p.stdout
    assert ckptstore.Store(str(tmp_path)).latest().version == "step-3"
    p = subprocess.run([sys.executable, "-c", script], env=dict(env, STOP_AT="0"), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0 and "finished at 7" in p.stdout, p.stderr[-3000:]
    ev = [e for e in events.read_events(events.default_path(str(tmp_path))) if e["kind"] == "restore"]
    assert ev[-1]["version"] == "step-3"


FORKED_CHILD = """
import multiprocessing as mp, os, signal, sys, time, torch, ckptstore
mgr = ckptstore.CheckpointManager(sys.argv[1], {"x": torch.zeros(3)}, grace_s=2)
p = mp.get_context("fork").Process(target=time.sleep, args=(30,))
p.start()
time.sleep(0.3)
os.kill(p.pid, signal.SIGTERM)
p.join(5)
time.sleep(3)  # past the parent's grace period
print("child", p.exitcode, "parent signalled", mgr._sig is not None or mgr._sig_mono is not None, flush=True)
mgr.close()
"""


def test_a_forked_childs_sigterm_ends_the_child_and_not_the_parent(tmp_path):
    """A forked child (a data loader worker) gets the default SIGTERM back, and its signal never
    reaches the parent's watchdog through the shared wakeup fd."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
    p = subprocess.run([sys.executable, "-c", FORKED_CHILD, str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0 and "child -15 parent signalled False" in p.stdout, (p.returncode, p.stdout, p.stderr[-2000:])


@pytest.mark.slow
def test_process_executor_preempted_by_a_signal_to_one_rank(tmp_path):
    """PROCESS executor, in-process ranks: only rank 1 gets SIGTERM; both ranks learn it at the same
    save() call, save that step and raise Preempted; the resumed job continues bit for bit."""
    root = str(tmp_path)
    outs = run_ranks(preempt_ranks.rank_train, 2, root,
                     {"steps": 40, "kill_at": {"1": 7}, "interval": 3, "grace_s": 20, "executor": "process"}, timeout=180)
    pre = [o["preempted"] for o in outs]
    assert pre[0]["step"] == pre[1]["step"] == 8 and all(p["saved"] for p in pre), pre  # learnt at the next call
    assert ckptstore.Store(root).latest().version == "step-8"
    outs2 = run_ranks(preempt_ranks.rank_train, 2, root, {"steps": 12, "interval": 3, "executor": "process"}, timeout=180)
    ref = preempt_ranks.reference(2, 12)
    for r, o in enumerate(outs2):
        assert o["start"] == 9 and o.get("finished")
        assert _losses(outs[r], 1, 8) == ref[r][:8] and _losses(o, 9, 12) == ref[r][8:]


def test_a_rank_stuck_past_the_grace_period_does_not_hang_the_others(tmp_path):
    """Rank 0 gets SIGTERM; rank 1 is stuck in its step (a hung data loader) for longer than the grace
    period, so rank 0 waits in the loop's own all-reduce: its watchdog ends it (exit 143) before the
    grace period is over; nothing half-saved becomes visible."""
    root = str(tmp_path)
    grace = 4.0
    job = Ranks(preempt_ranks.rank_train, 2, root,
                {"steps": 40, "kill_at": {"0": 7}, "sleep_at": {"1": [8, 2 * grace]}, "interval": 3, "grace_s": grace})
    t0 = time.time()
    codes = job.wait(120)
    assert codes[0] == 143, codes
    ev = _preempt_events(root)
    assert len(ev) == 1 and ev[0]["outcome"] == "grace period over" and not ev[0]["saved"], ev
    # the watchdog's line is its last act: rank 0 ended within the grace period of its signal
    sig_t = [e for e in events.read_events(events.default_path(root)) if e["kind"] == "progress" and e.get("step") == 7][0]["t"]
    assert ev[0]["t"] - sig_t < grace, (ev[0]["t"] - sig_t, time.time() - t0)
    assert [v.version for v in ckptstore.Store(root).versions()] == ["step-3", "step-6"]


@pytest.mark.slow
def test_process_executor_under_torchrun_sigterm_mid_save_with_s3(tmp_path, s3_url):
    """PROCESS executor, a remote tier: SIGTERM while a save is in flight. The checkpoint subprocess
    is out of the worker's process group (torchrun signals the group), so the save in flight
    finishes; then the step reached is saved and committed remotely within the grace period."""
    grace = 20.0
    root = str(tmp_path / "store")
    cfg = dict(root=root, steps=400, interval=5, step_s=0.02, grace_s=grace, executor="process", remote=s3_url,
               big=4 << 20)
    job = TorchrunJob(tmp_path / "a", cfg).start()
    # right after a save was handed over (a progress line that names a save): it is in flight
    log = events.default_path(root)
    job.wait_for(lambda: os.path.exists(log) and any(e["kind"] == "progress" and e.get("save") and e["step"] >= 10
                                                     for e in events.read_events(log)), what="a save of step >= 10")
    reached = job.last_step()
    t_kill = job.sigterm()
    assert job.wait(grace + 30) == 1
    got = _check_preempted_run(job, root, t_kill, grace, reached)
    assert got["event"]["in_flight"] is True and got["event"]["durability"] == "remote", got["event"]
    st = ckptstore.Store(root, remote=s3_url)
    assert "remote" in st.get(got["res"][0]["preempted"]["version"]).tiers
    print(f"\nPROCESS + S3, SIGTERM mid-save at step {reached}: step {got['step']} committed remotely "
          f"{got['commit_s']:.2f} s after the signal; workers exited after {max(got['exits']):.2f} s")
    _resume_and_compare(tmp_path, cfg, root, got["step"], got["res"], got["step"] + 6, "b")


@pytest.mark.slow
def test_a_rank_that_ignores_sigterm_under_torchrun_does_not_hang_the_other(tmp_path):
    grace = 6.0
    root = str(tmp_path / "store")
    # rank 1 ignores SIGTERM and is stuck in step 15 for 3 grace periods; rank 0 waits for it in the
    # loop's all-reduce, where its Python signal handler cannot run: its watchdog ends it
    cfg = dict(root=root, steps=400, interval=10, step_s=0.05, grace_s=grace, ignore_signal_rank=1,
               sleep_at={"1": [15, 3 * grace]})
    job = TorchrunJob(tmp_path / "a", cfg).start()
    job.wait_for(lambda: any(w.startswith("sleeping") for _t, w in job.marks(1)), what="rank 1 stuck")
    t_kill = job.sigterm()
    job.wait(90)
    r0 = job.rc(0)
    assert r0["rc"] == 143 and r0["t"] - t_kill < grace, r0
    ev = _preempt_events(root)
    assert ev and ev[-1]["outcome"] == "grace period over" and not ev[-1]["saved"], ev
    assert ckptstore.Store(root).latest().step == 10  # nothing half-saved is visible
    print(f"\nrank 1 ignores SIGTERM: rank 0 exited 143 {r0['t'] - t_kill:.2f} s after it (grace {grace:g} s)")


@pytest.mark.slow
def test_two_crashes_under_torchrun_count_as_two_restarts(tmp_path):
    """torchrun --max-restarts=2, rank 1 SIGKILLed in the first two attempts: ``ckptstore goodput``
    on the run's event log counts both restarts and the work each lost."""
    root = str(tmp_path / "store")
    cfg = dict(root=root, steps=40, interval=5, step_s=0.02, crash_at={"0": 13, "1": 27}, save_on_signal=None)
    job = TorchrunJob(tmp_path / "a", cfg, max_restarts=2).start()
    assert job.wait(300) == 0, job.output()
    p = subprocess.run([sys.executable, "-m", "ckptstore.cli", "goodput", root, "--json"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["attempts"] == 3 and rep["restarts"] == 2 and rep["failures"] == 2, rep
    assert [w["kept_to_step"] for w in rep["lost_work"]] == [10, 25] and [w["lost_steps"] for w in rep["lost_work"]] == [3, 2]
    assert rep["steps"] == 40 and rep["lost_s"] > 0 and rep["restart_s"] > 0


def test_one_sigterm_makes_every_manager_of_the_process_save_the_same_step(tmp_path):
    """The README's two managers (model: ``step-`` every 5 steps; data loader: ``prefix="loader-"``
    every step) in each rank of a 2-rank job; SIGTERM at step 7 on rank 0. Every manager of every rank
    saves one and the same step (``step-S`` and ``loader-S``), the last one called raises
    ``Preempted``, and the next run resumes the model and the data loader at the same step."""
    root = str(tmp_path / "root")
    fast = dict(start_method="forkserver", preload=["preempt_ranks"])
    first = run_ranks(preempt_ranks.two_managers, 2, root, {"steps": 20, "kill_at": 7}, timeout=240, **fast)
    steps = {r["preempted"]["step"] for r in first if r["preempted"]}
    assert len(steps) == 1 and all(r["preempted"] and r["preempted"]["saved"] for r in first), first
    (s,) = steps
    assert s >= 7
    assert all(r["saved_by"] == [("model", s)] for r in first), first  # the model saved it, then returned
    names = {r.version for r in ckptstore.Store(root).versions()}
    assert f"step-{s}" in names and f"loader-{s}" in names, sorted(names)
    again = run_ranks(preempt_ranks.two_managers, 2, root, {"steps": s + 2, "save_on_signal": None}, timeout=240, **fast)
    for r in again:
        assert r["model_start"] == r["loader_start"] == s + 1, r
        assert r["pos_start"] == s  # the data loader's position of the step the model resumes after
