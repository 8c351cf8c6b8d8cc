"""A load in a job whose ranks may see different roots (docs/FORMAT.md, "Placement", "Restore choice",
Read rules 6-10): the I/O around the pure restore choice of ``ckptstore/choice.py``.

Every rank reports what its own root holds — the versions committed there (each manifest's facts,
its damage mark, the MD5 of the manifest file) and the objects present per attempt — and the first
rank also what the remote tier holds and its root's restore log; one ``all_gather_object`` over the
load's process group hands every rank every report (outside a job the one report is this
process's), and every rank then takes the same decisions from the same data
(:func:`ckptstore.choice.decide`): which version, where each rank reads each object (its own root,
another rank's root through ``torch.distributed``, the remote tier), which roots to repair (a root
holding objects of the chosen attempt but not its manifest gets it from a root that has it).

The remote tier is listed once; a remote manifest is read only for a version that may be newer than
every version the first rank's root holds, or whose ETag is not the MD5 of that root's copy (another
copy under the same name). A remote tier that does not answer leaves ``remote_error`` in the report:
the choice is then made from the roots alone (Read rule 9).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch.distributed as dist

from .._names import decode_version
from ..choice import View, decide
from ..errors import (CkptStoreError, InvalidNameError, ManifestError, ObjectNotFoundError, TransientStorageError,
                      UnsupportedFormatError, VersionNotFoundError)
from ..manifest import catalogue, layout
from ..manifest.schema import parse
from ._roots import copy_into

log = logging.getLogger("ckptstore")

__all__ = ["View", "exchange", "fetch_manifest", "opens", "in_job", "append_restore_log", "read_restore_log"]

#: restore-log entries read back (the restart-loop rule needs only the last run of entries)
_RESTORE_LOG_TAIL = 64


def in_job(pg) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(pg) > 1


def _facts(m, damaged: bool) -> dict:
    """What the restore choice needs to know about one committed copy (``choice`` module docstring)."""
    return {"attempt": m.attempt, "created": m.created, "seq": m.seq, "step": m.step, "damaged": damaged,
            "objects": sorted(o.name for o in m.all_objects()), "world_size": m.world_size, "nbytes": m.nbytes,
            "supersedes": sorted(m.superseded_attempts), "groups": len(m.placement or ()) or 1,
            "refs": sorted([r.name, r.version, r.attempt] for r in m.refs), "nonfinite": m.nonfinite,
            "key_id": (m.encryption or {}).get("key_id")}


def _report(local, first: bool, rank: int, key_id: str | None = None) -> dict:
    """What this rank's root holds (and, on the first rank, the restore log); ``key_id``: the id of
    the master key this rank loads with (None: no key)."""
    committed: dict[str, dict] = {}
    parts: dict[str, dict[str, list]] = {}
    problems: list = []
    if local is not None:
        for v, e in catalogue.scan(local, problems).items():
            committed[v] = {**_facts(e.manifest, e.damaged), "md5": e.md5}
        for info in local.list(layout.VERSIONS + "/"):
            att = layout.attempt_of_key(info.key)
            v = layout.version_of_key(info.key)
            if att is None or v is None or layout.is_temporary(info.key):
                continue
            parts.setdefault(v, {}).setdefault(att, []).append(info.key[len(layout.version_dir(v)) + 1 :])
    invalid = {}
    for _t, key, why in problems:
        v = layout.version_of_key(key)
        if v is not None:
            invalid[v] = f"{why} (in {local.url})"
    rep: dict[str, Any] = {"rank": rank, "root": None if local is None else local.url, "committed": committed,
                           "parts": parts, "remote": None, "remote_error": None, "restores": [], "invalid": invalid,
                           "key_id": key_id}
    if first:
        rep["restores"] = read_restore_log(local)
    return rep


def _add_remote(reports: list, remote, want: str | None, everything: bool = False) -> None:
    """The first rank: put the remote tier's view (given what every root holds) into ``reports[0]``."""
    known: dict[str, list] = {}
    for r in reports:
        for v, e in r["committed"].items():
            known.setdefault(v, []).append(e)
    try:
        reports[0]["remote"] = _remote_view(remote, known, reports[0]["invalid"], want, everything)
        reports[0]["remote_error"] = None
    except TransientStorageError as e:
        # the remote tier does not answer: restore from what the roots hold (docs/FORMAT.md, Read
        # rule 9); transient is never absent, so nothing is marked or deleted because of it
        reports[0]["remote"] = None
        reports[0]["remote_error"] = str(e)


