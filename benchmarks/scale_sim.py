"""Simulated jobs of thousands of ranks through ckptstore's real restore-choice, placement and
commit code (docs/FORMAT.md, "Restore choice", "Placement": what a rank receives, lists and stats
must not grow with the number of ranks).

    python benchmarks/scale_sim.py [--ranks 1024,4096,16384] [--per-root 8] [--versions 5] [--items 291]
                                   [--no-commit] [--out DIR] [--work DIR]

No process group of that size can run on one machine, so the collectives are simulated and
everything else is the real code, on real files:

* **Roots on disk.** ``N / --per-root`` node-local roots (ranks ``8k .. 8k+7`` share root ``k``, as
  torchrun numbers a node's ranks). For each of ``--versions`` versions, one real sealed manifest of
  ``N`` objects (``Manifest.to_bytes``, with the root groups as its ``placement``) is written once
  and hard-linked into every root (the copies of one commit are byte-identical); every root holds
  its group's shard objects and the metadata object (empty files: a restore's listing reads names,
  not bytes).
* **Save: root discovery.** Every simulated rank claims its root for the attempt
  (``_roots.claim``: real claim files, the coordinator first); ``_roots.placement`` of the ``(rank,
  leader)`` pairs must give the ``N / per-root`` groups. Filesystem calls per rank are counted.
* **Restore.** Every simulated rank claims its root for a load token; each root's claimer lists it
  with ``_job.root_report`` (the first rank's root first, the others knowing its digests) under
  ``ckptstore.testing.meter.metered`` (``listdir``/``scandir``/``stat`` calls); ``_job._assemble``
  builds the job report and ``choice.decide`` decides, timed. Bytes received per rank are those of
  the messages ``_job.exchange`` sends, as torch's object collectives carry them (every object
  pickled plus its 8-byte size; ``all_gather_object`` pads each rank's entry to the largest): the
  first rank's broadcast of (token, digests), the ``all_gather_object`` of the leaders, the job
  report broadcast, and on the first rank the reports of the other roots' leaders.
* **Commit.** ``StorageWriter.finish()`` of ``N`` ranks × ``--items`` FSDP-sharded tensors with every
  rank's root report (``bench_lib.synthetic_finish``, as the 1,024-rank row of ``benchmarks/run.py``
  section 5 simulates it), timed: metadata object, placement, manifest, put-if-absent, fsyncs.

Targets at 16,384 ranks (2,048 roots, 5 versions): <= 4 MB received per rank, choice <= 1 s, commit
< 2 s. Writes ``scale_sim.json`` into ``--out``; exit status 1 when a target is missed or the choice
does not restore the newest version.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TARGET_BYTES = 4_000_000
TARGET_CHOICE_S = 1.0
TARGET_COMMIT_S = 2.0


def _wire(obj) -> int:
    """Bytes one object travels as in torch's object collectives: its pickle and its int64 size."""
    return len(pickle.dumps(obj)) + 8


