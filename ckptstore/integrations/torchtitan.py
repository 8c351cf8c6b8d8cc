"""torchtitan's checkpointer on ckptstore: saves, loads, discovery and retention through a store.

Install torchtitan 0.3.0 next to ckptstore (from a clone of ckptstore: ``pip install -e '.[torchtitan]'``;
from a package index: ``pip install 'ckptstore[torchtitan]'``; torchtitan is never a dependency of
ckptstore itself), then activate it with torchtitan's own override mechanism — no change to
torchtitan or to its configs::

    torchrun --nproc-per-node=8 -m torchtitan.train --module llama3 --config llama3_8b \\
        --checkpoint.enable --checkpoint.interval 500 --checkpoint.keep-latest-k 3 \\
        --override.imports 'ckptstore.integrations.torchtitan.checkpointing={"remote": "s3://bucket/run-42"}'

The override replaces the ``checkpoint`` config (torchtitan's DCP ``CheckpointManager.Config``) by
:class:`CheckpointManager.Config` — every torchtitan field kept (``derive``), plus the options given
as the override's JSON kwargs: ``remote`` (``s3://bucket/prefix``), ``key_file``, ``durability``
(``"local"``/``"replicated"``/``"remote"``), ``remote_options``. The local root is torchtitan's
``dump_folder/checkpoint.folder``, retention its ``keep_latest_k``, version names its ``step-N``;
``ckptstore list DUMP/checkpoint`` shows them. What the subclass changes: ``ckptstore/integrations/_titan_v0_3.py``
(module docstring). In Python, without the override::

    from ckptstore.integrations.torchtitan import CheckpointManager
    config.checkpoint = derive(config.checkpoint, CheckpointManager.Config, remote="s3://b/run")

torchtitan's fault-tolerance mode (``--module torchft.llama3 --fault_tolerance.enable``, torchft
across replica groups) has its own checkpointer, ``TorchFTCheckpointManager``; its ckptstore subclass
is :data:`FTCheckpointManager` and its override ``ckptstore.integrations.torchtitan.ft_checkpointing``
(docs/torchft.md, "Under torchtitan", has the command)::

    torchrun --nproc-per-node=8 -m torchtitan.train --module torchft.llama3 --config llama3_torchft_debugmodel \
        --fault_tolerance.enable --fault_tolerance.replica_id 0 --fault_tolerance.group_size 2 \
        --checkpoint.enable --override.imports 'ckptstore.integrations.torchtitan.ft_checkpointing'

Importing this module needs torchtitan (:data:`TESTED_VERSIONS`; another release warns once).
"""

from __future__ import annotations

import warnings

try:
    import torchtitan as _torchtitan
    from torchtitan.components.checkpoint import CheckpointManager as _TitanCheckpointManager
    from torchtitan.config.override import derive as _derive
    from torchtitan.config.override import override as _override
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"ckptstore.integrations.torchtitan needs torchtitan 0.3.0 ({e}): from a clone of ckptstore "
        "pip install -e '.[torchtitan]' (in the clone's folder), from a package index "
        "pip install 'ckptstore[torchtitan]'; on a CPU-only torch also pip install triton (docs/howto/torchtitan.md)"
    ) from e

from ._titan_v0_3 import TESTED_VERSIONS, manager_class

__all__ = ["CheckpointManager", "FTCheckpointManager", "checkpointing", "ft_checkpointing", "TESTED_VERSIONS"]

_version = getattr(_torchtitan, "__version__", "unknown")
if _version.split("+")[0] not in TESTED_VERSIONS:
    warnings.warn(
        f"ckptstore.integrations.torchtitan was tested with torchtitan {', '.join(TESTED_VERSIONS)}, not {_version}: "
        "it overrides private methods of torchtitan's CheckpointManager (listed in ckptstore/integrations/"
        "_titan_v0_3.py); check that they still exist",
        RuntimeWarning, stacklevel=2,
    )

#: torchtitan's DCP checkpointer saving through ckptstore (subclass of its ``CheckpointManager``)
CheckpointManager = manager_class(_TitanCheckpointManager)
CheckpointManager.__module__ = __name__
CheckpointManager.__qualname__ = CheckpointManager.__name__ = "CheckpointManager"


@_override(target=_TitanCheckpointManager.Config,
           description="checkpoints through ckptstore (saves, loads, discovery, retention)")
def checkpointing(cfg, **options):
    """The ``--override.imports`` factory: torchtitan's checkpoint config → :class:`CheckpointManager.Config`
    with every field kept and ``options`` (``remote``, ``key_file``, ``durability``, ``remote_options``)."""
    return _derive(cfg, CheckpointManager.Config, **options)


# -- torchtitan's fault-tolerance mode (torchtitan.experiments.torchft) -------------------------------
try:
    from torchtitan.experiments.torchft.checkpoint import TorchFTCheckpointManager as _TitanFTCheckpointManager
except ImportError:  # pragma: no cover - torchft not installed: torchtitan's FT mode cannot run either
    _TitanFTCheckpointManager = None
    FTCheckpointManager = None
    ft_checkpointing = None
else:
    #: torchtitan's fault-tolerant checkpointer (``TorchFTCheckpointManager``) saving through ckptstore
    FTCheckpointManager = manager_class(_TitanFTCheckpointManager)
    FTCheckpointManager.__module__ = __name__
    FTCheckpointManager.__qualname__ = FTCheckpointManager.__name__ = "FTCheckpointManager"

    @_override(target=_TitanFTCheckpointManager.Config,
               description="checkpoints through ckptstore under torchtitan's fault tolerance (torchft)")
    def ft_checkpointing(cfg, **options):
        """The ``--override.imports`` factory of torchtitan's fault-tolerance mode: its
        ``TorchFTCheckpointManager.Config`` → :class:`FTCheckpointManager.Config` with every field kept
        and ``options`` (``remote``, ``key_file``, ``durability``, ``endpoint_url``)."""
        return _derive(cfg, FTCheckpointManager.Config, **options)
