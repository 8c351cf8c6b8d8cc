"""Everything that depends on PyTorch Lightning's surface beyond ``CheckpointIO``: one module, pinned.

Tested with the ``pytorch-lightning`` releases in :data:`TESTED_VERSIONS`. A release that changes any
of the following needs this module changed (and a new entry in :data:`TESTED_VERSIONS`):

* ``lightning_fabric.plugins.CheckpointIO`` (``save_checkpoint(checkpoint, path, storage_options)``,
  ``load_checkpoint(path, map_location, weights_only)``, ``remove_checkpoint(path)``, ``teardown()``)
  and that ``Strategy.save_checkpoint``/``remove_checkpoint`` call it on global rank 0 only, on the
  training thread (``AsyncCheckpointIO``, which saves on a worker thread, is refused), while
  ``Strategy.load_checkpoint`` calls it on every rank; ``_WrappingCheckpointIO.checkpoint_io``;
* the checkpoint dict's ``global_step`` and ``epoch`` (the manifest's step, user metadata);
* ``ModelCheckpoint.CHECKPOINT_NAME_LAST`` (``last``), its version counter's suffix ``-v<N>``, and
  ``_find_last_checkpoints``, which takes a file of the checkpoint directory whose stem starts with
  ``last`` as a "last" checkpoint; the checkpoint connector resolves ``ckpt_path="last"`` to the
  newest such file that exists (by modification time), on every rank;
* ``ModelParallelStrategy``: ``save_checkpoint`` receiving ``state_dict`` (its DTensor model state)
  and ``optimizer_states`` (DCP ``get_optimizer_state_dict`` per optimizer) in the checkpoint, which it
  saves under the keys ``state_dict`` and ``optimizer_<i>``; the attributes ``_save_distributed_checkpoint``,
  ``model``, ``optimizers``, ``lightning_module.strict_loading``, ``broadcast``, ``barrier``,
  ``is_global_zero``, ``local_rank``, ``world_size``; that ``load_model_state_dict`` and
  ``load_optimizer_state_dict`` do nothing (the strategy loads in ``load_checkpoint``).

What changes for Lightning (each a behaviour that ckptstore does instead):

* :class:`StoreCheckpointIO` saves a checkpoint as version ``stem(path)`` of the store (rank 0, the
  DDP and single-device path), loads it on every rank (one collective restore choice and load;
  ranks on other nodes read through ckptstore's peer exchange), removes it through ``gc.plan_drop``;
  writes a pointer file at ``path`` after the commit, so ``ModelCheckpoint`` and ``ckpt_path="last"``
  work on files as before; a path whose stem is a "last" name loads the newest committed version;
* :func:`model_parallel_class`'s subclass saves every rank's shards and rank 0's rest of the
  checkpoint as one version (instead of DCP's ``FileSystemWriter`` plus ``meta.pt``), loads into the
  live model and optimizers through DCP's state-dict helpers as Lightning does, and prunes each node's
  root.

Not covered: ``FSDPStrategy`` (FSDP1). Lightning 2.6.6 refuses it with ``accelerator="cpu"`` ("The
strategy `fsdp` requires a GPU accelerator"), and torch 2.13's ``FullyShardedDataParallel`` raises
"FSDP needs a non-CPU accelerator device" on a machine without one, so it could not be tested here.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch
from lightning_fabric.plugins import CheckpointIO as _CheckpointIO

from ..errors import CkptStoreError
from . import _lightning_store as _store

#: pytorch-lightning releases this module was tested with
TESTED_VERSIONS = ("2.6.6",)

log = logging.getLogger("ckptstore.integrations.lightning")


def name_last() -> str:
    from pytorch_lightning.callbacks import ModelCheckpoint

    return ModelCheckpoint.CHECKPOINT_NAME_LAST


def is_last(path) -> bool:
    """``path`` names Lightning's "last" checkpoint: its stem is ``ModelCheckpoint.CHECKPOINT_NAME_LAST``,
    possibly with the version counter's suffix (``last``, ``last-v1``)."""
    return _store.last_pattern(name_last()).fullmatch(_store.version_of(path)) is not None


