"""Profiles for ``benchmarks/run.py``: where the time of a ckptstore save/load goes.

* ``profile_subprocess``: runs a workload under **py-spy** (sampling, every thread, native
  extensions included as their Python call site), twice when asked: once sampling every active
  thread (``--threads``: where the threads spend time) and once with ``--gil`` (only the thread
  holding the GIL: what serialises the encoder/decoder threads). Falls back to cProfile of the
  main thread when py-spy is not installed (``bash benchmarks/setup.sh`` installs it).
* ``cprofile_region``: cProfile of one call in this process (main-thread work such as
  ``dcp.async_save`` staging or ``finish()``).

Summaries: share of samples per thread group (main / encoder / decoder / other), the top "self"
lines (where samples land: the line of Python that is running or that called into C), and the top
inclusive functions.
"""

from __future__ import annotations

import collections
import cProfile
import io
import json
import os
import pstats
import re
import shutil
import subprocess
import sys
from typing import Callable

RATE = 250  # samples per second
_LINE = re.compile(r"^thread \((\d+)\)(?:: ([^;]*))?;?(.*) (\d+)$")  # the name is sometimes missing
_FOCUS = ("_profiled",)


def pyspy() -> str | None:
    p = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return p if os.path.exists(p) else shutil.which("py-spy")


def _short(frame: str) -> str:
    """``fn (/long/path/site-packages/pkg/mod.py:12)`` → ``fn (pkg/mod.py:12)``."""
    m = re.match(r"^(.*) \((.*)\)$", frame)
    if not m:
        return frame
    fn, loc = m.groups()
    for cut in ("site-packages/", "/work/main/", "lib/python3"):
        if cut in loc:
            loc = loc.split(cut, 1)[1]
            break
    return f"{fn} ({loc})"


def _group(thread: str, stack: str) -> str:
    """Thread group by name, and for pool threads by what they run (py-spy may keep the name of
    an earlier thread whose id was reused)."""
    if thread == "MainThread":
        return "main thread"
    if "reader.py" in stack or "FrameCodec.decode" in stack:
        return "decoder threads"
    if "writer.py" in stack or "FrameCodec.encode" in stack:
        return "encoder threads"
    if "upload.py" in stack or "tiers/s3/" in stack:
        return "upload threads"
    return "other threads"


_WAIT = ("Condition.wait", "Event.wait", "Thread.join", "_wait_for_tstate_lock", "Future.result", "wait (threading.py")


def _waiting(leaf: str) -> bool:
    """A blocked thread (py-spy does not always see that a thread waiting on a lock is idle)."""
    if leaf.startswith(_WAIT):
        return True
    return leaf.startswith("_worker (") and "concurrent/futures/thread.py" in leaf  # pool thread waiting for work


def parse_raw(path: str, focus=_FOCUS) -> dict:
    """Summarise py-spy ``--format raw --threads`` output. Main-thread samples outside ``focus``
    functions (building the state, imports, warm-up) are dropped; samples of blocked threads
    (waiting on a lock, a future or the pool's queue) are counted apart as "waiting"."""
    waiting: collections.Counter = collections.Counter()
    groups: collections.Counter = collections.Counter()
    self_: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    by_group_self: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    total = 0
    with open(path) as f:
        for line in f:
            m = _LINE.match(line.rstrip("\n"))
            if not m:
                continue
            _tid, thread, stack, n = m.groups()
            n = int(n)
            frames = [x for x in stack.split(";") if x]
            if thread is None:  # py-spy could not read the name: the main thread runs the script's <module>
                thread = "MainThread" if frames and frames[0].startswith("<module>") else ""
            g = _group(thread, stack)
            if g == "main thread" and not any(x.split(" (")[0].endswith(focus) for x in frames):
                continue
            leaf = _short(frames[-1]) if frames else ""
            if _waiting(leaf):
                waiting[g] += n
                continue
            total += n
            groups[g] += n
            if frames:
                self_[leaf] += n
                by_group_self[g][leaf] += n
            seen = set()
            for x in frames:
                fn = re.sub(r":\d+\)$", ")", _short(x))
                if fn not in seen:
                    seen.add(fn)
                    incl[fn] += n
    pct = lambda c: round(100.0 * c / total, 1) if total else 0.0
    return {
        "samples": total,
        "groups": {g: pct(c) for g, c in groups.most_common()},
        "waiting_samples": dict(waiting),
        "self": [(k, pct(c)) for k, c in self_.most_common(15)],
        "inclusive": [(k, pct(c)) for k, c in incl.most_common(40) if not k.startswith(("Thread.", "_bootstrap", "<module>"))][:15],
        "self_by_group": {g: [(k, pct(c)) for k, c in cnt.most_common(6)] for g, cnt in by_group_self.items()},
    }


