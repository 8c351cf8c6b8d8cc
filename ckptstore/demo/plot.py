"""The demo's figure: both loss curves, and the crashed job's timeline."""

from __future__ import annotations

import os

from .events import History
from .goodput import Goodput
from .supervisor import Job


#: the timeline's span kinds and their colours (see :mod:`.goodput` for what each counts)
COLORS = {"useful": "tab:green", "blocked": "tab:orange", "lost": "tab:red", "recovery": "0.55", "startup": "0.8"}


def plot(path: str, ref: History, run: History, ref_job: Job, run_job: Job, gp: Goodput, ref_gp: Goodput,
         committed: list[tuple[str, int | None, float | None]], title: str) -> str:
    """Write the figure to ``path`` (PNG) and return ``path``: above, both runs' mean loss per step
    with the committed checkpoints, the crash and the resume; below, each run's timeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, tl) = plt.subplots(2, 1, figsize=(12, 8.5), gridspec_kw={"height_ratios": [3, 2]})
    fig.suptitle(title, fontsize=11)
    _plot_losses(ax, ref, run, committed)
    _plot_timelines(tl, ref, run, ref_job, run_job, gp, ref_gp)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_losses(ax, ref: History, run: History, committed: list[tuple[str, int | None, float | None]]) -> None:
    """Both loss curves, the steps lost in the crash, the committed checkpoints, the crash and the resume."""
    rs = sorted(ref.effective)
    ax.plot(rs, [ref.mean_loss(s) for s in rs], color="black", lw=2.2, label="reference (no crash)")
    cs = sorted(run.effective)
    ax.plot(cs, [run.mean_loss(s) for s in cs], color="tab:blue", lw=1.0, ls="--", marker=".", ms=3,
            label="crashed + resumed run")
    lost = run.discarded()
    if lost:
        ax.plot([e["step"] for e in lost], [e["mean"] for e in lost], "x", color="tab:red", ms=5,
                label=f"steps lost in the crash ({len(lost)}, redone)")
    for i, (v, step, _) in enumerate(committed):
        if step is not None:
            ax.axvline(step, color="tab:green", alpha=0.25, lw=1, label="committed checkpoint" if i == 0 else None)
    if run.crash:
        ax.axvline(run.crash["step"], color="tab:red", lw=2, label=f"SIGKILL at step {run.crash['step']}")
    for a, res in sorted(run.resumed.items()):
        ax.axvline(res["step"], color="tab:green", lw=2, ls=":",
                   label=f"resumed from {res['version']} on {res.get('world_size', '?')} rank(s)")
    ax.set_xlabel("step")
    ax.set_ylabel("mean train loss (nats/byte)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")


def _spans(job: Job, h: History) -> dict[str, list[tuple[float, float]]]:
    """Rank 0's time of ``job`` as ``(start, width)`` spans per kind of :data:`COLORS`, seconds since launch."""
    t0 = job.t0
    out = {k: [] for k in COLORS}
    first0 = h.first_step_event(0)
    if first0:
        out["startup"].append((0, first0["t0"] - t0))
    for (a, r, s), e in h.steps.items():
        if r == 0:
            k = "useful" if h.effective.get(s) == a else "lost"
            out[k].append((e["t0"] - t0, e["t1"] - e["t0"]))
    for e in h.of_kind("save"):
        k = "blocked" if h.effective.get(e["step"]) == e["attempt"] else "lost"
        out[k].append((e["wait0"] - t0, max(e["t1"] - e["wait0"], 0.05)))
    for a in h.attempts:
        first = h.first_step_event(a)
        if a and first and h.crash and h.crash["attempt"] == a - 1:
            out["recovery"].append((h.crash["t"] - t0, first["t0"] - h.crash["t"]))
    return out


def _plot_timelines(tl, ref: History, run: History, ref_job: Job, run_job: Job, gp: Goodput, ref_gp: Goodput) -> None:
    """One bar per run (spans, saves returned, commits), the crash and the resume marked."""
    from matplotlib.patches import Patch

    rows = [("reference", ref_job, ref, 1.0), ("crash run", run_job, run, 0.0)]
    for name, job, h, y in rows:
        for k, sp in _spans(job, h).items():
            if sp:
                tl.broken_barh(sp, (y + 0.1, 0.6), facecolors=COLORS[k], edgecolor="none")
        for e in h.of_kind("save_done"):
            if e["ok"]:
                tl.plot([e["t"] - job.t0], [y + 0.8], marker="v", color="tab:green", ms=6)
        for e in h.of_kind("save"):
            tl.plot([e["t1"] - job.t0], [y + 0.8], marker="|", color="tab:orange", ms=8)
    if run.crash:
        tc = run.crash["t"] - run_job.t0
        tl.plot([tc, tc], [0.0, 0.95], color="tab:red", lw=1.5)
        tl.annotate(f"SIGKILL rank {run.crash['rank']} (step {run.crash['step']}, save in flight)", (tc, 0.95),
                    xytext=(-3, 0), textcoords="offset points", fontsize=8, color="tab:red", va="center", ha="right")
    for a, res in sorted(run.resumed.items()):
        first = run.first_step_event(a)
        if first:
            tr = first["t0"] - run_job.t0
            tl.plot([tr, tr], [0.0, 0.95], color="tab:green", lw=1.5, ls=":")
            tl.annotate(f"resumed from {res['version']}", (tr, 0.95), xytext=(3, 0), textcoords="offset points",
                        fontsize=8, color="tab:green", va="center")
    tl.set_yticks([0.4, 1.4])
    tl.set_yticklabels([f"crash run\ngoodput {gp.goodput:.0%}", f"reference\ngoodput {ref_gp.goodput:.0%}"])
    tl.set_xlabel("wall time since launch (s)   (rank 0; ▼ checkpoint committed, | mgr.save returned)")
    tl.set_ylim(-0.1, 2.1)
    tl.grid(axis="x", alpha=0.3)
    tl.legend(
        handles=[Patch(color=c, label=k) for k, c in COLORS.items()], fontsize=8, loc="upper right", ncol=5,
        bbox_to_anchor=(1.0, 1.18),
    )
