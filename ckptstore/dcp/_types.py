"""Plain, picklable records that travel in DCP plans and ``Metadata.storage_data``.

They are registered with ``torch.serialization.add_safe_globals`` so that a restricted
(``weights_only``) unpickler of newer torch releases can read DCP metadata written by ckptstore.
"""

from __future__ import annotations

import dataclasses

from ..codec.frame import FrameRef


@dataclasses.dataclass(frozen=True)
class LocalPlanData:
    """Set in ``prepare_local_plan``: the rank that owns the plan (kept by the global plan)."""

    rank: int
    seq: int | None = None  # the highest commit sequence in this rank's root (docs/FORMAT.md, "Order")
    existing: str | None = None  # the attempt of this version name already committed in this rank's root
    #: an incremental writer without a baseline in memory: the coordinator reads one from the store
    want_base: bool = False


@dataclasses.dataclass(frozen=True)
class PlanData:
    """Set by the coordinator in ``prepare_global_plan`` for every rank's plan.

    ``discover``: find this rank's root group (a job of more than one rank: claim the root for the
    attempt, docs/FORMAT.md "Placement"); ``coordinator``: the rank that commits (its root holds the
    commit point, which it claimed first).
    """

    rank: int
    attempt: str
    wrapped_key: str | None
    key_id: str | None
    discover: bool = False
    coordinator: int = 0
    #: versions committed locally but not remotely that every rank uploads its part of again in this
    #: save (a crash or an outage cut their remote commit off; docs/FORMAT.md, Save rule 8)
    restage: tuple = ()
    #: this rank's incremental baseline read from the store by the coordinator (``_incremental.Baseline``),
    #: when it asked for one (``LocalPlanData.want_base``)
    baseline: object = None
    #: the AWS KMS key that wrapped ``wrapped_key`` (its ``CiphertextBlob``), None: a raw master key
    kms_key_arn: str | None = None


@dataclasses.dataclass(frozen=True)
class RootReport:
    """Rank → coordinator: the rank that leads the root ``rank`` writes to (the root group's claimer,
    docs/FORMAT.md "Placement"): ranks with one leader form one root group; the rank's failure domain
    (docs/FORMAT.md, "Replicas")."""

    rank: int
    leader: int
    domain: str = ""


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Frames that travel together in a load's exchange (``_peers``): ``frames``: ``((object name,
    FrameRef), ...)`` in object and offset order; ``origin``: the global rank whose root serves them,
    None for the remote tier."""

    origin: int | None
    frames: tuple

    @property
    def nbytes(self) -> int:
        """Stored bytes of the chunk's frames."""
        return sum(f.length for _o, f in self.frames)


@dataclasses.dataclass(frozen=True)
class ExchangePlan:
    """Load plan storage data: this rank's part of the load's exchange (``_peers.plan``).

    ``chunks``: the chunks it reads, receives or forwards; ``read``: indices of the chunks it reads and
    verifies itself; ``steps``: ``((round, peer global rank, send, (chunk indices, ...)), ...)`` — one
    message per entry, the chunks in that order on both sides; ``make_group``: every rank of the load
    makes a gloo group for the exchange first (the load runs on the default group)."""

    chunks: tuple = ()
    read: tuple = ()
    steps: tuple = ()
    make_group: bool = False


@dataclasses.dataclass(frozen=True)
class ItemLocation:
    """``WriteResult.storage_data`` / ``Metadata.storage_data[index]`` for one write item.

    ``object``: object name in the version (``attempts/<a>/r00001.ckd``); ``frames``: the item's
    frames in order (their ``raw_len`` add up to ``nbytes``); ``dtype``: e.g. ``"bfloat16"`` for
    tensors, None for bytes; ``shape``: the stored chunk's shape (C-contiguous), None for bytes.
    """

    object: str
    frames: tuple
    nbytes: int
    dtype: str | None
    shape: tuple | None


@dataclasses.dataclass(frozen=True)
class ObjectReport:
    """Rank → coordinator: one object that rank wrote (carried as a sentinel WriteResult)."""

    name: str
    size: int
    digest: str
    frames: int
    rank: int
    nbytes: int
    codecs: tuple
    #: ``RefEntry``s of earlier versions' objects whose frames this rank's items reference
    #: (incremental saves, docs/FORMAT.md "References"), and the logical bytes of those items
    refs: tuple = ()
    ref_nbytes: int = 0
    #: the rank's non-finite values (docs/FORMAT.md, "Manifest": ``nonfinite``): ``(values, write
    #: items holding any, ((fqn, values), ...) of the first few)``; None: not counted
    nonfinite: tuple | None = None


@dataclasses.dataclass(frozen=True)
class ReplicaDigest:
    """Rank → coordinator: XXH3 of a non-sharded item this rank holds (to detect divergent copies)."""

    fqn: str
    rank: int
    digest: int


def _register() -> None:
    try:
        import torch.serialization as ts

        ts.add_safe_globals([FrameRef, ItemLocation, LocalPlanData, PlanData, ObjectReport, ReplicaDigest, RootReport, Chunk, ExchangePlan])
    except Exception:  # pragma: no cover - older torch
        pass


_register()
