"""Peer replicas: every root group's objects copied to the roots of F other groups (docs/FORMAT.md,
"Replicas").

One :class:`Replicator` per writer runs the copies on a thread of its own over a gloo group of its
own (made once, at the writer's construction, on every rank), so neither the training loop nor DCP's
collectives ever share it. It takes *jobs* in the order every rank submits them — every rank runs
the same saves in the same order, so the jobs pair up across ranks:

* **save** (submitted in ``write_data`` right after the rank's object is committed locally, also when
  the rank's write failed, so that no peer waits for it): one ``all_gather_object`` of every rank's
  ``(rank, its root group's leader, object)``; then the replica plan
  (:func:`ckptstore.manifest.placement.replica_assignment`); each owner sends its object's stored
  bytes (as stored: encrypted, checksummed) to its receivers; each receiver writes them to a
  temporary file, fsyncs it, verifies every frame, the frame count, the header digest and the size
  against the owner's entry, renames it to the object's own name and fsyncs the directory; then it
  writes its replica record ``attempts/<a>/replicas.rNNNNN.json`` listing what it holds. A last
  ``all_gather_object`` tells every rank whether every replica of the version is in place (what
  ``durability="replicated"`` waits for).
* **heal** (after a restore): the same exchange for the objects a rank's root should hold of the
  restored version (its own shard and the replicas assigned to it) but lacks — a replaced node gets
  its part back from its peers' replicas, so the next loss is survivable too. Every rank computes the
  same plan from the restore's view; no collective but the point-to-point copies.

Sends and receives of one job run on two threads, so two ranks that send to each other never wait on
each other; bytes travel in chunks of :data:`CHUNK` so that no object is held in memory whole.
Fault points: ``replica.send`` (before an owner sends an object), ``replica.receive`` (a receiver got
the bytes, before it writes them), ``replica.rename`` (written, fsync'd and verified, before the
rename), ``replica.record`` (before the record).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import logging
import os
import queue
import threading

import torch
import torch.distributed as dist

from .. import _faults
from ..codec.frame import FrameWalk
from ..errors import CkptStoreError, IntegrityError
from ..manifest import layout
from ..manifest.placement import group_domains, replica_assignment

log = logging.getLogger("ckptstore")

#: bytes per message of a copy (an object travels in chunks of this size)
CHUNK = 16 << 20


@dataclasses.dataclass(frozen=True)
class Held:
    """One rank's object of a version, as the replica exchange announces it."""

    name: str
    size: int
    digest: str
    frames: int
    #: the version directory the object lives in when it is not the job's version: an object of an
    #: earlier version that the job's version references (docs/FORMAT.md, "References")
    version: str | None = None


class ReplicaError(CkptStoreError):
    """A replica could not be made (a peer failed, bytes did not verify); the primary copy stands."""


