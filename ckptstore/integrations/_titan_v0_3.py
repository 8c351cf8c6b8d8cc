"""Everything that depends on torchtitan's private methods: one subclass of its DCP checkpointer.

Tested with the torchtitan releases in :data:`TESTED_VERSIONS`. :func:`manager_class` subclasses
``torchtitan.components.checkpoint.CheckpointManager`` (given as ``base``) and relies on this much
of it — a release that changes any of it needs this module changed (and a new entry in
:data:`TESTED_VERSIONS`):

* the constructor ``__init__(config, *, dataloader, model_parts, optimizers, lr_schedulers, states,
  sd_adapter, base_folder)`` and the attributes it sets: ``enable``, ``folder``, ``states`` (with
  ``"model"`` a ``ModelWrapper``), ``async_mode`` (an ``AsyncMode``), ``exclude_from_loading``,
  ``save_future``, ``load_only``; its ``Config`` dataclass (``async_mode``, ``keep_latest_k``,
  ``load_step``, ``load_only`` …);
* that the trainer calls ``save(step, last_step)`` at every step and ``save`` calls ``_save``;
  ``_should_save(curr_step, last_step)`` and ``_flattened_model_states_sd()`` (called);
* the hooks overridden here: ``_save(curr_step, last_step)``, ``dcp_save(state_dict, checkpoint_id, async_mode,
  enable_garbage_collection=False, to_hf=False)`` (every save goes through it), ``dcp_load(state_dict,
  checkpoint_id, from_hf, from_quantized)``, ``_load(step)``, ``_find_load_step(folder="")``,
  ``_create_checkpoint_id(step, folder="")``, ``_purge_stale_checkpoints()``, ``_wait_for_saving()``,
  ``_close()``; and ``_states_to_load(model_only)`` (called);
* that ``_save`` asserts a ``Future`` from ``dcp_save`` in ``"async"`` mode and an
  ``AsyncSaveResponse`` in ``"async_with_pinned_mem"`` mode, and that ``_load`` falls back to
  ``initial_load_path`` / ``hf_assets_path`` / a fresh start when ``_find_load_step()`` is -1.

What the subclass changes (each a torchtitan behaviour that ckptstore does instead):

* **saves** go to one :class:`ckptstore.CheckpointManager` (:func:`._titan_store.open_manager`) as version
  ``step-N``; ``"async"`` saves on its worker thread, ``"async_with_pinned_mem"`` in DCP's checkpoint
  subprocess (ckptstore's own staging buffers, not torchtitan's pinned-memory stager);
* **preemption**: every step torchtitan does not save still calls the store's ``save(step)``, so a
  SIGTERM (Slurm, Kubernetes, ``torchrun`` forwarding it) is noticed at the next step boundary: that
  step is saved on every rank within the grace period and the process exits with status 143, saying
  how to resume in torchtitan's terms (stock torchtitan dies at once and loses the steps since the
  last interval; a check at due saves only noticed it at the next one, often after the grace period);
* **its own gloo group**: the manager's (survives ``torchrun --max-restarts`` in-place restarts);
  torchtitan's ``dist.new_group(backend="gloo")`` is never made;
* **retention** ``KeepLast(keep_latest_k)`` runs after each commit on committed versions only
  (never the newest, never a save in flight); torchtitan's purge thread (``rmtree`` of folders by
  name, also of a save still being written) is never started;
* **discovery** is the manager's restore choice over the store (committed, verified versions;
  damaged or unloadable ones skipped); with nothing committed torchtitan's own ``_load`` runs:
  ``initial_load_path``, ``hf_assets_path`` (HF) or a fresh start;
* ``load_step=N`` loads ``step-N``; a later save of a newer name (an abandoned timeline, e.g.
  ``step-6`` after resuming from ``step-4``) *supersedes* it (docs/FORMAT.md, "Superseding")
  instead of raising ``VersionExistsError``; ``exclude_from_loading`` and the model-only load of
  ``step-0`` are honoured (the other keys of the version stay unread);
* **torchtitan's fault-tolerance mode** (``manager_class(TorchFTCheckpointManager)``, torchtitan's
  ``experiments.torchft``): its ``_save`` keeps deciding that only the replica at
  ``ft_manager.participating_rank() == 0`` writes the main checkpoint (through the store) and that
  every replica saves its data loader every step into ``FOLDER/ft-replicat-<id>/step-N`` with
  torchtitan's own DCP writer on its own gloo group (``dcp_save``/``dcp_load``/``_find_load_step``
  of a folder outside the store are torchtitan's); ``_wait_for_saving`` waits for that save too;
* **close** waits for every save and upload (``UploadError`` names what was not uploaded), then
  destroys the group; HF exports (``last_save_in_hf``) are written by torchtitan's own HF writer to
  ``FOLDER/hf/step-N``, outside the store.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import os
from typing import Any

from . import _titan_store as _store

#: torchtitan releases this module was tested with
TESTED_VERSIONS = ("0.3.0",)
MODEL = "model"

log = logging.getLogger("ckptstore.integrations.torchtitan")


class _NoStager:
    """Set as torchtitan's ``stager`` so that ``_save`` makes none: ckptstore stages into its own
    buffers (a pinned-memory ``DefaultStager`` also needs an accelerator: "Non-blocking copy requires
    that the current accelerator is available")."""

    def close(self) -> None:
        pass


def _done() -> cf.Future:
    f: cf.Future = cf.Future()
    f.set_result(None)
    return f


class _StoreCheckpointing:
    """The methods of :func:`manager_class`'s subclass: torchtitan's hooks, overridden to save, load,
    find and prune through one :class:`ckptstore.CheckpointManager` (``self._ckpt``). Placed before
    torchtitan's class in the bases, so ``super()`` is torchtitan's ``CheckpointManager``."""

    def __init__(self, config: Any, **kwargs: Any) -> None:
        # torchtitan's constructor without the two things ckptstore replaces: its gloo group
        # (made only for async modes) and its purge thread (made only for keep_latest_k > 0)
        inner = dataclasses.replace(config, async_mode="disabled", keep_latest_k=0)
        super().__init__(inner, **kwargs)
        if not self.enable:
            return
        self.async_mode = type(self.async_mode)(config.async_mode)
        self.keep_latest_k = config.keep_latest_k
        self.stager = _NoStager()
        self._find_cache: int | None = None
        self._ckpt = _store.open_manager(
            self.folder, async_mode=str(self.async_mode.value), keep_latest_k=config.keep_latest_k,
            remote=config.remote, key_file=config.key_file, durability=config.durability,
            remote_options=dict(config.remote_options or {}), load_only=bool(getattr(config, "load_only", False)),
            **_store.legacy_options(config),
        )
        log.info("ckptstore: checkpoints of this job are versions step-N of the store %s%s", self.folder,
                 f" (remote {config.remote})" if config.remote else "")

    # -- saving ------------------------------------------------------------------------------
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """torchtitan calls ``save(step)`` at every step: a step it does not save still goes through
        the store's ``save(step)``, so a preemption signal becomes the save of this step (and exit
        status 143) at the next step boundary, within the grace period, whatever the interval."""
        if self._should_save(curr_step, last_step):
            return super()._save(curr_step, last_step)  # -> dcp_save -> the store's save(step, force=True)
        if getattr(self, "enable_ft_dataloader_checkpoints", False):
            # torchtitan's fault-tolerance mode (TorchFTCheckpointManager): its per-replica data loader
            # checkpoint at every step, in its own folder, by its own DCP writer (not a store version)
            self._ft_save(curr_step)
        self._ckpt.save(curr_step, self._full_state)  # saves nothing unless a preemption signal came
        return False

    def _full_state(self) -> dict:
        """The state a preemption save writes: torchtitan's full checkpoint of this step (built only then)."""
        return _store.adapt(self._flattened_model_states_sd())

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        if to_hf:  # an HF export: torchtitan's own writer, into a folder outside the store
            path = checkpoint_id if not _store.is_version(checkpoint_id) else os.path.join(self.folder, "hf", checkpoint_id)
            return super().dcp_save(state_dict, path, async_mode, enable_garbage_collection, to_hf=True)
        if not _store.is_version(checkpoint_id):  # a folder outside the store (the per-replica FT loader)
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection)
        self._ckpt.save(_store.step_of(checkpoint_id), _store.adapt(state_dict), force=True)
        mode = getattr(async_mode, "value", async_mode)
        if mode == "disabled":
            self._ckpt.wait()
            return None
        # the manager staged the state before save() returned; the save itself is awaited by
        # _wait_for_saving (torchtitan calls it before the next save and at the last step)
        if mode == "async_with_pinned_mem":
            from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

            return AsyncSaveResponse(staging_completion=_done(), upload_completion=_done())
        return _done()

    def _wait_for_saving(self) -> None:
        fut = self.save_future  # torchtitan's own async save (the per-replica FT loader), if any
        if fut is not None and hasattr(fut, "result"):
            fut.result()
        self._ckpt.wait()
        self.save_future = None

    def _purge_stale_checkpoints(self) -> None:
        pass  # retention runs in the store after each commit (KeepLast(keep_latest_k))

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        if folder and os.path.abspath(folder) != os.path.abspath(self.folder):
            return super()._create_checkpoint_id(step, folder)
        return self._ckpt.version_name(step)

    # -- loading -----------------------------------------------------------------------------
    def _find_load_step(self, folder: str = "") -> int:
        if folder and os.path.abspath(folder) != os.path.abspath(self.folder):
            return super()._find_load_step(folder)
        if self._find_cache is not None:  # _load asked the store a moment ago (a collective)
            step, self._find_cache = self._find_cache, None
            return step
        version = self._ckpt.latest()
        return -1 if version is None else _store.step_of(version)

    def _load(self, step: int = -1) -> bool:
        if step == -1:
            version = self._ckpt.latest()  # a collective on the manager's group: every rank agrees
            if version is None:  # nothing committed: torchtitan's initial_load_path / HF / fresh start
                self._find_cache = -1
                return super()._load(step)
        else:
            version = self._ckpt.version_name(step)
        model_only = _store.step_of(version) == 0
        states = self._states_to_load(model_only)
        partial: bool | tuple = True if model_only else tuple(f"{k}." for k in self.exclude_from_loading)
        log.info("ckptstore: loading %s%s from %s", version, " (model only)" if model_only else "", self.folder)
        # step == -1 and a full load: the restore choice may fall back past a version that fails
        # verification; a named step (or step-0's model-only load) loads exactly that version
        named = version if (step != -1 or model_only) else None
        restored = self._ckpt.restore(_store.adapt(states), version=named, allow_partial_load=partial)
        if restored is None:
            return False
        self.states[MODEL].load_state_dict(states)
        info = self._ckpt.last_restore
        if info is not None and info.skipped:
            log.warning("ckptstore: restored %s; skipped %s", info.version,
                        "; ".join(f"{s.version} ({s.kind}: {s.reason})" for s in info.skipped))
        return True

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        if from_hf or not _store.is_version(checkpoint_id):  # initial_load_path, HF folders: torchtitan's
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        self._ckpt.restore(_store.adapt(state_dict), version=checkpoint_id, allow_partial_load=True)
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    # -- closing -----------------------------------------------------------------------------
    def _close(self) -> None:
        ckpt = getattr(self, "_ckpt", None)
        try:
            if ckpt is not None:
                ckpt.close()  # waits for every save and upload; destroys ckptstore's group
        finally:
            super()._close()


