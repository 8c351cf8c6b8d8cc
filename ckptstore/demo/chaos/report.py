"""The chaos run's figures: goodput in ckptstore's and in Google's buckets, each fault's story, the
comparison with the reference, the peer; the printed tables and the summary JSON.

Goodput is computed two ways for a ckptstore job and compared: ``ckptstore goodput`` on the job's
event log (the product's accounting, :mod:`ckptstore.goodput`), and :func:`step_goodput` from the
workers' own step events (the same definitions, independent time points). The peer, which has no
ckptstore event log, is measured with :func:`step_goodput` only; the reference with both.

Google's buckets (ml-goodput-measurement, README "Badput Breakdown Details";
:func:`ckptstore.goodput.google_buckets` says how ckptstore's rows map onto them): productive time;
``UNPRODUCTIVE_CHECKPOINT_SAVE_TIME`` (the loop blocked in a save); ``UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME``;
``WASTED_PROGRESS_FROM_DISRUPTION`` (training lost after a restart); ``INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION``
(from the disruption until the workload runs again); ``OTHER`` (start-up, training preparation, shutdown).
"""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ... import events as ck_events
from ...goodput import GOOGLE_BUCKETS, account, google_buckets
from .schedule import KINDS, Fault
from .timeline import Timeline, fault_story

#: the goodput the chaos run must reach, as a share of the reference's
GOODPUT_RATIO = 0.8
#: ckptstore goodput and the step-event accounting of one run agree within this (goodput points)
AGREE_POINTS = 0.02


class Follower:
    """Prints what matters as it happens (the supervisor calls it with every new worker event)."""

    def __init__(self, console: Console, label: str) -> None:
        self.console, self.label = console, label
        self.t0: float | None = None

    def __call__(self, e: dict[str, Any]) -> None:
        k, r = e["kind"], e.get("rank")
        if self.t0 is None:
            self.t0 = e["T"]
        msg = None
        if k == "step" and r == 0 and e["step"] % 50 == 0:
            msg = f"[dim]step {e['step']:>5}  loss {e['mean']:.4f}[/dim]" if e.get("mean") == e.get("mean") else None
        elif k == "resumed" and r == 0:
            sk = e.get("skipped") or []
            fb = (e.get("reads") or {}).get("fallback_reads")
            msg = (f"[green]resumed from {e['version']} (step {e['step']}) in {e['t1'] - e['t0']:.1f} s[/green]"
                   + (f"; passed over {', '.join(s['version'] + ' (' + s['kind'] + ')' for s in sk)}" if sk else "")
                   + (f"; {fb} fallback read(s)" if fb else ""))
        elif k == "rollback" and r == 0:
            msg = f"[green]mgr.rollback() to {e['version']} (step {e['step']})[/green]"
        elif k == "nonfinite" and r == 0:
            msg = f"[yellow]non-finite loss at step {e['step']} (batch {e['b']}): skip it, roll back[/yellow]"
        elif k == "fatal":
            msg = f"[red]rank {r} ended: {escape(str(e.get('error', ''))[:160])}[/red]"
        elif k == "preempted" and r == 0:
            msg = f"[yellow]preempted: step {e.get('step')} saved={e.get('saved')} in {e.get('seconds') or 0:.1f} s[/yellow]"
        elif k == "save_error" and r == 0:
            msg = f"[yellow]a save failed, training goes on: {escape(str(e.get('error', ''))[:140])}[/yellow]"
        elif k == "stop" and r == 0:
            msg = f"stopped at step {e['step']}"
        if msg:
            self.console.print(f"  [dim]{self.label}[/dim] {msg}", highlight=False)


def schedule_table(faults: list[Fault]) -> Table:
    t = Table(title="fault schedule (seeded; the peer gets the same)", title_justify="left")
    for c in ("#", "at", "kind", "node", "rank", "what"):
        t.add_column(c)
    for f in faults:
        t.add_row(str(f.index + 1), f"{f.at_s:6.0f} s", f.kind, str(f.node), str(f.rank), KINDS[f.kind].what)
    return t


