"""The seed-rate benchmark of ckptstore under torchft (docs/DEMO.md, "torchft: the seed rate"): the
shape of torchft's headline experiment (replica groups of several ranks, FSDP inside each, a failure
every 15 seconds), scaled to one CPU machine: a real torchft lighthouse, 3 replica groups × 2 ranks
(FSDP2, gloo), the job of ``tests/torchft_groups.py``.

Four runs of the same STEPS steps:

* ``fault-free`` with the durable tier on, and ``fault-free-off`` with it off (the kill switch);
* ``faults``: every FAULT_EVERY seconds (± a quarter) one rank of a random running group is
  SIGKILLed (the harness ends the group's other rank and relaunches the group: torchft heals it);
  one whole-job loss at WHOLE_AT × the fault-free time (every rank SIGKILLed, the job relaunched: a
  cold start from ckptstore); one SIGTERM to a rank near the end (SIGTERM_AT × the fault-free time);
* ``faults-off``: the same schedule with the tier off (torchft alone: after the whole-job loss the job
  starts again from step 0).

The fault-free pair runs ``--fault-free-reps`` times (default 2) in ABBA order (on, off, off, on):
the baseline is the mean of each kind, and the spread between runs of one kind (``tier_step_cost.noise``:
largest over smallest) is the noise the tier's cost is read against.

Reported: goodput = fault-free seconds / run seconds (the same steps), against the fault-free runs and
``faults`` against ``faults-off``; the steps lost at the whole-job loss (the step reached minus the
step restored); the faults injected; the tier's cost in the fault-free runs, on vs off: wall, CPU,
step-time p50 and p99 ratios of the means (``tier_step_cost``), and the tier's share of step time
within each fault-free run (``tier_share_within_run``, :func:`tier_share`: the due steps' excess over
the run's own baseline plus ``step_done()``; the figure a drifting machine does not blur).

The lighthouse runs with ``--heartbeat_timeout_ms 1000 --join_timeout_ms 2000`` (``--heartbeat-timeout-ms``,
``--join-timeout-ms``; torchft's defaults are 5000 and 60000): with a fault every 15 s, every kill
otherwise holds the live groups for the heartbeat timeout, and every relaunch for up to the join
timeout while the relaunched group heartbeats before its first quorum (docs/DEMO.md, "torchft: the
seed rate"). ``slow_steps`` in each run's result lists the steps of rank 0 of each group over 1 s;
``cpu_s`` is the CPU time of every process of the run (the relaunches' start-up included);
``first_done_s`` the time the first group finished (the job's last step committed), and
``goodput_to_last_step`` the goodput ratios up to it.

    python benchmarks/torchft_seed_rate.py [--steps 800] [--fault-every 15] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import torchft_groups as tg  # noqa: E402


def _max_step(job: tg.Job) -> int:
    return max((x["step"] for g in range(3) for x in job.lines(g) if x.get("committed")), default=0)


def _children_cpu() -> float:
    """user+sys seconds of the processes this benchmark started and waited for (the lighthouse and
    every launch of every rank, killed ones included)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(tmp: Path, name: str, *, steps: int, interval: int, enabled: bool, faults: dict | None, seed: int,
        positions_every_s: float | None = None, heartbeat_timeout_ms: int = 3000, join_timeout_ms: int = 20000) -> dict:
    job = tg.Job(tmp, tmp / f"{name}-root", name=name, steps=steps, interval=interval, num_groups=3, ranks=2,
                 positions_every_s=positions_every_s, join_timeout_ms=join_timeout_ms,
                 fsdp=True, enabled=enabled, heartbeat_timeout_ms=heartbeat_timeout_ms,
                 samples=(steps + 10) * tg.BATCH * tg.MAX_GROUPS * 2)  # one epoch covers the run
    job.start_lighthouse()
    rng = random.Random(seed)
    cpu0 = _children_cpu()
    log: list[dict] = []
    born: dict[int, float] = {}
    try:
        t0 = time.monotonic()
        job.start()
        for g in range(3):
            born[g] = t0
        next_fault = t0 + (faults["every"] if faults else float("inf"))
        whole = faults and faults["whole_at"]
        term = faults and faults["sigterm_at"]
        lost = None
        first_done = None
        finished: set[int] = set()
        while job.procs:
            now = time.monotonic()
            for (g, r), p in list(job.procs.items()):
                if job.procs.get((g, r)) is not p:
                    continue
                rc = p.poll()
                if rc is None:
                    continue
                del job.procs[(g, r)]
                if rc == 0:
                    if not finished:  # the first group done: the job's last step is committed
                        first_done = now - t0
                    finished.add(g)
                    continue
                if finished:  # the job reached its last step: a group failing now is not relaunched
                    log.append({"t": round(now - t0, 1), "fault": f"group {g} rank {r} exit {rc} after the end",
                                "step": _max_step(job), "injected": False})
                    job.kill_group(g)
                    continue
                if rc != 0 and faults is None:
                    raise RuntimeError(f"{name}: group {g} rank {r} exited {rc}:\n{job.tails()}")
                if rc != 0:  # killed, or failed after a fault (a torchft timeout): torchrun restarts the group
                    if rc not in (-signal.SIGKILL, -signal.SIGTERM, 143):
                        log.append({"t": round(now - t0, 1), "fault": f"group {g} rank {r} failed (exit {rc})",
                                    "step": _max_step(job), "injected": False})
                    job.kill_group(g)
                    job.launch(g)
                    born[g] = time.monotonic()
            if whole and now - t0 >= whole:
                whole = None
                reached = _max_step(job)
                for p in job.procs.values():
                    p.kill()
                for p in job.procs.values():
                    p.wait()
                job.procs.clear()
                log.append({"t": round(now - t0, 1), "fault": "whole-job SIGKILL", "step": reached})
                time.sleep(2.0)  # the lighthouse's heartbeats of the dead groups go stale: a cold start
                job.start(barrier=False)
                lost = {"reached": reached, "launch": {g: job.launches[g] for g in range(3)}}
                for g in range(3):
                    born[g] = time.monotonic()
                next_fault = time.monotonic() + faults["every"]
                continue
            if term and now - t0 >= term:
                live = [k for k in job.procs if now - born[k[0]] > 5]
                if live:
                    term = None
                    g, r = rng.choice(sorted(live))
                    job.procs[(g, r)].send_signal(signal.SIGTERM)
                    log.append({"t": round(now - t0, 1), "fault": f"SIGTERM group {g} rank {r}", "step": _max_step(job)})
            if now >= next_fault:
                live = sorted({g for (g, _r) in job.procs if now - born[g] > 5})
                if live:
                    g = rng.choice(live)
                    r = rng.randrange(2)
                    if (g, r) in job.procs:
                        job.procs[(g, r)].kill()
                        log.append({"t": round(now - t0, 1), "fault": f"SIGKILL group {g} rank {r}", "step": _max_step(job)})
                next_fault = now + faults["every"] * rng.uniform(0.75, 1.25)
            time.sleep(0.05)
        took = time.monotonic() - t0
    finally:
        job.close()
    out = {"seconds": round(took, 1), "first_done_s": None if first_done is None else round(first_done, 1),
           "cpu_s": round(_children_cpu() - cpu0, 1), "faults": log,
           "injected": sum(1 for e in log if e.get("injected", True)),
           "failed_after_a_fault": sum(1 for e in log if not e.get("injected", True))}
    if lost is not None:
        # the step the relaunched job started from: its cold starts (0 with the tier off or nothing stored)
        # (the relaunch right after the loss: later cold starts are later losses' restores)
        res = [x["resume"] for g in range(3) for x in job.lines(g) if "resume" in x and not x.get("lost_join")
               and int(x["launch"]) == lost["launch"][g]]
        restored = max((r["step"] for r in res if r["kind"] == "cold-start"), default=0)
        out["whole_job_loss"] = {"step_reached": lost["reached"], "step_restored": restored,
                                 "steps_lost": lost["reached"] - restored}
    dts = [x["dt"] for g in range(3) for r in range(2) for x in job.lines(g, r) if "dt" in x and x["step"] > 2]
    # where a faulty run's time goes: steps of rank 0 of each group that took over 1 s (a quorum waiting
    # for the lighthouse to drop a killed group, or for a relaunched group to join), as their durations
    slow = sorted(round(x["dt"], 1) for g in range(3) for x in job.lines(g, 0) if "dt" in x and x["dt"] > 1.0)
    out["slow_steps"] = {"count": len(slow), "seconds": round(sum(slow), 1), "each_s": slow}
    if dts:
        q = statistics.quantiles(dts, n=100)
        out["step_ms"] = {"p50": round(statistics.median(dts) * 1e3, 2), "p99": round(q[98] * 1e3, 2), "n": len(dts)}
    # restores after a live job was lost while a group joined it (docs/torchft.md)
    out["lost_join_restores"] = sum(1 for g in range(3) for x in job.lines(g) if x.get("lost_join"))
    finals = [x for g in range(3) for x in job.lines(g) if x.get("final")]
    if finals:
        out["tier_stats_last"] = finals[-1]["stats"]
    return out


