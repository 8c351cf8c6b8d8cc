"""Node-local roots: which ranks share a root, and the manifest copies to every root that holds
objects of a version (docs/FORMAT.md, "Placement").

Discovery, with no flag from the user: every rank (re)writes its process's probe file
``probes/rNNNNN.<nonce>`` into its root during ``set_up_storage_writer`` and sends its nonce in its local plan; the coordinator
hands every rank the list of ``(rank, nonce)``; in ``write_data`` — after every rank has written its
probe, since DCP gathered all local plans in between — each rank lists its own probe directory and
finds the ranks whose probes it sees: its *root group*. A shared filesystem gives one group, node-local
disks one group per node, and any mix works the same way. The lowest rank of a group leads it.

Copies: the coordinator commits the manifest in its root (the single commit point) and then
publishes the manifest and the metadata object in the job's c10d key-value store (the one
``torch.distributed`` set up); the leader of every other root group waits for it in a background
thread (started in ``write_data``), checks that its root holds its group's objects, and writes the
metadata object, then the manifest (put-if-absent) into its root, then applies retention there.
Without that store (or after a crash between the commit and a copy) the next load repairs the root
(``StorageReader`` in a job, see ``_job.py``).
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import secrets
import threading
from typing import Any

import torch.distributed as dist

from .. import _faults
from ..errors import CkptStoreError, ObjectExistsError, ObjectNotFoundError, PlacementError
from ..manifest import layout, leases
from ..manifest.schema import parse
from ..tiers import LocalTier

log = logging.getLogger("ckptstore")

_ABORT = b"ckptstore:abort"
_KEY = "ckptstore/copy/"


def new_nonce() -> int:
    return secrets.randbits(64)


#: one probe per process (a rank): re-written (mtime refreshed) at every save, never deleted by the
#: writer — another save of this process may be in flight — and removed by ``ckptstore gc`` once
#: older than the grace period. Drawn at import and again in every forked child: ranks forked from
#: one process (a forkserver, ``multiprocessing``'s fork, a launcher that imported ckptstore) must
#: not share it, or a rank's probe left in a root it no longer writes to would pass for its probe there.
_nonce = new_nonce()


def process_nonce() -> int:
    """This process's root-probe nonce (see ``_nonce``)."""
    return _nonce


def _redraw_nonce() -> None:
    global _nonce
    _nonce = new_nonce()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_redraw_nonce)


def check_groups(groups: dict) -> None:
    """Refuse root groups the ranks disagree on: ``groups`` ``{rank: its root group}`` (every rank
    of a save). Each rank's group holds the rank, and every member of a group saw that same group —
    otherwise one root would be claimed by two groups (a rank's stale probe in a root it no longer
    writes to, a root visible from one node only) and the manifest's ``placement`` would be one the
    reader refuses (docs/FORMAT.md, "Placement"). Raises :class:`PlacementError`."""
    bad = []
    for r, g in sorted(groups.items()):
        g = tuple(g)
        if r not in g:
            bad.append(f"rank {r} sees {list(g)} (not itself)")
            continue
        for x in g:
            if x in groups and tuple(groups[x]) != g:
                bad.append(f"rank {r} sees ranks {list(g)} in its root, rank {x} sees {list(groups[x])}")
                break
    if bad:
        raise PlacementError(
            "the ranks disagree on which of them share a root (" + "; ".join(bad[:4]) + (" ..." if len(bad) > 4 else "")
            + "): a probe file of a rank that no longer writes to that root (probes/rNNNNN.<nonce>), or a root one "
            "node sees and another does not. Nothing was committed; remove the stale probes ('ckptstore gc' after "
            "the grace period, or delete ROOT/probes) and save again")


def write_probe(tier: LocalTier, rank: int, nonce: int) -> None:
    tier.put(layout.probe_key(rank, nonce), b"")


def root_group(tier: LocalTier, rank: int, probes: tuple) -> tuple[int, ...]:
    """The ranks (of ``probes``: ``(rank, nonce)`` pairs) whose probe this root holds; always
    includes ``rank``. One directory listing."""
    if not probes:
        return (rank,)
    prefix = layout.PROBES + "/"
    seen = {i.key[len(prefix):] for i in tier.list(prefix)}
    group = {r for r, n in probes if layout.probe_key(r, n)[len(prefix):] in seen}
    group.add(rank)
    return tuple(sorted(group))


def placement(groups: list[tuple]) -> list | None:
    """The manifest's ``placement``: distinct root groups in rank order, or None for one group."""
    distinct = sorted({tuple(g) for g in groups})
    return None if len(distinct) <= 1 else [list(g) for g in distinct]


