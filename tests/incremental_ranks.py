"""Rank bodies for tests/test_incremental.py: a frozen-base fine-tune (a frozen bf16 base, a small
trained adapter and its AdamW state) saved through ``CheckpointManager(incremental=True)``."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

BASE = 1 << 22  # elements of the frozen base (bf16: 8 MiB)
ADAPTER = 1 << 13  # fp32: with its AdamW state 96 KiB change per save, ~1.7 % of the stored base (the proportions of a LoRA fine-tune)


class FineTune(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.base = torch.nn.Parameter(torch.randn(BASE, generator=g).to(torch.bfloat16), requires_grad=False)
        self.adapter = torch.nn.Parameter(torch.zeros(ADAPTER))


def make():
    model = FineTune()
    opt = torch.optim.AdamW([model.adapter], lr=1e-2)
    return {"model": model, "optim": opt}


def step(state, i: int) -> None:
    model, opt = state["model"], state["optim"]
    g = torch.Generator().manual_seed(100 + i)
    loss = (model.adapter - torch.randn(ADAPTER, generator=g)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def digest(state) -> str:
    """Bit-exact fingerprint of the model and the optimizer state."""
    import hashlib

    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    h = hashlib.sha256()
    for t in (state["model"].base, state["model"].adapter):
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    osd = get_optimizer_state_dict(state["model"], state["optim"])
    for k in sorted(osd["state"]):
        for n in sorted(osd["state"][k]):
            v = osd["state"][k][n]
            h.update(v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
    return h.hexdigest()


def train(rank, world, root, saves, remote=None, opts=None):
    """Resume, then ``saves`` more steps with a save each; returns the fingerprint after each save."""
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    from ckptstore import CheckpointManager

    state = make()
    out = {}
    with CheckpointManager(root, state, remote=remote, interval_steps=1, incremental=True, **(opts or {})) as m:
        start = m.resume()
        for i in range(start, start + saves):
            step(state, i)
            m.save(i)
            out[i] = digest(state)
        m.wait()
    if dist.is_initialized():
        dist.barrier()
    return out


def load(rank, world, root, version, remote=None, reshard=True):
    """Fingerprint of ``version`` loaded into a fresh state (through the manager; any world size)."""
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    from ckptstore import CheckpointManager

    state = make()
    with CheckpointManager(root, state, remote=remote, reshard=reshard) as m:
        m.restore(version=version)
    return digest(state)


def env_root(base: str) -> str:
    return os.path.join(base, "store")


def reference(steps: int) -> dict:
    """The fingerprints an uninterrupted run has after each step (no saving)."""
    state = make()
    out = {}
    for i in range(1, steps + 1):
        step(state, i)
        out[i] = digest(state)
    return out


def crash_job(rank, world, root, saves, remote, scratch):
    """:func:`train` under the peer watchdog of ``crash_ranks`` (the armed fault kills one rank, the
    other dies with it, as a job does)."""
    from crash_ranks import Watchdog

    wd = Watchdog(scratch, rank, world)
    opts = {"durability": "remote", "upload_timeout": 30} if remote else {}
    out = train(rank, world, root, saves, remote, opts)
    wd.done()
    return out
