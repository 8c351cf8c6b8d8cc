"""What each rank reports to the coordinator through DCP's write results.

DCP gathers every rank's ``write_data`` results to the coordinator's ``finish``. Besides the one
packed item table per rank (``ItemTable``, docs/FORMAT.md "DCP metadata object"), ranks send a few
records as *sentinel* results — a ``MetadataIndex`` no state dict key can have (:data:`SENTINEL`):
the object they wrote (``ObjectReport``), the leader of their root group (``RootReport``), a failed upload
(:class:`UploadFailure`) and, for DCP-replicated items, a digest of their value (``ReplicaDigest``).
:func:`collect` sorts them out again on the coordinator.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import CkptStoreError
from ._metadata import ItemTable, pack_items
from ._types import ObjectReport, ReplicaDigest, RootReport

SENTINEL = "\x00ckptstore/"


@dataclasses.dataclass(frozen=True)
class UploadFailure:
    """A rank's failed upload (PROCESS executor, durability="local"), reported to the coordinator."""

    rank: int
    error: str


def items_result(rank: int, nbytes: int, idx: list, locs: list, digests: list | None = None) -> WriteResult:
    """The one WriteResult that carries all of a rank's item locations (``MetadataIndex`` ``idx`` →
    ``ItemLocation`` ``locs``; with ``digests``, each item's XXH3-128), packed as an ``ItemTable``
    (docs/FORMAT.md, "DCP metadata object"): DCP gathers a few byte strings per rank instead of one
    object per item, and the coordinator's ``finish`` concatenates them without touching single items."""
    return WriteResult(MetadataIndex(SENTINEL + f"items/{rank}"), nbytes, pack_items(idx, locs, digests))


def object_result(rep: ObjectReport, nbytes: int) -> WriteResult:
    return WriteResult(MetadataIndex(SENTINEL + f"object/{rep.rank}"), nbytes, rep)


def root_result(rank: int, leader: int, domain: str = "") -> WriteResult:
    return WriteResult(MetadataIndex(SENTINEL + f"root/{rank}"), 0, RootReport(rank, leader, domain))


def upload_failure_result(failed: UploadFailure) -> WriteResult:
    return WriteResult(MetadataIndex(SENTINEL + f"upload/{failed.rank}"), 0, failed)


def digest_result(fqn: str, rank: int, digest: int) -> WriteResult:
    return WriteResult(MetadataIndex(SENTINEL + "replica/" + fqn), 0, ReplicaDigest(fqn, rank, digest))


def collect(results: list[list[WriteResult]]) -> tuple[list[ObjectReport], dict[str, dict[int, int]], list, list]:
    """Split the ranks' write results into object reports, replica digests, the ranks' item tables
    (in rank order) and the other sentinels (root reports, upload failures)."""
    reports: list[ObjectReport] = []
    replicas: dict[str, dict[int, int]] = {}
    tables: list[ItemTable] = []
    extras: list = []
    for per_rank in results:
        for r in per_rank:  # a few sentinels per rank (and a digest per replicated item)
            sd = r.storage_data
            if isinstance(sd, ItemTable):
                tables.append(sd)
            elif isinstance(sd, ObjectReport):
                reports.append(sd)
            elif isinstance(sd, ReplicaDigest):
                replicas.setdefault(sd.fqn, {})[sd.rank] = sd.digest
            elif isinstance(sd, (RootReport, UploadFailure)):
                extras.append(sd)
            else:
                raise CkptStoreError(
                    f"write result {r.index.fqn!r} carries {type(sd).__name__}, not a ckptstore record: every "
                    "rank of a save must use ckptstore.StorageWriter of the same release")
    return reports, replicas, tables, extras


__all__ = ["SENTINEL", "UploadFailure", "collect", "digest_result", "items_result", "object_result", "root_result",
           "upload_failure_result"]
