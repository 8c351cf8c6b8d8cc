"""A load in a job whose ranks may see different roots (docs/FORMAT.md, "Placement", Read rules 6-8).

Every rank of the load reports what its own root holds — the versions committed there and the
objects present per attempt — and the first rank also what the remote tier holds; one
``all_gather_object`` over the load's process group hands every rank every report, and every rank
then takes the same decisions from the same data:

* **which version** — the one asked for, or else the newest committed version whose every object
  is on some root of the job or whose remote copy is committed: never a version one node has and
  another lacks the objects of;
* **where each rank reads each object** — its own root first, else the root of another rank of the
  load (peer fetch through ``torch.distributed`` in ``read_data``: a cluster network beats an S3
  GET, and a restore on the same nodes then makes no remote request even for the replicated items
  DCP stored on one rank only), else the remote tier;
* **which roots to repair** — a root holding objects of the chosen attempt but not its manifest (a
  crash between the coordinator's commit and that root's copy) gets the manifest and metadata object
  from a root that has them (``broadcast_object_list``).

The remote tier is listed, and a remote manifest read only when it may be newer than every version
the local roots hold, so a restore on the same nodes makes no remote GET.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist

from .._names import decode_version
from ..errors import (CkptStoreError, DamagedVersionError, IntegrityError, InvalidNameError, ManifestError,
                      UnsupportedFormatError, VersionNotFoundError)
from ..manifest import catalogue, layout
from ..manifest.schema import parse
from ._roots import copy_into

log = logging.getLogger("ckptstore")


def in_job(pg) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(pg) > 1


def _report(local, remote, first: bool) -> dict:
    """What this rank's root holds (and, on the first rank, the remote tier)."""
    committed: dict[str, dict] = {}
    parts: dict[str, dict[str, list]] = {}
    if local is not None:
        for v, e in catalogue.scan(local).items():
            m = e.manifest
            committed[v] = {"attempt": m.attempt, "created": m.created, "damaged": e.damaged,
                            "objects": sorted(o.name for o in m.all_objects()), "step": m.step,
                            "world_size": m.world_size, "nbytes": m.nbytes}
        for info in local.list(layout.VERSIONS + "/"):
            att = layout.attempt_of_key(info.key)
            v = layout.version_of_key(info.key)
            if att is None or v is None or layout.is_temporary(info.key):
                continue
            parts.setdefault(v, {}).setdefault(att, []).append(info.key[len(layout.version_dir(v)) + 1 :])
    rep: dict[str, Any] = {"rank": dist.get_rank(), "committed": committed, "parts": parts, "remote": None}
    if first and remote is not None:
        rep["remote"] = _remote_view(remote, committed)
    return rep


def _remote_view(remote, local_committed: dict) -> dict:
    """``{version: {"attempt", "created", "damaged"}}`` of the remote tier from one listing; a remote
    manifest is read only for a version no local root of this rank holds whose remote manifest is
    newer (LastModified) than that of every version this rank holds (``attempt``/``created`` None:
    same as the local copy). LastModified has a resolution of one second on many servers: a
    remote-only version committed in the same second as the newest local one is not considered
    newer (the local one, committed in both tiers, is loaded)."""
    listing = list(remote.list(layout.VERSIONS + "/"))
    manifests = {}
    damaged = set()
    for i in listing:
        parts = i.key.split("/")
        if len(parts) != 3:
            continue
        try:
            v = decode_version(parts[1])
        except Exception:  # noqa: BLE001 - not a version directory: catalogue/scrub report it
            continue
        if parts[2] == layout.MANIFEST:
            manifests[v] = i.mtime
        elif parts[2] == layout.DAMAGED:
            damaged.add(v)
    both = [t for v, t in manifests.items() if v in local_committed]
    newest_both = max(both) if both else None
    out = {}
    for v, t in manifests.items():
        if v in local_committed:
            out[v] = {"attempt": None, "created": None, "damaged": v in damaged}
        elif newest_both is None or t > newest_both:
            try:
                m = catalogue.read_manifest(remote, v).manifest
            except VersionNotFoundError:  # un-committed since the listing
                continue
            except (ManifestError, UnsupportedFormatError, InvalidNameError) as e:
                # invalid: not a candidate (scrub reports it). A storage error is raised: transient
                # is never absent (docs/FORMAT.md, Read rule 5)
                log.warning("ignoring remote manifest of %r: %s", v, e)
                continue
            out[v] = {"attempt": m.attempt, "created": m.created, "damaged": v in damaged, "step": m.step,
                      "world_size": m.world_size}
    return out