def tier_share(run_dir: Path, interval: int, window: int = 10) -> dict:
    """The tier's share of step time *within* one fault-free run, robust to a machine whose speed
    drifts between runs (on this VM identical runs differ by 5-15 %): the steps of every rank away from
    a due step (``step % interval >= window``) give the baseline (median); the first ``window`` steps
    of each interval pay the due step's saves (the excess of their medians over the baseline, per due
    step); every other step pays ``step_done()`` (``sd`` in the step lines, its median). Share =
    (excess × due steps + step_done median × other steps) / the ranks' mean summed step time. Reads
    about 0 for a run with the tier off (the method's own error)."""
    by: dict[int, list[float]] = {}
    sds: list[float] = []
    total: dict[str, float] = {}
    steps = 0
    for f in sorted(run_dir.glob("g*.jsonl")):
        for line in f.read_text().splitlines():
            x = json.loads(line)
            if "dt" not in x or x["step"] <= 2:
                continue
            k = x["step"] % interval
            by.setdefault(min(k, window), []).append(x["dt"])
            if k >= window:
                sds.append(x["sd"])
            total[f.name] = total.get(f.name, 0.0) + x["dt"]
            steps = max(steps, x["step"])
    if not sds or window not in by:
        return {}
    base = statistics.median(by[window])
    excess = sum(statistics.median(by[k]) - base for k in range(window) if k in by)
    dues = steps // interval
    sd = statistics.median(sds)
    cost = excess * dues + sd * (steps - dues * window)
    return {"share": round(cost / statistics.mean(total.values()), 4), "base_step_ms": round(base * 1e3, 2),
            "excess_per_due_step_ms": round(excess * 1e3, 1), "step_done_median_ms": round(sd * 1e3, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--interval", type=int, default=50)
    ap.add_argument("--fault-every", type=float, default=15.0)
    ap.add_argument("--whole-at", type=float, default=0.6, help="whole-job loss at this fraction of the fault-free time")
    ap.add_argument("--sigterm-at", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=34)
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=1000,
                    help="the lighthouse's --heartbeat_timeout_ms: how long until a killed group counts as gone "
                         "(torchft's default: 5000)")
    ap.add_argument("--join-timeout-ms", type=int, default=2000,
                    help="the lighthouse's --join_timeout_ms: how long the live groups wait for a relaunched group "
                         "that heartbeats but has not asked for a quorum yet (torchft's default: 60000)")
    ap.add_argument("--fault-free-reps", type=int, default=2,
                    help="fault-free pairs (tier on, tier off), run in ABBA order; their means are the baseline and "
                         "their spread the noise")
    ap.add_argument("--out", default=None)
    ap.add_argument("--reuse", action="store_true", help="reuse the runs an earlier invocation left in --out")
    a = ap.parse_args()
    tmp = Path(a.out or tempfile.mkdtemp(prefix="torchft-seed-"))
    tmp.mkdir(parents=True, exist_ok=True)
    res: dict = {"shape": "3 groups x 2 ranks (FSDP2), gloo, CPU", "steps": a.steps, "interval": a.interval,
                 "fault_every_s": a.fault_every,
                 "lighthouse": {"heartbeat_timeout_ms": a.heartbeat_timeout_ms, "join_timeout_ms": a.join_timeout_ms}}
    def once(name: str, **kw) -> dict:
        cached = tmp / f"{name}.json"
        if a.reuse and cached.exists():  # a run of an earlier invocation with the same --out
            return json.loads(cached.read_text())
        got = run(tmp, name, steps=a.steps, interval=a.interval, seed=a.seed,
                  heartbeat_timeout_ms=a.heartbeat_timeout_ms, join_timeout_ms=a.join_timeout_ms, **kw)
        cached.write_text(json.dumps(got))
        return got

    # the fault-free pairs in ABBA order (on, off, off, on, ...): a machine that drifts faster or slower
    # over the runs weighs on both alike, and the spread between runs of one kind is the noise
    ons, offs, names = [], [], []  # names: (tier on, tier off) of each pair
    for i in range(a.fault_free_reps):
        sfx = f"-{i + 1}" if i else ""
        pair = [("fault-free" + sfx, True), ("fault-free-off" + sfx, False)]
        names.append((pair[0][0], pair[1][0]))
        for name, en in (pair if i % 2 == 0 else pair[::-1]):
            (ons if en else offs).append(once(name, enabled=en, faults=None))

    def mean_of(rs: list) -> dict:  # the first run's record, its times the runs' means
        out = dict(rs[0], seconds=round(statistics.mean(r["seconds"] for r in rs), 1))
        if all(r.get("first_done_s") for r in rs):
            out["first_done_s"] = round(statistics.mean(r["first_done_s"] for r in rs), 1)
        return out

    ff, ff_off = mean_of(ons), mean_of(offs)
    sched = {"every": a.fault_every, "whole_at": a.whole_at * ff["seconds"], "sigterm_at": a.sigterm_at * ff["seconds"]}
    on = once("faults", enabled=True, faults=sched)
    off = once("faults-off", enabled=False, faults=sched)
    res.update({"fault_free": ff, "fault_free_off": ff_off, "faults": on, "faults_off": off})
    res["goodput"] = {"faults_vs_fault_free": round(ff["seconds"] / on["seconds"], 3),
                      "faults_off_vs_fault_free": round(ff_off["seconds"] / off["seconds"], 3),
                      "faults_vs_faults_off": round(off["seconds"] / on["seconds"], 3)}
    if all(r.get("first_done_s") for r in (ff, ff_off, on, off)):
        # the same ratios up to the job's last step (the first group to finish): after it, the run
        # only waits for a group relaunched late to start up, find the job done and exit
        res["goodput_to_last_step"] = {
            "faults_vs_fault_free": round(ff["first_done_s"] / on["first_done_s"], 3),
            "faults_off_vs_fault_free": round(ff_off["first_done_s"] / off["first_done_s"], 3),
            "faults_vs_faults_off": round(off["first_done_s"] / on["first_done_s"], 3)}
    res["fault_free_runs"] = {"on": [{k: r.get(k) for k in ("seconds", "cpu_s", "step_ms")} for r in ons],
                              "off": [{k: r.get(k) for k in ("seconds", "cpu_s", "step_ms")} for r in offs]}
    res["tier_share_within_run"] = {"on": [tier_share(tmp / on_name, a.interval) for on_name, _ in names],
                                    "off (the method's error)": [tier_share(tmp / off_name, a.interval)
                                                                 for _, off_name in names]}
    if all("step_ms" in r for r in ons + offs):
        def ratio(f):
            return round(statistics.mean(f(r) for r in ons) / statistics.mean(f(r) for r in offs), 3)

        def spread(rs, f):  # the noise: the largest over the smallest of one kind's runs
            return round(max(f(r) for r in rs) / min(f(r) for r in rs), 3)

        res["tier_step_cost"] = {
            "wall_ratio": ratio(lambda r: r["seconds"]), "cpu_ratio": ratio(lambda r: r["cpu_s"]),
            "p50_ratio": ratio(lambda r: r["step_ms"]["p50"]), "p99_ratio": ratio(lambda r: r["step_ms"]["p99"]),
            "noise": {kind: {"wall": spread(rs, lambda r: r["seconds"]), "p50": spread(rs, lambda r: r["step_ms"]["p50"]),
                             "p99": spread(rs, lambda r: r["step_ms"]["p99"])} for kind, rs in (("on", ons), ("off", offs))}}
    text = json.dumps(res, indent=1)
    (tmp / "summary.json").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
