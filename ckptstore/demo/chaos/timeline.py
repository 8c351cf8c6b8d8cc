"""What happened in one job of ``ckptstore demo --chaos``, from its event files (pure reading, no torch).

Times: every worker line carries ``up`` (the host's boot clock, which a jumped clock or libfaketime does
not move); the supervisor measured ``off`` (its wall clock minus the boot clock), so ``T = up + off`` puts
every line on the supervisor's clock.

**Which steps survived.** A *segment* is one stretch of training of rank 0: a worker generation (``gen``)
from its restore, or the part after a ``rollback`` (``seg``). A segment starts from a restored version
(or from scratch) and trains steps after it. The final state is the last segment's; it descends from the
version that segment restored, which the segment that *committed* that version (the last to commit that
name before the restore) trained, and so on back to a fresh start: the *lineage*. A step is *kept* when
its run in the lineage is the one whose result the final state holds; every other run of a step was
wasted (redone, or thrown away by a rollback).

**Faults.** For each scheduled fault: when it was injected (its first action), the step rank 0 had
reached, when the job reacted (*detected*: a rank failed or was told to stop, a restore passed over a
damaged version or read around it, a save failed, the loss went non-finite), what the next restore
loaded and passed over (*versions skipped* and why), the steps lost, and when the job was back
(*recovered*: rank 0 trains past the step it had reached, and for a fault with a window — S3 down, a full
disk — a save committed after the window closed).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any


def read_jsonl(path: str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path, "rb") as f:
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if isinstance(e, dict) and "kind" in e:
                    out.append(e)
    except OSError:
        pass
    return out


@dataclass
class Segment:
    gen: int
    seg: int
    start: float  # T of the restore's end (or the first step's start)
    restored: str | None = None
    restored_step: int = 0
    restore_t0: float | None = None
    restore_t1: float | None = None
    skipped: list[dict] = field(default_factory=list)
    reads: dict = field(default_factory=dict)
    steps: dict[int, dict] = field(default_factory=dict)  # step -> rank 0's event
    saves: dict[int, dict] = field(default_factory=dict)  # step -> rank 0's "save" (call returned)
    commits: dict[int, float] = field(default_factory=dict)  # step -> T of its commit (save_done ok)
    end: float = 0.0
    rollback: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return (self.gen, self.seg)

    @property
    def last_step(self) -> int:
        return max(self.steps, default=self.restored_step)


class Timeline:
    """The events of one job, on the supervisor's clock."""

    def __init__(self, run_dir: str, off: float) -> None:
        self.run_dir, self.off = run_dir, off
        self.events: list[dict[str, Any]] = []
        for path in sorted(glob.glob(os.path.join(run_dir, "events", "rank*.a*.jsonl"))):
            self.events.extend(read_jsonl(path))
        for e in self.events:
            e["T"] = self.T(e)
        self.events.sort(key=lambda e: (e["T"], e.get("rank", 0)))
        self.sup = read_jsonl(os.path.join(run_dir, "supervisor.jsonl"))
        for e in self.sup:
            e["T"] = e["t"]
        self.ck = read_jsonl(os.path.join(run_dir, "events.jsonl"))  # ckptstore's event log (rank 0's manager)
        self.segments = self._segments()
        self.lineage, self.lineage_note = self._lineage()

    def T(self, e: dict[str, Any]) -> float:
        up = e.get("up")
        return up + self.off if isinstance(up, (int, float)) else float(e.get("t", 0.0))

    @classmethod
    def of(cls, run_dir: str, off: float) -> "Timeline":
        return cls(run_dir, off)

    # -- segments and lineage -----------------------------------------------------------------------
    def _segments(self) -> list[Segment]:
        segs: dict[tuple[int, int], Segment] = {}
        order: list[tuple[int, int]] = []

        def get(e) -> Segment:
            k = (e["gen"], e.get("seg", 0) if e["kind"] == "step" else cur.get(e["gen"], 0))
            if k not in segs:
                segs[k] = Segment(k[0], k[1], e["T"])
                order.append(k)
            return segs[k]

        cur: dict[int, int] = {}
        for e in self.events:
            if e.get("rank") != 0 or e.get("gen") is None:
                continue
            g, k = e["gen"], e["kind"]
            if k == "resumed":
                s = get(e)
                s.restored, s.restored_step = e.get("version"), int(e.get("step") or 0)
                s.restore_t1 = e["T"]
                s.restore_t0 = e["T"] - (float(e.get("t1", e["t"])) - float(e.get("t0", e["t"])))
                s.skipped, s.reads = e.get("skipped") or [], e.get("reads") or {}
                s.start = e["T"]
            elif k == "rollback":
                cur[g] = cur.get(g, 0) + 1
                s = get(e)
                s.rollback = True
                s.restored, s.restored_step = e.get("version"), int(e.get("step") or 0)
                s.restore_t1 = e["T"]
                s.restore_t0 = e["T"] - (float(e.get("t1", e["t"])) - float(e.get("t0", e["t"])))
                s.skipped = e.get("skipped") or []
                s.start = e["T"]
            elif k == "step":
                s = get(e)
                if not s.steps and s.restored is None:
                    s.start = min(s.start, e["T"] - (e["t1"] - e["t0"]))
                s.steps[e["step"]] = e
            elif k == "save":
                get(e).saves[e["step"]] = e
            elif k == "save_done" and e.get("ok"):
                get(e).commits[e["step"]] = e["T"]
            elif k == "preempted" and e.get("saved") and e.get("step") is not None:  # the last save, inside save()
                get(e).commits.setdefault(int(e["step"]), e["T"])
            if g in cur or k in ("init_done", "resumed", "step"):
                s = segs.get((g, cur.get(g, 0)))
                if s is not None:
                    s.end = max(s.end, e["T"])
        out = [segs[k] for k in order]
        for s in out:
            s.end = max(s.end, s.start)
        return out

    def _lineage(self) -> tuple[list[Segment], str | None]:
        """The segments whose steps the final state holds, oldest first."""
        # the final state is the last segment's, also one that restored and then trained no step (a
        # restart right before the stop: its restore decides which run of the steps before it survived)
        final = [s for s in self.segments if s.steps or s.restored is not None]
        if not any(s.steps for s in self.segments):
            return [], "no step trained"
        cur = final[-1]
        chain = [cur]
        while cur.restored is not None:
            t = cur.restore_t0 if cur.restore_t0 is not None else cur.start
            best: tuple[float, Segment] | None = None
            for s in self.segments:  # the last segment that committed (or at least started) that step's save
                if s is cur:
                    continue
                c, saved = s.commits.get(cur.restored_step), s.saves.get(cur.restored_step)
                tt = c if c is not None else (saved["T"] if saved is not None else None)
                if tt is not None and tt <= t and (best is None or tt > best[0]):
                    best = (tt, s)
            prod = None if best is None else best[1]
            if prod is None:
                return list(reversed(chain)), f"no segment committed {cur.restored} before it was restored"
            chain.append(prod)
            cur = prod
        return list(reversed(chain)), None

    def kept(self) -> dict[int, tuple[Segment, dict]]:
        """step -> (segment, rank 0's event) of the run of each step the final state holds."""
        out: dict[int, tuple[Segment, dict]] = {}
        for i, s in enumerate(self.lineage):
            upto = self.lineage[i + 1].restored_step if i + 1 < len(self.lineage) else s.last_step
            for st, e in s.steps.items():
                if st <= upto:
                    out[st] = (s, e)
        return out

    def final_step(self) -> int:
        return max(self.kept(), default=0)

    def skipped_batches(self) -> list[int]:
        """Batches the final run skipped (a corrupt sample): the reference skips them from the start."""
        kept = self.kept()
        out = {int(e["b"]) for e in self.events if e["kind"] in ("skip_batch", "nonfinite") and e.get("rank") == 0}
        trained = {int(ev["b"]) for _s, ev in kept.values() if ev.get("b") is not None}
        return sorted(out - trained)

    def rank_event(self, seg: Segment, rank: int, step: int) -> dict | None:
        for e in self.events:
            if (e["kind"] == "step" and e.get("rank") == rank and e.get("gen") == seg.gen and e.get("seg", 0) == seg.seg
                    and e["step"] == step):
                return e
        return None

    def rank_steps(self) -> dict[tuple[int, int, int, int], dict]:
        """(gen, seg, rank, step) -> step event, every rank."""
        return {(e["gen"], e.get("seg", 0), e["rank"], e["step"]): e for e in self.events
                if e["kind"] == "step" and e.get("gen") is not None}

    def done(self) -> dict[int, dict]:
        """rank -> its ``done`` event of the last generation (the final state's digests)."""
        last = self.lineage[-1].gen if self.lineage else None
        return {e["rank"]: e for e in self.events if e["kind"] == "done" and e.get("gen") == last}

    def wasted_steps(self) -> list[dict]:
        kept = {(s.key, st) for st, (s, _e) in self.kept().items()}
        return [e for s in self.segments for st, e in s.steps.items() if (s.key, st) not in kept]

    def of_kind(self, kind: str, rank: int | None = 0, after: float | None = None) -> list[dict]:
        return [e for e in self.events if e["kind"] == kind and (rank is None or e.get("rank") == rank)
                and (after is None or e["T"] > after)]


