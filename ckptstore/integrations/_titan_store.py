"""The ckptstore side of the torchtitan integration; imports nothing of torchtitan.

:func:`open_manager` makes the :class:`ckptstore.CheckpointManager` that does every save, load,
discovery and prune of a torchtitan job, from the options of torchtitan's checkpoint config;
:func:`adapt` turns torchtitan's (flattened) state dict into one that manager saves and loads.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import CkptStoreError

#: torchtitan's version names: ``step-N`` (``CheckpointManager._create_checkpoint_id``)
PREFIX = "step-"
DURABILITY = ("local", "replicated", "remote")


class _Stateful:
    """A ``state_dict()``/``load_state_dict()`` object shown to the manager as just that: torchtitan's
    ``OptimizersContainer`` is a ``torch.optim.Optimizer``, which the manager would save through
    ``get_optimizer_state_dict`` with one module (torchtitan flattens the model instead)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict:
        return self.obj.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.obj.load_state_dict(sd)


def adapt(state_dict: dict[str, Any]) -> dict[str, Any]:
    """torchtitan's state dict (model tensors flattened at the top, ``optimizer``, ``lr_scheduler``,
    ``dataloader``, ``train_state`` as ``Stateful`` objects) as the manager's ``state``: tensors and
    plain values as they are (loaded in place), stateful objects behind :class:`_Stateful`; keys,
    and so the stored layout, unchanged."""
    out: dict[str, Any] = {}
    for k, v in state_dict.items():
        out[k] = _Stateful(v) if hasattr(v, "state_dict") and hasattr(v, "load_state_dict") else v
    return out


def step_of(version: str) -> int:
    m = re.fullmatch(re.escape(PREFIX) + r"(\d+)", version)
    if m is None:
        raise CkptStoreError(f"{version!r} is not a torchtitan checkpoint name ({PREFIX}N)")
    return int(m.group(1))


def is_version(checkpoint_id: str) -> bool:
    """``checkpoint_id`` names a version of the store (``step-N``), not a directory (an
    ``initial_load_path``, an HF folder: absolute paths or URIs)."""
    return isinstance(checkpoint_id, str) and re.fullmatch(re.escape(PREFIX) + r"\d+", checkpoint_id) is not None


def legacy_options(config) -> dict:
    """The deprecated per-tier fields of a checkpoint config that are set (``tiers.DEPRECATED_OPTIONS``)."""
    from ..tiers import DEPRECATED_OPTIONS

    return {k: getattr(config, k) for k in DEPRECATED_OPTIONS if getattr(config, k, None) is not None}


def open_manager(folder: str, *, async_mode: str, keep_latest_k: int, remote: str | None, key_file: str | None,
                 durability: str, remote_options: dict | None = None, load_only: bool = False, **legacy):
    """The :class:`ckptstore.CheckpointManager` of a torchtitan job (collective: every rank calls it).

    ``folder``: torchtitan's ``dump_folder``/``checkpoint.folder``, the local root (a directory;
    the object store goes in ``remote``, its options in ``remote_options``). ``async_mode``: ``"disabled"`` and ``"async"`` save on the manager's
    worker thread, ``"async_with_pinned_mem"`` in DCP's checkpoint subprocess (PROCESS).
    ``keep_latest_k`` > 0: retention ``KeepLast(k)`` in every tier, applied after each commit.
    ``key_file``: the master key (else ``CKPTSTORE_KEY`` / ``CKPTSTORE_KEY_FILE``).

    torchtitan decides when to save (``interval``, ``last_step``, the first step), so the manager has
    no interval of its own (``interval_steps=None``): the subclass calls ``save(step, force=True)``
    to save and ``save(step)`` at every other step, where a preemption signal (SIGTERM) becomes the
    save of that step and exit status 143 within the grace period. ``load_only``: no saves at all, so
    no signal handler either (SIGTERM ends the process as in stock torchtitan)."""
    from .. import CheckpointManager
    from ..retention import KeepLast, RetentionPolicy

    if "://" in folder:
        raise CkptStoreError(
            f"checkpoint.folder {folder!r} is a URI; with ckptstore it is the local root (a directory), "
            "and an object store is given as remote (override kwarg {\"remote\": \"s3://bucket/prefix\"})")
    if durability not in DURABILITY:
        raise CkptStoreError(f"durability must be one of {DURABILITY}, got {durability!r}")
    retention = RetentionPolicy(rules=(KeepLast(keep_latest_k),)) if keep_latest_k > 0 else None
    extra = {"remote_options": dict(remote_options)} if remote_options else {}
    extra.update(legacy)  # deprecated per-tier options: CheckpointManager maps them onto remote_options
    mgr = CheckpointManager(
        folder, None, remote=remote, key_file=key_file or None, interval_steps=None, retention=retention,
        durability=durability, executor="process" if async_mode == "async_with_pinned_mem" else "thread", save_rng=False,
        prefix=PREFIX, save_on_signal=None if load_only else "auto", **extra,
    )
    mgr.resume_hint = RESUME_HINT.format(folder=folder, step="{step}", version="{version}")
    return mgr


#: how a preempted torchtitan job resumes (the last sentence of ckptstore's preemption message)
RESUME_HINT = ("Resume by running the same torchtitan command again: it loads {version} from {folder} (the newest "
               "version every rank can load; --checkpoint.load-step N for another step)")