def _remote_view(remote, known: dict, invalid: dict | None = None, want: str | None = None,
                 everything: bool = False) -> dict:
    """``{version: facts}`` of the remote tier from one listing (docs/FORMAT.md, Read rule 6).

    ``known``: ``{version: [facts of each root's copy]}`` over every root of the job. A remote
    manifest whose ETag is the MD5 of a root's copy is that copy (no GET). Otherwise it is read when
    a root holds another copy of the name (a possibly divergent copy: docs/FORMAT.md, "One name, one
    content"), or when no root holds the version and its remote manifest is newer (LastModified, the
    server's one clock) than that of every version the roots hold; the others are
    listed as ``{"attempt": None}`` (not read: older than what the roots hold). LastModified has a
    resolution of one second on many servers: a remote-only version committed in the same second as
    the newest local one is not considered newer. ``want`` (an explicitly named version) and, with
    ``everything``, every version is read. A damage mark is read to check its attempt."""
    listing = list(remote.list(layout.VERSIONS + "/"))
    manifests: dict[str, Any] = {}
    marks = set()
    for i in listing:
        parts = i.key.split("/")
        if len(parts) != 3:
            continue
        try:
            v = decode_version(parts[1])
        except Exception:  # noqa: BLE001 - not a version directory: catalogue/scrub report it
            continue
        if parts[2] == layout.MANIFEST:
            manifests[v] = i
        elif parts[2] == layout.DAMAGED:
            marks.add(v)
    both = [i.mtime for v, i in manifests.items() if v in known]
    newest_both = max(both) if both else None
    out: dict[str, dict] = {}
    for v, info in manifests.items():
        copies = known.get(v) or []
        same = next((e for e in copies if info.etag and info.etag == e.get("md5")), None)
        if same is not None:
            facts = {k: val for k, val in same.items() if k != "md5"}
        elif copies or newest_both is None or info.mtime > newest_both or v == want or everything:
            try:
                m = catalogue.read_manifest(remote, v).manifest
            except VersionNotFoundError:  # un-committed since the listing
                continue
            except (ManifestError, UnsupportedFormatError, InvalidNameError) as e:
                # invalid: not a candidate (scrub reports it). A storage error is raised: transient
                # is never absent (docs/FORMAT.md, Read rule 5)
                log.warning("ignoring remote manifest of %r: %s", v, e)
                if invalid is not None:
                    invalid[v] = f"{e} (in {remote.url})"
                continue
            facts = _facts(m, False)
        else:
            out[v] = {"attempt": None, "damaged": v in marks}
            continue
        facts["damaged"] = v in marks and catalogue._mark_applies(remote, layout.damaged_key(v), facts["attempt"])
        out[v] = facts
    return out


def read_restore_log(local) -> list:
    """The last entries of the root's restore log (docs/FORMAT.md, "Restore log"), oldest first; a
    torn or unreadable line is skipped."""
    if local is None:
        return []
    try:
        data = local.get(layout.RESTORE_LOG)
    except (ObjectNotFoundError, CkptStoreError, OSError):
        return []
    out = []
    for line in data.splitlines()[-_RESTORE_LOG_TAIL:]:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict):
            out.append(e)
    return out