class Replicator:
    """The replica copies of one writer (see the module docstring). ``tier``: this rank's root;
    ``group``: a gloo group of every rank (made by :func:`ckptstore._groups.new_gloo_group`);
    ``factor``: F."""

    def __init__(self, tier, group, factor: int):
        self.tier = tier
        self.group = group
        self.factor = int(factor)
        self._q: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._seq = 0  # jobs submitted: the tag base of the next one (the same on every rank)
        self.closed = False
        self.errors: list[str] = []
        self.stats = {"sent_bytes": 0, "received_bytes": 0, "replicas": 0}

    # -- submitting ----------------------------------------------------------------------------------
    def _submit(self, fn, *args) -> cf.Future:
        fut: cf.Future = cf.Future()
        with self._lock:
            if self.closed:
                raise ReplicaError("this writer's replica copies were closed (StorageWriter.close()); "
                                   "make a new StorageWriter(replicas=...) to save with replicas")
            tag = self._seq
            self._seq += 1
            self._q.put((fut, fn, args, tag))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ckptstore-replica", daemon=True)
                self._thread.start()
        return fut

    def save(self, version: str, attempt: str, rank: int, leader: int, held: Held | None, domain: str = "") -> cf.Future:
        """Replicate this rank's object of ``version`` (None: it has none, or its write failed);
        ``leader``: the leader of this rank's root group (ranks with one leader share a root);
        ``domain``: this rank's failure domain (docs/FORMAT.md, "Replicas"). The future yields the
        replicas of the version that were not made, on every rank (``[]``: every replica is in
        place), each as ``"<object> of rank R on the root of rank T: <why>"``."""
        return self._submit(self._save, version, attempt, rank, int(leader), held, domain)

    def heal(self, version: str, attempt: str, copies: list, manifest: bytes | None, metadata: bytes | None) -> cf.Future:
        """Copy ``[(holder rank, receiver rank, Held, is_replica)]`` (the same list on every rank) and
        install ``manifest``/``metadata`` where a receiver's root lacks them."""
        return self._submit(self._heal, version, attempt, copies, manifest, metadata)

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every submitted job has run (at once once closed: nothing is left)."""
        if self.closed:
            return
        fut = self._submit(lambda _tag: True)
        fut.result(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Let the submitted jobs run, stop the thread and destroy the group (local, no collective):
        each group holds a connection to every rank, so a writer per save would otherwise run out of
        file descriptors. Later submissions raise :class:`ReplicaError`. ``timeout``: seconds to wait
        for the thread; a thread still stuck in an exchange after that (a peer died mid-copy) is left
        to the process's exit (it is a daemon) and the group is not destroyed under it."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            t = self._thread
            if t is not None and t.is_alive():
                self._q.put(None)
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                log.warning("ckptstore: replica copies still running after %s s at close (a peer gone?); left to exit",
                            timeout)
                return
        from .._groups import destroy_group

        group, self.group = self.group, None
        destroy_group(group)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            fut, fn, args, tag = job
            try:
                fut.set_result(fn(*args, tag))
            except BaseException as e:  # noqa: BLE001 - reported through the future and the log
                msg = f"{type(e).__name__}: {e}"
                self.errors.append(msg)
                log.warning("ckptstore: replica copies failed: %s (the primary copies stand)", msg)
                fut.set_exception(e)

    # -- the exchanges -------------------------------------------------------------------------------
    def _save(self, version, attempt, rank, leader, held, domain, tag) -> list[str]:
        infos: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(infos, (rank, leader, held, domain), group=self.group)
        by_leader: dict = {}
        for r, lead, _h, _d in infos:
            by_leader.setdefault(lead, []).append(r)
        groups = sorted((tuple(sorted(g)) for g in by_leader.values()), key=lambda g: g[0])
        doms = group_domains(groups, {r: d for r, _g, _h, d in infos})  # as the manifest records them
        entries = {r: h for r, _g, h, _d in infos if h is not None}
        plan = [(o, t, entries[o], True) for o, t in replica_assignment(groups, self.factor, set(entries), doms)]
        gaps = self._copy(version, attempt, rank, plan, tag)
        verdict: list = [None] * len(infos)
        dist.all_gather_object(verdict, gaps, group=self.group)  # every rank learns every gap
        if len(groups) <= 1 and rank == min(r for r, _g, _h, _d in infos):
            log.warning("ckptstore: replicas=%d but every rank writes to one root (a shared filesystem): there is "
                        "no other root to copy %r to", self.factor, version)
        return [g for v in verdict for g in (v or ())]

    def _heal(self, version, attempt, copies, manifest, metadata, tag) -> bool:
        me = dist.get_rank()
        ok = not self._copy(version, attempt, me, list(copies), tag)
        if manifest is not None and any(r == me for _h, r, _e, _x in copies):
            from ._roots import copy_into

            try:
                copy_into(self.tier, version, attempt, manifest, metadata, ())
            except CkptStoreError as e:
                log.warning("ckptstore: could not install the manifest of %r in %s: %s", version, self.tier.url, e)
        return ok

    def _copy(self, version: str, attempt: str, me: int, plan: list, tag: int) -> list[str]:
        """Run the copies of ``plan`` (``[(from rank, to rank, Held, is_replica)]``) that involve this
        rank: sends on one thread, receives on this one. Returns the copies of this rank that failed
        (``[]``: all succeeded)."""
        sends = [(t, h) for o, t, h, _x in plan if o == me and t != me]
        recvs = [(o, h, x) for o, t, h, x in plan if t == me and o != me]
        base = (tag % 4096) * 64
        sender = None
        if sends:
            sender = cf.ThreadPoolExecutor(1, thread_name_prefix="ckptstore-replica-send")
            sent = sender.submit(self._send_all, version, sends, base)
        gaps: list[str] = []
        received = []
        try:
            for o, h, is_replica in recvs:
                try:
                    self._receive(version, o, h, base)
                    if is_replica and h.version is None:  # a referenced object is recorded by nobody: its
                        received.append(h.name)  # origin's records go with the origin (docs/FORMAT.md "Replicas")
                except (CkptStoreError, OSError) as e:
                    gaps.append(f"{h.name} of rank {o} on the root of rank {me} ({self.tier.url}): "
                                f"{type(e).__name__}: {e}")
                    log.warning("ckptstore: replica %s of %r from rank %d not made: %s", h.name, version, o, e)
            if received:
                self._record(version, attempt, me, received)
        except (CkptStoreError, OSError) as e:  # the record: the replicas are in place but not listed
            gaps.append(f"the replica record of rank {me} ({self.tier.url}): {type(e).__name__}: {e}")
            log.warning("ckptstore: replica record of %r not written: %s", version, e)
        finally:
            if sender is not None:
                try:
                    sent.result()
                except (CkptStoreError, OSError, RuntimeError) as e:
                    gaps.append(f"sending from rank {me}: {type(e).__name__}: {e}")
                    log.warning("ckptstore: sending replicas of %r failed: %s", version, e)
                sender.shutdown(wait=True)
        self.errors.extend(f"{version}: {g}" for g in gaps)
        return gaps

    def _send_all(self, version: str, sends: list, base: int) -> None:
        for to, h in sends:
            _faults.point("replica.send")
            key = layout.object_key(h.version or version, h.name)
            path = self.tier.local_path(key)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                fd = None  # gone meanwhile: announce 0 bytes, the receiver reports it
            try:
                size = os.fstat(fd).st_size if fd is not None else -1
                if fd is not None and size != h.size:
                    size = -1
                dist.send(torch.tensor([size], dtype=torch.int64), dst=to, group=self.group, tag=base)
                off = 0
                while size > 0 and off < size:
                    n = min(CHUNK, size - off)
                    buf = bytearray(os.pread(fd, n, off))
                    if len(buf) != n:
                        raise OSError(f"{path}: short read")
                    dist.send(torch.frombuffer(buf, dtype=torch.uint8), dst=to, group=self.group, tag=base + 1)
                    off += n
                with self._lock:
                    self.stats["sent_bytes"] += max(size, 0)
            finally:
                if fd is not None:
                    os.close(fd)

    def _receive(self, version: str, src: int, h: Held, base: int) -> None:
        head = torch.zeros(1, dtype=torch.int64)
        dist.recv(head, src=src, group=self.group, tag=base)
        size = int(head.item())
        if size < 0:
            raise ReplicaError(f"rank {src} does not hold {h.name} of {version!r} (any more)")
        chunks = []
        off = 0
        while off < size:
            n = min(CHUNK, size - off)
            buf = torch.empty(n, dtype=torch.uint8)
            dist.recv(buf, src=src, group=self.group, tag=base + 1)
            chunks.append(buf)
            off += n
        _faults.point("replica.receive")
        key = layout.object_key(h.version or version, h.name)

        def fill(tmp: str) -> None:
            with open(tmp, "wb") as f:
                for c in chunks:
                    f.write(memoryview(c.numpy()))

        def verify(read, got: int) -> None:
            if got != h.size:
                raise IntegrityError(f"{h.name}: replica has {got} bytes, the owner announced {h.size}", object=h.name)
            walk = FrameWalk(read, got, h.name).walk()
            if walk.count != h.frames or walk.digest() != h.digest:
                raise IntegrityError(f"{h.name}: replica frames do not match the owner's entry", object=h.name)
            _faults.point("replica.rename")

        self.tier.put_verified(key, fill, verify)
        with self._lock:
            self.stats["received_bytes"] += size
            self.stats["replicas"] += 1

    def _record(self, version: str, attempt: str, me: int, names: list) -> None:
        """This rank's replica record: what it holds as replicas of ``attempt`` (merged with an
        earlier record of the same attempt, e.g. from a heal)."""
        _faults.point("replica.record")
        key = layout.object_key(version, layout.replica_record_name(attempt, me))
        have: set = set()
        try:
            have = set(json.loads(self.tier.get(key)).get("objects", []))
        except Exception:  # noqa: BLE001 - no record yet (or an unreadable one: rewritten)
            pass
        self.tier.put(key, json.dumps({"objects": sorted(have | set(names))}, sort_keys=True).encode())


class ReplicaStage:
    """The replicate stage of a writer: its :class:`Replicator` (None: ``replicas=0``, or a job of one
    rank), as ``write_data``, ``close`` and ``heal`` drive it. ``cfg``: the writer's settings
    (``replicas``, ``durability``, ``upload_timeout``); ``tier``: this rank's root."""

    def __init__(self, cfg, tier, replicator: "Replicator | None" = None) -> None:
        self.cfg = cfg
        self.tier = tier
        self.replicator = replicator
        self._lock = threading.Lock()
        self._futs: dict[str, cf.Future] = {}  # version -> its exchange (handed out once: replica_future)
        #: ``{version: [gap, ...]}``: replicas of ``durability="local"`` saves that were not made and not
        #: reported yet (:meth:`close` raises them, as uploads that did not complete)
        self.gaps: dict[str, list[str]] = {}

    def __getstate__(self):
        s = self.__dict__.copy()
        s["_lock"], s["_futs"], s["gaps"] = None, {}, {}
        return s

    def __setstate__(self, s):
        self.__dict__.update(s)
        self._lock = threading.Lock()

    @classmethod
    def create(cls, cfg, tier, multi_rank: bool) -> "ReplicaStage":
        """Call on the caller's thread, on every rank (the gloo group is made here: never a collective
        from DCP's background thread)."""
        rep = None
        if cfg.replicas and multi_rank:
            from .. import _groups

            rep = Replicator(tier, _groups.new_gloo_group(), cfg.replicas)
        return cls(cfg, tier, rep)

    def save(self, version: str, pd, rep) -> "cf.Future | None":
        """Submit this rank's part of the version's replica exchange — ``rep``: the ``ObjectReport``
        of its object, None when it has none or its write failed (every rank joins, docs/FORMAT.md
        "Replicas") — or None without replicas."""
        if self.replicator is None:
            return None
        from ._roots import claim

        held = None if rep is None else Held(rep.name, rep.size, rep.digest, rep.frames)
        leader = claim(self.tier, pd.attempt, pd.rank) if pd.discover else pd.rank  # the root group's leader
        fut = self.replicator.save(version, pd.attempt, pd.rank, leader, held, self.cfg.replica_domain)
        with self._lock:
            self._futs[version] = fut
            while len(self._futs) > 64:  # nobody asked for them (a plain StorageWriter): keep the newest
                self._futs.pop(next(iter(self._futs)))
        if self.cfg.durability not in ("replicated", "remote"):  # the save does not wait: close() reports
            fut.add_done_callback(lambda f, v=version: self._note_gaps(v, f))
        return fut

    def _note_gaps(self, version: str, fut: cf.Future) -> None:
        gaps = outcome(fut)
        if gaps:
            with self._lock:
                self.gaps.setdefault(version, []).extend(gaps)

    def replica_future(self, version: str) -> "cf.Future | None":
        """The future of ``version``'s replica exchange (its result: the replicas not made, ``[]``:
        all in place), or None without replicas; handed out once."""
        with self._lock:
            return self._futs.pop(version, None)

    def settle(self, version: str, fut) -> None:
        """Wait for the exchange ``fut`` inside the save when its durability says so
        (``"replicated"`` or ``"remote"``); :class:`ReplicaError` unless every replica is in place."""
        if fut is None or self.cfg.durability not in ("replicated", "remote"):
            return
        timeout = self.cfg.upload_timeout
        try:
            gaps = fut.result(timeout)  # the replicas not made
        except cf.TimeoutError:
            raise ReplicaError(f"version {version!r}: replicas not in place within {timeout:.0f} s; "
                               "nothing was committed") from None
        except ReplicaError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed exchange
            raise ReplicaError(f"version {version!r}: the replica exchange failed ({type(e).__name__}: {e}); "
                               "nothing was committed") from e
        if gaps:
            raise ReplicaError(f"version {version!r}: replicas not made: {'; '.join(gaps[:4])}"
                               f"{' ...' if len(gaps) > 4 else ''}; durability={self.cfg.durability!r} commits only once "
                               "every replica is in place, nothing was committed")

    def close(self, timeout: float) -> None:
        """Wait for the copies a ``durability="local"`` save left running, then close the replicator.
        Raises :class:`ReplicaError` naming every replica of such a save that was not made (a
        redundancy gap: the version stands on its primaries; the next restore of it copies what is
        missing, docs/FORMAT.md "Replicas"), as ``close()`` raises ``UploadError`` for uploads."""
        if self.replicator is None:
            return
        try:
            self.replicator.wait(timeout)
        except cf.TimeoutError:
            raise ReplicaError(f"replica copies did not finish within {timeout:.0f} s (a peer gone?); the "
                               "committed versions stand, their missing replicas are made at the next restore") from None
        finally:
            self.replicator.close(timeout)
        self.raise_gaps()

    def raise_gaps(self) -> None:
        """Raise :class:`ReplicaError` for the gaps not reported yet (and forget them)."""
        with self._lock:
            gaps, self.gaps = self.gaps, {}
        if gaps:
            raise ReplicaError(
                "replicas not made (the versions are committed on their own roots, without these copies until the "
                "next restore of each copies them again; docs/FORMAT.md \"Replicas\"): "
                + "; ".join(f"version {v!r}: " + "; ".join(g) for v, g in gaps.items()))

    def heal(self, view, manifest: bytes | None, metadata: bytes | None):
        """See ``StorageWriter.heal``."""
        from ..manifest.schema import parse

        if self.replicator is None or self.replicator.closed or manifest is None:
            return None
        m = parse(manifest, expect_version=view.version).manifest
        copies = heal_plan(view, m, m.replicas or self.cfg.replicas)
        if not copies:
            return None
        return self.replicator.heal(view.version, view.attempt, copies, manifest, metadata)