# -- goodput from the step events ----------------------------------------------------------------------
def step_goodput(tl: Timeline, t0: float, t1: float) -> dict[str, float]:
    """Google's buckets from the workers' events (seconds). Each step's *iteration* runs from its start to
    the next step's start in the same segment (its last: to its save call's return, else its end), as
    ``ckptstore goodput`` counts from one ``save()`` call to the next. Kept iterations less their save call
    are ``productive``, the save calls ``checkpoint_save``; iterations (and save calls) thrown away are
    ``wasted_progress``; restores and rollbacks ``checkpoint_restore``; from a worker generation's last
    sign of life to the next generation's first process start ``infrastructure_recovery``; the rest
    (start-up, the stop) ``other``."""
    kept = tl.kept()
    keys = {(s.key, st) for st, (s, _e) in kept.items()}
    productive = save = wasted = restore = 0.0
    for s in tl.segments:
        order = sorted(s.steps)
        for i, st in enumerate(order):
            e = s.steps[st]
            sv = s.saves.get(st)
            blocked = (sv["t1"] - sv["t0"]) if sv else 0.0
            if i + 1 < len(order):
                end = s.steps[order[i + 1]]["t0"]
            else:
                end = sv["t1"] if sv else e["t1"]
            it = max(0.0, end - e["t0"])
            if (s.key, st) in keys:
                productive += max(0.0, it - blocked)
                save += blocked
            else:
                wasted += it
        if s.restore_t0 is not None and s.restore_t1 is not None:
            restore += max(0.0, s.restore_t1 - s.restore_t0)
    # generations: pid -> gen from any event carrying both; a generation starts at its first process start
    gen_of = {}
    for e in tl.events:
        if e.get("gen") is not None and e.get("pid") is not None:
            gen_of.setdefault(e["pid"], e["gen"])
    gens: dict[int, dict[str, float]] = {}
    for e in tl.events:
        g = e.get("gen", gen_of.get(e.get("pid")))
        if g is None:
            continue
        x = gens.setdefault(g, {"start": e["T"], "last": e["T"]})
        x["start"] = min(x["start"], e["T"])
        x["last"] = max(x["last"], e["T"])
    infra = 0.0
    order = sorted(gens.values(), key=lambda x: x["start"])
    for a, b in zip(order, order[1:]):
        infra += max(0.0, b["start"] - a["last"])
    wall = t1 - t0
    other = wall - productive - save - restore - wasted - infra
    return {"wall": wall, "productive": productive, "checkpoint_save": save, "checkpoint_restore": restore,
            "wasted_progress": wasted, "infrastructure_recovery": infra, "other": other,
            "goodput": productive / wall if wall > 0 else 0.0, "steps": len(kept)}


def ck_report(run_dir: str):
    path = os.path.join(run_dir, ck_events.LOG_NAME)
    with open(path, "rb") as f:
        evs, bad = ck_events.parse(f)
    return account(evs, mtbf_s=None, skipped_lines=bad)


# -- the comparison with the reference -----------------------------------------------------------------
def compare(run: Timeline, ref: Timeline, world: int) -> dict[str, Any]:
    """Every kept step of ``run`` against the reference's: per rank the loss and the all-reduced loss (as
    ``float.hex``), the sample ids and the weights' digest after the step; then the final weights and
    optimizer state (``done`` digests) when both ran to the same final step."""
    kept, rk = run.kept(), ref.kept()
    a, b = run.rank_steps(), ref.rank_steps()
    bad: list[dict] = []
    n = 0
    for st in sorted(kept):
        if st not in rk:
            continue
        (s, _e), (rs, _re) = kept[st], rk[st]
        n += 1
        for r in range(world):
            x, y = a.get((s.gen, s.seg, r, st)), b.get((rs.gen, rs.seg, r, st))
            if x is None or y is None:
                bad.append({"step": st, "rank": r, "what": "missing event"})
                continue
            diff = [k for k in ("loss", "gloss", "ids", "wd") if x.get(k) != y.get(k)]
            if diff:
                bad.append({"step": st, "rank": r, "what": ", ".join(diff)})
    d1, d2 = run.done(), ref.done()
    same_end = run.final_step() == ref.final_step() and bool(d1) and bool(d2)
    final_w = same_end and all(d1.get(r, {}).get("wd") == d2.get(r, {}).get("wd") for r in range(world))
    final_o = same_end and all(d1.get(r, {}).get("od") == d2.get(r, {}).get("od") for r in range(world))
    return {"equal": not bad and n == len(kept) and (final_w and final_o if same_end else True),
            "steps_compared": n, "steps_kept": len(kept), "ranks": world, "mismatches": len(bad),
            "first_mismatch": bad[0] if bad else None, "final_step": run.final_step(),
            "final_weights_equal": final_w if same_end else None, "final_optimizer_equal": final_o if same_end else None}


