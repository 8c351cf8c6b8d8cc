"""The faults of ``ckptstore demo --chaos``, made real: signals, file damage, a full file system, a stopped
S3 server, the operator's own commands, a clock ahead. One :class:`Injector` per scheduled fault.

Each kind is a generator (``KIND_STEPS``) that acts on the running job and yields :class:`Wait` objects
(a time, or a condition with a timeout) between its actions; the supervisor's loop advances it, so
faults overlap without threads (a server start and the operator's commands run as processes or in a
thread of their own). Every action is recorded with its time. Cleanup (start S3 again, free the disk,
put the clock back) sits in ``finally`` blocks, run also when the run's time is up.

What a fault touches depends on the job (:class:`Targets`): ckptstore's node-local roots
(``ckptstore gc``/``ckptstore drop`` are the operator's commands there), or the stock-DCP peer's
folder on a file system both nodes share (the only way stock DCP works across nodes: ``.metadata`` is
written by rank 0 alone), where the operator's commands are what people run on such folders: keep the
newest ``step-N`` folder (``ls step-* | sort -V | head -n -1 | xargs rm -rf``), or remove the newest one.
"""

from __future__ import annotations

import glob
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from rich.markup import escape

from . import worker
from .clockexec import faketime_env, read_offset
from .schedule import KINDS, Fault


@dataclass
class Wait:
    """Resume the fault after ``seconds``, or once ``until()`` is true (``timeout``: give up, False)."""

    seconds: float | None = None
    until: Callable[[], Any] | None = None
    timeout: float | None = None


class Targets:
    """What the ckptstore job's faults touch."""

    flavour = "ckptstore"

    def __init__(self, job) -> None:
        self.job = job
        self.cfg = job.cfg

    def root(self, node: int) -> str:
        return self.cfg["node_roots"][node]

    def disk(self, node: int) -> str:
        """The file system a node's checkpoints live on (a tmpfs mount point when running as root)."""
        return os.path.dirname(self.root(node))

    def wipe(self, node: int) -> str:
        self.job.wipe(self.disk(node))
        return self.disk(node)

    def newest(self, node: int) -> str | None:
        import ckptstore

        try:
            st = ckptstore.Store(self.root(node))
            recs = [r for r in st.versions() if "local" in r.tiers]
            st.close()
        except Exception:  # noqa: BLE001 - nothing committed there yet
            return None
        return recs[-1].version if recs else None

    def newest_object(self, node: int, rank: int) -> tuple[str, str] | None:
        """(version, path) of ``rank``'s object of the newest committed version in ``node``'s root."""
        import ckptstore
        from ckptstore.manifest import layout
        from ckptstore.tiers.local import LocalTier

        v = self.newest(node)
        if v is None:
            return None
        st = ckptstore.Store(self.root(node))
        try:
            m = st.manifest(v, "local").manifest
        finally:
            st.close()
        names = [o.name for o in m.objects if o.name.endswith(f"r{rank:05d}.ckd")] or [o.name for o in m.objects]
        tier = LocalTier(self.root(node))
        for name in names:
            p = tier.local_path(layout.object_key(v, name))
            if os.path.exists(p):
                return v, p
        return None

    def operator_gc(self, node: int) -> list[str]:
        return ["gc", self.root(node), "--keep-last", "1", *self._remote()]

    def operator_drop(self, node: int) -> list[str] | None:
        v = self.newest(node)
        return None if v is None else ["drop", self.root(node), v, "--yes", *self._remote()]

    def _remote(self) -> list[str]:
        return ["--remote", self.cfg["remote"]] if self.cfg.get("remote") else []