def _to(obj: Any, device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = _to(v, device)
        return obj
    if isinstance(obj, list):
        return [_to(v, device) for v in obj]
    if isinstance(obj, tuple) and not hasattr(type(obj), "_fields"):
        return tuple(_to(v, device) for v in obj)
    return obj


class StoreCheckpointIO(_CheckpointIO):
    """Lightning's ``CheckpointIO`` on a ckptstore (see :mod:`ckptstore.integrations.lightning`)."""

    def __init__(self, root: str | os.PathLike, **options: Any) -> None:
        self.store = _store.LightningStore(root, **options)

    # -- CheckpointIO ---------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any = None) -> None:
        """Commit ``checkpoint`` as version ``stem(path)`` (replacing a committed one of that name),
        then write the pointer file at ``path``. Called by Lightning on global rank 0 only."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported; "
                            "pass the store's options to the constructor")
        if threading.current_thread() is not threading.main_thread():
            # AsyncCheckpointIO: saves queue on its worker thread while ModelCheckpoint removes versions on
            # the training thread, so a removal can reach the store before the save it removes (measured:
            # the removed epoch=0-step=3 committed afterwards and stayed)
            raise CkptStoreError(
                f"{type(self).__name__} saves on the training thread only (called on thread "
                f"{threading.current_thread().name!r}): Lightning's AsyncCheckpointIO would let ModelCheckpoint's "
                "removals overtake the queued saves they remove. Pass StoreCheckpointIO itself in plugins=[...]")
        step = checkpoint.get("global_step")
        self.store.save_full(checkpoint, path, step=step if isinstance(step, int) else None,
                             user_metadata=_user_metadata(checkpoint, path))

    def load_checkpoint(self, path, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint of version ``stem(path)`` — or, for a "last" path, the newest version every
        rank can load and verify — rebuilt on every rank (a collective when ``torch.distributed`` is
        initialised). ``weights_only`` applies to the non-tensor part as in ``torch.load``;
        ``map_location``: None (CPU tensors), a device or a device string."""
        version = None if is_last(path) else _store.version_of(path)
        chosen, ckpt = self.store.load_full(version, weights_only=weights_only)
        log.info("ckptstore: loaded %r from %s for %s", chosen, self.store.root, os.fspath(path))
        if map_location is not None:
            if not isinstance(map_location, (str, torch.device)):
                raise TypeError(f"{type(self).__name__}.load_checkpoint takes map_location as a device or a device "
                                f"string, got {type(map_location).__name__}")
            ckpt = _to(ckpt, torch.device(map_location))
        return ckpt

    def remove_checkpoint(self, path) -> None:
        """Remove version ``stem(path)`` from every tier (``gc.plan_drop``: un-commit first, objects that
        other versions reference stay), then the pointer file. A pinned version stays (warning)."""
        if self.store.drop(_store.version_of(path)) != "pinned":
            _store.remove_pointer(path)

    def teardown(self) -> None:
        """Wait for uploads and release the writers (Lightning calls this at the end of each fit)."""
        self.store.close()


def _user_metadata(checkpoint: dict, path) -> dict:
    meta = {"path": os.path.basename(os.fspath(path))}
    for k in ("epoch", "global_step"):
        if isinstance(checkpoint.get(k), int):
            meta[k] = checkpoint[k]
    return {"lightning": meta}


def store_io(strategy) -> StoreCheckpointIO:
    """The :class:`StoreCheckpointIO` of ``strategy`` (also inside Lightning's ``AsyncCheckpointIO``)."""
    io = strategy._checkpoint_io
    inner = getattr(io, "checkpoint_io", None)
    if not isinstance(io, StoreCheckpointIO) and isinstance(inner, StoreCheckpointIO):
        io = inner
    if not isinstance(io, StoreCheckpointIO):
        raise CkptStoreError(
            f"{type(strategy).__name__} saves through ckptstore and needs its store: pass "
            "Trainer(plugins=[StoreCheckpointIO(root, ...)]) (from ckptstore.integrations.lightning)")
    return io


def model_parallel_class(base: type) -> type:
    """The ckptstore subclass of Lightning's ``ModelParallelStrategy`` class ``base``."""

    class StoreModelParallelStrategy(base):
        """Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel, DTensor state) saving every
        rank's shards, loading and removing through ckptstore (:mod:`ckptstore.integrations.lightning`).
        Takes ``ModelParallelStrategy``'s arguments; ``save_distributed_checkpoint`` must stay True."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if not self._save_distributed_checkpoint:
                raise CkptStoreError(
                    "StoreModelParallelStrategy saves sharded checkpoints only (save_distributed_checkpoint=True): "
                    "every rank's shard goes to the store; a full checkpoint would be gathered on rank 0")

        def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
            if storage_options is not None:
                raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
            io = store_io(self)
            path = self.broadcast(os.fspath(filepath))  # rank 0's path, as Lightning does
            version = _store.version_of(path)
            sharded = {"state_dict": checkpoint.pop("state_dict")}
            for i, osd in enumerate(checkpoint.pop("optimizer_states", [])):
                sharded[f"optimizer_{i}"] = osd
            # the copies of the name this save replaces: rank 0's (its root and the remote tier), sent
            # to every rank, and each rank's own root's (node-local roots; the same attempt when shared)
            first = self.broadcast(sorted(io.store.existing_attempts(version)) if self.is_global_zero else None)
            supersede = set(first) | (io.store.existing_attempts(version, remote=False) if not self.is_global_zero else set())
            step = checkpoint.get("global_step")
            io.store.save_sharded(
                sharded, checkpoint if self.is_global_zero else None, path,
                step=step if isinstance(step, int) else None, supersede=supersede,
                world_size=self.world_size, write_pointer_here=self.local_rank == 0,
                user_metadata=_user_metadata(checkpoint, path))

        def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                                 get_optimizer_state_dict, set_optimizer_state_dict)

            io = store_io(self)
            path = self.broadcast(os.fspath(checkpoint_path))
            version = None if is_last(path) else _store.version_of(path)

            def targets(held: set) -> dict:
                sd = {"state_dict": get_model_state_dict(self.model)}
                for i, opt in enumerate(self.optimizers):
                    if f"optimizer_{i}" in held:  # absent from a weights-only save
                        sd[f"optimizer_{i}"] = get_optimizer_state_dict(self.model, opt)
                return sd

            chosen, sharded, rest = io.store.load_sharded(version, targets, weights_only=weights_only)
            self.model.load_state_dict(sharded["state_dict"], strict=self.lightning_module.strict_loading)
            for i, opt in enumerate(self.optimizers):
                if f"optimizer_{i}" in sharded:
                    set_optimizer_state_dict(self.model, opt, optim_state_dict=sharded[f"optimizer_{i}"],
                                             options=StateDictOptions(cpu_offload=True))
            log.info("ckptstore: loaded %r from %s for %s", chosen, io.store.root, path)
            return rest

        def remove_checkpoint(self, filepath) -> None:
            # global rank 0 removes the version from its root and the remote tier (and its pointer); then
            # each other node's first rank from its own root (node-local roots, docs/FORMAT.md Delete rule 10)
            io = store_io(self)
            path = os.fspath(filepath)
            if self.is_global_zero:
                io.remove_checkpoint(path)
            self.barrier("ckptstore.remove_checkpoint")
            if self.local_rank == 0 and not self.is_global_zero:
                if io.store.drop(_store.version_of(path), tiers=["local"]) != "pinned":
                    _store.remove_pointer(path)

    return StoreModelParallelStrategy
