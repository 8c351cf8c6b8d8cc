"""Node-local roots, proven with two real ``torchrun`` node agents on one host.

Each "node" is one ``python -m torch.distributed.run --nnodes=N --node-rank=i`` agent (c10d
rendezvous on loopback); its ranks get their own local root through ``CKPT_ROOT`` (every rank passes
the same kind of path, but the nodes' directories differ, as the same ``/nvme/ckpt`` is a different
disk on every node). The per-rank body is ``tests/multinode_ranks.py``; each rank writes a JSON result
that the test reads. After the jobs the test runs the real CLI on every node's root
(``ckptstore list --json``, ``ckptstore scrub``) and prints a transcript (``-s``): per node, the
versions held, bytes on disk, remote reads during the restore, scrub exit codes.

Remote reads are counted twice: by the reader (``reader.stats["remote_reads"]``) and at the tier
boundary, by a counting TCP proxy in front of SeaweedFS (one per node, so the counts say which node's
ranks read): a GET of a stored object (``*.ckd``) through it is a remote data read.

Cases: (a) local only, save x5 (KeepLast(2)), restart, restore; (b) the same with SeaweedFS
(KeepLast(2) local, KeepLast(4) remote), restore with zero remote reads; (c) node 1's root emptied
(a replaced node): only node 1's ranks read remote; (d) local-only resharded loads 4 -> 2 and 2 -> 3
(objects on the other node fetched from a peer rank, or a clear error); (e) one shared root (all
ranks one group); (f) re-saving an existing name from a fresh root with the same remote (both
durabilities) is refused before anything is committed; (g) a mixed layout (two ranks share a root, a
third has its own); (h) node 1's manifest copy of the newest version missing (a crash between the
coordinator's commit and the copy): the job agrees on one version that loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ckptstore import errors as _errors

#: names of ckptstore's typed errors (what a rank's error chain must contain to count as "clear")
CKPT_ERRORS = {n for n, c in vars(_errors).items() if isinstance(c, type) and issubclass(c, _errors.CkptStoreError)}
REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "multinode_ranks.py"
JOB_TIMEOUT = float(os.environ.get("CKPTSTORE_MN_TIMEOUT", "240"))  # seconds per torchrun job
VERSIONS = [f"v{i}" for i in range(5)]
# also count GETs of manifests (not only of stored objects) as remote reads in case (b)
STRICT_GETS = os.environ.get("CKPTSTORE_MN_STRICT_GETS") == "1"
TRANSCRIPT: list[str] = []

# two or three torchrun jobs per case, each ≈ 45-60 s on 2 busy cores (agent + worker start-up dominates)
pytestmark = pytest.mark.timeout(900)


def say(line: str = "") -> None:
    TRANSCRIPT.append(line)
    print(line, flush=True)


# -- launcher ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Node:
    root: str
    nproc: int = 2
    env: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Job:
    phase: str
    out: Path
    logs: list
    codes: list
    results: dict  # rank -> JSON result
    seconds: float

    def log_text(self) -> str:
        parts = []
        for i, p in enumerate(self.logs):
            try:
                text = Path(p).read_text(errors="replace")
            except OSError:
                text = "(no log)"
            parts.append(f"===== node {i} agent log ({p}), exit {self.codes[i]} =====\n{text[-12000:]}")
        return "\n".join(parts)

    def ranks(self, *, node: int | None = None) -> list[dict]:
        return [r for _, r in sorted(self.results.items()) if node is None or r["node"] == node]

    def errors(self) -> str:
        return "\n".join(
            f"rank {r['rank']} (node {r['node']}): " + "; ".join(
                f"[failing rank {e['rank']}] {' <- '.join(e['types'])}: {e['message'][:400]}" for e in r["errors"]
            )
            for r in self.ranks() if not r.get("ok")
        )

    def check(self, world: int) -> "Job":
        """Every agent exited 0 and every rank reported; otherwise fail with the agents' logs."""
        if self.codes != [0] * len(self.codes) or sorted(self.results) != list(range(world)):
            pytest.fail(
                f"torchrun job {self.phase!r}: agent exit codes {self.codes}, ranks reported "
                f"{sorted(self.results)} of {world}\n{self.errors()}\n{self.log_text()}", pytrace=False
            )
        return self

    def ok(self, world: int) -> "Job":
        """:meth:`check`, and no rank's phase raised (else fail with the ranks' real errors)."""
        self.check(world)
        if not all(r["ok"] for r in self.ranks()):
            pytest.fail(f"torchrun job {self.phase!r} failed on some ranks:\n{self.errors()}", pytrace=False)
        return self


