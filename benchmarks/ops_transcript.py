"""Operator transcript: the ``ckptstore`` CLI on a real two-tier store, and scrub throughput.

One command::

    python benchmarks/ops_transcript.py [--versions 20] [--out bench-results/ops] [--quick]

1. Starts a SeaweedFS S3 server on loopback (``ckptstore.testing.seaweed``, temp dir) and builds a
   store of ``--versions`` versions (steps 1000, 2000, ...) with real ``dcp.save`` into
   ``ckptstore.StorageWriter(root, remote="s3://ckpt/run1", durability="remote")`` — a few MiB of
   bf16/fp32 tensors each, ``user_metadata={"loss": ...}`` — and pins one version with the CLI.
2. Runs the CLI as a user would (subprocesses, S3 credentials in the environment): ``list``,
   ``show``, ``gc --dry-run``, ``gc``, ``list``, ``scrub``; then damages three objects (local:
   truncate one by 1 byte, zero 4 KiB inside another; remote: delete a third with boto3) and runs
   ``scrub`` (exit 10), ``scrub --repair`` (exit 11), ``scrub`` (exit 0). Every expectation is
   checked and its verdict written into the transcript (gc removed exactly what the dry run said;
   the scrub names the three damaged objects with the right kinds; exit codes).
3. Measures scrub throughput (GB/s of stored bytes verified, ``ckptstore.scrub.scrub`` called in
   process) on the local tier of a larger store (512 MiB stored; ``--quick`` 128 MiB) against a
   plain sequential read of the same files (8 MiB ``readinto`` per call), interleaved 3 times
   after a warm-up read so both see the same (warm) page cache; medians and their ratio.
4. Writes ``OUT/transcript.md`` and ``OUT/scrub_throughput.json`` and prints both.

``--from-head`` runs everything (this process and the ``ckptstore`` subprocesses) against a snapshot
of git HEAD's ``ckptstore/`` instead of the working tree, for a checkout others are editing; the
transcript's header says which code ran.

Exit status: 0 when every check passed, 1 otherwise (the outputs are written either way).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings


def _rerun_from_head(argv) -> int:
    """Export HEAD's ``ckptstore/`` to a temporary directory and run this script again with it first
    on PYTHONPATH (the ``ckptstore`` subprocesses inherit it)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    snap = tempfile.mkdtemp(prefix="ckptstore-head-")
    try:
        arc = subprocess.run(["git", "-C", repo, "archive", "HEAD", "ckptstore"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", snap], input=arc, check=True)
        env = dict(os.environ, CKPTSTORE_OPS_SNAPSHOT=head,
                   PYTHONPATH=os.pathsep.join(x for x in (snap, os.environ.get("PYTHONPATH")) if x))
        argv = sys.argv[1:] if argv is None else list(argv)
        return subprocess.run([sys.executable, os.path.abspath(__file__), *argv], env=env).returncode
    finally:
        shutil.rmtree(snap, ignore_errors=True)


if __name__ == "__main__" and "--from-head" in sys.argv[1:] and not os.environ.get("CKPTSTORE_OPS_SNAPSHOT"):
    sys.exit(_rerun_from_head(None))  # before importing ckptstore: the working tree may not even import

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import ckptstore  # noqa: F401  (the installed package, or PYTHONPATH's)
except ImportError:  # not installed: use this checkout
    sys.path.insert(0, REPO)

import ckptstore  # noqa: E402
from ckptstore import scrub as _scrub  # noqa: E402
from ckptstore.manifest import layout  # noqa: E402
from ckptstore.testing.seaweed import SeaweedServer  # noqa: E402

BUCKET = "ckpt"
PREFIX = "run1"
MiB = 1 << 20


def version_name(step: int) -> str:
    return f"step{step:07d}"


def make_state(seed: int, mib: float) -> dict:
    """~``mib`` MiB of random tensors: 3/4 bf16 (two matrices), 1/4 fp32 (a vector and a matrix)."""
    g = torch.Generator().manual_seed(seed)
    n_bf16 = int(mib * MiB * 0.75) // 2
    n_fp32 = int(mib * MiB * 0.25) // 4
    a = n_bf16 // 2 // 1024 * 1024
    b = (n_bf16 - a) // 1024 * 1024
    f = n_fp32 // 1024 * 1024
    return {
        "model.w1": torch.randn(a // 1024, 1024, generator=g).to(torch.bfloat16),
        "model.w2": torch.randn(b // 1024, 1024, generator=g).to(torch.bfloat16),
        "optim.exp_avg": torch.randn(f // 1024, 1024, generator=g),
        "optim.bias": torch.randn(1024, generator=g),
        "step": torch.tensor(seed),
    }


def save_version(root, url, step, state, endpoint, loss=None, remote=True):
    kw = dict(step=step, user_metadata={"loss": loss} if loss is not None else {})
    if remote:
        kw.update(remote=url, durability="remote", endpoint_url=endpoint, upload_timeout=300.0)
    w = ckptstore.StorageWriter(root, **kw)
    try:
        dcp.save(state, checkpoint_id=version_name(step), storage_writer=w, no_dist=True)
    finally:
        w.close()


def provenance() -> str:
    """Which ckptstore code ran: its directory, and git HEAD + uncommitted files when it is a checkout."""
    pkg = os.path.dirname(os.path.abspath(ckptstore.__file__))
    snap = os.environ.get("CKPTSTORE_OPS_SNAPSHOT")
    if snap:
        return f"ckptstore code: a snapshot of git HEAD {snap} (`git archive`, via --from-head) at `{pkg}`"
    top = os.path.dirname(pkg)
    try:
        head = subprocess.run(["git", "-C", top, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", top, "status", "--porcelain", "--", "ckptstore"], capture_output=True,
                               text=True, check=True).stdout.split("\n")
        dirty = [ln[3:] for ln in dirty if ln.strip()]
    except (OSError, subprocess.CalledProcessError):
        return f"ckptstore code: `{pkg}` (not a git checkout)"
    return (f"ckptstore code: `{pkg}`, git HEAD {head}"
            + (f", uncommitted changes in {', '.join(dirty)}" if dirty else ", no uncommitted changes under ckptstore/"))


# -- transcript ---------------------------------------------------------------------------------------
class Transcript:
    def __init__(self, env: dict, subst: dict):
        self.env = env
        self.subst = subst  # long path -> short shell variable, for display
        self.parts: list[str] = []
        self.checks: list[tuple[bool, str]] = []
        self.ckptstore = shutil.which("ckptstore", path=os.path.dirname(sys.executable)) or shutil.which("ckptstore")
        if not self.ckptstore:
            raise SystemExit("the 'ckptstore' command is not installed (pip install -e .)")

    def show(self, s: str) -> str:
        for long, short in self.subst.items():
            s = s.replace(long, short)
        return s

    def note(self, text: str) -> None:
        self.parts.append(text + "\n")

    def run(self, args: list[str], expect: int | None = 0, title: str | None = None) -> tuple[int, str]:
        cmd = "ckptstore " + " ".join(shlex.quote(a) for a in args)
        t0 = time.perf_counter()
        p = subprocess.run([self.ckptstore, *args], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
        dt = time.perf_counter() - t0
        out = p.stdout
        head = f"### {title}\n\n" if title else ""
        self.parts.append(f"{head}```console\n$ {self.show(cmd)}\n{self.show(out).rstrip()}\n"
                          f"[exit {p.returncode}, {dt:.1f} s]\n```\n")
        if expect is not None:
            self.check(p.returncode == expect, f"`{self.show(cmd)}` exits {expect} (got {p.returncode})")
        return p.returncode, out

    def check(self, ok: bool, what: str) -> None:
        self.checks.append((ok, what))
        self.parts.append(f"check: {'OK' if ok else 'FAILED'}: {what}\n")

    def text(self) -> str:
        return "\n".join(self.parts)


def parse_gc_plan(out: str) -> dict[str, set[str]]:
    """``{tier: {version, ...}}`` of the ``DELETE`` lines of ``ckptstore gc`` text output."""
    res: dict[str, set[str]] = {}
    tier = None
    for line in out.splitlines():
        m = re.match(r"^(\w+) tier: \d+ committed version", line)
        if m:
            tier = m.group(1)
            res.setdefault(tier, set())
            continue
        m = re.match(r"^  DELETE (\S+)", line)
        if m and tier:
            res[tier].add(m.group(1))
    return res


def parse_gc_actions(out: str) -> set[tuple[str, str, str]]:
    """``{(op, tier, key)}`` of the action lines of ``ckptstore gc`` text output."""
    return {(m.group(1), m.group(2), m.group(3)) for m in
            re.finditer(r"^  (uncommit|delete|abort-upload|rmdir)\s+(local|remote)\s+(\S+)", out, re.M)}


def committed(root, url, endpoint) -> dict[str, set[str]]:
    st = ckptstore.Store(root, remote=url, endpoint_url=endpoint)
    try:
        out = {"local": set(), "remote": set()}
        for r in st.versions():
            for t in r.tiers:
                out[t].add(r.version)
        return out
    finally:
        st.close()


# -- part 1 + 2: the store and the CLI transcript ------------------------------------------------------
def ops_transcript(args, work: str) -> Transcript:
    sw_dir = os.path.join(work, "seaweed")
    root = os.path.join(work, "store")
    url = f"s3://{BUCKET}/{PREFIX}"
    with SeaweedServer(sw_dir, buckets=(BUCKET,)) as sw:
        sw.create_bucket(BUCKET)
        os.environ.update(sw.env)  # the in-process StorageWriter / Store use the boto3 chain too
        env = dict(os.environ)
        env.update(sw.env)
        env.pop("CKPTSTORE_KEY", None)
        env.pop("CKPTSTORE_KEY_FILE", None)
        tr = Transcript(env, {root: "$ROOT"})
        t0 = time.perf_counter()
        steps = [1000 * (i + 1) for i in range(args.versions)]
        for i, step in enumerate(steps):
            loss = round(3.2 * math.exp(-step / 8000) + 0.9 + 0.02 * math.sin(step), 4)
            save_version(root, url, step, make_state(i + 1, args.mib_per_version), sw.endpoint, loss)
        build_s = time.perf_counter() - t0
        pinned = version_name(steps[min(6, len(steps) - 1)])  # step 7000: kept by no rule but the pin
        tr.note(f"# ckptstore operator transcript\n\n"
                f"Date: {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}; "
                f"ckptstore {ckptstore.__version__}, torch {torch.__version__}; {provenance()}.\n\n"
                f"Store: `ROOT={root}` (local tier) + `{url}` (SeaweedFS S3 on loopback at {sw.endpoint}, "
                f"credentials in `AWS_*` environment variables). {len(steps)} versions "
                f"(steps {steps[0]}..{steps[-1]}) written with `dcp.save` into "
                f"`ckptstore.StorageWriter(ROOT, remote=\"{url}\", durability=\"remote\", step=..., "
                f"user_metadata={{\"loss\": ...}})`, ~{args.mib_per_version:g} MiB of bf16/fp32 tensors each, "
                f"one process, in {build_s:.1f} s.\n")

        tr.note("## Pin, list, show\n")
        tr.run(["pin", root, "--remote", url, pinned, "--note", "paper baseline"])
        tr.run(["list", root, "--remote", url])
        tr.run(["show", root, version_name(steps[-1]), "--remote", url])

        tr.note("## Retention: dry run, then for real\n")
        gc_args = ["gc", root, "--remote", url, "--keep-last", "5", "--keep-every-steps", "5000",
                   "--remote-keep-last", "10", "--grace", "0"]
        before = committed(root, url, sw.endpoint)
        _rc, dry = tr.run(gc_args + ["--dry-run"])
        planned = parse_gc_plan(dry)
        planned_actions = parse_gc_actions(dry)
        after_dry = committed(root, url, sw.endpoint)
        tr.check(after_dry == before, "the dry run removed nothing")
        _rc, real = tr.run(gc_args)
        done = parse_gc_plan(real)
        after = committed(root, url, sw.endpoint)
        tr.check(done == planned, "gc planned the same version deletions as the dry run")
        done_actions = parse_gc_actions(real)
        tr.check(done_actions == planned_actions and "0 failed" in real,
                 f"gc applied the same {len(planned_actions)} actions the dry run listed, none failed")
        st = ckptstore.Store(root, remote=url, endpoint_url=sw.endpoint)
        left = sorted(f"{t} {k}" for op, t, k in planned_actions if op in ("uncommit", "delete") and st.tier(t).exists(k))
        st.close()
        tr.check(not left, "every manifest and object the dry run said it would remove is gone"
                 + (f" (still there: {left})" if left else ""))
        for t in ("local", "remote"):
            gone = before[t] - after[t]
            tr.check(gone == planned.get(t, set()),
                     f"{t} tier: gc removed exactly the {len(planned.get(t, ()))} version(s) the dry run listed "
                     f"(removed {len(gone)})")
        tr.check(pinned in after["local"] and pinned in after["remote"], f"pinned {pinned} survives in both tiers")
        tr.run(["list", root, "--remote", url])
        tr.run(["scrub", root, "--remote", url], expect=0)

        # -- damage --------------------------------------------------------------------------------
        both = sorted(after["local"] & after["remote"])
        v_trunc, v_zero, v_del = both[-3], both[-2], both[-1]
        st = ckptstore.Store(root, remote=url, endpoint_url=sw.endpoint)
        shard = {v: st.manifest(v, "local").manifest.objects for v in (v_trunc, v_zero, v_del)}
        st.close()

        def shard_entry(v):
            objs = shard[v]
            objs = list(objs.values()) if isinstance(objs, dict) else list(objs)
            return max(objs, key=lambda o: o.size)

        e_trunc, e_zero, e_del = shard_entry(v_trunc), shard_entry(v_zero), shard_entry(v_del)
        k_trunc = layout.object_key(v_trunc, e_trunc.name)
        k_zero = layout.object_key(v_zero, e_zero.name)
        k_del = layout.object_key(v_del, e_del.name)
        p_trunc = os.path.join(root, k_trunc)
        p_zero = os.path.join(root, k_zero)
        with open(p_trunc, "r+b") as f:
            f.truncate(os.fstat(f.fileno()).st_size - 1)
        zero_at = (e_zero.size // 2) // 4096 * 4096
        with open(p_zero, "r+b") as f:
            f.seek(zero_at)
            f.write(bytes(4096))
        c = sw.client()
        c.delete_object(Bucket=BUCKET, Key=f"{PREFIX}/{k_del}")
        c.close()
        tr.note("## Damage, scrub, repair\n\n"
                "Three objects damaged behind ckptstore's back:\n\n"
                f"* local `{k_trunc}` ({e_trunc.size} bytes): truncated by 1 byte (Python `truncate`);\n"
                f"* local `{k_zero}` ({e_zero.size} bytes): 4096 bytes at offset {zero_at} overwritten with zeros;\n"
                f"* remote `s3://{BUCKET}/{PREFIX}/{k_del}`: deleted (boto3 `delete_object`).\n")
        expected = {("local", v_trunc, e_trunc.name, "truncated"), ("local", v_zero, e_zero.name, "corrupt"),
                    ("remote", v_del, e_del.name, "missing")}
        _rc, out = tr.run(["scrub", root, "--remote", url], expect=10)
        found = set(_damage_lines(out))
        tr.check(found == expected, "scrub names exactly the three damaged objects with the right kinds: "
                 + ", ".join(f"{t} {v} {o} {k}" for t, v, o, k in sorted(expected))
                 + ("" if found == expected else f" (found {sorted(found)})"))
        _rc, out = tr.run(["scrub", root, "--remote", url, "--repair"], expect=11)
        rep = set(_damage_lines(out, status="repaired"))
        tr.check(rep == expected, "scrub --repair restores all three from the other tier")
        tr.run(["scrub", root, "--remote", url], expect=0)
        tr.run(["list", root, "--remote", url])
        ok = sum(1 for k, _ in tr.checks if k)
        tr.note(f"## Checks\n\n{ok} of {len(tr.checks)} checks passed.\n")
        return tr


def _damage_lines(out: str, status: str = "damaged"):
    """``(tier, version, object, kind)`` for each object line of ``ckptstore scrub`` text output."""
    tier = version = None
    for line in out.splitlines():
        m = re.match(r"^(\w+)\s+(\S+): [A-Z]+", line)
        if m:
            tier, version = m.group(1), m.group(2)
            continue
        m = re.match(rf"^\s+{status}: (attempts/\S+): ([\w-]+): ", line)
        if m and tier:
            yield tier, version, m.group(1), m.group(2)


# -- part 3: scrub throughput ---------------------------------------------------------------------------
def plain_read(paths: list[str], bufsize: int = 8 * MiB) -> int:
    buf = bytearray(bufsize)
    mv = memoryview(buf)
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while True:
                n = f.readinto(mv)
                if not n:
                    break
                total += n
    return total


def scrub_throughput(args, work: str) -> dict:
    root = os.path.join(work, "big")
    total_mib = 128 if args.quick else 512
    n_versions = 4
    t0 = time.perf_counter()
    st = ckptstore.Store(root)
    # logical MiB per version; after the first save, rescaled by its compression ratio so that the
    # store holds ~total_mib *stored* bytes
    per = total_mib / n_versions
    for i in range(n_versions):
        save_version(root, None, 1000 * (i + 1), make_state(100 + i, per), None, remote=False)
        if i == 0:
            m = st.manifest(version_name(1000), "local").manifest
            per = (total_mib - m.stored_bytes / MiB) / (n_versions - 1) * m.nbytes / m.stored_bytes
    build_s = time.perf_counter() - t0
    paths, stored, logical = [], 0, 0
    for r in st.versions():
        m = st.manifest(r.version, "local").manifest
        logical += m.nbytes
        for o in m.all_objects():
            paths.append(os.path.join(root, layout.object_key(r.version, o.name)))
            stored += o.size
    assert sum(os.path.getsize(p) for p in paths) == stored
    plain_read(paths)  # warm-up: both measurements then see the same (warm) page cache
    res = {"scrub_s": [], "read_s": []}
    for rep in range(args.reps):
        order = ["scrub", "read"] if rep % 2 == 0 else ["read", "scrub"]
        for what in order:
            if what == "scrub":
                t = time.perf_counter()
                report = _scrub.scrub(st)
                res["scrub_s"].append(time.perf_counter() - t)
                if report.exit_code != 0:
                    raise RuntimeError(f"scrub of the throughput store exited {report.exit_code}")
                nobj = sum(len(v.objects) for v in report.versions)
                assert nobj == len(paths), (nobj, len(paths))
            else:
                t = time.perf_counter()
                n = plain_read(paths)
                res["read_s"].append(time.perf_counter() - t)
                assert n == stored
    st.close()
    scrub_med = statistics.median(res["scrub_s"])
    read_med = statistics.median(res["read_s"])
    return {
        "what": "GB/s (1e9 bytes/s) of stored bytes verified: ckptstore.scrub.scrub(Store(root)) on the local tier "
                "vs a plain sequential read of the same files (open(..., buffering=0).readinto, 8 MiB), "
                "in-process, warm page cache (one warm-up read first), interleaved repetitions",
        "versions": n_versions,
        "objects": len(paths),
        "stored_bytes": stored,
        "logical_bytes": logical,
        "build_s": round(build_s, 2),
        "reps": args.reps,
        "scrub_s": [round(x, 4) for x in res["scrub_s"]],
        "read_s": [round(x, 4) for x in res["read_s"]],
        "scrub_gbps_median": round(stored / scrub_med / 1e9, 3),
        "read_gbps_median": round(stored / read_med / 1e9, 3),
        "scrub_over_read": round(read_med / scrub_med, 3),
        "scrub_gbps_per_rep": [round(stored / x / 1e9, 3) for x in res["scrub_s"]],
        "read_gbps_per_rep": [round(stored / x / 1e9, 3) for x in res["read_s"]],
        "cpus": os.cpu_count(),
        "ckptstore_threads_env": os.environ.get("CKPTSTORE_THREADS"),
        "loadavg": list(os.getloadavg()),
        "quick": args.quick,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", type=int, default=20, help="versions in the transcript store (default 20)")
    ap.add_argument("--out", default="bench-results/ops", help="output directory (default bench-results/ops)")
    ap.add_argument("--quick", action="store_true", help="128 MiB throughput store instead of 512 MiB")
    ap.add_argument("--mib-per-version", type=float, default=4.0, help="state size per transcript version (MiB)")
    ap.add_argument("--reps", type=int, default=3, help="throughput repetitions (default 3)")
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one, removed at the end)")
    ap.add_argument("--from-head", action="store_true",
                    help="run against a snapshot of git HEAD's ckptstore/ (git archive), not the working tree: "
                         "for a checkout that others are editing")
    args = ap.parse_args(argv)
    if args.from_head and not os.environ.get("CKPTSTORE_OPS_SNAPSHOT"):
        return _rerun_from_head(argv if argv is not None else sys.argv[1:])
    if args.versions < 12:
        ap.error("--versions must be at least 12 (the gc rules keep 5 local / 10 remote)")
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below (server, scratch dir)
    t_start = time.perf_counter()
    load_start = list(os.getloadavg())
    work = args.work or tempfile.mkdtemp(prefix="ckptstore-ops-")
    os.makedirs(work, exist_ok=True)
    try:
        tr = ops_transcript(args, work)
        thr = scrub_throughput(args, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    thr["total_run_s"] = round(time.perf_counter() - t_start, 1)
    thr["loadavg_start"] = load_start
    tr.note("## Scrub throughput\n\n"
            f"Local tier of a separate store: {thr['versions']} versions, {thr['objects']} objects, "
            f"{thr['stored_bytes'] / MiB:.0f} MiB stored. Median of {thr['reps']} interleaved runs (warm page cache):\n\n"
            f"| | GB/s | per run |\n|---|---:|---|\n"
            f"| `ckptstore.scrub.scrub` | {thr['scrub_gbps_median']} | {thr['scrub_gbps_per_rep']} |\n"
            f"| plain read, 8 MiB `readinto` | {thr['read_gbps_median']} | {thr['read_gbps_per_rep']} |\n\n"
            f"scrub / plain read: **{thr['scrub_over_read']}x**. Load average (1/5/15 min) at start {[round(x, 2) for x in load_start]}, "
            f"after the measurement {[round(x, 2) for x in thr['loadavg']]}; {thr['cpus']} CPUs.\n\n"
            f"Total run time: {thr['total_run_s']} s.\n")
    text = tr.text()
    with open(os.path.join(args.out, "transcript.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "scrub_throughput.json"), "w") as f:
        json.dump(thr, f, indent=2)
        f.write("\n")
    print(text)
    print(json.dumps(thr, indent=2))
    failed = [w for ok, w in tr.checks if not ok]
    for w in failed:
        print(f"FAILED: {w}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