class DcpTargets(Targets):
    """What the stock-DCP peer's faults touch: its shared ``step-N`` folders."""

    flavour = "dcp"
    _STEP = re.compile(r"step-(\d+)$")

    def folder(self) -> str:
        return self.cfg["dcp_folder"]

    def disk(self, node: int) -> str:
        return os.path.dirname(self.folder())

    def wipe(self, node: int) -> str:
        d = os.path.join(self.job.node_dirs[node], "disk")  # the node's own disk: no checkpoint of the peer on it
        self.job.wipe(d)
        return d

    def _folders(self, complete: bool) -> list[tuple[int, str]]:
        out = []
        for p in glob.glob(os.path.join(self.folder(), "step-*")):
            m = self._STEP.search(p)
            if m and (not complete or os.path.exists(os.path.join(p, ".metadata"))):
                out.append((int(m.group(1)), p))
        return sorted(out)

    def newest(self, node: int) -> str | None:
        f = self._folders(True)
        return os.path.basename(f[-1][1]) if f else None

    def newest_object(self, node: int, rank: int) -> tuple[str, str] | None:
        f = self._folders(True)
        if not f:
            return None
        files = sorted(glob.glob(os.path.join(f[-1][1], f"__{rank}_*.distcp"))) or sorted(
            glob.glob(os.path.join(f[-1][1], "*.distcp")))
        return (os.path.basename(f[-1][1]), files[0]) if files else None

    def operator_gc(self, node: int) -> list[str]:  # keep the newest step-N folder (complete or not)
        return [sys.executable, "-c", "import shutil,sys\nfor p in sys.argv[1:]: shutil.rmtree(p)",
                *[p for _s, p in self._folders(False)[:-1]]]

    def operator_drop(self, node: int) -> list[str] | None:
        f = self._folders(True)
        return None if not f else [sys.executable, "-c", "import shutil,sys; shutil.rmtree(sys.argv[1])", f[-1][1]]