# -- each fault's story ------------------------------------------------------------------------------
def _read_around(reads: dict[str, Any]) -> bool:
    """A restore that read around a damaged or missing copy: a fallback read (another copy after a
    failed check), or bytes from a peer's replica or from S3 (a rank's own node holds its part, intact)."""
    return any(int(reads.get(k) or 0) for k in ("fallback_reads", "repaired", "peer_bytes", "remote_reads"))


def fault_story(tl: Timeline, rec: dict[str, Any], t0: float, kind: Any, next_inj: float | None) -> dict[str, Any]:
    """Detection, recovery, lost steps and skipped versions of one injected fault (``rec``: the
    injector's record; ``t0``: the job's launch; ``next_inj``: when the next fault was injected)."""
    out: dict[str, Any] = {"kind": rec["kind"], "index": rec["index"], "node": rec["node"], "rank": rec["rank"],
                           "at_s": rec.get("injected_s"), "detected_s": None, "recovered_s": None, "lost_steps": 0,
                           "restored": None, "versions_skipped": [], "changes_math": kind.changes_math,
                           "math": kind.math, "actions": rec.get("actions", []), "note": rec.get("note")}
    if not rec.get("ran", True) or rec.get("injected_s") is None:
        out["note"] = rec.get("note") or "not injected"
        return out
    ti = t0 + rec["injected_s"]
    steps0 = [e for e in tl.of_kind("step") if e["T"] <= ti]
    step_at = steps0[-1]["step"] if steps0 else 0
    out["step_at_fault"] = step_at
    name = rec["kind"]
    det: float | None = None
    if kind.restarts:
        cands = [e["T"] for e in tl.events if e["T"] > ti and (
            e["kind"] in ("fatal", "preempted") or (e["kind"] == "proc_start"))]
        det = min(cands, default=None)
    if name == "disk-full":
        cands = [e["T"] for e in tl.events if e["T"] > ti and e["kind"] in ("save_error",)]
        cands += [e["T"] for e in tl.events if e["T"] > ti and e["kind"] == "save_done" and e.get("ok") is False]
        det = min(cands, default=None)
    if name == "nan":
        cands = [e["T"] for e in tl.events if e["T"] > ti and e["kind"] in ("nonfinite", "fatal")]
        det = min(cands, default=None)
    if name in ("flip-byte", "delete-object"):
        cands = [e["T"] for e in tl.events if e["T"] > ti and e["kind"] == "resumed" and (
            e.get("skipped") or _read_around(e.get("reads") or {}))]
        cands += [e["T"] for e in tl.events if e["T"] > ti and e["kind"] == "fatal"]
        det = min(cands, default=None)
        if det is None:
            out["note"] = (out["note"] or "") + "the damage was never noticed"
    if name == "s3-down":
        cands = [float(e["t"]) for e in tl.ck if float(e["t"]) > ti and (
            (e["kind"] == "save" and e.get("outcome") != "committed") or (e["kind"] == "restore" and e.get("remote_error")))]
        cands += [e["T"] for e in tl.events if e["T"] > ti and e["kind"] in ("fatal", "proc_start")]
        det = min(cands, default=None)
    out["detected_s"] = None if det is None else round(det - ti, 2)
    # the restore(s) that followed, until training is back past the step reached
    back = None
    after = ti
    if name == "nan":  # the poisoned step itself comes after the injection: back once past it after the rollback
        bad = [e for e in tl.of_kind("nonfinite", after=ti)]
        rb = [e for e in tl.of_kind("rollback", after=ti)]
        if bad and rb:
            step_at, after = int(bad[0]["step"]), rb[0]["T"]
            out["step_at_fault"] = step_at
        else:
            after = float("inf")
    for e in tl.of_kind("step", after=after):
        if e["step"] > step_at:
            back = e["T"]
            break
    window_end = rec.get("window_end_s")
    if window_end is not None:
        te = t0 + window_end
        commits = [e["T"] for e in tl.events if e.get("rank") == 0 and e["kind"] == "save_done" and e.get("ok")
                   and e["T"] > te]
        if back is not None:
            back = max(back, min(commits, default=back)) if name in ("disk-full", "s3-down") else back
    out["recovered_s"] = None if back is None else round(back - ti, 2)
    horizon = back if back is not None else float("inf")
    restores = [e for e in tl.events if e.get("rank") == 0 and e["kind"] in ("resumed", "rollback") and ti < e["T"] <= horizon]
    if restores:
        r = restores[-1]
        out["restored"] = r.get("version")
        out["lost_steps"] = max(0, step_at - int(r.get("step") or 0))
        for x in restores:
            for s in x.get("skipped") or []:
                if s not in out["versions_skipped"]:
                    out["versions_skipped"].append(s)
        reads = [x.get("reads") or {} for x in restores]
        out["fallback_reads"] = sum(int(x.get("fallback_reads") or 0) for x in reads)
    if next_inj is not None and back is not None and back > next_inj:
        out["overlaps_next"] = True
    return out
