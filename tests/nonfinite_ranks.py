"""Rank bodies for tests/test_nonfinite.py (module-level, so spawned or forked ranks can import them).

:func:`loop` is a 2-rank data-parallel training loop through ``CheckpointManager`` that watches its
loss: a batch poisoned with a NaN (on rank 0 only) makes the all-reduced gradients — and so every
rank's parameters and AdamW moments — NaN; the save of that step commits with its NaN count recorded;
the loop sees the NaN in the all-reduced loss, calls ``mgr.rollback()`` on every rank, adds the
batch to the batches it skips, and continues. Run without the poison and with that batch skipped
from the start, the loop must end in the same state bit for bit.
"""

from __future__ import annotations

import dataclasses
import io

import torch
import torch.distributed as dist

PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict", "ckptstore",
           "ckptstore.manager", "nonfinite_ranks"]

HIDDEN = 32


class Cursor:
    """The data loader's position (the next batch), saved with the state (the same on every rank)."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, sd):
        self.pos = sd["pos"]


def batch(pos: int, rank: int) -> torch.Tensor:
    """Batch ``pos`` of rank ``rank``'s share of the data (deterministic)."""
    return torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(1000 * pos + rank))


def loop(rank, world, root, steps, poison=None, skip=()):
    """Train ``steps`` steps, saving every 2; ``poison``: the batch position whose rank-0 batch holds
    a NaN; ``skip``: batch positions skipped from the start. Returns the final state and what the
    rollbacks saw."""
    from ckptstore import CheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optim, "data": Cursor()}
    torch.manual_seed(77 + rank)  # the noise below: per-rank RNG, saved and restored with the state
    skip = set(skip)
    out: dict = {"rollbacks": []}
    with CheckpointManager(root, state, interval_steps=2, save_on_signal=None) as mgr:
        step = mgr.resume()
        while step <= steps:
            pos = state["data"].pos
            while pos in skip:
                pos += 1
            x = batch(pos, rank)
            if pos == poison and rank == 0:
                x[3, 5] = float("nan")  # one bad sample on one rank
            loss = (model(x + 0.01 * torch.randn_like(x)) - 1).square().mean()
            optim.zero_grad()
            loss.backward()
            for p in model.parameters():  # data parallel by hand: the NaN reaches every rank
                dist.all_reduce(p.grad)
                p.grad /= world
            optim.step()
            state["data"].pos = pos + 1
            mgr.save(step)  # a due step saves whatever the state holds, NaN included
            seen = loss.detach().clone()
            dist.all_reduce(seen)  # every rank takes the same decision
            if not torch.isfinite(seen):
                skip.add(pos)  # the loop's choice: never train on that batch again
                nxt = mgr.rollback()
                r = mgr.last_restore
                out["rollbacks"].append({"at": step, "next": nxt, "version": r.version,
                                         "skipped": [dataclasses.asdict(s) for s in r.skipped]})
                step = nxt
                continue
            step += 1
        mgr.wait()
    buf = io.BytesIO()  # as bytes: tensors through the result queue would share memory with an exited process
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()["state"], "pos": state["data"].pos,
                "rng": torch.get_rng_state()}, buf)
    out["final"] = buf.getvalue()
    return out