class Injector:
    """One fault on one job: advances its kind's generator; records what it did and when."""

    def __init__(self, job, fault: Fault, targets: Targets) -> None:
        self.job, self.f, self.x = job, fault, targets
        self.rng = random.Random(fault.seed)
        self.rec: dict[str, Any] = {**fault.to_json(), "ran": True, "actions": [], "injected_s": None,
                                    "window_end_s": None, "note": None}
        job.result.faults.append(self.rec)
        self.wait: Wait | None = None
        self.wait_t0 = 0.0
        self.gen: Iterator[Wait] = KIND_STEPS[fault.kind](self)
        self.finished = False
        job.slog("fault", index=fault.index, fault_kind=fault.kind, node=fault.node, rank=fault.rank)
        job.say(f"[bold yellow]fault {fault.index + 1} {fault.kind}[/bold yellow] (node {fault.node}, rank "
                f"{fault.rank}): {KINDS[fault.kind].what}")

    # -- the generator protocol -------------------------------------------------------------------
    def tick(self, now: float) -> bool:
        """Advance; True once the fault is over."""
        if self.finished:
            return True
        try:
            if self.wait is None:
                self._next(None)
            else:
                w = self.wait
                if w.seconds is not None and now - self.wait_t0 >= w.seconds:
                    self._next(True)
                elif w.until is not None and w.until():
                    self._next(True)
                elif w.timeout is not None and now - self.wait_t0 >= w.timeout:
                    self._next(False)
        except StopIteration:
            self._finish()
        except Exception as e:  # noqa: BLE001 - a fault that could not be injected is reported, not fatal
            self.rec["note"] = f"injection failed: {type(e).__name__}: {e}"
            self.job.slog("fault_error", index=self.f.index, error=self.rec["note"])
            self.job.say(f"[red]fault {self.f.index + 1}: {escape(self.rec['note'])}[/red]")
            self._finish()
        return self.finished

    def _next(self, value) -> None:
        self.wait = self.gen.send(value) if self.wait is not None else next(self.gen)
        self.wait_t0 = time.time()

    def _finish(self) -> None:
        self.finished = True
        self.rec["end_s"] = round(self.job.elapsed(), 2)
        self.job.slog("fault_end", index=self.f.index)

    def abort(self) -> None:
        """The run's time is up: close the generator (its ``finally`` cleans up)."""
        if not self.finished:
            try:
                self.gen.close()
            except Exception as e:  # noqa: BLE001
                self.rec["note"] = f"cleanup failed: {e}"
            self.rec["note"] = (self.rec["note"] or "") + " (cut short: the run's time was up)"
            self._finish()

    # -- actions -----------------------------------------------------------------------------------
    def act(self, what: str, **kw: Any) -> None:
        s = round(self.job.elapsed(), 2)
        if self.rec["injected_s"] is None:
            self.rec["injected_s"] = s
        self.rec["actions"].append({"s": s, "what": what, **kw})
        self.job.slog("fault_action", index=self.f.index, what=what, **kw)
        shown = {k: v for k, v in kw.items() if k != "output"}
        self.job.say(escape(f"  fault {self.f.index + 1}: {what}" + (f" {shown}" if shown else "")))

    def training(self, timeout: float = 180.0) -> Wait:
        t = time.time()
        return Wait(until=lambda: self.job.index.training_since(t), timeout=timeout)

    def next_save(self, timeout: float = 90.0) -> Wait:
        n = len(self.job.index.saves)
        return Wait(until=lambda: len(self.job.index.saves) > n, timeout=timeout)

    def kill_rank(self, rank: int, why: str = "SIGKILL") -> int | None:
        pid = self.job.index.pid(rank)
        if pid is None:
            self.act(f"no live process of rank {rank} to kill")
            return None
        self.job.kill_pids([pid], signal.SIGKILL)
        self.act(f"{why} rank {rank}", pid=pid)
        return pid

    def cli(self, node: int, args: list[str]) -> subprocess.Popen:
        """The operator's command on ``node`` (under that node's clock), output to the job's directory."""
        cmd = args if args and args[0] == sys.executable else [sys.executable, "-m", "ckptstore.cli", *args]
        env = dict(os.environ)
        off = read_offset(self.job.clock_file(node))
        if off:
            env = faketime_env(off, env)
        log = open(os.path.join(self.job.run_dir, f"fault{self.f.index + 1}-{self.f.kind}.log"), "ab")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.job.extra_pids.add(p.pid)
        return p

    def cli_output(self) -> str:
        try:
            with open(os.path.join(self.job.run_dir, f"fault{self.f.index + 1}-{self.f.kind}.log"), "rb") as f:
                return f.read().decode(errors="replace")[-1500:]
        except OSError:
            return ""


def _thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


# -- the kinds -----------------------------------------------------------------------------------------
def kill_rank_step(x: Injector):
    yield x.training()
    x.kill_rank(x.f.rank, "SIGKILL (mid-step)")


def kill_rank_save(x: Injector):
    yield x.training()
    if not (yield x.next_save()):
        x.act("no save started within 90 s; killing anyway")
    x.kill_rank(x.f.rank, "SIGKILL (save in flight)")


def node_lost(x: Injector):
    yield x.training()
    job, node = x.job, x.f.node
    job.hold.add(node)
    try:
        pids = job.kill_node(node)
        x.act(f"node {node} lost: SIGKILL its agent and ranks", pids=pids)
        yield Wait(seconds=0.5)
        x.act(f"node {node} replaced by an empty machine: its disk wiped", path=x.x.wipe(node))
    finally:
        job.hold.discard(node)


def preempt(x: Injector, *, after_kill: bool = False):
    job, node = x.job, x.f.node
    yield x.training()
    if after_kill:
        t = time.time()
        x.kill_rank(x.f.rank, "SIGKILL (to force a restart)")
        ok = yield Wait(until=lambda: any(e["kind"] == "init_done" and e["T"] > t for e in job.index.new), timeout=180)
        if not ok:
            x.act("the restarted job did not reach its restore within 180 s")
            return
    a = job.agents[node]
    if a is None or a.proc.poll() is not None:
        x.act(f"node {node} has no running agent to preempt")
        return
    a.proc.send_signal(signal.SIGTERM)
    x.act(f"SIGTERM to node {node}'s torchrun agent (forwarded to its ranks)"
          + (" while the job restores" if after_kill else ""), grace_s=job.grace_s)
    if not (yield Wait(until=lambda: a.proc.poll() is not None, timeout=job.grace_s)):
        x.act(f"grace period over: SIGKILL node {node}", pids=job.kill_node(node))