def append_restore_log(local, entry: dict) -> None:
    """Append one line to the root's restore log (one ``write`` of a line with ``O_APPEND``, then
    fsync: a crash leaves at most a torn last line, which :func:`read_restore_log` skips)."""
    path = local.local_path(layout.RESTORE_LOG)
    if path is None:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    line = (json.dumps(entry, sort_keys=True, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def exchange(local, remote, pg, version: str | None, key_id: str | None = None, **choice) -> tuple[View, int]:
    """Gather every rank's report and decide (see the module docstring; ``key_id``: the id of the
    master key this rank loads with; ``choice``: keyword arguments of :func:`ckptstore.choice.decide`);
    returns the view and this rank's index in the group. Outside a job of more than one rank, the one
    report is this process's. Raises the same error on every rank when nothing can be loaded."""
    if not in_job(pg):
        reports = [_report(local, True, 0, key_id)]
        if remote is not None:
            _add_remote(reports, remote, version)
        return _said(_decide(reports, version, local, remote, None, 0, choice)), 0
    me = dist.get_rank(pg)
    try:
        mine: Any = _report(local, me == 0, dist.get_rank(), key_id)
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
    if remote is not None:  # the first rank reads the remote tier knowing what every root holds
        box: list = [None]
        if me == 0:
            try:
                _add_remote(reports, remote, version)
                box = [(reports[0]["remote"], reports[0]["remote_error"], reports[0]["invalid"])]
            except Exception as e:  # noqa: BLE001 - every rank must reach the broadcast
                box = [e]
        dist.broadcast_object_list(box, src=_first(pg), group=pg)
        if isinstance(box[0], BaseException):
            raise box[0]
        reports[0] = {**reports[0], "remote": box[0][0], "remote_error": box[0][1], "invalid": box[0][2]}
    view = _decide(reports, version, local, remote, pg, me, choice)
    return (_said(view) if me == 0 else view), me


def _decide(reports: list, version, local, remote, pg, me: int, choice: dict):
    """:func:`decide`; when nothing is loadable while the first rank left remote manifests unread
    (older than what its root holds: a fallback past every local version), the first rank reads them
    all and every rank decides again (one broadcast in a job) — the same on every rank, since every
    rank got the same error from the same reports."""
    try:
        return decide(reports, version, where=_where(local, remote), **choice)
    except VersionNotFoundError:
        rem = reports[0].get("remote") or {}
        if version is not None or not any(e.get("attempt") is None for e in rem.values()):
            raise
    full = [None]
    if me == 0:
        try:
            again = [dict(r) for r in reports]
            _add_remote(again, remote, None, everything=True)
            full = [again[0]["remote"]]
        except Exception as e:  # noqa: BLE001 - every rank must reach the broadcast
            full = [e]
    if pg is not None:
        dist.broadcast_object_list(full, src=_first(pg), group=pg)
    if isinstance(full[0], BaseException):
        raise full[0]
    reports = list(reports)
    reports[0] = {**reports[0], "remote": full[0]}
    return decide(reports, version, where=_where(local, remote), **choice)


def _said(view):
    """Warn (once per load, on the first rank) what the choice passed over."""
    if view is None:
        return view
    if view.remote_error:
        log.warning("ckptstore: the remote tier could not be read (%s); restoring %r from what the roots of this "
                    "job hold, without consulting it", view.remote_error, view.version)
    for where, att in view.stale:
        log.warning("ckptstore: %s holds another copy of version %r (attempt %s), not the one the catalogue chose "
                    "(attempt %s): it is stale or superseded and is not loaded ('ckptstore scrub' reports it)",
                    where, view.version, att, view.attempt)
    return view


def _first(pg) -> int:
    """The global rank of the group's first rank."""
    return 0 if pg is None else dist.get_global_rank(pg, 0)


def _where(local, remote) -> str:
    return " or ".join(f"{t.name} tier {t.url}" for t in (local, remote) if t is not None)


def opens(view: View, i: int) -> bool:
    """Group rank ``i``'s copy of the view's manifest opens with the master key rank ``i`` loads with:
    it is not encrypted, or wrapped by that key (by key id). A copy wrapped by another key — a root a
    ``ckptstore rekey`` missed — is not used while another copy opens (docs/FORMAT.md, Read rule 12).
    Without a key nothing opens an encrypted copy: the reader says so."""
    kid = (view.reports[i]["committed"].get(view.version) or {}).get("key_id")
    mine = view.reports[i].get("key_id")
    return kid is None or mine is None or kid == mine


def fetch_manifest(view: View, me: int, local, remote, pg) -> tuple[bytes, bytes | None, str]:
    """The manifest file of the view's version for rank ``me``, the stored bytes of its metadata
    object when it came from another rank (else None), and where it came from (for messages). Ranks
    whose root lacks the manifest — or holds a copy wrapped by another master key than theirs
    (:func:`opens`) — get both from a root whose copy opens (one broadcast, made by every rank when
    any rank needs it), else from the remote tier; a root holding objects of the attempt without its
    manifest is repaired on the way (a copy under another key is left for ``ckptstore rekey``)."""
    usable = [h for h in view.holders if opens(view, h)]
    holder = usable[0] if usable else (view.holders[0] if view.holders else None)
    need = [i for i in range(len(view.reports)) if holder is not None and i != holder
            and (not view.has_manifest(i) or (not opens(view, i) and opens(view, holder)))]
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
            if not view.has_manifest(me) and view.present(me) and local is not None:
                _repair(local, view, got)
    from_holder = f"the root of rank {view.global_rank(holder)} ({view.reports[holder].get('root')})" \
        if holder is not None else ""
    mine = f"the root of rank {view.global_rank(me)} ({view.reports[me].get('root')})"
    if view.has_manifest(me) and opens(view, me):
        return local.get(layout.manifest_key(view.version)), None, mine
    if got is not None:
        if view.has_manifest(me):
            _rekey_missed(view, me, from_holder)
        return got[0], got[1], from_holder
    if view.has_manifest(me) and not (view.remote_ok and remote is not None):
        return local.get(layout.manifest_key(view.version)), None, mine  # the reader names the key problem
    if view.has_manifest(me):
        _rekey_missed(view, me, f"the remote tier ({remote.url})")
    return remote.get(layout.manifest_key(view.version)), None, f"the remote tier ({remote.url})"


def _rekey_missed(view: View, me: int, used: str) -> None:
    kid = (view.reports[me]["committed"].get(view.version) or {}).get("key_id")
    root = view.reports[me].get("root")
    log.warning("ckptstore: the manifest of version %r in %s is wrapped by master key id %s, not by the key given "
                "(id %s): a key rotation missed this root. Loading with the copy of %s (the data keys are the "
                "same). Run 'ckptstore rekey %s --key-file OLD --new-key-file NEW' on that node",
                view.version, root, kid, view.reports[me].get("key_id"), used, root)


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