# -- the whole analysis --------------------------------------------------------------------------------
def _stories(tl: Timeline, res) -> list[dict[str, Any]]:
    recs = sorted(res.faults, key=lambda r: r["index"])
    inj = [res.t0 + r["injected_s"] for r in recs if r.get("injected_s") is not None]
    out = []
    for r in recs:
        ti = res.t0 + r["injected_s"] if r.get("injected_s") is not None else None
        nxt = min((x for x in inj if ti is not None and x > ti), default=None)
        out.append(fault_story(tl, r, res.t0, KINDS[r["kind"]], nxt))
    return out


def analyse(run) -> dict[str, Any]:
    cfg, world = run.cfg, run.cfg.world_size
    jobs = run.jobs
    tl = {k: Timeline.of(run.configs[k]["run_dir"], jobs[k].off) for k in jobs}
    out: dict[str, Any] = {}
    ch, ref = tl["chaos"], tl["reference"]
    gp = {k: step_goodput(tl[k], jobs[k].t0, jobs[k].t1) for k in jobs}
    rep = {k: ck_report(run.configs[k]["run_dir"]) for k in ("chaos", "reference")}
    ours = {k: google_buckets(rep[k]) for k in rep}
    faults = _stories(ch, jobs["chaos"])
    exact = compare(ch, ref, world)
    checks: list[dict[str, Any]] = []

    def check(name, ok, detail):
        checks.append({"name": name, "ok": bool(ok), "detail": detail})

    manual = jobs["chaos"].manual_steps
    # the headline figures come from the workers' step events, timed on the host's boot clock: a clock-jump
    # fault moves the wall-clock times of ckptstore's event log (its lines carry the writer's wall clock),
    # which then stops agreeing (checked below only when no clock jumped)
    goodput, ref_goodput = gp["chaos"]["goodput"], gp["reference"]["goodput"]
    jumped = any(f["kind"] == "clock-jump" and f["at_s"] is not None for f in faults)
    injected = [f for f in faults if f["at_s"] is not None]
    check("every scheduled fault was injected", len(injected) == len(faults),
          f"{len(injected)} of {len(faults)} ({len({f['kind'] for f in injected})} kinds)")
    check("no manual step: the job never needed a person (manual_steps 0)", not manual,
          "; ".join(m["reason"] for m in manual) or "0")
    check("the job recovered from every fault", all(f["recovered_s"] is not None for f in injected),
          ", ".join(f"#{f['index'] + 1} {f['kind']}" for f in injected if f["recovered_s"] is None) or "all")
    check(f"goodput ≥ {GOODPUT_RATIO:.0%} of the reference's", goodput >= GOODPUT_RATIO * ref_goodput,
          f"{goodput:.1%} vs {ref_goodput:.1%} (ratio {goodput / ref_goodput if ref_goodput else 0:.2f})")
    check("bit-exact: every kept step (losses, sample ids, weights) and the final weights and optimizer equal the "
          "reference", exact["equal"], f"{exact['steps_compared']} steps x {world} ranks"
          + (f"; first mismatch {exact['first_mismatch']}" if exact["first_mismatch"] else "")
          + ("" if exact["final_weights_equal"] is None else
             f"; final weights {'equal' if exact['final_weights_equal'] else 'DIFFER'}, optimizer "
             f"{'equal' if exact['final_optimizer_equal'] else 'DIFFER'}"))
    for k in ("chaos", "reference"):
        off = abs(rep[k].goodput - gp[k]["goodput"])
        if k == "chaos" and jumped:
            out["event_log_goodput_note"] = (
                f"ckptstore goodput on the chaos run's event log: {rep[k].goodput:.1%} (step events: "
                f"{gp[k]['goodput']:.1%}); a clock-jump fault ran, and the event log's times are the writers' "
                "wall clocks, 2 h ahead on that node for a while: not comparable")
            continue
        check(f"ckptstore goodput on the {k} run's event log agrees with its step events", off <= AGREE_POINTS,
              f"{rep[k].goodput:.1%} vs {gp[k]['goodput']:.1%}")
    check("the job stopped cleanly when its time was up", jobs["chaos"].stopped_clean, "stop file → save → exit 0")
    peer = None
    if "peer" in jobs:
        pf = _stories(tl["peer"], jobs["peer"])
        pm = jobs["peer"].manual_steps
        pe = compare(tl["peer"], ref, world)
        stop = pm[0] if pm else None
        last_fault = None
        if stop is not None:
            before = [f for f in pf if f["at_s"] is not None and f["at_s"] <= stop["at_s"]]
            last_fault = before[-1] if before else None
        # a run that ended needing a person trained nothing until one came: its goodput is over the whole
        # duration (the time after it stopped is badput), beside the figure while it ran
        full = step_goodput(tl["peer"], jobs["peer"].t0, max(jobs["peer"].t1, jobs["peer"].t0 + (run.opts.duration_s or 0)))
        peer = {"goodput": full["goodput"], "goodput_while_running": gp["peer"]["goodput"],
                "kept_going": not pm and jobs["peer"].stopped_clean,
                "stopped_at": None if stop is None else {
                    "at_s": stop["at_s"], "reason": stop["reason"], "step": stop.get("last_step"),
                    "after_fault": None if last_fault is None else {"index": last_fault["index"], "kind": last_fault["kind"]}},
                "manual_steps": len(pm), "bit_exact": pe, "buckets": gp["peer"], "faults": pf,
                "steps_kept": tl["peer"].final_step()}
    out.update({
        "passed": all(c["ok"] for c in checks),
        "goodput": goodput,
        "reference_goodput": ref_goodput,
        "goodput_ratio": goodput / ref_goodput if ref_goodput else None,
        "faults": faults,
        "manual_steps": len(manual),
        "manual": manual,
        "bit_exact": {**exact, "reference_skips_batches": run.configs["reference"]["skip_batches"],
                      "per_fault": {f["kind"]: {"changes_math": f["changes_math"], "why": f["math"]} for f in faults}},
        "peer": peer,
        "goodput_buckets": {
            "ckptstore": {k: rep[k].to_json() for k in rep},
            "google": {k: ours[k] for k in ours},
            "from_step_events": gp,
        },
        "checks": checks,
        "duration_s": run.opts.duration_s,
        "fault_every_s": run.opts.fault_every_s,
        "seed": cfg.seed,
        "kinds": run.kinds,
        "kinds_not_run": run.skipped_kinds,
        "schedule": [f.to_json() for f in run.faults],
        "load_average": run.load,
        "jobs": {k: {"wall_s": jobs[k].t1 - jobs[k].t0, "launches": jobs[k].launches,
                     "relaunches": jobs[k].relaunches, "stopped_clean": jobs[k].stopped_clean,
                     "run_dir": run.configs[k]["run_dir"]} for k in jobs},
        "config": {k: v for k, v in run.configs["chaos"].items() if k not in ("corpus_dir",)},
        "out": run.out,
    })
    return out