def preempt_in_restore(x: Injector):
    yield from preempt(x, after_kill=True)


def s3_down(x: Injector):
    job = x.job
    s3 = job.s3
    yield x.training()
    if s3 is None:  # the stock-DCP peer: no S3 tier to lose (the ckptstore job alongside it stops the server)
        x.act("this job has no S3 tier: the restart alone")
        x.kill_rank(x.f.rank, "SIGKILL (the job restarts, as the ckptstore job does while S3 is down)")
        return
    th = _thread(s3.stop)
    started = None
    try:
        yield Wait(until=lambda: not th.is_alive(), timeout=60)
        x.act("S3 endpoint stopped (SeaweedFS SIGTERM)")
        yield Wait(seconds=5)
        x.kill_rank(x.f.rank, "SIGKILL (the job restarts while S3 is down)")
        yield Wait(seconds=max(0.0, KINDS["s3-down"].window_s - 5))
        t0 = time.time()
        started = _thread(s3.start)
        yield Wait(until=lambda: not started.is_alive(), timeout=120)
        x.rec["window_end_s"] = round(job.elapsed(), 2)
        x.act("S3 endpoint started again", took_s=round(time.time() - t0, 1))
    finally:
        if th.is_alive():
            th.join()
        if started is None or started.is_alive():
            if started is not None:
                started.join()
            s3.start()
            x.rec["window_end_s"] = round(job.elapsed(), 2)


def _damage(x: Injector, how: str):
    yield x.training()
    got = x.x.newest_object(x.f.node, x.f.rank)
    if got is None:
        x.act("nothing committed on that node yet")
        return
    version, path = got
    rel = os.path.relpath(path, x.job.run_dir)
    if how == "flip":
        size = os.path.getsize(path)
        off = x.rng.randrange(min(64, size - 1), size)
        fd = os.open(path, os.O_RDWR)
        try:
            b = os.pread(fd, 1, off)
            os.pwrite(fd, bytes([b[0] ^ (1 << x.rng.randrange(8))]), off)
            os.fsync(fd)
        finally:
            os.close(fd)
        x.act(f"flipped one bit of byte {off} of {version}'s object on node {x.f.node}", path=rel, size=size)
    else:
        os.remove(path)
        x.act(f"deleted {version}'s object on node {x.f.node}", path=rel)
    x.kill_rank(x.f.rank, "SIGKILL (the restart must restore past the damage)")


def flip_byte(x: Injector):
    yield from _damage(x, "flip")


def delete_object(x: Injector):
    yield from _damage(x, "delete")


def fill(disk: str, filler: str) -> int:
    """Allocate the free space of the file system at ``disk`` to ``filler`` (16 MiB pieces, then pages,
    until nothing fits); returns the bytes allocated."""
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
    size = 0
    try:
        for piece in (16 << 20, 1 << 20, 64 << 10, 4096):
            while True:
                try:
                    os.posix_fallocate(fd, size, piece)
                except OSError:
                    break
                size += piece
    finally:
        os.close(fd)
    return size


def disk_full(x: Injector):
    disk = x.x.disk(x.f.node)
    filler = os.path.join(disk, "runaway.log")
    yield x.training()
    try:
        free = fill(disk, filler)
        st = os.statvfs(disk)
        x.act(f"node {x.f.node}'s file system filled to the last byte", path=os.path.relpath(disk, x.job.run_dir),
              filled=free, free_after=st.f_bavail * st.f_frsize)
        yield Wait(seconds=KINDS["disk-full"].window_s)
    finally:
        try:
            os.remove(filler)
        except OSError:
            pass
        x.rec["window_end_s"] = round(x.job.elapsed(), 2)
        x.act("the runaway file is rotated away: space is back")


