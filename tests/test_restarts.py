"""In-place restarts: ``CheckpointManager``'s own gloo group comes up on every ``torchrun --max-restarts`` attempt.

A real ``torchrun --standalone`` job (2 workers, gloo); on every attempt but the last one rank SIGKILLs
itself after its manager made its group, restored and committed a save; torchrun restarts both workers
in place, on the same agent TCPStore. Before ckptstore/_groups.py the manager's
``dist.new_group(backend="gloo")`` read the dead attempt's gloo addresses from that store in about one
attempt of three ("Gloo connectFullMesh failed ... Connection refused"; docs/TESTING.md, "In-place
restarts"). The user sees: the job finishes, no attempt lost its group, each attempt resumed the
newest committed version, and the catalogue lists every save.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import ckptstore

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "restart_ranks.py"


def _is_our_worker(pid: int, out: Path) -> bool:
    """``pid`` is still a worker of this job (its command line names this job's ``out``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")
    except OSError:
        return False
    return str(WORKER).encode() in cmd and str(out).encode() in cmd


def run_restarts(tmp_path: Path, restarts: int, timeout: float) -> None:
    out, root = tmp_path / "out", tmp_path / "root"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
           f"--max-restarts={restarts}", "--monitor-interval=0.2", str(WORKER), str(out), str(root), str(restarts)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CKPTSTORE_FAULT")}
    env.update({"PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
    log = tmp_path / "torchrun.log"
    with open(log, "wb") as f:
        p = subprocess.Popen(cmd, env=env, cwd=str(REPO), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            code = f"killed after {timeout:.0f} s"
    events = [json.loads(line) for r in (0, 1) if (out / f"rank{r}.jsonl").exists()
              for line in (out / f"rank{r}.jsonl").read_text().splitlines()]
    for e in events:  # torchrun starts each worker in a session of its own: a hung one outlives killpg
        if code != 0 and e["event"] == "start" and _is_our_worker(e["pid"], out):
            os.kill(e["pid"], signal.SIGKILL)
    failed = [e for e in events if e["event"] == "manager" and "error" in e]
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
    assert not failed, f"the manager's group failed on {len(failed)} attempt(s): {failed}\n{tail}"
    assert code == 0, f"torchrun exited with {code}\n{tail}"
    for attempt in range(restarts + 1):
        got = {e["rank"] for e in events if e["attempt"] == attempt and e["event"] == "manager"}
        assert got == {0, 1}, (attempt, got)
        resumed = [e for e in events if e["attempt"] == attempt and e["event"] == "resumed"]
        want = None if attempt == 0 else attempt  # the newest version: the previous attempt's save
        assert [e["step"] for e in resumed] == [want, want], (attempt, resumed)
        if want is not None:
            assert all(e["w"] == [float(want)] * 8 and e["meta"] == {"attempt": attempt - 1} for e in resumed)
    assert {e["rank"] for e in events if e["event"] == "done"} == {0, 1}
    assert [r.step for r in ckptstore.Store(str(root)).versions()] == list(range(1, restarts + 2))


@pytest.mark.slow  # long (15-45 s); the default suite keeps a shorter case of the same kind (suite < 15 min)
def test_manager_group_survives_an_in_place_restart(tmp_path):
    run_restarts(tmp_path, 1, timeout=180)


@pytest.mark.slow
def test_manager_group_survives_three_in_place_restarts(tmp_path):
    run_restarts(tmp_path, 3, timeout=240)


@pytest.mark.slow
def test_manager_group_survives_ten_in_place_restarts(tmp_path):
    run_restarts(tmp_path, 10, timeout=600)


def test_close_destroys_the_manager_group(tmp_path):
    """Managers made and closed one after another leave no group behind (no gloo sockets pile up);
    ``restore()`` after ``close()`` still loads."""
    from ckptstore.testing.dist import run_ranks

    import restart_ranks

    outs = run_ranks(restart_ranks.open_close_managers, 2, str(tmp_path), 12)
    for o in outs:
        assert o["groups"] == 1, o  # only the default group is registered
        assert o["last"] <= o["first"] + 2, o  # 11 more groups of 2 ranks would hold 11+ more sockets
        assert o["restored"] == 1 and o["w"] == [11.0] * 4, o
