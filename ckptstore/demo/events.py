"""Read a job's event logs (``events/rank<R>.a<A>.jsonl``) into per-step histories."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any


def read_events(run_dir: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted(glob.glob(os.path.join(run_dir, "events", "rank*.a*.jsonl"))):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except ValueError:  # a torn last line of a killed process
                        pass
    out.sort(key=lambda e: (e["t"], e["attempt"], e["rank"]))
    return out


@dataclass
class History:
    """What a job trained on: for every step, the occurrence that survived into the final model."""

    events: list[dict[str, Any]]
    attempts: list[int] = field(default_factory=list)
    world: dict[int, int] = field(default_factory=dict)  # attempt -> world size
    # (attempt, rank, step) -> step event
    steps: dict[tuple[int, int, int], dict[str, Any]] = field(default_factory=dict)
    effective: dict[int, int] = field(default_factory=dict)  # step -> attempt whose result survived
    resumed: dict[int, dict[str, Any]] = field(default_factory=dict)  # attempt -> rank 0 "resumed" event
    crash: dict[str, Any] | None = None

    @classmethod
    def of(cls, run_dir: str) -> "History":
        h = cls(read_events(run_dir))
        for e in h.events:
            a = e["attempt"]
            if e["kind"] == "proc_start":
                h.world[a] = e["world_size"]
            elif e["kind"] == "step":
                h.steps[(a, e["rank"], e["step"])] = e
            elif e["kind"] == "resumed" and e["rank"] == 0:
                h.resumed[a] = e
            elif e["kind"] == "crash" and h.crash is None:
                h.crash = e
        h.attempts = sorted(h.world)
        for (a, r, s) in h.steps:
            if r == 0 and a >= h.effective.get(s, -1):
                h.effective[s] = a
        return h

    def last_step(self) -> int:
        return max(self.effective) if self.effective else 0

    def rank_steps(self, rank: int) -> list[dict[str, Any]]:
        """This rank's surviving step events, in step order (ranks that exist in the effective attempt)."""
        out = []
        for s in sorted(self.effective):
            e = self.steps.get((self.effective[s], rank, s))
            if e is not None:
                out.append(e)
        return out

    def global_ids(self, step: int) -> list[int]:
        """The global batch of ``step``: the ranks' sample ids concatenated in rank order."""
        a = self.effective[step]
        ids: list[int] = []
        for r in range(self.world[a]):
            ids.extend(self.steps[(a, r, step)]["ids"])
        return ids

    def mean_loss(self, step: int) -> float:
        return self.steps[(self.effective[step], 0, step)]["mean"]

    def discarded(self) -> list[dict[str, Any]]:
        """Rank-0 step events whose results were thrown away by the crash and redone."""
        return [e for (a, r, s), e in sorted(self.steps.items()) if r == 0 and self.effective.get(s) != a]

    def first_step_event(self, attempt: int) -> dict[str, Any] | None:
        c = [e for (a, r, s), e in self.steps.items() if a == attempt and r == 0]
        return min(c, key=lambda e: e["step"]) if c else None

    def of_kind(self, kind: str, attempt: int | None = None, rank: int | None = 0) -> list[dict[str, Any]]:
        return [
            e for e in self.events
            if e["kind"] == kind and (attempt is None or e["attempt"] == attempt) and (rank is None or e["rank"] == rank)
        ]