def profile_subprocess(name: str, cmd: list, out_dir: str, gil: bool = True) -> dict:
    """Run ``cmd`` (a Python workload printing JSON last) under py-spy; summarise."""
    tool = pyspy()
    res: dict = {"workload": " ".join(os.path.basename(c) if i == 0 else c for i, c in enumerate(cmd))}
    if tool is None:
        prof = os.path.join(out_dir, f"{name}.cprofile")
        p = subprocess.run([cmd[0], "-m", "cProfile", "-o", prof, *cmd[1:]], capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(p.stderr[-2000:])
        res.update(tool="cProfile (main thread only; install py-spy to see the worker threads)", **_pstats(pstats.Stats(prof)))
        return res
    runs = [("threads", ["--threads"])] + ([("gil", ["--threads", "--gil"])] if gil else [])
    for tag, flags in runs:
        raw = os.path.join(out_dir, f"{name}-{tag}.txt")
        p = subprocess.run([tool, "record", "-r", str(RATE), "-f", "raw", "-o", raw, *flags, "--", *cmd],
                           capture_output=True, text=True)
        secs = None
        for line in reversed(p.stdout.splitlines()):  # py-spy's own messages follow the workload's JSON
            if line.startswith("{"):
                secs = json.loads(line).get("seconds")
                break
        if p.returncode or secs is None:
            raise RuntimeError(f"profiled workload failed (py-spy exit {p.returncode}): {p.stderr[-2000:]}")
        res[tag] = parse_raw(raw)
        res[tag]["raw"] = raw
        res[tag]["workload_seconds"] = secs
    res["tool"] = f"py-spy record -r {RATE} --threads (and --gil)"
    return res


def _pstats(st: pstats.Stats, n: int = 15) -> dict:
    st.sort_stats("tottime")
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _callers) in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:n]:
        rows.append((_short(f"{fn} ({file}:{line})"), round(tt, 3), round(ct, 3), nc))
    cum = []
    for (file, line, fn), (cc, nc, tt, ct, _callers) in sorted(st.stats.items(), key=lambda kv: -kv[1][3])[: n + 5]:
        cum.append((_short(f"{fn} ({file}:{line})"), round(ct, 3), nc))
    return {"total_s": round(st.total_tt, 3), "by_self": rows, "by_cumulative": cum[:n]}


def cprofile_region(fn: Callable[[cProfile.Profile], object], out_dir: str, name: str) -> dict:
    """``fn(prof)`` enables/disables ``prof`` around the region it wants measured."""
    prof = cProfile.Profile()
    fn(prof)
    path = os.path.join(out_dir, f"{name}.cprofile")
    prof.dump_stats(path)
    res = {"tool": "cProfile (this call only)", **_pstats(pstats.Stats(prof))}
    res["file"] = path
    return res


def render(res: dict) -> str:
    out = io.StringIO()
    w = out.write
    w(f"  tool: {res.get('tool')}\n")
    if "threads" in res:
        t = res["threads"]
        if "workload_seconds" in t:
            w(f"  workload times (s): {', '.join(f'{x:.2f}' for x in t['workload_seconds'])}\n")
        w(f"  busy samples by thread group: {', '.join(f'{g} {p}%' for g, p in t['groups'].items())}"
          f" ({t['samples']} busy; blocked samples not counted: "
          f"{', '.join(f'{g} {c}' for g, c in t.get('waiting_samples', {}).items()) or 'none'})\n")
        w("  top self (line that runs or calls into C), % of all samples:\n")
        for k, p in t["self"][:12]:
            w(f"    {p:5.1f}%  {k}\n")
        w("  top inclusive functions:\n")
        for k, p in t["inclusive"][:12]:
            w(f"    {p:5.1f}%  {k}\n")
        if "gil" in res:
            g = res["gil"]
            w(f"  GIL holders (py-spy --gil; {g['samples']} samples; by thread group: "
              f"{', '.join(f'{a} {p}%' for a, p in g['groups'].items())}):\n")
            for k, p in g["self"][:10]:
                w(f"    {p:5.1f}%  {k}\n")
    elif "by_self" in res:
        w(f"  total {res['total_s']} s; top by own time (s own / s cumulative / calls):\n")
        for k, tt, ct, nc in res["by_self"][:12]:
            w(f"    {tt:7.3f} {ct:7.3f} {nc:8d}  {k}\n")
        w("  top cumulative:\n")
        for k, ct, nc in res["by_cumulative"][:10]:
            w(f"    {ct:7.3f} {nc:8d}  {k}\n")
    return out.getvalue()
