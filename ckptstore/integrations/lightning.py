"""PyTorch Lightning checkpoints through ckptstore: saves, loads, ``ckpt_path="last"`` and removal.

``pip install 'ckptstore[lightning]'`` (pytorch-lightning is never a dependency of ckptstore itself)::

    from pytorch_lightning import Trainer
    from pytorch_lightning.callbacks import ModelCheckpoint
    from ckptstore.integrations.lightning import StoreCheckpointIO

    io = StoreCheckpointIO("/nvme/ckpt", remote="s3://bucket/run-42")
    ckpt = ModelCheckpoint(dirpath="/nvme/ckpt", every_n_train_steps=500, save_top_k=1, save_last=True)
    trainer = Trainer(strategy="ddp", plugins=[io], callbacks=[ckpt])
    trainer.fit(model, ckpt_path="last")       # the newest committed version, or a fresh start

* **DDP and single device**: :class:`StoreCheckpointIO` is Lightning's ``CheckpointIO`` extension
  point. Lightning saves on global rank 0 (a one-rank save, manifest ``world_size`` 1) and loads on
  every rank (one restore choice and load for the job; a rank whose root lacks the version reads it
  from rank 0 through ckptstore's peer exchange, else from the remote tier).
* **Sharded** (FSDP2 / tensor parallel): :class:`ModelParallelStrategy`, Lightning's
  ``ModelParallelStrategy`` whose every rank writes its shards into the store (one version, committed
  by the whole job), with ``plugins=[StoreCheckpointIO(...)]`` for the store. Lightning's
  ``FSDPStrategy`` (FSDP1) is not covered: it needs a CUDA device (``_lightning_v2_6.py``).

Names: a checkpoint path is version ``stem(path)`` of the store at ``root`` — ``epoch=0-step=50.ckpt``
→ ``epoch=0-step=50``, ``last.ckpt`` → ``last``; the directory part is not used. A path Lightning
takes for a "last" checkpoint (stem ``last``, ``last-v1``, …) loads the newest version every rank can
load and verify. After each commit the path gets a small JSON pointer file, so ``ModelCheckpoint``
(version counter, ``save_top_k``, ``save_last``) and ``ckpt_path="last"`` work as with files; saving
to an existing path replaces that version (it supersedes the old attempt); ``save_top_k``'s removals
go through ``gc.plan_drop`` (un-commit first; objects another version references stay; pinned
versions stay). ``ckptstore list ROOT`` shows the versions.

Options of :class:`StoreCheckpointIO`: ``remote`` (``s3://bucket/prefix``), ``key`` (32 bytes or a
key provider) or ``key_file``, ``durability`` (``"local"``: a save returns at the local commit and
uploads continue; ``"remote"``), ``retention`` (a :class:`ckptstore.retention.RetentionPolicy`, or an
int *k* for ``KeepLast(k)``, applied after each commit — in addition to ``ModelCheckpoint``'s),
``incremental`` (default True: an item unchanged since this process's previous save, e.g. the
``last`` copy of the checkpoint just saved, is referenced instead of written again),
``remote_options`` (the remote tier's options, docs/tiers.md), ``upload_timeout`` (seconds ``teardown`` waits for uploads).

Importing this module needs pytorch-lightning (:data:`TESTED_VERSIONS`; another release warns once).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

try:
    import pytorch_lightning as _pl
    from pytorch_lightning.strategies import ModelParallelStrategy as _ModelParallelStrategy
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"ckptstore.integrations.lightning needs pytorch-lightning ({e}); install it with "
        "pip install 'ckptstore[lightning]'"
    ) from e

from . import _lightning_v2_6 as _v
from ._lightning_v2_6 import TESTED_VERSIONS

__all__ = ["StoreCheckpointIO", "ModelParallelStrategy", "TESTED_VERSIONS"]

_version = getattr(_pl, "__version__", "unknown")
if _version.split("+")[0] not in TESTED_VERSIONS:
    warnings.warn(
        f"ckptstore.integrations.lightning was tested with pytorch-lightning {', '.join(TESTED_VERSIONS)}, not "
        f"{_version}: it relies on parts of Lightning listed in ckptstore/integrations/_lightning_v2_6.py; "
        "check that they still hold",
        RuntimeWarning, stacklevel=2,
    )


class StoreCheckpointIO(_v.StoreCheckpointIO):
    """Lightning's ``CheckpointIO`` saving, loading and removing checkpoints as versions of a ckptstore
    (``Trainer(plugins=[StoreCheckpointIO(root, ...)])``; options in the module docstring).

    ``root``: the store's local directory (may be ``ModelCheckpoint``'s ``dirpath``: the pointer files
    then sit beside ``versions/``). Raises :class:`ckptstore.CkptStoreError` for a URI as ``root`` or an
    unknown ``durability``; errors of a save or load arrive as ckptstore's typed errors (a missing
    version: :class:`ckptstore.VersionNotFoundError`).
    """

    def __init__(self, root: str | os.PathLike, *, remote: str | None = None, key: Any = None,
                 key_file: str | None = None, durability: str = "local", retention: Any = None,
                 incremental: bool = True, remote_options: dict | None = None, upload_timeout: float = 3600.0,
                 **legacy: Any) -> None:
        if key_file:
            from ..codec.crypto import load_key_file

            key = load_key_file(os.path.expanduser(key_file))
        if isinstance(retention, int) and not isinstance(retention, bool):
            from ..retention import KeepLast, RetentionPolicy

            retention = RetentionPolicy(rules=(KeepLast(retention),))
        super().__init__(root, remote=remote, key=key, durability=durability, retention=retention,
                         incremental=incremental, remote_options=remote_options, upload_timeout=upload_timeout, **legacy)


#: Lightning's ``ModelParallelStrategy`` saving every rank's shards through ckptstore
ModelParallelStrategy = _v.model_parallel_class(_ModelParallelStrategy)
ModelParallelStrategy.__module__ = __name__
ModelParallelStrategy.__qualname__ = ModelParallelStrategy.__name__ = "ModelParallelStrategy"