@dataclasses.dataclass
class View:
    """The decisions of one load, identical on every rank."""

    version: str
    attempt: str
    reports: list  # by group rank
    remote_ok: bool  # the remote tier holds this attempt committed
    holders: list  # group ranks whose root has the manifest committed
    needed: list  # object names of the version (metadata object included)

    def __post_init__(self) -> None:
        # derived once: peer_plans asks for every read item of every rank
        self._present = [set(r["parts"].get(self.version, {}).get(self.attempt, [])) for r in self.reports]
        self._first_holder: dict[str, int] = {}
        for j in reversed(range(len(self.reports))):
            for name in self._present[j]:
                self._first_holder[name] = j

    def present(self, i: int) -> set:
        return self._present[i]

    def global_rank(self, i: int) -> int:
        return self.reports[i]["rank"]

    def source(self, i: int, name: str):
        """Where group rank ``i`` reads object ``name``: "local", "remote" or a peer's group rank."""
        if name in self._present[i]:
            return "local"
        if name in self._first_holder:
            return self._first_holder[name]
        if self.remote_ok:
            return "remote"
        raise CkptStoreError(f"object {name!r} of version {self.version!r} is on no root of this job")

    def has_manifest(self, i: int) -> bool:
        return i in self.holders


def exchange(local, remote, pg, version: str | None) -> tuple[View, int]:
    """Gather every rank's report and decide (see the module docstring); returns the view and this
    rank's index in the group. Raises the same error on every rank when nothing can be loaded."""
    me = dist.get_rank(pg)
    try:
        mine: Any = _report(local, remote, me == 0)
    except Exception as e:  # noqa: BLE001 - every rank must reach the collective; raised below
        mine = {"error": e}
    reports: list = [None] * dist.get_world_size(pg)
    dist.all_gather_object(reports, mine, group=pg)
    for i, rep in enumerate(reports):
        if "error" in rep:
            err = rep["error"]
            if i == me:
                raise err
            raise type(err)(f"rank {i} of the load could not read its root: {err}") if isinstance(err, CkptStoreError) \
                else CkptStoreError(f"rank {i} of the load could not read its root: {err!r}")
    return decide(reports, version, where=_where(local, remote)), me


def _where(local, remote) -> str:
    return " or ".join(f"{t.name} tier {t.url}" for t in (local, remote) if t is not None)


def decide(reports: list, version: str | None, where: str = "") -> View:
    remote = reports[0]["remote"] or {}
    cands: dict[str, tuple] = {}  # version -> (created, attempt)
    damaged: set = set()
    for rep in reports:
        for v, e in rep["committed"].items():
            if e["damaged"]:
                damaged.add((v, e["attempt"]))
                continue
            key = (e["created"], e["attempt"])
            if v not in cands or key > cands[v]:
                cands[v] = key
    for v, e in remote.items():
        if e["created"] is not None and not e["damaged"] and v not in cands:
            cands[v] = (e["created"], e["attempt"])

    def remote_ok(v, a) -> bool:
        e = remote.get(v)
        return e is not None and not e["damaged"] and e["attempt"] in (None, a)

    def needed(v, a) -> list:
        for rep in reports:
            e = rep["committed"].get(v)
            if e is not None and e["attempt"] == a:
                return e["objects"]
        return []

    def missing(v, a) -> list:
        have = set()
        for rep in reports:
            have.update(rep["parts"].get(v, {}).get(a, []))
        return [n for n in needed(v, a) if n not in have]

    def view(v, a) -> View:
        holders = [i for i, rep in enumerate(reports) if rep["committed"].get(v, {}).get("attempt") == a
                   and not rep["committed"][v]["damaged"]]
        return View(v, a, reports, remote_ok(v, a), holders, needed(v, a))

    if version is not None:
        if any(v == version for v, _a in damaged) and version not in cands:
            raise DamagedVersionError(f"version {version!r} is marked damaged on a root of this job; load another "
                                      "version or run 'ckptstore scrub --repair' on that node")
        if version not in cands:
            raise VersionNotFoundError(f"version {version!r} is not committed on any root of this job nor in {where}; "
                                       "run 'ckptstore list' on the nodes to see what is")
        a = cands[version][1]
        if not remote_ok(version, a):
            lost = missing(version, a)
            if lost:  # committed, but objects are lost: as a load of a missing object (Read rule 4)
                raise IntegrityError(_lost_message(version, lost, reports), object=lost[0])
        return view(version, a)
    order = sorted(cands.items(), key=lambda kv: (kv[1][0], kv[0]), reverse=True)
    skipped = []
    for v, (_created, a) in order:
        if remote_ok(v, a) or not missing(v, a):
            if skipped:
                log.warning("ckptstore: newer versions %s are not loadable by every rank of this job (objects on no "
                            "root and not in the remote tier); loading %r", skipped, v)
            return view(v, a)
        skipped.append(v)
    if order:
        v, (_c, a) = order[0]
        raise VersionNotFoundError(_lost_message(v, missing(v, a), reports, newest=True))
    raise VersionNotFoundError(f"no committed version on any root of this job nor in {where}; nothing to load "
                               "(save one first, or check root/remote)")


def _lost_message(v: str, lost: list, reports: list, newest: bool = False) -> str:
    shown = ", ".join(lost[:8]) + (" ..." if len(lost) > 8 else "")
    return (f"{'no version is loadable by every rank: the newest, ' if newest else ''}version {v!r} cannot be "
            f"loaded by this job: objects {shown} are on none of the roots of ranks "
            f"{[r['rank'] for r in reports]} and the version is not committed in a remote tier. Start the job "
            "on the nodes that hold them, restore those roots, or load another version")


