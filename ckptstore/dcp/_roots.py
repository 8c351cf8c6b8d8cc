"""Node-local roots: which ranks share a root, and the manifest copies to every root that holds
objects of a version (docs/FORMAT.md, "Placement").

Discovery, with no flag from the user, at O(1) per rank: a *claim* is the file
``probes/root.<token>`` created exclusively (``O_CREAT | O_EXCL``) in a rank's root and holding the
rank that created it; a rank that finds it there reads who did. The ranks that read one claimer
share that root: the claimer leads the root group. A save's token is its attempt — the coordinator
claims its own root in ``prepare_global_plan``, before any other rank sees the attempt, so it leads
its group, and every other rank claims in ``write_data``; a load's token is a fresh random one
(``_job.py``), claimed by the load's first rank before the others. A shared filesystem gives one
group, node-local disks one group per node, any mix works the same way; no rank lists another
rank's probe (nothing grows with the job on a shared root). The claimer removes the claim once every
rank has read it (after the commit, after a load's exchange); ``ckptstore gc`` removes what a killed
process left, once older than the grace period.

Copies: the coordinator commits the manifest in its root (the single commit point) and then
publishes the manifest and the metadata object in the job's c10d key-value store (the one
``torch.distributed`` set up); the leader of every other root group waits for it in a background
thread (started in ``write_data``), checks that its root holds its group's objects, and writes the
metadata object, then the manifest (put-if-absent) into its root, then applies retention there. So
``dcp.save`` can return on a rank of another group before its root holds the manifest; a load in
the same processes first waits for those copies (:func:`wait_for_copies`), so only a copy that a
crash cut off is repaired (and reported) by the next load (``StorageReader`` in a job, see ``_job.py``).
"""

from __future__ import annotations

import datetime as _dt
import errno
import logging
import os
import threading
import time
import weakref
from typing import Any

import torch.distributed as dist

from .. import _faults
from ..errors import CkptStoreError, ObjectExistsError, ObjectNotFoundError, PreconditionFailedError
from ..manifest import layout, leases
from ..manifest.schema import parse
from ..tiers import LocalTier

log = logging.getLogger("ckptstore")

_ABORT = b"ckptstore:abort"
_KEY = "ckptstore/copy/"
#: seconds a rank waits for the content of a claim another rank just created
_CLAIM_READ_S = 30.0


def claim(tier: LocalTier | None, token: str, rank: int) -> int:
    """The leader of ``tier``'s root group for ``token``: ``rank`` when this call created the claim
    ``probes/root.<token>``, else the rank the claim names. ``-1`` without a root (``tier`` None);
    ``rank`` itself when the root cannot be written (a read-only root: a group of one). One
    exclusive create, or one read; O(1) whatever the size of the job."""
    if tier is None:
        return -1
    path = tier.local_path(layout.claim_key(token))
    if path is None:
        return rank
    try:
        try:
            fd = _create(path)
        except FileExistsError:
            return _read_claim(path, rank)
        try:
            os.write(fd, str(rank).encode())
        finally:
            os.close(fd)
        return rank
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            log.warning("ckptstore: could not claim root %s (%s); this rank lists it alone", tier.url, e)
        return rank


def _create(path: str) -> int:
    for _ in range(3):
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:  # the first claim in this root: probes/ is not there (yet, or any more)
            os.makedirs(os.path.dirname(path), exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)


def _read_claim(path: str, rank: int) -> int:
    deadline = time.monotonic() + _CLAIM_READ_S
    delay = 0.001
    while True:
        try:
            with open(path, "rb") as f:
                data = f.read(32)
        except FileNotFoundError:
            data = b""  # released already: only after every rank claimed, so never for a live claim
        if data.strip().lstrip(b"-").isdigit():
            return int(data)
        if time.monotonic() > deadline:
            log.warning("ckptstore: the claim %s stayed empty (its creator died?); this rank lists its root alone", path)
            return rank
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def release(tier: LocalTier | None, token: str) -> None:
    """Remove the claim of ``token`` (its creator, once every rank has read it); never raises."""
    if tier is None:
        return
    try:
        path = tier.local_path(layout.claim_key(token))
        if path is not None:
            os.unlink(path)
            os.rmdir(os.path.dirname(path))  # probes/ when no other claim is in it: a load leaves no trace
    except OSError:
        pass  # gc removes it after the grace period; probes/ stays while other claims are in it