def _job_pids(tag: str) -> list[int]:
    """Processes of one job: every agent and worker inherits ``CKPTSTORE_MN_JOB=<tag>`` (torchrun
    starts its workers in new sessions, so a process-group kill would miss them, and a worker whose
    agent died is no longer its child)."""
    needle = f"CKPTSTORE_MN_JOB={tag}".encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(d))
        except OSError:
            continue
    return out


def _kill_job(tag: str) -> list[int]:
    pids = _job_pids(tag)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_job_count = 0


def run_job(tmp: Path, phase: str, nodes: list[Node], *args: str, timeout: float = JOB_TIMEOUT) -> Job:
    """Start one ``torchrun`` agent per node (c10d rendezvous on loopback), wait for all of them
    (killing every agent and worker after ``timeout`` seconds) and collect the per-rank results."""
    global _job_count
    _job_count += 1
    out = tmp / f"job{_job_count:02d}-{phase}"
    out.mkdir(parents=True)
    port, rid = _free_port(), uuid.uuid4().hex[:12]
    procs, logs = [], []
    t0 = time.monotonic()
    for i, node in enumerate(nodes):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={len(nodes)}", f"--nproc-per-node={node.nproc}", f"--node-rank={i}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rid}",
            f"--rdzv-conf=join_timeout={int(timeout)},is_host={'true' if i == 0 else 'false'}",
            "--max-restarts=0", "--monitor-interval=0.2", "--local-addr=127.0.0.1",
            str(WORKER), phase, "--out", str(out), *args,
        ]
        env = dict(os.environ)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CKPTSTORE_FAULT"):
            env.pop(k, None)
        env.update({
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")]),
            "CKPT_ROOT": node.root, "OMP_NUM_THREADS": "1", "CKPTSTORE_THREADS": "2",
            "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1",
        })
        env.update(node.env)
        env["CKPTSTORE_MN_JOB"] = rid
        log = out / f"node{i}.log"
        logs.append(log)
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(cmd, env=env, cwd=str(REPO), stdin=subprocess.DEVNULL, stdout=f,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    codes: list = [None] * len(procs)
    deadline = t0 + timeout
    try:
        while any(c is None for c in codes) and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                codes[i] = p.poll()
            if any(c not in (None, 0) for c in codes):  # one node failed: the others get 30 s more
                deadline = min(deadline, time.monotonic() + 30)
            time.sleep(0.2)
    finally:
        timed_out = any(c is None for c in codes)  # (or interrupted): end every agent and worker
        left = _kill_job(rid)
        for i, p in enumerate(procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
            if codes[i] is None:
                codes[i] = f"killed after {time.monotonic() - t0:.0f}s"
        if left and not timed_out:
            say(f"  [{phase}] killed {len(left)} process(es) left behind after the agents exited")
    results = {}
    for f in sorted(out.glob(f"{phase}-rank*.json")):
        r = json.loads(f.read_text())
        results[r["rank"]] = r
    job = Job(phase, out, logs, codes, results, round(time.monotonic() - t0, 1))
    say(f"  [{phase}] {len(nodes)} agents x {[n.nproc for n in nodes]} ranks: exit {codes}, {job.seconds} s")
    return job


# -- the CLI on one node's root ------------------------------------------------------------------
def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "ckptstore.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def disk(root: str) -> tuple[int, list[str], list[str]]:
    """(bytes of every file under ``root``, version directories holding any file, those with a manifest)."""
    total, dirs, committed = 0, set(), set()
    vroot = Path(root) / "versions"
    for dp, _dn, files in os.walk(root):
        for f in files:
            p = Path(dp) / f
            try:
                total += p.stat().st_size
            except OSError:
                continue
            try:
                rel = p.relative_to(vroot)
            except ValueError:
                continue
            dirs.add(rel.parts[0])
            if len(rel.parts) == 2 and rel.parts[1] == "manifest.json":
                committed.add(rel.parts[0])
    return total, sorted(dirs), sorted(committed)


@dataclasses.dataclass
class NodeReport:
    node: int
    root: str
    listed: list
    records: list
    list_rc: int
    scrub_rc: int
    scrub_out: str
    nbytes: int
    dirs_on_disk: list
    manifests_on_disk: list


def inspect_node(i: int, root: str, remote: str | None = None) -> NodeReport:
    extra = ["--remote", remote] if remote else []
    lst = cli("list", root, "--json", *extra)
    try:
        records = json.loads(lst.stdout)["versions"] if lst.returncode == 0 else []
    except (ValueError, KeyError):
        records = []
    sc = cli("scrub", root, *extra)
    nbytes, dirs, manifests = disk(root)
    rep = NodeReport(i, root, [r["version"] for r in records], records, lst.returncode, sc.returncode,
                     (sc.stdout + sc.stderr).strip(), nbytes, dirs, manifests)
    tiers = {r["version"]: r.get("tiers") for r in records}
    say(f"  node {i}: list rc={lst.returncode} versions={rep.listed} tiers={tiers}")
    say(f"          on disk: {nbytes} bytes, version dirs {dirs}, with a manifest {manifests}")
    say(f"          scrub{' --remote' if remote else ''} rc={sc.returncode}: " + rep.scrub_out.replace("\n", " | ")[:400])
    if lst.returncode:
        say(f"          list stderr: {lst.stderr.strip()[:400]}")
    return rep


def local_only_part(rec: dict) -> bool:
    """``list --json`` says this node holds only a part of the version: a tier
    named like ``local(part 2/4)``, or a field whose name has "part" and that says not whole (a
    ``Part.to_json()`` dict with ``whole: false``, or a non-empty label)."""
    if any("part" in str(t) for t in rec.get("tiers", [])):
        return True
    for k, v in rec.items():
        if "part" not in k.lower():
            continue
        if isinstance(v, dict) and any(isinstance(x, dict) and x.get("whole") is False for x in v.values()):
            return True  # {"local": {"index", "count", "ranks", "whole"}}
        if isinstance(v, dict):
            if v.get("whole") is False or (v.get("count", 1) or 1) > 1 and v.get("whole") is not True:
                return True
        elif isinstance(v, str) and v:
            return True
        elif isinstance(v, list) and any(isinstance(x, dict) and x.get("whole") is False for x in v):
            return True
    return False


# -- counting proxy in front of SeaweedFS (requests at the tier boundary): tests/counting_proxy.py --
from counting_proxy import CountingProxy  # noqa: E402  (test_replicas imports it from here too)


@pytest.fixture
def proxies(seaweed, s3_env):
    made: list[CountingProxy] = []

    def make(n: int) -> list[CountingProxy]:
        for _ in range(n):
            made.append(CountingProxy(seaweed.endpoint))
        return made[-n:]

    yield make
    for p in made:
        p.close()


# -- helpers shared by the cases -----------------------------------------------------------------
def roots(tmp: Path, n: int = 2) -> list[str]:
    return [str(tmp / f"node{i}") for i in range(n)]


def save5(tmp: Path, nodes: list[Node], world: int, *extra: str) -> Job:
    say(f"  save x{len(VERSIONS)} ({' '.join(extra) or 'local only'})")
    job = run_job(tmp, "save", nodes, "--versions", ",".join(VERSIONS), *extra).ok(world)
    for r in job.ranks():
        assert [s["version"] for s in r["saved"]] == VERSIONS
        assert r["close"]["ok"], f"rank {r['rank']}: close() raised: {r['close']}"
    return job


def restore(tmp: Path, nodes: list[Node], world: int, *extra: str, expect: str = VERSIONS[-1],
            problems: list[str]) -> Job:
    """Load with no version on a fresh job; every rank must load ``expect`` bit-exactly. What went
    wrong is appended to ``problems`` (so that one run reports every defect, not the first)."""
    job = run_job(tmp, "load", nodes, "--expect", expect, *extra).check(world)
    for r in job.ranks():
        if r["ok"]:
            say(f"  rank {r['rank']} (node {r['node']}): loaded {r['loaded']!r} reader says {r['reader_version']!r} "
                f"bytes_equal={r['bytes_equal']} stats={r['stats']} in {r.get('load_seconds')} s")
            if r["loaded"] != expect:
                problems.append(f"rank {r['rank']} loaded {r['loaded']!r}, expected the newest {expect!r}")
            if not r["bytes_equal"]:
                problems.append(f"rank {r['rank']}: entries differ from what was saved: {r['mismatches']}")
    if not all(r["ok"] for r in job.ranks()):
        say("  restore raised:\n    " + job.errors().replace("\n", "\n    "))
        problems.append(f"restore raised:\n{job.errors()}")
    return job


def check_roots(reports: list[NodeReport], keep: int, split: bool, newest: list[str], problems: list[str]) -> None:
    """Per node root: ``list`` shows ``newest``, at most ``keep`` committed versions and no data of
    other versions on disk, ``scrub`` exits 0, and ``list --json`` says part/whole as ``split``."""
    for rep in reports:
        p = problems.append
        held = [r for r in rep.records if any(str(t).startswith("local") for t in r.get("tiers", []))]
        local = [r["version"] for r in held]
        if rep.list_rc != 0:
            p(f"node {rep.node}: ckptstore list exited {rep.list_rc}")
        if local != newest:
            p(f"node {rep.node}: list shows {local} in its local tier, expected {newest}")
        if len(rep.manifests_on_disk) > keep:
            p(f"node {rep.node}: {rep.manifests_on_disk} committed on disk, KeepLast({keep})")
        if not set(rep.dirs_on_disk) <= set(local):
            p(f"node {rep.node}: version directories {rep.dirs_on_disk} on disk ({rep.nbytes} bytes), only "
              f"{local} listed locally (the root keeps data that retention or the catalogue does not see)")
        if rep.scrub_rc != 0:
            p(f"node {rep.node}: ckptstore scrub exited {rep.scrub_rc}: {rep.scrub_out[:300]}")
        for rec in held:
            if local_only_part(rec) != split:
                p(f"node {rep.node}: list --json for {rec['version']} says {'a part' if local_only_part(rec) else 'whole'}"
                  f", expected {'a part' if split else 'the whole version'}: tiers={rec.get('tiers')}")


def verdict(problems: list[str]) -> None:
    if problems:
        pytest.fail(f"{len(problems)} problem(s):\n- " + "\n- ".join(problems), pytrace=False)


# -- (a) local only: save x5, restart, restore ---------------------------------------------------
# slow: two torchrun agents take ~45 s here; the default set's representative case of the same
# behaviour is tests/test_node_roots.py::test_two_nodes_local_only_save_prune_restore (spawned ranks)
@pytest.mark.slow
def test_two_nodes_local_only_save_restore(tmp_path):
    say("\n=== (a) 2 nodes x 2 ranks, node-local roots, local only, KeepLast(2) ===")
    r = roots(tmp_path)
    nodes = [Node(r[0]), Node(r[1])]
    save5(tmp_path, nodes, 4)
    reports = [inspect_node(i, root) for i, root in enumerate(r)]
    problems: list[str] = []
    check_roots(reports, 2, split=True, newest=VERSIONS[-2:], problems=problems)
    restore(tmp_path, nodes, 4, problems=problems)
    verdict(problems)


# -- (b) local + SeaweedFS: restore with zero remote reads ----------------------------------------
@pytest.mark.slow
@pytest.mark.s3
def test_two_nodes_with_s3_restore_reads_no_remote(tmp_path, s3_url, proxies):
    say("\n=== (b) 2 nodes x 2 ranks, node-local roots + SeaweedFS, KeepLast(2) local / KeepLast(4) remote ===")
    r = roots(tmp_path)
    save5(tmp_path, [Node(r[0]), Node(r[1])], 4, "--remote", s3_url)
    reports = [inspect_node(i, root, s3_url) for i, root in enumerate(r)]
    px = proxies(2)
    nodes = [Node(r[i], env={"AWS_ENDPOINT_URL": px[i].endpoint}) for i in range(2)]
    problems: list[str] = []
    check_roots(reports, 2, split=True, newest=VERSIONS[-2:], problems=problems)
    job = restore(tmp_path, nodes, 4, "--remote", s3_url, problems=problems)
    counts = [p.summary() for p in px]
    say(f"  S3 requests during the restore, per node (counting proxy): {counts}")
    say(f"  remote reads per rank (reader.stats): {[x.get('remote_reads') for x in job.ranks()]}")
    for i, c in enumerate(counts):
        if c["object_gets"]:
            problems.append(f"node {i}: {c['object_gets']} object GETs from S3 during a same-node restore")
        if STRICT_GETS and c["object_gets"] + c["manifest_gets"]:
            problems.append(f"node {i}: {c['manifest_gets']} manifest GETs from S3 during a same-node restore "
                            "(CKPTSTORE_MN_STRICT_GETS=1)")
    for x in job.ranks():
        if x["ok"] and x.get("remote_reads") != 0:
            problems.append(f"rank {x['rank']}: reader.stats['remote_reads'] = {x.get('remote_reads')!r} "
                            f"(stats {x['stats']}); a same-node restore must read nothing from S3")
    remote = cli("list", "--json", "--remote", s3_url, str(tmp_path / "absent"))
    listed = [v["version"] for v in json.loads(remote.stdout)["versions"]] if remote.returncode == 0 else remote.stderr
    say(f"  remote tier holds: {listed}")
    if listed != VERSIONS[-4:]:
        problems.append(f"remote tier holds {listed}, expected {VERSIONS[-4:]} (KeepLast(4))")
    verdict(problems)


# -- (c) node 1 replaced (empty root): only node 1's ranks read from S3 ----------------------------
@pytest.mark.slow
@pytest.mark.s3
def test_replaced_node_reads_only_its_part_from_s3(tmp_path, s3_url, proxies):
    say("\n=== (c) 2 nodes x 2 ranks + SeaweedFS; node 1's root emptied (replaced node) ===")
    r = roots(tmp_path)
    save5(tmp_path, [Node(r[0]), Node(r[1])], 4, "--remote", s3_url)
    shutil.rmtree(r[1])
    px = proxies(2)
    nodes = [Node(r[i], env={"AWS_ENDPOINT_URL": px[i].endpoint}) for i in range(2)]
    problems: list[str] = []
    job = restore(tmp_path, nodes, 4, "--remote", s3_url, problems=problems)
    counts = [p.summary() for p in px]
    say(f"  S3 requests during the restore, per node (counting proxy): {counts}")
    say(f"  remote reads per rank (reader.stats): {[x.get('remote_reads') for x in job.ranks()]}")
    if not counts[1]["object_gets"]:
        problems.append("node 1 (empty root) read no object from S3, yet it holds nothing")
    # Only the replaced node's objects come from S3. The intact node reads from S3 only the items DCP
    # stored once for all ranks (replicated entries) in a replaced-node rank's object.
    lost = ("/r00002.ckd", "/r00003.ckd")
    for x in job.ranks():
        rr = x.get("remote_reads")
        if not x["ok"]:
            continue
        keys = x.get("remote_keys") or []
        say(f"  rank {x['rank']} (node {x['node']}) GET from S3: {[k.rsplit('/', 1)[-1] for k in keys]}")
        if x["node"] == 0 and not all(k.endswith(lost) for k in keys):
            problems.append(f"rank {x['rank']} on the intact node read its own node's objects from S3: {keys}")
        if x["node"] == 1 and not (isinstance(rr, int) and rr > 0):
            problems.append(f"rank {x['rank']} on the replaced node: remote_reads={rr!r} (stats {x['stats']})")
    for i, root in enumerate(r):
        inspect_node(i, root, s3_url)
    verdict(problems)


# -- (d) local-only resharded loads: peer fetch or a clear error ----------------------------------
RESHARD = [
    pytest.param([2, 2], [1, 1], id="4to2"),
    pytest.param([1, 1], [2, 1], id="2to3"),
]


def _say_ranks(job: Job) -> None:
    for x in job.ranks():
        if x["ok"]:
            say(f"  rank {x['rank']} (node {x['node']}): loaded {x['loaded']!r} bytes_equal={x['bytes_equal']} "
                f"stats={x['stats']}")
        else:
            say(f"  rank {x['rank']} (node {x['node']}): raised " + "; ".join(
                f"{' <- '.join(e['types'])}: {e['message'][:300]}" for e in x["errors"]))


@pytest.mark.slow
@pytest.mark.parametrize("save_layout,load_layout", RESHARD)
def test_resharded_local_only_load(tmp_path, save_layout, load_layout):
    """Every rank loads bit-exact data; the objects on the other node come from a rank that holds
    them (peer fetch through torch.distributed during ``dcp.load``): there is no remote tier."""
    sw, lw = sum(save_layout), sum(load_layout)
    say(f"\n=== (d) local only, resharded load {sw} -> {lw} (agents {save_layout} -> {load_layout}), node-local roots ===")
    r = roots(tmp_path)
    run_job(tmp_path, "save", [Node(r[i], n) for i, n in enumerate(save_layout)], "--versions", "v0,v1").ok(sw)
    for i, root in enumerate(r):
        inspect_node(i, root)
    job = run_job(tmp_path, "load", [Node(r[i], n) for i, n in enumerate(load_layout)], "--expect", "v1",
                  "--save-world", str(sw)).check(lw)
    _say_ranks(job)
    problems: list[str] = []
    if not all(x["ok"] for x in job.ranks()):
        problems.append("the resharded load raised (the objects exist on a peer node, so a peer fetch was "
                        f"expected):\n{job.errors()}")
    for x in job.ranks():
        if x["ok"] and not (x["loaded"] == "v1" and x["bytes_equal"]):
            problems.append(f"rank {x['rank']}: loaded {x['loaded']!r}, differing entries {x['mismatches']}")
    verdict(problems)


@pytest.mark.slow
def test_resharded_load_objects_held_by_no_rank_is_a_clear_error(tmp_path):
    """4 -> 2, local only, node 1's shard objects of v1 deleted (its manifest copy kept): no rank holds
    them, so every rank gets one clear typed error naming the missing objects — never a hang, a
    wrong tensor, or "no committed version"."""
    say("\n=== (d') local only, 4 -> 2, node 1's shard objects of v1 lost: a clear error ===")
    r = roots(tmp_path)
    run_job(tmp_path, "save", [Node(r[0]), Node(r[1])], "--versions", "v0,v1").ok(4)
    lost = sorted(p for p in (Path(r[1]) / "versions" / "v1").rglob("r0000*.ckd"))
    for p in lost:
        p.unlink()
    say(f"  removed from node 1: {[p.name for p in lost]}")
    job = run_job(tmp_path, "load", [Node(r[0], 1), Node(r[1], 1)], "--version", "v1", "--save-world", "4").check(2)
    _say_ranks(job)
    problems: list[str] = []
    if not lost:
        problems.append("node 1 held no shard object of v1 to remove (its ranks' objects are not on its root)")
    for x in job.ranks():
        if x["ok"]:
            problems.append(f"rank {x['rank']}: the load returned although r00002/r00003 exist nowhere "
                            f"(bytes_equal={x['bytes_equal']})")
            continue
        msgs = " ".join(e["message"] for e in x["errors"])
        types = {t for e in x["errors"] for t in e["types"]}
        if "VersionNotFoundError" in types:
            problems.append(f"rank {x['rank']}: v1 is committed, yet VersionNotFoundError: {msgs[:300]}")
        if "r00002.ckd" not in msgs and "r00003.ckd" not in msgs:
            problems.append(f"rank {x['rank']}: the error does not name the missing objects: {msgs[:300]}")
        if not types & CKPT_ERRORS:
            problems.append(f"rank {x['rank']}: not a ckptstore error {sorted(types)}: {msgs[:300]}")
    verdict(problems)


# -- (e) one shared root: all ranks one group ------------------------------------------------------
@pytest.mark.slow
def test_shared_root_two_agents(tmp_path):
    say("\n=== (e) 2 nodes x 2 ranks, one shared root, local only, KeepLast(2) ===")
    root = str(tmp_path / "shared")
    nodes = [Node(root), Node(root)]
    save5(tmp_path, nodes, 4)
    rep = inspect_node(0, root)
    problems: list[str] = []
    check_roots([rep], 2, split=False, newest=VERSIONS[-2:], problems=problems)
    restore(tmp_path, nodes, 4, problems=problems)
    verdict(problems)


# -- (g) mixed layout: two ranks share a root, a third has its own ----------------------------------
@pytest.mark.slow
def test_mixed_layout_save_restore(tmp_path):
    say("\n=== (g) mixed: node 0 has 2 ranks on one root, node 1 one rank on its own root; local only ===")
    r = roots(tmp_path)
    nodes = [Node(r[0], 2), Node(r[1], 1)]
    save5(tmp_path, nodes, 3)
    reports = [inspect_node(i, root) for i, root in enumerate(r)]
    problems: list[str] = []
    check_roots(reports, 2, split=True, newest=VERSIONS[-2:], problems=problems)
    restore(tmp_path, nodes, 3, problems=problems)
    verdict(problems)


# -- (f) one name, one version, across tiers --------------------------------------------------------
@pytest.mark.slow
@pytest.mark.s3
def test_resave_existing_name_from_fresh_root_is_refused(tmp_path, s3_url):
    say("\n=== (f) 'v' saved and uploaded from job A; job B (fresh roots, same remote) saves other data as 'v' ===")
    ra = roots(tmp_path / "A")
    job = run_job(tmp_path, "save", [Node(ra[0]), Node(ra[1])], "--versions", "v", "--salt", "A",
                  "--remote", s3_url).ok(4)
    assert all(x["close"]["ok"] for x in job.ranks()), job.ranks()
    rb = roots(tmp_path / "B")
    job = run_job(tmp_path, "resave", [Node(rb[0]), Node(rb[1])], "--versions", "v", "--salt", "B",
                  "--expect-salt", "A", "--remote", s3_url).ok(4)
    seen: dict[str, list[int]] = {}  # problem -> ranks (one line per problem, not per rank)

    def problem(text: str, rank: int) -> None:
        seen.setdefault(text, []).append(rank)

    for durability in ("local", "remote"):
        for x in job.ranks():
            rs = x["resave"][durability]
            save_types = {t for e in rs["save"].get("errors", []) for t in e["types"]}
            say(f"  durability={durability} rank {x['rank']}: save ok={rs['save']['ok']} "
                f"errors={sorted(save_types)} close ok={rs['close']['ok']} "
                f"then load: {rs.get('loaded')!r} bytes_equal(A)={rs.get('bytes_equal')} "
                f"{'load error ' + str(rs['load_error'])[:300] if 'load_error' in rs else ''}")
            if rs["save"]["ok"]:
                problem(f"{durability}: dcp.save of a name that exists remotely returned normally", x["rank"])
            elif "VersionExistsError" not in save_types:
                problem(f"{durability}: save raised {sorted(save_types)}, not VersionExistsError", x["rank"])
            if not rs["close"]["ok"]:
                problem(f"{durability}: close() raised " + "; ".join(
                    f"{'<-'.join(e['types'])}: {e['message'][:200]}" for e in rs["close"]["errors"]), x["rank"])
            if not rs.get("bytes_equal"):
                what = rs.get("mismatches") or "; ".join(
                    f"{'<-'.join(e['types'])}: {e['message'][:200]}" for e in rs.get("load_error", [])[:1])
                problem(f"{durability}: loading 'v' from the fresh root + remote did not return A's data: {what}",
                        x["rank"])
        for i, root in enumerate(rb):
            fresh = os.path.join(root, durability)
            _n, dirs, manifests = disk(fresh)
            say(f"  durability={durability} node {i}: fresh root committed {manifests}, version dirs {dirs}")
            if manifests:
                problem(f"{durability}: node {i}'s fresh root committed {manifests} locally", -1)
    problems = [f"{t} (ranks {sorted(set(r))})" if r != [-1] else t for t, r in seen.items()]
    remote = cli("list", "--json", "--remote", s3_url, str(tmp_path / "absent"))
    say(f"  remote list rc={remote.returncode}: {remote.stdout.strip()[:300]}")
    verdict(problems)


# -- (h) a root that holds its objects but not yet the manifest copy: the job agrees on a version -------
@pytest.mark.slow
def test_missing_manifest_copy_on_one_node_agreed_version(tmp_path):
    """What a crash between the coordinator's commit and node 1's manifest copy leaves, made by hand:
    node 1's copy of v4's manifest removed. Node 1 must not list v4; the next load on both nodes
    agrees on one version (v4 repaired, or v3) and every rank loads it bit-exactly."""
    say("\n=== (h) 2 nodes x 2 ranks, local only; node 1's manifest copy of v4 removed (crash before the copy) ===")
    r = roots(tmp_path)
    nodes = [Node(r[0]), Node(r[1])]
    save5(tmp_path, nodes, 4)
    problems: list[str] = []
    copy = Path(r[1]) / "versions" / VERSIONS[-1] / "manifest.json"
    if copy.exists():
        copy.unlink()
    else:
        problems.append(f"node 1 holds no manifest copy of {VERSIONS[-1]} to remove (the copies are not made)")
    rep = inspect_node(1, r[1])
    if VERSIONS[-1] in rep.listed:
        problems.append(f"node 1 lists {VERSIONS[-1]} although its manifest copy is missing")
    job = run_job(tmp_path, "load", nodes).check(4)
    loaded = {x["rank"]: x.get("loaded") for x in job.ranks()}
    say(f"  loaded per rank: {loaded}; errors: {job.errors() or 'none'}")
    if not all(x["ok"] for x in job.ranks()):
        problems.append(f"the load raised:\n{job.errors()}")
    elif len(set(loaded.values())) != 1 or set(loaded.values()) - set(VERSIONS[-2:]):
        problems.append(f"ranks loaded {loaded}: not one agreed version among {VERSIONS[-2:]}")
    for x in job.ranks():
        if x["ok"] and not x["bytes_equal"]:
            problems.append(f"rank {x['rank']}: entries differ from what {x['loaded']!r} saved: {x['mismatches']}")
    for i, root in enumerate(r):
        inspect_node(i, root)
    verdict(problems)


@pytest.fixture(scope="module", autouse=True)
def _transcript_file(tmp_path_factory):
    """The transcript (also printed live with ``-s``) is written to ``<basetemp>/multinode_transcript.txt``."""
    yield
    if TRANSCRIPT:
        path = tmp_path_factory.getbasetemp() / "multinode_transcript.txt"
        path.write_text("\n".join(TRANSCRIPT) + "\n")
        print(f"\n(issue-10 transcript written to {path})", flush=True)
