"""The commit stage of a save (phase 2, the coordinator's ``finish``; docs/FORMAT.md, "Commit, read
and deletion ordering"): sort the ranks' reports, check them (the whole job, equal values of
DCP-replicated items, a trainer still alive), write DCP's ``Metadata`` as a framed object, seal the
manifest and commit it put-if-absent in this root — the version exists from then on — then hand the
manifest to the other roots that hold objects of it (docs/FORMAT.md, "Placement") and apply
retention. The rank side of the equal-values check (:func:`value_digests`) lives here too.
"""

from __future__ import annotations

import io
import logging
import time

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .. import _faults, _pace
from ..codec import FrameCodec, xxh3
from ..codec.crypto import FrameCipher
from ..errors import (CkptStoreError, CommitRefusedError, FencedError, InvalidNameError, ManifestError, ObjectNotFoundError,
                      PlacementError, StateDictKeysError, UnsupportedFormatError)
from ..manifest import chain, layout, leases, placement, writers
from ..manifest.commit import commit_manifest, supersede_manifest
from ..manifest.placement import group_domains
from ..manifest.schema import Manifest, ObjectEntry, nonfinite_text, parse, utcnow
from . import _roots
from ._checks import check_metadata_loads, value_digest
from ._frames import NONFINITE_FIRST, tensor_bytes, write_small_object
from ._metadata import ItemTables, dump, pack_head
from ._reports import UploadFailure, collect, digest_result
from ._stage import OwnLock
from ._types import RootReport

log = logging.getLogger("ckptstore")


def value_digests(items: list, planner, rank: int) -> list:
    """Rank side of the equal-values check: a digest of the value of each of this rank's write
    ``items`` (a tensor's bytes; a bytes item's value, ``_checks.value_digest``) for the coordinator
    to compare across ranks (:meth:`Committer.commit`)."""
    out = []
    for item in items:
        data = planner.resolve_data(item)
        mv = value_digest(planner, item, data) if isinstance(data, io.BytesIO) else tensor_bytes(data, item.index.fqn)
        out.append(digest_result(item.index.fqn, rank, xxh3(mv)))
    return out


def _check_same_values(digests: dict[str, dict[int, int]]) -> None:
    for fqn, by_rank in digests.items():
        if len(set(by_rank.values())) > 1:
            raise StateDictKeysError(
                f"state dict key {fqn!r} holds different values on ranks {sorted(by_rank)} "
                "(a plain tensor or object, not a DTensor, is saved once for all ranks, so the other "
                "ranks' values would be lost). Save per-rank state under per-rank keys, e.g. "
                f"f'{fqn}.rank{{rank}}', or pass allow_divergent_replicas=True to keep only one copy"
            )