def heal_plan(view, manifest, factor: int) -> list:
    """``[(holder rank, receiver rank, Held, is_replica)]``: the objects each rank's root should hold
    of ``view``'s version — its own shard and the replicas assigned to it by the saved placement,
    and the same for the objects of earlier versions that the version references — but does not,
    each from the first rank whose root holds it. The same on every rank (a pure function of the
    view and the manifest). Only for a job of the version's own shape."""
    from ..manifest.placement import domains, groups

    if view.size != manifest.world_size:
        return []
    gs = groups(manifest)
    doms = domains(manifest)  # the saved placement: the domains its replicas were placed by
    by_rank = {o.rank: o for o in manifest.objects}
    want: list = [(o.rank, o, False) for o in manifest.objects if o.rank is not None]
    want += [(t, by_rank[o], True) for o, t in replica_assignment(gs, factor, set(by_rank), doms)]
    refs: dict = {}
    for r in manifest.refs:
        if r.rank is not None:
            want.append((r.rank, r, False))
            refs.setdefault(r.rank, []).append(r)
    want += [(t, r, True) for o, t in replica_assignment(gs, factor, set(refs), doms) for r in refs[o]]
    out = []
    for receiver, o, is_replica in want:
        i = view.index_of(receiver)
        if i is None or o.name in view.present(i):
            continue
        holder = view.first_holder(o.name)
        if holder is None:
            continue  # on no root of the job (the remote tier may hold it)
        origin = getattr(o, "version", None)  # a RefEntry: the referenced object's own version
        out.append((view.global_rank(holder), receiver, Held(o.name, o.size, o.digest, o.frames, origin), is_replica))
    return out


def outcome(fut: cf.Future) -> list[str]:
    """The replicas a finished exchange ``fut`` did not make (``[]``: all in place; a failed exchange
    is one gap, its error)."""
    try:
        return list(fut.result(0))
    except cf.CancelledError:
        return ["the replica exchange was cancelled"]
    except Exception as e:  # noqa: BLE001 - a failed exchange (a peer gone, groups refused)
        return [f"the replica exchange failed: {type(e).__name__}: {e}"]


__all__ = ["CHUNK", "Held", "ReplicaError", "ReplicaStage", "Replicator", "heal_plan", "outcome"]
