"""The plan stage of a save: the per-save state (:class:`Save`) and what ``set_up_storage_writer``,
``prepare_local_plan`` and ``prepare_global_plan`` decide (:class:`Planner`): one name, one version
across tiers (docs/FORMAT.md, "Superseding"), the attempt and its data key, the commit sequence
(docs/FORMAT.md, "Order"), the coordinator's root claim (docs/FORMAT.md, "Placement") and what to stage again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid

import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from ..errors import (CkptStoreError, InvalidNameError, ManifestError, TransientStorageError, UnsupportedFormatError,
                      VersionExistsError, VersionNotFoundError)
from ..manifest import layout
from ..manifest.order import next_seq
from . import _roots
from ._config import multi_rank
from ._types import LocalPlanData, PlanData

log = logging.getLogger("ckptstore")

#: seconds the coordinator skips the remote existence check after the remote tier did not answer
_REMOTE_DOWN_S = 60.0


@dataclasses.dataclass(eq=False)
class Save:
    """Everything one DCP call sequence (reset → … → finish) needs; never shared between saves."""

    version: str | None
    step: int | None
    user_metadata: dict
    save_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    rank: int = 0
    is_coordinator: bool = True
    use_collectives: bool = True
    started: bool = False  # set_up_storage_writer ran: the next DCP sequence needs a new Save
    local_items: list = dataclasses.field(default_factory=list)
    attempt: str | None = None
    wrapped: object = None  # the wrapped data key (codec.crypto.WrappedKey) drawn by the coordinator; None: not encrypted
    #: ``{attempt: reason}`` of existing copies of this name the save may replace (docs/FORMAT.md, "Superseding")
    supersede: dict = dataclasses.field(default_factory=dict)
    existing: str | None = None  # the attempt of this name committed in this rank's root, if any
    #: the version token of that copy's manifest when it was checked: a superseding commit replaces
    #: only that copy (docs/FORMAT.md, "Superseding")
    existing_token: str | None = None
    existing_remote: str | None = None  # ... in the remote tier (coordinator)
    seq: int | None = None  # commit sequence (coordinator)
    restage: tuple = ()  # versions staged again with this save (see _remote.RemoteStage.restage_plan)
    replaced: tuple = ()  # attempts this commit replaces, every rank's root and the remote tier (coordinator)
    head: bytes | None = None  # the catalogue head this commit writes into the root (docs/FORMAT.md, "Catalogue chain")


class Planner:
    """Set-up checks and plans of the writer's saves. ``cfg``: the writer's settings; ``tier`` /
    ``remote``: this rank's root and the remote tier (None); ``keys``: ``_keys.DataKeys``;
    ``guard``: ``_liveness.Guard``; ``uploads``: ``_remote.RemoteStage``."""

    def __init__(self, cfg, tier, remote, keys, guard, uploads) -> None:
        self.cfg = cfg
        self.tier = tier
        self.remote = remote
        self.keys = keys
        self.guard = guard
        self.uploads = uploads
        self._remote_down_until = 0.0  # monotonic time before which set-up does not wait for the remote tier

    def begin(self, s: Save, is_coordinator: bool, kwargs: dict) -> None:
        """``set_up_storage_writer``'s arguments into ``s``; refuse a save that cannot commit."""
        s.started = True
        s.is_coordinator = is_coordinator
        s.use_collectives = kwargs.get("use_collectives", True)
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        s.rank = int(rank)
        if s.version is None:
            raise CkptStoreError(
                "no version name: pass checkpoint_id= to dcp.save/async_save or version= to StorageWriter"
            )
        world = self.cfg.world_size
        if world is not None and world > 1 and not (dist.is_available() and dist.is_initialized()):
            # DCP saves "in a single process" when torch.distributed is not initialised (any more)
            self.guard.check_world(1, f"the save of {s.version!r} (torch.distributed is not initialised)")
        if not s.use_collectives and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise CkptStoreError(
                "ckptstore commits one manifest per version and needs rank coordination; "
                "call dcp.save/async_save with use_collectives=True (the default)"
            )

    def check_existing(self, s: Save) -> None:
        """One name, one version, across tiers: every rank checks its own root (so every root of the
        job is checked) and the coordinator the remote tier, before anything is committed anywhere.
        A copy is replaced only with ``overwrite=True`` or when its attempt is one the save was told
        to supersede; otherwise :class:`VersionExistsError`. The attempts found are recorded in the
        new manifest's ``supersedes`` (docs/FORMAT.md, "Superseding")."""
        s.existing, s.existing_token = existing_copy(self.tier, s.version)
        where = None
        sync = self.uploads.sync
        if s.existing is not None and not self._may_replace(s, s.existing):
            where = f"the local tier {self.cfg.root}"
        elif s.is_coordinator and self.remote is not None and (sync or time.monotonic() >= self._remote_down_until):
            try:
                s.existing_remote = existing_attempt(self.remote, s.version)
            except TransientStorageError as e:
                if sync:
                    raise
                # durability="local": commit locally now; the remote commit is put-if-absent and
                # refuses the name there if it exists (docs/FORMAT.md, Save rule 8). For a minute
                # the next saves do not wait for the remote tier's retries again.
                self._remote_down_until = time.monotonic() + _REMOTE_DOWN_S
                log.warning("ckptstore: could not check the remote tier for an existing %r (%s); saving locally, "
                            "the upload follows when the remote tier answers", s.version, e)
            if s.existing_remote is not None and not self._may_replace(s, s.existing_remote):
                where = f"the remote tier {self.cfg.remote_url}"
        if where is not None:
            raise VersionExistsError(
                f"Checkpoint already exists: version {s.version!r} in {where}; choose a new checkpoint_id "
                "or pass overwrite=True to replace it"
            )

    def _may_replace(self, s: Save, attempt: str) -> bool:
        return self.cfg.overwrite or attempt in s.supersede

    def local_plan(self, s: Save, plan: SavePlan, want_base: bool = False) -> SavePlan:
        """``prepare_local_plan``: this rank, its root's commit sequence and existing copy, and
        whether it needs an incremental baseline from the store (``want_base``)."""
        s.local_items = [i for i in plan.items if i.type in (WriteItemType.TENSOR, WriteItemType.BYTE_IO)]
        from ..manifest import catalogue

        return dataclasses.replace(plan, storage_data=LocalPlanData(
            rank=s.rank,
            # one rank per node reads its root's newest manifests for the commit sequence (docs/FORMAT.md, "Order")
            seq=catalogue.max_seq(self.tier) if os.environ.get("LOCAL_RANK", "0") == "0" else None,
            existing=s.existing, want_base=want_base))

    def global_plan(self, s: Save, plans: list[SavePlan]) -> list[SavePlan]:
        """``prepare_global_plan`` (coordinator): the attempt, its data key, every rank's plan data
        (the same few fields for every rank: nothing in it grows with the job). In a job of more than
        one rank the coordinator claims its root for the attempt here, before any other rank sees the
        attempt, so it leads its root group (docs/FORMAT.md, "Placement")."""
        self.guard.check_world(len(plans), f"the plan of {s.version!r}")
        from .. import gc
        from ..manifest import writers

        # housekeeping first: what killed saves left in this root goes now, not after the grace period
        # (docs/FORMAT.md, Delete rule 15), so a root that killed writers filled has room for this save
        gc.reclaim_dead_writers_due(self.tier)
        attempt = layout.new_attempt()
        # before any rank writes anything: a key service that refuses fails the save here (docs/FORMAT.md, Save rule 10)
        w = self.keys.draw(s.version, attempt)
        # who coordinates the attempt, before any rank learns it (Delete rule 15)
        writers.write(self.tier, s.version, attempt)
        wrapped, kid, arn = (None, None, None) if w is None else (w.wrapped_key, w.key_id, w.kms_key_arn)
        ranks = [p.storage_data.rank if isinstance(p.storage_data, LocalPlanData) else i for i, p in enumerate(plans)]
        discover = len(plans) > 1 and multi_rank()
        if discover:
            _roots.claim(self.tier, attempt, s.rank)
        restage = self.uploads.restage_plan(s.version, len(plans))
        bases = self._baselines(s, ranks, plans)
        out = [
            dataclasses.replace(p, storage_data=PlanData(r, attempt, wrapped, kid, discover, s.rank, restage,
                                                         bases.get(r), arn))
            for r, p in zip(ranks, plans)
        ]
        s.attempt = attempt
        s.wrapped = w
        local = [p.storage_data for p in plans if isinstance(p.storage_data, LocalPlanData)]
        s.seq = next_seq([d.seq for d in local])
        s.replaced = tuple(sorted({d.existing for d in local if d.existing is not None}
                                  | ({s.existing_remote} if s.existing_remote is not None else set())))
        return out

    def _baselines(self, s: Save, ranks: list, plans: list) -> dict:
        """``{rank: Baseline}`` for the ranks of an incremental save that have no baseline in memory,
        read from the store (``_incremental.store_baseline``: the newest version of the writer's scope
        committed in this root); each rank gets only its own items."""
        want = [r for r, p in zip(ranks, plans) if isinstance(p.storage_data, LocalPlanData) and p.storage_data.want_base]
        if not (self.cfg.incremental and want):
            return {}
        from ._incremental import store_baseline

        _v, bases = store_baseline(self.tier, self.keys, self.cfg.scope, s.version, want)
        return bases


def existing_attempt(tier, version: str) -> str | None:
    """The attempt of ``version`` committed in ``tier`` (None: not committed there). A manifest
    that does not parse counts as a copy of an unknown attempt: never replaced unless overwrite."""
    return existing_copy(tier, version)[0]


def existing_copy(tier, version: str) -> tuple[str | None, str | None]:
    """``(attempt, token)`` of the copy of ``version`` committed in ``tier`` (``(None, None)``: not
    committed there): its attempt as :func:`existing_attempt` says, and the version token of its
    manifest taken before the manifest was read (``manifest.commit.read_token``)."""
    from ..manifest import catalogue
    from ..manifest.commit import read_token

    token = read_token(tier, version)
    if token is None and not tier.exists(layout.manifest_key(version)):
        return None, None
    try:
        return catalogue.read_manifest(tier, version).manifest.attempt, token
    except VersionNotFoundError:
        return None, None
    except (ManifestError, UnsupportedFormatError, InvalidNameError):
        return "(invalid manifest)", token


__all__ = ["Planner", "Save", "existing_attempt", "existing_copy"]