class Committer(OwnLock):
    """Commits versions in this rank's root (the coordinator's, or a follower's copy through
    :meth:`after_commit`). ``cfg``: the writer's settings; ``tier``/``remote``: this root and the
    remote tier (None); ``keys``: ``_keys.DataKeys``; ``guard``: ``_liveness.Guard``;
    ``publisher``: ``_roots.Publisher``; ``in_flight()``: versions still uploading (retention keeps them);
    ``software``: the manifest's ``writer`` (``"ckptstore X torch Y"``)."""

    _fresh = {"_pruned": list}

    def __init__(self, cfg, tier, remote, keys, guard, publisher, in_flight, software: str) -> None:
        super().__init__()
        self.cfg = cfg
        self.tier = tier
        self.remote = remote
        self.keys = keys
        self.guard = guard
        self.publisher = publisher
        self.in_flight = in_flight
        self.software = software
        self._pruned: list[dict] = []

    def commit(self, s, metadata: Metadata, results: list, timed) -> tuple[Manifest, bytes, list]:
        """Commit the save ``s`` (a ``_plan.Save``) locally from DCP's ``metadata`` and every rank's
        write ``results``; returns the manifest, its bytes and the ranks' upload failures.
        ``timed(version, **seconds)`` records ``commit_s`` and ``replicate_s``."""
        t0 = time.monotonic()
        _pace.point()  # a paced save thread pauses before the commit, never between its fence check and commit point
        reports, digests, tables, extras = collect(results)
        upload_failures = [x for x in extras if isinstance(x, UploadFailure)]
        roots = [x for x in extras if isinstance(x, RootReport)]
        split = _roots.placement([(r.rank, r.leader) for r in roots])
        # the failure domain of each root group: its leader's (docs/FORMAT.md, "Replicas")
        doms = group_domains(split, {r.rank: r.domain for r in roots}) if split else None
        try:
            self.guard.check_world(len(results), f"the commit of {s.version!r}")
            _check_same_values(digests)
            m, body = self.seal(s, metadata, tables, reports, world_size=len(results), placement=split, domains=doms)
            _pace.point()
            self.check_committable(s, m, body)
            self.guard.check_trainer(f"the local commit of {s.version!r}")
            self.check_owner(s.version)
            if s.existing is not None and not self.cfg.overwrite:
                # replace the copy the save checked and no other (docs/FORMAT.md, "Superseding")
                supersede_manifest(self.tier, s.version, body, token=s.existing_token, attempt=s.existing,
                                   fault="commit.manifest")
            else:
                commit_manifest(
                    self.tier, s.version, body, overwrite=self.cfg.overwrite,
                    fault="commit.manifest",
                    hint="another save committed it first; its data is intact. Choose a new checkpoint_id or pass overwrite=True",
                )
        except BaseException:
            if split:
                self.publisher.publish(s.attempt, b"", None)  # the other roots stop waiting (and reclaim)
            leases.release(self.tier, s.attempt)  # the save failed: its references need no protection
            from .. import gc

            gc.reclaim_failed_attempt(self.tier, s.version, s.attempt)  # unless it did commit (Delete rule 14)
            raise
        # committed here: the manifest now names what the ranks of this root referenced (their leases go),
        # and protects the attempt (its writer record goes, Delete rule 15)
        leases.release(self.tier, s.attempt)
        writers.remove(self.tier, s.version, s.attempt)
        if s.head is not None:  # the root's catalogue head names this commit now (docs/FORMAT.md, "Catalogue chain")
            try:
                self.tier.put(layout.CATALOGUE_HEAD, s.head)
            except CkptStoreError as e:
                log.warning("ckptstore: could not update the catalogue head of %s after %r: %s", self.tier.url, s.version, e)
        _faults.point("commit.after_manifest")
        timed(s.version, commit_s=time.monotonic() - t0)
        if m.nonfinite_count:
            log.warning("ckptstore: version %r holds %s; committed and recorded as such, it is not the default "
                        "restore point (docs/FORMAT.md, \"Restore choice\")", s.version, nonfinite_text(m.nonfinite))
        if split:  # every other root that holds objects gets the manifest (docs/FORMAT.md, "Placement")
            t1 = time.monotonic()
            self.publisher.publish(s.attempt, body, self.tier.get(layout.object_key(s.version, m.metadata_object.name)))
            timed(s.version, replicate_s=time.monotonic() - t1)
        return m, body, upload_failures

    def check_committable(self, s, m: Manifest, body: bytes) -> None:
        """Refuse to commit a manifest the reader would refuse (docs/FORMAT.md, Save rule 11): its
        bytes parse under the reader's rules (placement, references, replicas, every field), every
        object of a saving rank belongs to a root group of ``placement``, and every object of an
        earlier version it references that this root should hold (the objects of its own group's
        ranks) is here with its size — a ``gc``/``drop`` that removed one while the save ran
        (docs/FORMAT.md, "References") fails the save instead of committing what cannot load.
        Raises :class:`CommitRefusedError`; nothing is committed, a retry of the name works."""
        try:
            parse(body, expect_version=s.version)
        except (ManifestError, UnsupportedFormatError, InvalidNameError) as e:
            raise CommitRefusedError(f"version {s.version!r}: this save built a manifest a reader would refuse ({e}); "
                                     "nothing was committed") from e
        groups = placement.groups(m)
        in_groups = {r for g in groups for r in g}
        stray = sorted({o.rank for o in m.objects if o.rank is not None and o.rank not in in_groups})
        if m.placement and stray:
            raise PlacementError(f"version {s.version!r}: ranks {stray} wrote objects but belong to no root group "
                                     f"of {m.placement}; nothing was committed")
        mine = next((set(g) for g in groups if s.rank in g), None)
        gone = []
        for ref in m.refs:
            if mine is not None and m.placement and ref.rank not in mine:
                continue  # held by another root (checked by the rank that references it)
            try:
                if self.tier.stat(layout.object_key(ref.version, ref.name)).size != ref.size:
                    gone.append(f"{ref.name} of {ref.version!r} (changed)")
            except ObjectNotFoundError:
                gone.append(f"{ref.name} of {ref.version!r}")
        if gone:
            raise CommitRefusedError(
                f"version {s.version!r} references objects of earlier versions that are no longer in {self.tier.url}: "
                f"{', '.join(gone[:4])}{' ...' if len(gone) > 4 else ''} (deleted by gc or drop while the save ran); "
                "nothing was committed. Save again: the next save writes those items whole")

    def check_owner(self, version: str) -> None:
        """The writer's ``commit_check`` right before the commit point (docs/FORMAT.md, Save rule 9):
        a reason refuses the commit (:class:`FencedError`); an error in the check refuses it too."""
        check = self.cfg.commit_check
        if check is None:
            return
        try:
            why = check(version)
        except Exception as e:  # noqa: BLE001 - an owner that cannot tell does not commit
            why = f"the commit check failed: {type(e).__name__}: {e}"
        if why:
            raise FencedError(f"the save of {version!r} was not committed: {why}. Its objects are garbage for "
                              "ckptstore gc; the owner of the step commits it")

    def seal(self, s, metadata: Metadata, tables: list, reports: list, world_size: int,
             placement: list | None = None, domains: list | None = None) -> tuple[Manifest, bytes]:
        """Phase 2 up to the commit: write the DCP metadata object (``metadata`` with the ranks' item
        ``tables``), build and seal the manifest."""
        cfg = self.cfg
        w = s.wrapped
        data_key = cipher = None
        if w is not None:
            data_key = self.keys.unwrap(w, s.version, s.attempt)
            cipher = FrameCipher(data_key)
        codec = FrameCodec(s.version, s.attempt, cipher, compress=cfg.compression, level=cfg.level)
        metadata.storage_meta = StorageMeta(checkpoint_id=s.version, save_id=s.save_id)  # as FileSystemWriter records it
        # the item locations stay packed: dcp.save returns (and DCP broadcasts) them as ItemTables
        metadata.storage_data = ItemTables(tables)
        head = pack_head(metadata, tables)  # docs/FORMAT.md, "DCP metadata object" (format 3: packed tables)
        parts = dump(head)  # the header pickle, then the columns as the ranks' tables hold them
        del head
        # never commit what the reader refuses: every object of the pickle (the columns follow it as bytes)
        check_metadata_loads(parts[0], s.version)
        meta_entry, meta_codecs = write_small_object(self.tier, codec, s.version, layout.metadata_name(s.attempt), parts,
                                                     cfg.frame_size, threads=cfg.threads)
        del parts
        reports.sort(key=lambda r: r.rank)
        objects = [ObjectEntry(r.name, r.size, r.digest, r.frames, r.rank, r.nbytes) for r in reports]
        codecs = sorted({c for r in reports for c in r.codecs} | set(meta_codecs))
        m = Manifest(
            version=s.version,
            attempt=s.attempt,
            created=utcnow(),
            world_size=world_size,
            objects=objects,
            metadata_object=meta_entry,
            nbytes=sum(r.nbytes + r.ref_nbytes for r in reports),
            stored_bytes=sum(o.size for o in objects) + meta_entry.size,
            step=s.step,
            user=s.user_metadata,
            encryption=None if w is None else w.encryption(),
            codecs=[c for c in codecs if c],
            writer=self.software,
            placement=placement,
            domains=domains if domains and all(domains) else None,
            seq=s.seq,
            replicas=cfg.replicas or None,
            refs=sorted({ref.name: ref for r in reports for ref in r.refs}.values(), key=lambda r: r.name),
            supersedes=[{"attempt": a, "reason": s.supersede.get(a, "overwritten (overwrite=True)")} for a in s.replaced] or None,
            nonfinite=nonfinite_of(reports) if cfg.count_nonfinite else None,
        )
        if data_key is not None:  # a keyed commit extends the root's chain (docs/FORMAT.md, "Catalogue chain")
            counter, prev = chain.counter_of(self.tier)
            m.chain = {"n": counter + 1, "prev": prev}
            s.head = chain.head_bytes(s.version, s.attempt, counter + 1, m.encryption, data_key, counter=counter + 1)
        return m, m.to_bytes(data_key)

    def after_commit(self, m: Manifest) -> None:
        """Retention in this root after ``m`` was committed (or copied) here."""
        from ..gc import apply_after_commit

        t0 = time.monotonic()
        decisions = apply_after_commit(self.tier, self.cfg.retention, m, tier_name="local", others={"remote": self.remote},
                                       in_flight=self.in_flight())
        deleted = [d.version for d in decisions if not d.keep]
        if deleted:
            with self._lock:
                self._pruned.append({"tier": "local", "after": m.version, "deleted": deleted,
                                     "seconds": time.monotonic() - t0, "outcome": "ok"})
                del self._pruned[:-16]

    def pruned(self) -> list[dict]:
        """What :meth:`after_commit` deleted since the last call (``StorageWriter.pruned``)."""
        with self._lock:
            out, self._pruned = self._pruned, []
        return out


def nonfinite_of(reports: list) -> dict | None:
    """The manifest's ``nonfinite`` (docs/FORMAT.md, "Manifest") from the ranks' ``ObjectReport``s
    (sorted by rank): the values and items added up, the first NONFINITE_FIRST keys in rank order
    (a key held by several ranks — the shards of one tensor — once, with its values added up); None
    when a rank did not count (unknown)."""
    if any(r.nonfinite is None for r in reports):
        return None
    first: dict[str, int] = {}
    for r in reports:
        for key, n in r.nonfinite[2]:
            if key in first or len(first) < NONFINITE_FIRST:
                first[key] = first.get(key, 0) + n
    return {"count": sum(r.nonfinite[0] for r in reports), "items": sum(r.nonfinite[1] for r in reports),
            "first": [{"key": k, "count": n} for k, n in first.items()]}


def divergence_checked(allow_divergent: bool) -> bool:
    """Whether ranks report value digests: a job of more than one rank (one rank cannot diverge from
    itself) that did not pass ``allow_divergent_replicas``."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return not allow_divergent and world > 1


__all__ = ["Committer", "divergence_checked", "nonfinite_of", "value_digests"]
