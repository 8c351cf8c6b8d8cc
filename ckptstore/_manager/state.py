"""The state dict a :class:`ckptstore.CheckpointManager` saves and loads for the loop's state.

- **State.** Values in ``state`` may be an ``nn.Module`` (saved through
  ``torch.distributed.checkpoint.state_dict.get_model_state_dict``), an ``Optimizer`` (through
  ``get_optimizer_state_dict`` with the state's one module), any object with ``state_dict()`` /
  ``load_state_dict()`` (scheduler, data loader), or plain tensors/values. Module and optimizer keys
  are canonical (wrapper components dropped: :func:`ckptstore._state_keys.canonical_fqn`), so any
  nesting of ``torch.compile``, ``checkpoint_wrapper`` and DDP saves and restores the same keys. The
  RNG states of this rank (torch, CUDA when present, ``random``, numpy when imported) are saved under
  ``rng/rank{r}`` for the caller (``save_rng=False`` to turn off) and restored per rank.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

from .._state_keys import _Respelled
from ..errors import CkptStoreError


class StateDicts:
    """Builds and applies the state dicts of rank ``rank``: ``per_rank_keys`` are saved under
    ``f"{key}/rank{rank}"``, and with ``save_rng`` this rank's RNG states under ``rng/rank{rank}``."""

    def __init__(self, rank: int, per_rank_keys: tuple[str, ...], save_rng: bool) -> None:
        self.rank = rank
        self.per_rank_keys = tuple(per_rank_keys)
        self.save_rng = save_rng

    def build(self, state: dict[str, Any], for_load: bool = False, per_rank: bool = True) -> dict[str, Any]:
        """The state dict saved and loaded for ``state``. Module and optimizer keys are canonical: the
        components wrappers add (``torch.compile``'s ``_orig_mod``, ``checkpoint_wrapper``'s
        ``_checkpoint_wrapped_module``, DDP's ``module``, FSDP1's ``_fsdp_wrapped_module``) are dropped
        wherever ``get_model_state_dict`` leaves them, so every nesting of wrappers saves and loads the
        same keys (``model.0.weight``); :meth:`apply` maps them back to the module's own spelling."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        module = _the_module(state)
        sd: dict[str, Any] = {}
        for k, v in state.items():
            if k in self.per_rank_keys:
                if not per_rank:
                    continue
                k = f"{k}/rank{self.rank}"
            if isinstance(v, torch.nn.Module):
                sd[k] = _Respelled.model(v, get_model_state_dict(v))
            elif isinstance(v, torch.optim.Optimizer):
                if module is None:
                    raise CkptStoreError(f"state[{k!r}] is an optimizer; the state needs exactly one nn.Module for it")
                sd[k] = _Respelled.optimizer(module, get_optimizer_state_dict(module, v))
            elif hasattr(v, "state_dict") and hasattr(v, "load_state_dict"):
                sd[k] = v.state_dict()
            else:
                sd[k] = v
        if self.save_rng and per_rank:
            sd[f"rng/rank{self.rank}"] = _rng_state()
        return sd

    def apply(self, state: dict[str, Any], sd: dict[str, Any], per_rank: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        module = _the_module(state)
        for k, v in state.items():
            if k in self.per_rank_keys and not per_rank:
                continue
            sk = f"{k}/rank{self.rank}" if k in self.per_rank_keys else k
            if isinstance(v, torch.nn.Module):
                set_model_state_dict(v, _Respelled.back_of(sd[sk]))
            elif isinstance(v, torch.optim.Optimizer):
                set_optimizer_state_dict(module, v, _Respelled.back_of(sd[sk]))
            elif hasattr(v, "state_dict") and hasattr(v, "load_state_dict"):
                v.load_state_dict(sd[sk])
            elif isinstance(v, torch.Tensor):
                pass  # loaded in place by DCP
            else:
                state[k] = sd[sk]
        if self.save_rng and per_rank:
            _set_rng_state(sd[f"rng/rank{self.rank}"])


def _the_module(state: dict[str, Any]) -> torch.nn.Module | None:
    mods = [v for v in state.values() if isinstance(v, torch.nn.Module)]
    return mods[0] if len(mods) == 1 else None


def _rng_state() -> dict[str, Any]:
    s: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["cuda"] = torch.cuda.get_rng_state()
    np = sys.modules.get("numpy")
    if np is not None:
        s["numpy"] = np.random.get_state()
    return s


def _set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in s:
        np.random.set_state(s["numpy"])
