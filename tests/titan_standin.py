"""A small stand-in for torchtitan's trainer and checkpointer, for the default suite (which has no
torchtitan): what ``ckptstore/integrations/_titan_v0_3.py`` relies on, written from its
docstring's list, not copied from torchtitan.

* :class:`StandInCheckpointManager` keeps torchtitan 0.3.0's DCP ``CheckpointManager`` contract: its
  ``Config`` (the fields the subclass reads and the validation of ``keep_latest_k``), the
  constructor and attributes, the public ``save``/``load``/``close``/``maybe_wait_*`` over the
  ``_``-hooks, ``_save``'s flow (wait for the previous save, last-step model-only export, the
  flattened state, ``dcp_save`` per ``async_mode`` with the result types torchtitan asserts, then
  ``_purge_stale_checkpoints``), ``_load``'s (``_find_load_step`` over ``step-N`` folders, the
  ``initial_load_path`` and fresh-start branches, step 0 model-only), and stock DCP file-system
  ``dcp_save``/``dcp_load``. Like torchtitan it makes a gloo group for async modes and a purge thread
  (``rmtree`` of the oldest ``step-N`` folders) for ``keep_latest_k > 0``; the counters
  :data:`GROUPS_MADE` and :data:`PURGE_THREADS` show whether the subclass kept them off.
* :func:`train` is the trainer: a 2-layer MLP, an ``Optimizer`` subclass container (as torchtitan's
  ``OptimizersContainer`` is), an LR scheduler, a data loader whose state is per rank
  (``dp_rank_R``), a ``train_state`` with the step; it returns ``{step: loss}``.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import pickle
import queue
import re
import shutil
import threading
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER = "model", "optimizer", "lr_scheduler", "dataloader"
GROUPS_MADE = [0]
PURGE_THREADS = [0]


class AsyncMode(str):
    """torchtitan's ``AsyncMode`` enum reduced to what the subclass uses: ``AsyncMode(value)`` and ``.value``."""

    @property
    def value(self) -> str:
        return str(self)


class ModelWrapper:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return dict(self.model.state_dict())

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict({k: v for k, v in sd.items() if k in self.model.state_dict()}, strict=False)