def fetch_manifest(view: View, me: int, local, remote, pg) -> tuple[bytes, bytes | None]:
    """The manifest file of the view's version for rank ``me`` and, when it came from another
    rank, the stored bytes of its metadata object. Ranks whose root lacks the manifest get both from
    a root that has them (one broadcast, made by every rank when any rank needs it), else from the
    remote tier; a root holding objects of the attempt without its manifest is repaired on the way."""
    holder = view.holders[0] if view.holders else None
    need = [i for i in range(len(view.reports)) if not view.has_manifest(i) and holder is not None]
    got: tuple[bytes, bytes | None] | None = None
    if need:
        obj = [None, None]
        if me == holder:
            body = local.get(layout.manifest_key(view.version))
            md = layout.object_key(view.version, parse(body, expect_version=view.version).manifest.metadata_object.name)
            obj = [body, local.get(md)]
        dist.broadcast_object_list(obj, src=view.global_rank(holder), group=pg)
        if me in need:
            got = (obj[0], obj[1])
            if view.present(me) and local is not None:
                _repair(local, view, got)
    if view.has_manifest(me):
        return local.get(layout.manifest_key(view.version)), None
    if got is not None:
        return got
    return remote.get(layout.manifest_key(view.version)), None


def _repair(local, view: View, got: tuple) -> None:
    try:
        m = parse(got[0], expect_version=view.version).manifest
        if copy_into(local, view.version, view.attempt, got[0], got[1], _ranks_present(m, local, view)) is not None:
            log.warning("ckptstore: repaired root %s: it held objects of version %r but not its manifest "
                        "(a crash after the commit); copied from another rank's root", local.url, view.version)
    except CkptStoreError as e:
        log.warning("ckptstore: could not repair root %s for version %r: %s", local.url, view.version, e)


def _ranks_present(m, local, view: View) -> set:
    vdir = layout.version_dir(view.version) + "/"
    present = {i.key[len(vdir):] for i in local.list(vdir + layout.attempt_dir(view.attempt) + "/")}
    return {o.rank for o in m.objects if o.name in present}


def peer_plans(view: View, plans: list, needed_frames) -> list:
    """``[(send, recv)]`` per plan (group rank): the byte ranges each rank serves from its root to
    the ranks that need them and receives from its peers. ``needed_frames(read_item)`` gives the
    ``(object, [FrameRef])`` a read item needs."""
    req: dict[tuple, dict[str, set]] = {}
    for i, p in enumerate(plans):
        for ri in p.items:
            obj, frames = needed_frames(ri)
            if not frames:
                continue
            src = view.source(i, obj)
            if isinstance(src, int):
                req.setdefault((src, i), {}).setdefault(obj, set()).update((f.offset, f.length) for f in frames)
    send = [[] for _ in plans]
    recv = [[] for _ in plans]
    for (j, i) in sorted(req):
        for obj in sorted(req[(j, i)]):
            ranges = tuple(sorted(req[(j, i)][obj]))
            send[j].append((view.global_rank(i), obj, ranges))
            recv[i].append((view.global_rank(j), obj, ranges))
    return [(tuple(s), tuple(r)) for s, r in zip(send, recv)]


def run_peer_exchange(send: tuple, recv: tuple, local, version: str, pg) -> dict:
    """Serve ``send`` from this rank's root and receive ``recv``; returns ``{(object, offset): bytes}``.

    One message per pair of ranks (the concatenated ranges, in the order both sides list them); every
    send is posted before any receive, so no order of ranks can deadlock. The bytes travel as stored
    (encrypted, checksummed): the receiver verifies every frame as if it had read it itself.
    """
    if (send or recv) and "gloo" not in str(dist.get_backend(pg)):
        raise CkptStoreError(
            "this load fetches objects from other ranks' roots (no remote tier holds them), which needs a "
            "gloo-capable process group: pass process_group=torch.distributed.new_group(backend='gloo') "
            "to StorageReader and dcp.load"
        )
    works = []
    for dst, entries in _by_peer(send):
        chunks = []
        for obj, ranges in entries:
            key = layout.object_key(version, obj)
            chunks.extend(local.get_ranges(key, [(o, o + n) for o, n in ranges]))
        buf = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
        works.append(dist.isend(buf, dst=dst, group=pg))
    out: dict = {}
    for src, entries in _by_peer(recv):
        total = sum(n for _obj, ranges in entries for _o, n in ranges)
        buf = torch.empty(total, dtype=torch.uint8)
        dist.recv(buf, src=src, group=pg)
        mv = memoryview(buf.numpy())
        pos = 0
        for obj, ranges in entries:
            for o, n in ranges:
                out[(obj, o)] = bytes(mv[pos : pos + n])
                pos += n
    for w in works:
        w.wait()
    return out


def _by_peer(entries: tuple) -> list:
    grouped: dict[int, list] = {}
    for peer, obj, ranges in entries:
        grouped.setdefault(peer, []).append((obj, ranges))
    return sorted(grouped.items())