def build_roots(base: str, n: int, per_root: int, versions: int) -> tuple[list, list]:
    """The roots of a job of ``n`` ranks holding ``versions`` committed versions; returns the root
    directories (one per rank) and the version names."""
    from ckptstore.manifest import layout
    from ckptstore.manifest.schema import Manifest, ObjectEntry

    n_roots = n // per_root
    groups = [list(range(k * per_root, (k + 1) * per_root)) for k in range(n_roots)]
    root_dirs = [os.path.join(base, f"node{k:05d}") for k in range(n_roots)]
    names = [f"step-{1000 * (i + 1):07d}" for i in range(versions)]
    for i, v in enumerate(names):
        attempt = layout.new_attempt()
        objects = [ObjectEntry(layout.shard_name(attempt, r), 1 << 20, f"{r:016x}", 4, r, 4 << 20) for r in range(n)]
        meta = ObjectEntry(layout.metadata_name(attempt), 1 << 16, "0" * 16, 1, None, 1 << 17)
        m = Manifest(version=v, attempt=attempt, created=f"2026-12-01T10:{i:02d}:00.000000Z", world_size=n, objects=objects,
                     metadata_object=meta, nbytes=n * (4 << 20), stored_bytes=n * (1 << 20), step=1000 * (i + 1),
                     writer="scale_sim", placement=groups, seq=1_000_000 + i)
        body = m.to_bytes(None)
        master = os.path.join(base, f"manifest-{i}.json")
        with open(master, "wb") as f:
            f.write(body)
        for k, rd in enumerate(root_dirs):
            adir = os.path.join(rd, *layout.object_key(v, layout.attempt_dir(attempt)).split("/"))
            os.makedirs(adir, exist_ok=True)
            for r in groups[k]:
                open(os.path.join(rd, *layout.object_key(v, layout.shard_name(attempt, r)).split("/")), "wb").close()
            open(os.path.join(rd, *layout.object_key(v, meta.name).split("/")), "wb").close()
            os.link(master, os.path.join(rd, *layout.manifest_key(v).split("/")))
    return [root_dirs[r // per_root] for r in range(n)], names


def save_discovery(roots: list) -> dict:
    """Every rank claims its root for one attempt, the coordinator (rank 0) first; the placement."""
    from ckptstore.dcp import _roots
    from ckptstore.manifest import layout
    from ckptstore.testing.meter import metered
    from ckptstore.tiers import LocalTier

    tiers = {d: LocalTier(d) for d in set(roots)}
    attempt = layout.new_attempt()
    t0 = time.perf_counter()
    with metered() as m:
        leaders = [(r, _roots.claim(tiers[d], attempt, r)) for r, d in enumerate(roots)]
    dt = time.perf_counter() - t0
    placement = _roots.placement(leaders)
    for d in tiers:
        _roots.release(tiers[d], attempt)
    return {"groups": len(placement or [()]), "fs_per_rank": m.fs_calls() / len(roots), "seconds_per_rank": dt / len(roots)}


def restore(roots: list, names: list) -> dict:
    """The restore choice of a job whose rank ``r`` has root ``roots[r]``, through the real code."""
    from ckptstore.choice import decide
    from ckptstore.dcp import _job, _roots
    from ckptstore.testing.meter import metered
    from ckptstore.tiers import LocalTier

    n = len(roots)
    tiers = {d: LocalTier(d) for d in set(roots)}
    token = "load-sim"
    # 2: the first rank claims and lists its root; broadcasts (token, digests)
    fs_lead = []
    t0 = time.perf_counter()
    with metered() as m:
        lead0 = _roots.claim(tiers[roots[0]], token, 0)
        own0 = _job.root_report(tiers[roots[0]], frozenset(), first=True)
    fs_lead.append(m.fs_calls())
    list_s = [time.perf_counter() - t0]
    head = (token, sorted(own0[1]))
    # 3: every other rank claims; the claimers list their roots knowing the first rank's digests
    got = {0: own0}
    leaders = [lead0]
    fs_other = []
    for r in range(1, n):
        with metered() as m:
            lead = _roots.claim(tiers[roots[r]], token, r)
        if lead == r:
            t0 = time.perf_counter()
            with metered() as m2:
                got[r] = _job.root_report(tiers[roots[r]], frozenset(head[1]))
            list_s.append(time.perf_counter() - t0)
            fs_lead.append(m.fs_calls() + m2.fs_calls())
        else:
            fs_other.append(m.fs_calls())
        leaders.append(lead)
    for d in tiers:
        _roots.release(tiers[d], token)
    order = _job._root_order(leaders)
    # 5-6: the first rank assembles; every rank decides
    job = _job._assemble(order, got)
    wire_head = _wire(head)
    wire_leaders = n * (max(_wire(x) for x in set(leaders)))  # all_gather_object pads to the largest
    wire_reports = sum(_wire(got[lead]) for lead in order if lead != 0)
    wire_job = _wire(job)
    index = {lead: k for k, lead in enumerate(order)}
    job["ranks"] = [[i, index.get(lead)] for i, lead in enumerate(leaders)]
    t0 = time.perf_counter()
    view = decide(job, None)
    choice_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    need = any(not view.has_manifest(i) for i in range(view.size))  # fetch_manifest's question, every rank
    src = [view.source(i, f"attempts/{view.attempt}/r{i:05d}.ckd") for i in (0, n // 2, n - 1)]
    ask_s = time.perf_counter() - t0
    return {"version": view.version, "newest": view.version == names[-1], "roots": len(order),
            "bytes_rank": wire_head + wire_leaders + wire_job, "bytes_first": wire_head + wire_leaders + wire_job + wire_reports,
            "parts": {"head": wire_head, "leaders": wire_leaders, "job": wire_job, "reports_to_first": wire_reports},
            "choice_s": choice_s, "view_questions_s": ask_s, "manifest_missing_somewhere": need, "sources": src,
            "fs_leader_mean": sum(fs_lead) / len(fs_lead), "fs_leader_max": max(fs_lead),
            "fs_other_max": max(fs_other) if fs_other else 0, "list_s_max": max(list_s), "list_s_mean": sum(list_s) / len(list_s)}


def commit(n: int, items: int, per_root: int, work: str) -> dict:
    import bench_lib as B

    return B.synthetic_finish(n, items, work, "ckpt-on", per_root=per_root)


def _line(row: dict, args) -> str:
    """One size's results, as a line."""
    n, r, c = row["ranks"], row.get("restore"), row.get("commit")
    out = f"{n:>6} ranks, {row['roots']:>5} roots, {args.versions} versions"
    if r is not None:
        out += (f": received/rank {r['bytes_rank'] / 1e6:.3f} MB (first rank {r['bytes_first'] / 1e6:.3f} MB); choice "
                f"{r['choice_s']:.3f} s; listdir+stat per root leader {r['fs_leader_mean']:.0f} (max {r['fs_leader_max']}), "
                f"per other rank {r['fs_other_max']}; save discovery {row['save']['fs_per_rank']:.1f} fs calls/rank, "
                f"{row['save']['groups']} groups")
    if c is not None:
        out += (f"; commit {c['seconds']:.2f} s wall, {c['cpu_seconds']:.2f} s CPU ({args.items} tensors/rank, manifest "
                f"{c['manifest_bytes'] / 1e6:.1f} MB, metadata object {c['metadata_bytes'] / 1e6:.1f} MB)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1024,4096,16384")
    ap.add_argument("--per-root", type=int, default=8)
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--items", type=int, default=291)
    ap.add_argument("--no-commit", action="store_true")
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--work", default=None, help="where the simulated roots go (a tmpfs such as /dev/shm builds them fast)")
    ap.add_argument("--commit-work", default=None, help="where the commit writes (default: --work); a disk, for its fsyncs")
    ap.add_argument("--no-restore", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for n in [int(x) for x in args.ranks.split(",")]:
        row = {"ranks": n, "roots": n // args.per_root, "versions": args.versions}
        if not args.no_restore:
            base = tempfile.mkdtemp(prefix=f"scale-{n}-", dir=args.work)
            try:
                t0 = time.perf_counter()
                roots, names = build_roots(base, n, args.per_root, args.versions)
                row["build_s"] = time.perf_counter() - t0
                row["save"] = save_discovery(roots)
                row["restore"] = restore(roots, names)
            finally:
                shutil.rmtree(base, ignore_errors=True)
        if not args.no_commit:
            work = tempfile.mkdtemp(prefix=f"commit-{n}-", dir=args.commit_work or args.work)
            try:
                row["commit"] = commit(n, args.items, args.per_root, work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        rows.append(row)
        print(_line(row, args), flush=True)
    print("\n| ranks | roots | received per rank (first rank) | choice | listdir+stat: root leader / other rank | save discovery fs calls/rank | commit |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        r, c = row.get("restore"), row.get("commit")
        cells = ["-"] * 4 if r is None else [
            f"{r['bytes_rank'] / 1e6:.2f} MB ({r['bytes_first'] / 1e6:.2f} MB)", f"{r['choice_s']:.3f} s",
            f"{r['fs_leader_max']} / {r['fs_other_max']}", f"{row['save']['fs_per_rank']:.1f}"]
        print(f"| {row['ranks']:,} | {row['roots']:,} | " + " | ".join(cells) + (f" | {c['seconds']:.2f} s ({c['cpu_seconds']:.2f} s CPU) |" if c else " | - |"))
    last = rows[-1]
    ok = all(r["restore"]["newest"] and r["save"]["groups"] == r["roots"] for r in rows if "restore" in r)
    goals = []
    if "restore" in last:
        goals += [("received per rank <= 4 MB", max(last["restore"]["bytes_first"], last["restore"]["bytes_rank"]) <= TARGET_BYTES),
                  ("choice <= 1 s", last["restore"]["choice_s"] <= TARGET_CHOICE_S)]
    if "commit" in last:
        goals.append(("commit < 2 s (wall)", last["commit"]["seconds"] < TARGET_COMMIT_S))
        goals.append(("commit < 2 s (CPU)", last["commit"]["cpu_seconds"] < TARGET_COMMIT_S))
    for what, met in goals:
        print(f"goal at {last['ranks']:,} ranks, {what}: {'met' if met else 'NOT met'}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "scale_sim.json"), "w") as f:
        json.dump(rows, f, indent=1, default=str)
    return 0 if ok and all(m for _w, m in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