def manager_class(base: type) -> type:
    """The ckptstore subclass of torchtitan's DCP ``CheckpointManager`` class ``base``."""

    class CkptStoreCheckpointManager(_StoreCheckpointing, base):
        """torchtitan's checkpointer, saving, loading, finding and pruning through ckptstore
        (:mod:`ckptstore.integrations.torchtitan`). Config: torchtitan's, plus ``remote``
        (``"s3://bucket/prefix"``, ``"gs://…"``, ``"az://…"``), ``key_file``, ``durability``
        (``"local"``, ``"replicated"``, ``"remote"``), ``remote_options``; the local root is torchtitan's ``dump_folder/checkpoint.folder``
        and ``keep_latest_k`` the retention."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(base.Config):
            remote: str | None = None
            """Remote tier every version is also staged to (``s3://bucket/prefix``, ``gs://…``, ``az://…``); None: local only."""

            key_file: str | None = None
            """Master key file (32 bytes or their base64); None: CKPTSTORE_KEY / CKPTSTORE_KEY_FILE or no encryption."""

            durability: str = "local"
            """When a save counts as done: "local", "replicated" or "remote" (ckptstore.StorageWriter)."""

            remote_options: dict[str, str] = dataclasses.field(default_factory=dict)
            """The remote tier's options (docs/tiers.md, "Options"), e.g. {"endpoint_url": ...}; else its SDK's environment."""

            endpoint_url: str | None = None
            """Deprecated: remote_options = {"endpoint_url": ...} (mapped onto it, with a DeprecationWarning)."""

            def __post_init__(self) -> None:
                base.Config.__post_init__(self)
                if self.durability not in _store.DURABILITY:
                    raise ValueError(f"checkpoint durability must be one of {_store.DURABILITY}, got {self.durability!r}")

    return CkptStoreCheckpointManager
