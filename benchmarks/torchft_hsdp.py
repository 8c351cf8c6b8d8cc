"""The HSDP must-show run of ckptstore under torchft (docs/DEMO.md, "torchft: replica groups of
many ranks"): a real torchft lighthouse, 3 replica groups × 2 ranks (FSDP2 inside each group, gloo,
CPU), the job of ``tests/torchft_groups.py``.

1. reference: the job uninterrupted (STEPS steps, a main version every INTERVAL);
2. heal: rank 1 of group 1 killed mid-step, rank 0 of group 0 (the writer) killed inside its main
   save right before the commit point; each group's other rank is ended and the group relaunched: it
   joins the live job and torchft heals it. Reported: who committed which due step, that the killed
   save never committed, each rank's batches (repeats, never a skip);
3. cold: every rank of every group killed mid-step, the whole job restarted from ckptstore: every
   per-step loss of every rank compared with the reference (the math is the same: FSDP2's
   reductions over the same 2 ranks, torchft's average over the same 3 groups), batches exact;
4. reshard: the store of (3) restarted as 2 groups × 3 ranks: what each rank's loader continues from.

    python benchmarks/torchft_hsdp.py [--steps 30] [--interval 5] [--out DIR]

Prints one JSON summary (also ``OUT/summary.json``); exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import torchft_groups as tg  # noqa: E402


def _run(tmp: Path, root: Path, name: str, restart_killed: bool = False, **cfg) -> tuple[tg.Job, float, dict]:
    job = tg.Job(tmp, root, name=name, **cfg)
    job.start_lighthouse()
    try:
        t0 = time.monotonic()
        job.start()
        codes = job.wait(900, restart_killed=restart_killed)
        return job, time.monotonic() - t0, codes
    finally:
        job.close()


def _timeline(job: tg.Job, g: int, r: int) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for rec in job.lines(g, r):
        if rec.get("committed"):
            out[rec["step"]] = rec
    return out


def _batches_ok(job: tg.Job, g: int, r: int, ranks: int) -> tuple[bool, int]:
    """Every launch's batches are a run of the rank's shard that starts at or before where the last
    one ended (repeats allowed, no skip); returns (ok, batches repeated)."""
    shard = tg.shard_order(g, r, ranks)
    launches = sorted({x["launch"] for x in job.lines(g, r) if "launch" in x})
    end, repeated = 0, 0
    for n in launches:
        got = [x["ids"] for x in job.lines(g, r) if x.get("counted") and x["launch"] == n]
        if not got:
            continue
        b = shard.index(got[0])
        if got != shard[b:b + len(got)] or b > end:
            return False, repeated
        repeated += end - b
        end = b + len(got)
    return True, repeated


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--interval", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tmp = Path(a.out or tempfile.mkdtemp(prefix="torchft-hsdp-"))
    tmp.mkdir(parents=True, exist_ok=True)
    base = dict(steps=a.steps, interval=a.interval, num_groups=3, ranks=2, fsdp=True)
    summary: dict = {"shape": "3 groups x 2 ranks (FSDP2), gloo, CPU", "steps": a.steps, "interval": a.interval}
    fails: list[str] = []

    ref, ref_s, codes = _run(tmp, tmp / "ref-root", "reference", **base)
    summary["reference"] = {"seconds": round(ref_s, 1), "exit": codes}

    kill_mid = min(4, a.steps - 1)
    kill_save = a.interval * 2
    heal, heal_s, codes = _run(tmp, tmp / "heal-root", "heal", restart_killed=True, pace_s=2.0,
                               kill={"1": [[kill_mid, "mid-step", "0", 1]], "0": [[kill_save, "mid-save", "0", 0]]},
                               **base)
    from ckptstore import Store
    from ckptstore.manifest import catalogue
    from ckptstore.tiers.local import LocalTier

    recs = {v.version: v for v in Store(tmp / "heal-root").versions()}
    writers = {s: catalogue.read_manifest(LocalTier(str(tmp / "heal-root")), f"step-{s}").manifest.user["torchft"]["group"]
               for s in range(a.interval, a.steps + 1, a.interval) if f"step-{s}" in recs}
    reps = {}
    for g in range(3):
        for r in range(2):
            ok, n = _batches_ok(heal, g, r, 2)
            reps[f"g{g}r{r}"] = n
            if not ok:
                fails.append(f"heal: group {g} rank {r} skipped batches")
    if kill_save in writers:
        fails.append(f"heal: step-{kill_save} committed by a group killed before its commit point")
    summary["heal"] = {"seconds": round(heal_s, 1), "exit": codes, "launches": heal.launches,
                       "kills": [f"group 1 rank 1 mid-step at {kill_mid}", f"group 0 rank 0 mid-save of step-{kill_save}"],
                       "main_versions_by_group": writers, "world_sizes": sorted({recs[f'step-{s}'].world_size for s in writers}),
                       "batches_repeated": reps}

    kill_all = a.steps * 2 // 3 + 1
    cold_root = tmp / "cold-root"
    cold = tg.Job(tmp, cold_root, name="cold", kill={str(g): [kill_all, "mid-step"] for g in range(3)}, **base)
    cold.start_lighthouse()
    try:
        t0 = time.monotonic()
        cold.start()
        c0 = cold.wait(600)
        cold.start()
        c1 = cold.wait(600)
        cold_s = time.monotonic() - t0
    finally:
        cold.close()
    equal, compared = True, 0
    for g in range(3):
        for r in range(2):
            want = {s: (x["loss"], x["ids"]) for s, x in _timeline(ref, g, r).items()}
            got = {s: (x["loss"], x["ids"]) for s, x in _timeline(cold, g, r).items()}
            compared += len(got)
            if got != want:
                equal = False
                fails.append(f"cold: group {g} rank {r} differs from the reference at steps "
                             f"{sorted(s for s in set(got) | set(want) if got.get(s) != want.get(s))[:5]}")
            ok, _ = _batches_ok(cold, g, r, 2)
            if not ok:
                fails.append(f"cold: group {g} rank {r} skipped batches")
    res = [x["resume"] for x in cold.lines(0) if "resume" in x][-1]
    summary["cold"] = {"seconds": round(cold_s, 1), "exit": [c0, c1], "killed_at": kill_all, "restored": res["version"],
                       "resume_s": round(res["seconds"], 2), "per_step_losses_equal_reference": equal,
                       "steps_compared": compared}

    two, two_s, codes = _run(tmp, cold_root, "reshard", steps=a.steps + a.interval, interval=a.interval, num_groups=2,
                             ranks=3, fsdp=True)
    per_rank = {}
    for g in range(2):
        for r in range(3):
            rep = [x["resume"] for x in two.lines(g, r) if "resume" in x][0]
            per_rank[f"g{g}r{r}"] = {k: rep["loader"][k] for k in ("how", "source", "source_rank", "batches")}
            orphaned = rep["orphaned"]
    summary["reshard"] = {"seconds": round(two_s, 1), "exit": codes, "restored": rep["version"], "loader": per_rank,
                          "orphaned": orphaned}
    summary["failures"] = fails
    text = json.dumps(summary, indent=1)
    (tmp / "summary.json").write_text(text)
    print(text)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