# -- printing ------------------------------------------------------------------------------------------
def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"


def faults_table(faults: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=title, title_justify="left")
    for c in ("#", "kind", "at", "detected", "recovered", "lost steps", "restored", "versions skipped (why)", "math"):
        t.add_column(c)
    for f in faults:
        sk = "; ".join(f"{s['version']}: {s['kind']}" for s in f["versions_skipped"]) or "-"
        t.add_row(str(f["index"] + 1), f["kind"], _s(f["at_s"]), _s(f["detected_s"]), _s(f["recovered_s"]),
                  str(f["lost_steps"]), f["restored"] or "-", sk, "changes" if f["changes_math"] else "same")
    return t


def buckets_table(res: dict[str, Any]) -> Table:
    g = res["goodput_buckets"]
    cols = [("ckptstore run", g["google"]["chaos"]), ("reference", g["google"]["reference"])]
    steps = [("(step events)", g["from_step_events"]["chaos"])]
    if "peer" in g["from_step_events"]:
        steps.append(("stock DCP peer (step events)", g["from_step_events"]["peer"]))
    t = Table(title="goodput in Google's buckets (ml-goodput-measurement BadputType; ckptstore goodput --buckets google)",
              title_justify="left")
    t.add_column("bucket")
    for name, _ in cols + steps:
        t.add_column(name, justify="right")
    for key, label in GOOGLE_BUCKETS:
        row = [label]
        for _n, b in cols + steps:
            x = b.get(key)
            row.append("-" if x is None else f"{x:7.1f} s {x / b['wall']:6.1%}")
        t.add_row(*row)
    t.add_row("wall", *[f"{b['wall']:7.1f} s" for _n, b in cols + steps])
    t.add_row("[bold]goodput[/bold]", *[f"[bold]{b['goodput']:.1%}[/bold]" for _n, b in cols + steps])
    return t


