"""Rank bodies for tests/test_state_keys.py: one model under every nesting of wrappers (real
``torch.compile`` with the eager backend, ``checkpoint_wrapper``, DDP on a 1-rank gloo group)."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import ckptstore


def _compile(m):
    return torch.compile(m, backend="eager")


def _blocks(m):  # per block, as activation checkpointing of compiled blocks does it
    m[0] = checkpoint_wrapper(_compile(m[0]))
    m[2] = _compile(checkpoint_wrapper(m[2]))
    return m


WRAPS = {
    "plain": lambda m: m,
    "compiled": _compile,
    "ddp": DDP,
    "ckpt(compiled)": lambda m: checkpoint_wrapper(_compile(m)),
    "compiled(ckpt)": lambda m: _compile(checkpoint_wrapper(m)),
    "ddp(compiled)": lambda m: DDP(_compile(m)),
    "compiled(ddp)": lambda m: _compile(DDP(m)),
    "ddp(ckpt(compiled))": lambda m: DDP(checkpoint_wrapper(_compile(m))),
    "ckpt(ddp)": lambda m: checkpoint_wrapper(DDP(m)),
    "blocks": lambda m: _compile(_blocks(m)),
}


def trained(wrap: str, seed: int, layers=(4, 3, 2)):
    """(base module, wrapped module, optimizer) after one Adam step; values depend on ``seed``."""
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(layers[0], layers[1]), nn.ReLU(), nn.Linear(layers[1], layers[2]))
    opt = torch.optim.Adam(base.parameters(), lr=0.1)
    base(torch.randn(5, layers[0])).square().sum().backward()
    opt.step()
    return base, WRAPS[wrap](base), opt


def _values(base, opt) -> list[bytes]:
    out = [p.detach().numpy().tobytes() for p in base.parameters()]
    for st in opt.state_dict()["state"].values():
        out += [st[k].numpy().tobytes() for k in sorted(st)]
    return out


def cross_load(rank, world, root, names=tuple(WRAPS)):
    """Save with each nesting of ``names``, restore into each; ``{(saver, loader): "ok" | error}`` and
    the model keys each saver stored."""
    results, stored = {}, {}
    want = {}
    for i, saver in enumerate(names):
        base, model, opt = trained(saver, seed=i)
        want[saver] = _values(base, opt)
        with ckptstore.CheckpointManager(os.path.join(root, str(i)), {"model": model, "optim": opt}, save_rng=False) as mgr:
            mgr.save(1, force=True)
        r = ckptstore.StorageReader(os.path.join(root, str(i)))
        r.reset("step-1")
        stored[saver] = sorted(k for k in r.read_metadata().state_dict_metadata if k.startswith("model."))
    for i, saver in enumerate(names):
        for loader in names:
            base, model, opt = trained(loader, seed=100)
            mgr = ckptstore.CheckpointManager(os.path.join(root, str(i)), {"model": model, "optim": opt}, save_rng=False)
            try:
                mgr.restore()
                results[(saver, loader)] = "ok" if _values(base, opt) == want[saver] else "loaded other values"
            except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
                results[(saver, loader)] = f"{type(e).__name__}: {e}"[:300]
            finally:
                mgr.close()
    return results, stored


def legacy_and_mismatch(rank, world, root):
    """A version stored by an earlier release (the keys ``get_model_state_dict`` gives for
    ``checkpoint_wrapper(torch.compile(m))``: ``model._orig_mod.0.weight``) restores into a plain and a
    wrapped model; a model of another shape fails with both spellings in the error."""
    base, model, opt = trained("ckpt(compiled)", seed=7)
    want = _values(base, opt)
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    assert "_orig_mod.0.weight" in sd["model"]
    dcp.save(sd, checkpoint_id="step-1", storage_writer=ckptstore.StorageWriter(root, step=1))
    out = {}
    for loader in ("plain", "ckpt(compiled)", "ddp(compiled)"):
        base, model, opt = trained(loader, seed=100)
        with ckptstore.CheckpointManager(root, {"model": model, "optim": opt}, save_rng=False) as mgr:
            mgr.restore()
        out[loader] = _values(base, opt) == want
    # another architecture (Linear, Linear): its second layer is "1.*" where the checkpoint has "2.*"
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model = checkpoint_wrapper(_compile(other))
    mgr = ckptstore.CheckpointManager(root, {"model": model}, save_rng=False)
    try:
        mgr.restore()
        out["mismatch"] = "restored"
    except BaseException as e:  # noqa: BLE001
        fails = [f for f, _tb in e.failures.values()] if hasattr(e, "failures") else [e]
        out["mismatch"] = [f"{type(f).__name__}: {f}" for f in fails]
    finally:
        mgr.close()
    return out
