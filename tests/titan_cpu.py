"""torchtitan's trainer (``torchtitan.train``) on a CPU-only torch 2.13: the launcher of
``tests/test_torchtitan_e2e.py``, run by ``torchrun`` as ``python tests/titan_cpu.py ARGS``.

torchtitan 0.3.0 assumes an accelerator and a newer torch; on a CPU-only build it needs these
changes, made here before torchtitan is imported (nothing of them touches checkpointing):

* ``torch._utils._get_available_device_type`` answers ``"cpu"`` (torchtitan falls back to ``"cuda"``
  and calls ``torch.cuda.set_device``), and ``torch.cpu`` gets the few device-module functions
  torchtitan's memory monitor and barrier call (``get_device_name``, ``get_device_properties``,
  ``memory_stats``, ``reset_peak_memory_stats``, ``empty_cache``; ``current_device`` as index 0);
* ``torch.distributed.set_timeout`` (newer than torch 2.13) is a no-op;
* gloo has no ``ReduceOp.AVG`` / ``PREMUL_SUM``: FSDP's gradient reduction is asked for plain sums
  with the division done apart (its own ``force_sum_reduction_for_comms``); with more than one rank
  run with ``--parallelism.spmd-backend partial_dtensor`` (torch 2.13's ``fully_shard`` has no
  ``dp_mesh_dims`` path for torchtitan's default ``spmd_types`` backend on plain parameters);
* torchtitan's fault-tolerance trainer ignores ``--override.imports`` (its ``__init__`` replaces
  ``Trainer.__init__`` without the ``apply_overrides`` call): they are applied before it builds;
* FlexAttention has no backward on CPU: its compiled kernel is replaced by the same attention
  computed densely (the block mask evaluated with ``create_mask``, then
  ``scaled_dot_product_attention``), so the debug model's masks are kept.

At the end the process leaves through ``ckptstore._groups.exit_process`` (pytorch/pytorch #190489:
no interpreter finalisation a gloo thread could abort), with the exit status of a ``SystemExit``
(``ckptstore.Preempted``: 143 after SIGTERM) or 1 after an error.
"""

from __future__ import annotations

import os
import sys
import types

import torch
import torch._utils
import torch.distributed as dist
import torch.nn.functional as F

torch._utils._get_available_device_type = lambda: "cpu"
_cpu = torch.cpu
_cpu.get_device_name = lambda *a, **k: "cpu"
_cpu.get_device_properties = lambda *a, **k: types.SimpleNamespace(
    total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), name="cpu")
_cpu.reset_peak_memory_stats = lambda *a, **k: None
_cpu.empty_cache = lambda *a, **k: None
_cpu.memory_stats = lambda *a, **k: {}
_cpu.current_device = lambda: 0
if not hasattr(dist, "set_timeout"):
    dist.set_timeout = lambda timeout, group=None: None


def _dense_flex(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_aux=None,
                kernel_options=None):
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if score_mod is not None:
        raise NotImplementedError("titan_cpu: score_mod is not supported by the dense CPU attention")
    if return_aux is not None and (return_aux.lse or return_aux.max_scores):
        raise NotImplementedError("titan_cpu: auxiliary outputs are not supported by the dense CPU attention")
    mask = None
    if block_mask is not None:
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa), AuxOutput()


def _sum_reductions() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    orig = coll._get_gradient_divide_factors

    def factors(*args, **kwargs):
        if len(args) > 5:  # (group, group, dtype, device_type, factor, force_sum_reduction_for_comms)
            args = args[:5] + (True,) + args[6:]
        else:
            kwargs["force_sum_reduction_for_comms"] = True
        return orig(*args, **kwargs)

    coll._get_gradient_divide_factors = factors


def _ft_overrides() -> None:
    """torchtitan 0.3.0's ``FaultTolerantTrainer`` (``--module torchft.llama3``) replaces ``Trainer.__init__``
    without its ``apply_overrides`` call, so ``--override.imports`` is ignored in fault-tolerance mode:
    apply them first, as ``Trainer.__init__`` does."""
    try:
        from torchtitan.config.override import apply_overrides
        from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer
    except ImportError:  # torchft not installed: no fault-tolerance mode
        return
    init = FaultTolerantTrainer.__init__

    def __init__(self, config, *args, **kwargs):
        if config.override.imports:
            apply_overrides(config.override, config)
        init(self, config, *args, **kwargs)

    FaultTolerantTrainer.__init__ = __init__


def main() -> int:
    from torchtitan.models.common.attention import FlexAttention

    _sum_reductions()
    _ft_overrides()
    FlexAttention._compiled_flex_attn = staticmethod(_dense_flex)
    sys.argv[0] = "torchtitan.train"
    from torchtitan.train import main as titan_main

    titan_main()
    return 0


if __name__ == "__main__":
    from ckptstore._groups import exit_process

    import traceback

    try:
        code = main()
    except SystemExit as e:  # ckptstore.Preempted (143 after SIGTERM), or torchtitan's own exit
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed, then a failed exit
        traceback.print_exc()
        code = 1
    exit_process(code)