def _operator(x: Injector, what: str):
    yield x.training()
    if not (yield x.next_save()):
        x.act("no save started within 90 s; running the command anyway")
    args = x.x.operator_gc(x.f.node) if what == "gc" else x.x.operator_drop(x.f.node)
    if args is None:
        x.act("nothing to drop on that node")
        return
    shown = " ".join(os.path.relpath(a, x.job.run_dir) if a.startswith(x.job.run_dir) else a for a in args[-6:])
    off = read_offset(x.job.clock_file(x.f.node))
    p = x.cli(x.f.node, args)
    x.act(f"operator on node {x.f.node}: " + (f"ckptstore {shown}" if x.x.flavour == "ckptstore" else
                                              f"{'keep the newest step folder' if what == 'gc' else 'rm -rf the newest step folder'}")
          + (f" (clock {off})" if off else ""), pid=p.pid)
    done = yield Wait(until=lambda: p.poll() is not None, timeout=180)
    x.act(f"operator's command ended (exit {p.returncode})" if done else "operator's command still running after 180 s",
          output=x.cli_output()[-600:])


def gc_during_save(x: Injector):
    yield from _operator(x, "gc")


def drop_during_save(x: Injector):
    yield from _operator(x, "drop")


def clock_jump(x: Injector):
    job, node = x.job, x.f.node
    yield x.training()
    try:
        job.set_clock(node, "+2h")
        pids = job.kill_pids(job.node_pids(node))
        x.act(f"node {node}'s clock jumps 2 h ahead: its ranks restart under it (libfaketime)", pids=pids)
        yield Wait(seconds=KINDS["clock-jump"].window_s)
    finally:
        # NTP steps the clock back. libfaketime cannot move a running process's clock, so the node's ranks
        # restart once more, under the true clock: a rank left 2 h ahead has every S3 request refused, and
        # the coordinator's remote commits wait upload_timeout for its markers, for the rest of the run
        job.set_clock(node, "+0")
        x.rec["window_end_s"] = round(job.elapsed(), 2)
        pids = job.kill_pids(job.node_pids(node))
        x.act(f"node {node}'s clock stepped back (NTP): its ranks restart under the true clock", pids=pids)


def nan(x: Injector):
    yield x.training()
    inbox = os.path.join(worker.control_dir(x.job.run_dir), worker.INBOX)
    os.makedirs(inbox, exist_ok=True)
    open(os.path.join(inbox, f"nan.r{x.f.rank}"), "w").close()
    x.act(f"rank {x.f.rank}'s next sample is corrupt (NaN in its logits from now on)")
    t = time.time()
    ok = yield Wait(until=lambda: any(e["kind"] in ("rollback", "fatal") and e["T"] > t for e in x.job.index.new),
                    timeout=300)
    if not ok:
        x.act("no reaction within 300 s")


KIND_STEPS: dict[str, Callable[[Injector], Iterator[Wait]]] = {
    "kill-rank-step": kill_rank_step,
    "kill-rank-save": kill_rank_save,
    "node-lost": node_lost,
    "preempt": preempt,
    "preempt-in-restore": preempt_in_restore,
    "s3-down": s3_down,
    "flip-byte": flip_byte,
    "delete-object": delete_object,
    "disk-full": disk_full,
    "gc-during-save": gc_during_save,
    "drop-during-save": drop_during_save,
    "clock-jump": clock_jump,
    "nan": nan,
}
assert set(KIND_STEPS) == set(KINDS)


def factory(targets_cls):
    """The supervisor's injector factory for a job whose faults touch ``targets_cls``."""

    def make(job, fault: Fault) -> Injector:
        return Injector(job, fault, targets_cls(job))

    return make
