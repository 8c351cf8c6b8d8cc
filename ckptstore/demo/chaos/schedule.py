"""The catalogue of fault kinds of ``ckptstore demo --chaos`` and the seeded schedule (pure functions).

A :class:`Kind` says what the fault does (in words), whether it makes the job restart, whether it changes
the math of training (so the run can still be compared bit for bit with the fault-free reference, or why
not), how long its condition lasts, and what it needs to run here (a remote tier, two nodes, root for a
tmpfs, libfaketime). :func:`plan` draws a schedule from the kinds available: one fault per
``fault_every`` seconds, jittered by up to a quarter of the interval, every available kind once (in a
seeded random order) before any repeats, then seeded draws. Same seed, same schedule; the stock-DCP peer
runs the same schedule.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Kind:
    name: str
    what: str
    restarts: bool  # the job restarts because of it (a process dies, or the fault forces a restart)
    changes_math: bool
    math: str  # why the trained math stays the same (or not)
    needs: tuple[str, ...] = ()  # "remote", "nodes", "root", "faketime"
    window_s: float = 0.0  # how long its condition lasts (S3 down, disk full, clock ahead)


SAME = "a restart resumes the exact state (model, optimizer, scheduler, data position, RNG) of a committed step"

KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("kill-rank-step", "a rank SIGKILLed mid-step (as the OOM killer would); torchrun restarts the workers",
         True, False, SAME),
    Kind("kill-rank-save", "a rank SIGKILLed right after mgr.save() returned, while that save is in flight",
         True, False, SAME),
    Kind("node-lost", "a whole node lost: its torchrun agent and ranks SIGKILLed, its root wiped; the scheduler "
         "brings up a replacement with an empty disk", True, False, SAME + "; the lost node's part comes from its "
         "peer's replica or S3", needs=("nodes",)),
    Kind("preempt", "SIGTERM to one node (a spot VM reclaimed), SIGKILL after the grace period; the scheduler "
         "relaunches the job", True, False, SAME),
    Kind("preempt-in-restore", "a rank SIGKILLed, then SIGTERM to a node while the restarted job restores",
         True, False, SAME),
    Kind("s3-down", "the S3 endpoint stopped (SeaweedFS) for 60 s; 5 s in a rank is SIGKILLed, so the job "
         "restarts while S3 is down", True, False, SAME, needs=("remote",), window_s=60.0),
    Kind("flip-byte", "one byte flipped in a node's object of the newest committed version, then a rank "
         "SIGKILLed: the restart must restore past it", True, False, SAME + "; a damaged copy is never loaded"),
    Kind("delete-object", "a node's object of the newest committed version deleted, then a rank SIGKILLed: the "
         "restart must restore past it", True, False, SAME),
    Kind("disk-full", "one node's root (a tmpfs) filled to the last byte for 60 s, then freed (the runaway file "
         "is rotated away)", False, False, "saves fail and are retried later; training never stops",
         needs=("root",), window_s=60.0),
    Kind("gc-during-save", "an operator's `ckptstore gc ROOT --keep-last 1` (default grace, also --remote) on "
         "one node while a save is in flight", False, False, "gc never touches what a restore would need"),
    Kind("drop-during-save", "an operator's `ckptstore drop ROOT NEWEST --yes` (also --remote) on one node while "
         "a save is in flight", False, False, "a later restore takes an older version: steps are redone, "
         "the same math"),
    Kind("clock-jump", "one node's clock jumps 2 h ahead (libfaketime): its ranks restart under it and the "
         "operator's commands there run under it for 120 s; then NTP steps it back (its ranks restart again)",
         True, False, SAME + "; order comes from steps",
         needs=("faketime",), window_s=120.0),
    Kind("nan", "a corrupt sample: NaN in its logits enters the loss, the gradients and the weights; the loop "
         "sees the all-reduced loss, skips that batch from then on and calls mgr.rollback()", False, True,
         "the corrupt batch is skipped (the reference skips the same batches from the start, so the "
         "comparison stays exact)"),
)}


@dataclass
class Fault:
    """One scheduled fault: its kind, when (seconds after the job's launch) and its seeded parameters."""

    index: int
    kind: str
    at_s: float
    node: int  # the node it hits (or whose operator runs the command)
    rank: int  # the rank it kills or poisons
    seed: int  # for anything else it draws (the byte to flip)
    params: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def available(*, remote: bool, nodes: int, replicas: int, root: bool, faketime: bool,
              only: tuple[str, ...] | None = None) -> tuple[list[str], dict[str, str]]:
    """The kinds this set-up can run (catalogue order) and, for the others, why not."""
    have = {"remote": remote, "nodes": nodes > 1 and (replicas > 0 or remote), "root": root, "faketime": faketime}
    why = {"remote": "needs a remote tier (--seaweedfs or --remote)",
           "nodes": "needs --nodes 2 and --replicas 1 (or a remote tier): the wiped node's part must exist elsewhere",
           "root": "needs root, to mount a small tmpfs as a node's root (as tests/test_full_disk.py does)",
           "faketime": "needs libfaketime (Debian: apt-get install faketime)"}
    ok, skipped = [], {}
    for name, k in KINDS.items():
        if only is not None and name not in only:
            continue
        missing = [n for n in k.needs if not have[n]]
        if missing:
            skipped[name] = "; ".join(why[n] for n in missing)
        else:
            ok.append(name)
    return ok, skipped


def plan(duration_s: float, fault_every_s: float, seed: int, kinds: list[str], *, world_size: int, nodes: int,
         first_s: float | None = None, tail_s: float | None = None) -> list[Fault]:
    """Faults at ``first_s + i * fault_every_s`` (default first at one interval), each moved by up to a
    quarter interval, the last no later than ``duration_s - tail_s`` (default half an interval: time to
    recover before the run ends). Kinds: each of ``kinds`` once in a seeded order, then seeded draws
    (no kind twice in a row)."""
    if fault_every_s <= 0 or not kinds:
        return []
    rng = random.Random(f"ckptstore-chaos/{seed}")
    first = fault_every_s if first_s is None else first_s
    tail = fault_every_s / 2 if tail_s is None else tail_s
    order = list(kinds)
    rng.shuffle(order)
    out: list[Fault] = []
    i = 0
    while True:
        base = first + i * fault_every_s
        at = base + rng.uniform(-fault_every_s / 4, fault_every_s / 4) if i else base
        if at > duration_s - tail:
            break
        if i < len(order):
            kind = order[i]
        else:
            choices = [k for k in kinds if k != out[-1].kind] or kinds
            kind = rng.choice(choices)
        node = rng.randrange(nodes)
        per = world_size // nodes
        out.append(Fault(i, kind, round(at, 1), node, node * per + rng.randrange(per), rng.randrange(2**31)))
        i += 1
    return out