class StandInCheckpointManager:
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        _owner: ClassVar[type | None] = None
        enable: bool = False
        folder: str = "checkpoint"
        interval: int = 500
        initial_load_path: str | None = None
        initial_load_model_only: bool = True
        last_save_model_only: bool = True
        keep_latest_k: int = 10
        load_step: int = -1
        exclude_from_loading: list = dataclasses.field(default_factory=list)
        load_only: bool = False
        async_mode: str = "disabled"

        def __post_init__(self) -> None:
            if self.keep_latest_k == 1:
                raise ValueError("keep_latest_k must be 0 or >= 2")
            if MODEL in self.exclude_from_loading:
                raise ValueError("model cannot be excluded from loading")
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ValueError(f"Invalid async_mode: {self.async_mode}")

        def build(self, **kwargs):
            return self._owner(config=dataclasses.replace(self), **kwargs)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "Config" in cls.__dict__:
            cls.__dict__["Config"]._owner = cls

    def __init__(self, config, *, dataloader, model_parts, optimizers, lr_schedulers, states, sd_adapter=None,
                 base_folder=""):
        self.enable = config.enable
        if not self.enable:
            return
        self.folder = os.path.join(base_folder, config.folder)
        self.interval = config.interval
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts[0]), OPTIMIZER: optimizers, DATALOADER: dataloader,
                            LR_SCHEDULER: lr_schedulers})
        self.load_only = config.load_only
        self.exclude_from_loading = config.exclude_from_loading
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.last_save_model_only = config.last_save_model_only
        self.async_mode = AsyncMode(config.async_mode)
        self.pg = None
        if self.async_mode != "disabled":
            self.pg = dist.new_group(backend="gloo")
            GROUPS_MADE[0] += 1
        self.staging_future = None
        self.save_future = None
        self.keep_latest_k = config.keep_latest_k
        self.purge_thread = None
        if self.keep_latest_k > 0:
            self.purge_queue: queue.Queue = queue.Queue()
            self.purge_thread = threading.Thread(target=self._purger, daemon=True)
            self.purge_thread.start()
            PURGE_THREADS[0] += 1

    def _purger(self) -> None:
        while (path := self.purge_queue.get()) is not None:
            shutil.rmtree(path, ignore_errors=True)

    # public entry points over the hooks
    def load(self, step: int = -1) -> bool:
        return self._load(step) if self.enable else False

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        return self._save(curr_step, last_step) if self.enable else False

    def maybe_wait_for_staging(self) -> None:
        if self.enable and self.staging_future is not None:
            self.staging_future.result()
            self.staging_future = None

    def maybe_wait_for_saving(self) -> None:
        if self.enable and self.save_future is not None:
            self._wait_for_saving()

    def close(self) -> None:
        if getattr(self, "enable", False):
            self._close()

    def _close(self) -> None:
        if self.purge_thread is not None and self.purge_thread.is_alive():
            self.purge_queue.put(None)
            self.purge_thread.join()

    def _wait_for_saving(self) -> None:
        self.save_future.result()
        self.save_future = None

    # stock DCP, file-system writer and reader, checkpoint_id a directory
    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        if to_hf:
            raise NotImplementedError("HF exports are not part of the stand-in")
        if async_mode == "async":
            return dcp.async_save(state_dict, checkpoint_id=checkpoint_id, process_group=self.pg)
        if async_mode == "async_with_pinned_mem":
            return dcp.async_save(state_dict, checkpoint_id=checkpoint_id, process_group=self.pg,
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        return dcp.save(state_dict, checkpoint_id=checkpoint_id)

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        dcp.load(state_dict, checkpoint_id=checkpoint_id)
        self.states[MODEL].load_state_dict(state_dict)

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        return os.path.join(folder or self.folder, f"step-{step}")

    def _find_load_step(self, folder: str = "") -> int:
        folder = folder or self.folder
        if not os.path.isdir(folder):
            return -1
        steps = [int(m.group(1)) for n in os.listdir(folder) if (m := re.fullmatch(r"step-(\d+)", n))
                 and os.path.isfile(os.path.join(folder, n, ".metadata"))]
        return max(steps, default=-1)

    def _flattened_model_states_sd(self, state_dict=None) -> dict[str, Any]:
        states = state_dict if state_dict is not None else self.states
        sd = {k: v for k, v in states.items() if k != MODEL}
        if MODEL in states:
            sd.update(states[MODEL].state_dict())
        return sd

    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return self.states[MODEL].state_dict()
        return self._flattened_model_states_sd({k: v for k, v in self.states.items() if k not in self.exclude_from_loading})

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        return not self.load_only and (last_step or curr_step % self.interval == 0)

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        if last_step:
            states = self.states[MODEL].state_dict() if self.last_save_model_only else self._flattened_model_states_sd()
            self.dcp_save(states, checkpoint_id=self._create_checkpoint_id(curr_step), async_mode="disabled")
            return True
        checkpoint_id = self._create_checkpoint_id(curr_step)
        states = self._flattened_model_states_sd()
        result = self.dcp_save(states, checkpoint_id=checkpoint_id, async_mode=self.async_mode)
        if self.async_mode == "async_with_pinned_mem":
            assert isinstance(result, AsyncSaveResponse)
            self.staging_future, self.save_future = result.staging_completion, result.upload_completion
        elif self.async_mode == "async":
            assert isinstance(result, cf.Future)
            self.save_future = result
        self._purge_stale_checkpoints()
        return True

    def _purge_stale_checkpoints(self) -> None:
        if self.keep_latest_k > 0 and os.path.isdir(self.folder) and (not dist.is_initialized() or dist.get_rank() == 0):
            found = sorted((int(m.group(1)), os.path.join(self.folder, n)) for n in os.listdir(self.folder)
                           if (m := re.fullmatch(r"step-(\d+)", n)))
            for _, path in found[: -self.keep_latest_k]:
                self.purge_queue.put(path)

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        exists = os.path.exists(self.folder)
        load_step = (self._find_load_step() if step == -1 else step) if exists else -1
        if step != -1 and not exists:
            raise FileNotFoundError(f"load_step={step}: checkpoint folder {self.folder} does not exist")
        if load_step == -1:
            if not self.initial_load_path:
                return False
            model_only, checkpoint_id = self.initial_load_model_only, self.initial_load_path
        else:
            model_only, checkpoint_id = load_step == 0, self._create_checkpoint_id(load_step)
        self.dcp_load(self._states_to_load(model_only), checkpoint_id=checkpoint_id, from_hf=False, from_quantized=False)
        return True


StandInCheckpointManager.Config._owner = StandInCheckpointManager


# --- the stand-in trainer ----------------------------------------------------------------------------


class Optimizers(torch.optim.Optimizer):
    """One AdamW behind torchtitan's container shape: an ``Optimizer`` whose state dict is the flattened
    DCP one of its model (``flatten_optimizer_state_dict``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        super().__init__(model.parameters(), {"lr": 1e-2})
        self.param_groups = self.inner.param_groups

    def step(self, closure=None):
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.inner, options=StateDictOptions(flatten_optimizer_state_dict=True))

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.inner, sd, options=StateDictOptions(flatten_optimizer_state_dict=True))


class Schedulers:
    def __init__(self, opt: Optimizers, total: int) -> None:
        self.inner = torch.optim.lr_scheduler.LambdaLR(opt.inner, lambda s: 1.0 - s / (total + 1))

    def step(self) -> None:
        self.inner.step()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.inner.load_state_dict(sd)


class Loader:
    """Batch ``i`` of rank ``r`` is a pure function of (r, i); the state is per rank, as torchtitan's."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.pos = rank, world, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.rank + self.pos)
        self.pos += 1
        x = torch.randn(16, 8, generator=g)
        return x, x.sum(dim=1, keepdim=True).sin()

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.rank}": pickle.dumps({"pos": self.pos}), "world_size": self.world}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        key = f"dp_rank_{self.rank}"
        if key in sd:
            self.pos = pickle.loads(sd[key])["pos"]


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def train(config, steps: int, *, base_folder: str, total: int = 10, seed: int = 0, on_step=None) -> dict:
    """torchtitan's loop in small: ``load(load_step)``, then per step train, ``save(step, last_step=...)``
    (``on_step(step)`` is called after the step's training, before its ``save``).
    Returns ``{"losses": {step: loss}, "start": first step, "loader_pos": ..., "groups": ..., "purge_threads": ...}``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = Optimizers(model)
    sched = Schedulers(opt, total)
    loader = Loader(rank, world)
    ts = TrainState()
    groups0, purge0 = GROUPS_MADE[0], PURGE_THREADS[0]
    ckpt = config.build(dataloader=loader, model_parts=[model], optimizers=opt, lr_schedulers=sched,
                        states={"train_state": ts}, sd_adapter=None, base_folder=base_folder)
    losses = {}
    try:
        ckpt.load(step=config.load_step)
        start = ts.step + 1
        while ts.step < steps:
            ts.step += 1
            x, y = loader.next()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            if dist.is_initialized():  # data parallel: average the gradients
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            opt.step()
            sched.step()
            losses[ts.step] = loss.item()
            if on_step is not None:
                on_step(ts.step)
            ckpt.maybe_wait_for_staging()
            ckpt.save(ts.step, last_step=ts.step == steps)
    finally:
        ckpt.close()
    return {"losses": losses, "start": start, "loader_pos": loader.pos, "groups": GROUPS_MADE[0] - groups0,
            "purge_threads": PURGE_THREADS[0] - purge0,
            "weights": {k: v.clone() for k, v in model.state_dict().items()}}