def placement(leaders: list[tuple[int, int]]) -> list | None:
    """The manifest's ``placement`` from every rank's ``(rank, leader)``: the root groups (ranks
    with one leader) in rank order, or None for one group."""
    groups: dict[int, list] = {}
    for r, lead in leaders:
        groups.setdefault(lead, []).append(r)
    if len(groups) <= 1:
        return None
    return sorted(sorted(g) for g in groups.values())


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


#: copies in flight in this process: thread -> (root directory, c10d store, key) (:func:`wait_for_copies`)
_IN_FLIGHT: "weakref.WeakKeyDictionary[threading.Thread, tuple]" = weakref.WeakKeyDictionary()
_IN_FLIGHT_LOCK = threading.Lock()


def wait_for_copies(tier: LocalTier | None, timeout: float = 120.0) -> None:
    """Wait (at most ``timeout`` seconds) until the manifest copies this process makes into
    ``tier``'s root for saves already committed are written (docs/FORMAT.md, "Placement": ``dcp.save``
    may return before them). A copy whose save has not committed yet (its manifest not published) is
    not waited for. Never raises."""
    if tier is None:
        return
    with _IN_FLIGHT_LOCK:
        mine = [(t, store, key) for t, (root, store, key) in _IN_FLIGHT.items() if root == tier.root and t.is_alive()]
    deadline = time.monotonic() + timeout
    for t, store, key in mine:
        try:
            published = store.check([key])
        except Exception:  # noqa: BLE001 - the store is gone: nothing will arrive
            published = False
        if published:
            t.join(max(0.0, deadline - time.monotonic()))


class Follower:
    """Leader of a root group other than the coordinator's: copies committed manifests into its root."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def follow(self, tier: LocalTier, version: str, attempt: str, rank: int, timeout: float, after_copy) -> None:
        """Copy the manifest of ``attempt`` into ``tier`` once committed (``rank``: this leader's
        rank; its group is the manifest's placement group that holds it)."""
        store = _store()
        if store is None:
            return  # the claim stays for gc: another rank of this root may not have read it yet
        t = threading.Thread(target=self._run, args=(store, tier, version, attempt, rank, timeout, after_copy),
                             name="ckptstore-copy", daemon=True)
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT[t] = (tier.root, store, _KEY + attempt)
        t.start()
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def wait(self, timeout: float | None = None) -> None:
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout)

    def _run(self, store, tier, version, attempt, rank, timeout, after_copy) -> None:
        try:
            store.wait([_KEY + attempt], _dt.timedelta(seconds=timeout))
            data = store.get(_KEY + attempt)
        except Exception as e:  # noqa: BLE001 - coordinator gone or timeout: the next load repairs
            self._note(f"version {version!r}: no copy of the manifest arrived ({e})")
            return
        finally:
            release(tier, attempt)  # every rank of the save read the claim before the commit (or abort)
        if data == _ABORT:
            leases.release(tier, attempt)  # the save failed: what its ranks referenced needs no lease
            from .. import gc

            gc.reclaim_failed_attempt(tier, version, attempt)  # its objects in this root too (Delete rule 14)
            return
        n = int.from_bytes(data[:8], "little")
        _faults.point("copy.manifest")
        try:
            body = data[8 : 8 + n]
            m = copy_into(tier, version, attempt, body, data[8 + n :], group_of(parse(body, expect_version=version).manifest, rank))
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


def group_of(m, rank: int) -> tuple:
    """The root group of ``m``'s placement that holds ``rank`` (``(rank,)`` when none does)."""
    from ..manifest.placement import groups

    return next((tuple(g) for g in groups(m) if rank in g), (rank,))


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
        # a copy of an attempt this commit supersedes is replaced, conditionally: only if it is still
        # the copy read here (docs/FORMAT.md, "Superseding"); any other copy stays (the same attempt,
        # or a divergent one the restore choice reports)
        try:
            token = tier.stat(mkey).token
            old = parse(tier.get(mkey), expect_version=version).manifest.attempt
        except CkptStoreError:
            old = token = None
        if old is not None and old in m.superseded_attempts and token is not None:
            try:
                tier.replace_if_match(mkey, manifest, token)
            except PreconditionFailedError:
                log.warning("ckptstore: the copy of %r in %s changed while it was being superseded; left as it is "
                            "(the restore choice decides between the copies)", version, tier.url)
    return m
