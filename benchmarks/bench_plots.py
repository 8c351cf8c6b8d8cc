"""PNG plots of a ``benchmarks/run.py`` results dict (matplotlib, Agg backend)."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"ckpt-on": "#1f77b4", "ckpt-off": "#aec7e8", "dcp": "#ff7f0e", "dcp-zstd": "#d62728"}
KINDS = ("ckpt-on", "ckpt-off", "dcp", "dcp-zstd")


def _save(fig, out, name, made):
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    made.append(name)


def throughput(res, out, made):
    sl = res.get("save_load")
    if not sl:
        return
    pk = sl["per_kind"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.2
    for j, k in enumerate(KINDS):
        for i, op in enumerate(("save", "load")):
            vals = pk[k][op + "_gbps_all"]
            m = pk[k][op + "_gbps"]
            x = i + (j - 1.5) * width
            ax.bar(x, m, width, color=COLORS[k], label=pk[k]["label"] if i == 0 else None,
                   yerr=[[m - min(vals)], [max(vals) - m]], capsize=3)
            ax.text(x, m, f"{m:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([0, 1], ["save (dcp.save, fsync'd)", "load (page cache evicted)"])
    ax.set_ylabel("GB/s of logical state (median, min-max)")
    ax.set_title(f"Throughput, {sl['state_bytes'] / 2**20:.0f} MiB bf16 state, {sl['reps']} interleaved reps")
    ax.legend(fontsize=8)
    _save(fig, out, "throughput.png", made)


def rss_async(res, out, made):
    a = res.get("async")
    if not a:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(1, len(a["rss_mib"]) + 1)
    ax1.plot(xs, a["rss_mib"], "o-", ms=3, color=COLORS["ckpt-on"], label="ckptstore StorageWriter (own stager)")
    p = a["peer"]
    if p["rss_mib"]:
        ax1.plot(range(1, len(p["rss_mib"]) + 1), p["rss_mib"], "s-", ms=3, color=COLORS["dcp"], label=p["label"])
    ax1.set_xlabel("consecutive async_save (future waited)")
    ax1.set_ylabel("process RSS after the save, MiB")
    ax1.set_title(f"RSS over saves (peak 2nd half - peak 1st half: {a.get('peak_growth_mib', float('nan')):+.1f} MiB)")
    ax1.legend(fontsize=8)
    ax2.plot(xs, [x * 1000 for x in a["block_s"]], "o-", ms=3, color=COLORS["ckpt-on"], label="blocked in dcp.async_save")
    ax2.plot(xs, [x * 1000 for x in a["prealloc_copy_s"]], "-", color="gray", label="copy_ into preallocated buffers")
    ax2.plot(xs, [x * 1000 for x in a["clone_s"]], "--", color="black", label="{k: v.clone()}")
    if p["block_s"]:
        ax2.plot(range(1, len(p["block_s"]) + 1), [x * 1000 for x in p["block_s"]], "s-", ms=3, color=COLORS["dcp"],
                 label="DCP FileSystemWriter async_save")
    ax2.set_xlabel("consecutive async_save")
    ax2.set_ylabel("ms")
    ax2.set_title("What training waits for")
    ax2.legend(fontsize=8)
    _save(fig, out, "rss_async.png", made)


def rss_peak(res, out, made):
    pk = res.get("peak_rss")
    if not pk:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    for k in KINDS:
        r = pk.get(k)
        if not r or not r.get("timeline"):
            continue
        t = [s[0] for s in r["timeline"]]
        v = [(s[1] - r["baseline_rss"]) / 2**20 for s in r["timeline"]]
        ax.plot(t, v, color=COLORS[k], label=f"{k} (peak +{(r['peak_rss'] - r['baseline_rss']) / 2**20:.0f} MiB)")
    st = pk["ckpt-on"]["state_bytes"] / 2**20
    ax.axhline(st * 1.1 + 256, color="gray", ls="--", label="goal: 1.1 x state + 256 MiB")
    ax.axhline(st, color="gray", ls=":", label="state")
    ax.set_xlabel("seconds into the save")
    ax.set_ylabel("RSS above runtime baseline, MiB")
    ax.set_title("RSS during one save (fresh process each)")
    ax.legend(fontsize=8)
    _save(fig, out, "rss_peak.png", made)


def codecs(res, out, made):
    c = res.get("codecs")
    if not c:
        return
    sets = [("bf16 state", c["bf16_state"])]
    rw = c.get("real_weights", {})
    if "table" in rw:
        sets.append(("real weights: " + rw["source"].split(" (")[0], rw["table"]))
    fig, ax = plt.subplots(figsize=(9, 4))
    names = [r["codec"] for r in sets[0][1]]
    h = 0.8 / len(sets)
    for j, (label, table) in enumerate(sets):
        by = {r["codec"]: r["ratio"] for r in table}
        ys = [i + j * h for i in range(len(names))]
        vals = [by.get(n, 0) for n in names]
        ax.barh(ys, vals, h, label=label)
        for y, v in zip(ys, vals):
            ax.text(v, y, f" {v:.3f}", va="center", fontsize=8)
    ax.set_yticks([i + 0.4 - h / 2 for i in range(len(names))], names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.12)
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("stored / raw bytes (lower is better)")
    ax.set_title("Size ratio per codec")
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, out, "codec_ratio.png", made)


def scaling(res, out, made):
    s, fin = res.get("scaling"), res.get("finish")
    if not s and not fin:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if s:
        ws = sorted(int(w) for w in s["worlds"])
        for k, lbl in (("ckpt-on", "ckptstore on"), ("dcp", "DCP FileSystemWriter")):
            ax1.plot(ws, [s["worlds"][w if w in s["worlds"] else str(w)][k]["s_per_gb"] for w in ws], "o-",
                     color=COLORS[k], label=lbl)
        ax1.set_xticks(ws)
        ax1.set_xlabel(f"ranks ({s['cpus']} cores; same total state {s['total_bytes'] / 2**20:.0f} MiB)")
        ax1.set_ylabel("save seconds per GB (lower is better)")
        ax1.set_title("Multi-rank save (gloo, DTensor Shard(0))")
        ax1.legend(fontsize=8)
    if fin:
        for items, ls in ((16, "o-"), (291, "s--")):
            for k, lbl in (("ckpt-on", "ckptstore"), ("dcp", "DCP")):
                pts = sorted((f["ranks"], f["seconds"]) for f in fin if f["kind"] == k and f["items_per_rank"] == items)
                if pts:
                    ax2.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=COLORS[k],
                             label=f"{lbl}, {items} tensors/rank")
        ax2.axhline(1.0, color="gray", ls=":", label="goal < 1 s at 1,024")
        ax2.set_xscale("log", base=2)
        ax2.set_yscale("log")
        ax2.set_xlabel("simulated ranks")
        ax2.set_ylabel("finish() seconds")
        ax2.set_title("Commit: metadata object + manifest")
        ax2.legend(fontsize=7)
    _save(fig, out, "scaling.png", made)


def make_all(res: dict, out: str) -> list[str]:
    made: list[str] = []
    for fn in (throughput, rss_async, rss_peak, codecs, scaling):
        try:
            fn(res, out, made)
        except Exception as e:  # one bad plot must not lose the others
            print(f"plot {fn.__name__} failed: {e!r}")
    return made