def _store():
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: the next load repairs the roots
        return None


class Publisher:
    """Coordinator side: hand the committed manifest and metadata object to the other roots."""

    def __init__(self) -> None:
        self._keys: list[str] = []

    def publish(self, attempt: str, manifest: bytes, metadata: bytes | None) -> None:
        store = _store()
        if store is None:
            return
        data = _ABORT if metadata is None else len(manifest).to_bytes(8, "little") + manifest + metadata
        try:
            for old in self._keys[:-1]:  # a follower that has not read by now repairs at the next load
                store.delete_key(old)
            self._keys = self._keys[-1:] + [_KEY + attempt]
            store.set(_KEY + attempt, data)
        except Exception as e:  # noqa: BLE001 - the commit stands; the next load repairs the roots
            log.warning("ckptstore: could not hand version copies to the other roots (%s); the next load repairs them", e)


class Follower:
    """Leader of a root group other than the coordinator's: copies committed manifests into its root."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def follow(self, tier: LocalTier, version: str, attempt: str, group: tuple, timeout: float, after_copy) -> None:
        store = _store()
        if store is None:
            return
        t = threading.Thread(target=self._run, args=(store, tier, version, attempt, group, timeout, after_copy),
                             name="ckptstore-copy", daemon=True)
        t.start()
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def wait(self, timeout: float | None = None) -> None:
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout)

    def _run(self, store, tier, version, attempt, group, timeout, after_copy) -> None:
        try:
            store.wait([_KEY + attempt], _dt.timedelta(seconds=timeout))
            data = store.get(_KEY + attempt)
        except Exception as e:  # noqa: BLE001 - coordinator gone or timeout: the next load repairs
            self._note(f"version {version!r}: no copy of the manifest arrived ({e})")
            return
        if data == _ABORT:
            leases.release(tier, attempt)  # the save failed: what its ranks referenced needs no lease
            return
        n = int.from_bytes(data[:8], "little")
        _faults.point("copy.manifest")
        try:
            m = copy_into(tier, version, attempt, data[8 : 8 + n], data[8 + n :], group)
        except Exception as e:  # noqa: BLE001 - the commit stands elsewhere; the next load repairs this root
            self._note(f"version {version!r}: copying the manifest into {tier.url} failed ({e})")
            return
        if m is not None:
            leases.release(tier, attempt)  # the copy names what this root's ranks referenced
        if m is not None and after_copy is not None:
            after_copy(m)

    def _note(self, msg: str) -> None:
        log.warning("ckptstore: %s; the next load on this root repairs it", msg)
        with self._lock:
            self.errors.append(msg)


def copy_into(tier: LocalTier, version: str, attempt: str, manifest: bytes, metadata: bytes, ranks) -> Any:
    """Write the metadata object, then the manifest of ``version`` into ``tier`` (a root holding
    the objects of ``ranks``). Checks first that the manifest is this attempt's and that every
    object of those ranks — and every object of an earlier version they reference — is present with
    its size; returns the manifest, or None when the root does not hold the part (nothing is written
    then). Idempotent: a manifest already there stays."""
    m = parse(manifest, expect_version=version).manifest
    if m.attempt != attempt:
        return None
    rs = set(ranks)
    # its group's objects, and the objects of earlier versions they reference (docs/FORMAT.md, Save rule 11)
    for o in [*(o for o in m.objects if o.rank in rs), *(r for r in m.refs if r.rank in rs)]:
        try:
            if tier.stat(layout.object_key(getattr(o, "version", version), o.name)).size != o.size:
                return None
        except ObjectNotFoundError:
            if getattr(o, "version", version) != version:
                log.warning("ckptstore: version %r references %s of %r, which %s no longer holds; its manifest is "
                            "not installed there", version, o.name, o.version, tier.url)
            return None
    key = layout.object_key(version, m.metadata_object.name)
    if len(metadata) != m.metadata_object.size:
        raise CkptStoreError(f"metadata object copy of {version!r} has {len(metadata)} bytes, manifest says {m.metadata_object.size}")
    tier.put(key, metadata)
    mkey = layout.manifest_key(version)
    try:
        tier.put_if_absent(mkey, manifest)
    except ObjectExistsError:
        # a copy of an attempt this commit supersedes is replaced (docs/FORMAT.md, "Superseding");
        # any other copy stays (the same attempt, or a divergent one the restore choice reports)
        try:
            old = parse(tier.get(mkey), expect_version=version).manifest.attempt
        except CkptStoreError:
            old = None
        if old is not None and old in m.superseded_attempts:
            tier.put(mkey, manifest)
    return m