def show(run) -> None:
    res, c = run.result, run.console
    c.rule("what happened")
    c.print(faults_table(res["faults"], "faults of the ckptstore run (seconds after injection)"))
    rep = res["goodput_buckets"]["ckptstore"]["chaos"]
    t = Table(title="goodput (ckptstore goodput on each run's event log)", title_justify="left")
    t.add_column("")
    t.add_column("ckptstore run", justify="right")
    t.add_column("reference", justify="right")
    ref = res["goodput_buckets"]["ckptstore"]["reference"]
    for key, label in (("useful_s", "useful training"), ("blocked_s", "blocked in save"), ("lost_s", "work lost"),
                       ("restart_s", "restart (end of an attempt → training again)"), ("startup_s", "start-up"),
                       ("other_s", "other"), ("wall_s", "wall")):
        t.add_row(label, f"{rep[key]:.1f} s", f"{ref[key]:.1f} s")
    t.add_row("restarts / steps kept", f"{rep['restarts']} / {rep['steps']}", f"{ref['restarts']} / {ref['steps']}")
    t.add_row("[bold]goodput[/bold]", f"[bold]{rep['goodput']:.1%}[/bold]", f"{ref['goodput']:.1%}")
    c.print(t)
    if res.get("event_log_goodput_note"):
        c.print(f"[yellow]{escape(res['event_log_goodput_note'])}[/yellow]", highlight=False)
    c.print(buckets_table(res))
    p = res.get("peer")
    if p:
        c.print(faults_table(p["faults"], "faults of the stock-DCP peer (the same schedule)"))
        where = ("kept going to the end" if p["kept_going"] else
                 f"stopped at {p['stopped_at']['at_s']:.0f} s (step {p['stopped_at']['step']}): {p['stopped_at']['reason']}"
                 + (f", after fault #{p['stopped_at']['after_fault']['index'] + 1} {p['stopped_at']['after_fault']['kind']}"
                    if p["stopped_at"] and p["stopped_at"].get("after_fault") else ""))
        be = p["bit_exact"]
        c.print(f"stock DCP peer: goodput {p['goodput']:.1%} over the run's duration"
                + ("" if p["kept_going"] else f" ({p['goodput_while_running']:.1%} until it stopped)")
                + f"; {where}; {p['steps_kept']} steps kept; "
                f"bit-exact against the reference: {be['equal']} ({be['steps_compared']} steps"
                + (f", first mismatch {be['first_mismatch']}" if be["first_mismatch"] else "") + ")", highlight=False)
    t = Table(show_header=False, box=None)
    for ch in res["checks"]:
        t.add_row("[green]PASS[/green]" if ch["ok"] else "[bold red]FAIL[/bold red]", ch["name"], f"[dim]{ch['detail']}[/dim]")
    c.print(t)
    loads = ", ".join(f"{k} {a:.1f}→{b:.1f}" for k, (a, b) in run.load.items())
    c.print(f"load average (1 min) at the start and end of each job: {loads}", highlight=False)


def conclude(run) -> int:
    res, c = run.result, run.console
    c.rule()
    n = len([f for f in res["faults"] if f["at_s"] is not None])
    kinds = len({f["kind"] for f in res["faults"] if f["at_s"] is not None})
    line = (f"{n} faults of {kinds} kinds in {res['duration_s']:.0f} s; goodput {res['goodput']:.1%} (reference "
            f"{res['reference_goodput']:.1%}); manual steps {res['manual_steps']}; bit-exact {res['bit_exact']['equal']}")
    if res.get("peer"):
        p = res["peer"]
        line += f"; stock DCP {p['goodput']:.1%}, " + ("kept going" if p["kept_going"] else "stopped")
    if res["passed"]:
        c.print(f"[bold green]PASS[/bold green]: {line}", highlight=False)
        return 0
    failed = [ch["name"] for ch in res["checks"] if not ch["ok"]]
    c.print(f"[bold red]FAIL[/bold red]: {'; '.join(failed)} — {line}", highlight=False)
    return 1
