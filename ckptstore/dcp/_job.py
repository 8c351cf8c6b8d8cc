"""A load in a job whose ranks may see different roots (docs/FORMAT.md, "Placement", "Restore choice",
Read rules 6-10): the I/O around the pure restore choice of ``ckptstore/choice.py``.

What a root holds is listed and reported once per root, by one of its ranks, and every rank gets one
*job report* (``choice`` module docstring) whose size grows with roots × versions, never with ranks:

1. every rank waits for the manifest copies this process still makes into its root for saves that
   already committed (``_roots.wait_for_copies``: ``dcp.save`` may return before them), so a load
   right after a save never mistakes them for a crash;
2. the load's first rank claims its root for a fresh token (``_roots.claim``), lists it and reads its
   manifests (:func:`root_report`), and broadcasts the token with the digests of those manifests;
3. every other rank claims its root for the token: the rank that created the claim *leads* that
   root and lists it (one rank per root: no listing storm on a shared filesystem);
4. one ``all_gather_object`` of one small integer per rank — the leader of its root (-1: none) —
   the only per-rank term, of fixed size (like DCP's own plan gather);
5. every other leader sends its root's report to the first rank (point to point), with the facts of
   only the manifests the first rank did not hold (a manifest's facts travel once);
6. the first rank adds the remote tier and broadcasts the job report; every rank then takes the same
   decisions from the same data (:func:`ckptstore.choice.decide`): which version, where each rank
   reads each object (its own root, another rank's root through ``torch.distributed``, the remote
   tier), which roots to repair (a root holding objects of the chosen attempt but not its manifest
   gets it from a root that has them; its leader writes it).

A root is listed one level at a time (``catalogue.version_dirs``: the version directories, then
the attempt directories of each), never walked object by object with a ``stat`` each; the object
list of a committed version comes from its manifest. The remote tier is listed the same way (its
version directories, ``Delimiter="/"``); a remote manifest is read only for a version that may be
newer than every version the roots hold, or whose ETag is not the MD5 of a root's copy (another copy
under the same name). A remote tier that does not answer leaves ``remote_error`` in the job report:
the choice is then made from the roots alone (Read rule 9).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
from typing import Any

import torch.distributed as dist

from .._names import decode_version
from ..choice import View, decide
from ..errors import (CkptStoreError, InvalidNameError, ManifestError, ObjectNotFoundError, TransientStorageError,
                      UnsupportedFormatError, VersionNotFoundError)
from ..manifest import catalogue, layout
from ..manifest.objsets import ObjSet
from ..manifest.schema import parse
from . import _roots
from ._roots import copy_into

log = logging.getLogger("ckptstore")

__all__ = ["View", "exchange", "facts_of", "fetch_manifest", "opens", "in_job", "root_report", "append_restore_log",
           "read_restore_log"]

#: restore-log entries read back (the restart-loop rule needs only the last run of entries)
_RESTORE_LOG_TAIL = 64


def in_job(pg) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(pg) > 1


def facts_of(m) -> dict:
    """What the restore choice needs to know about one manifest (``choice`` module docstring): a
    fixed set of fields, its objects and its references as object sets (rank runs)."""
    refs: dict[tuple, list] = {}
    for r in m.refs:
        refs.setdefault((r.version, r.attempt), []).append(r.name)
    return {"attempt": m.attempt, "created": m.created, "seq": m.seq, "step": m.step, "world_size": m.world_size,
            "nbytes": m.nbytes, "supersedes": sorted(m.superseded_attempts), "groups": len(m.placement or ()) or 1,
            "objects": ObjSet.of_names(m.attempt, (o.name for o in m.all_objects())).to_json(),
            "refs": [[v, a, ObjSet.of_names(a, names).to_json()] for (v, a), names in sorted(refs.items())],
            "nonfinite": m.nonfinite, "key_id": (m.encryption or {}).get("key_id")}


def _objects_in(local, enc: str, attempt: str) -> list[str]:
    """Object names in one attempt directory of ``local`` (one ``listdir``, no ``stat``)."""
    prefix = f"{layout.VERSIONS}/{enc}/{layout.attempt_dir(attempt)}/"
    path = local.local_path(prefix[:-1])
    if path is not None:
        try:
            names = os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []
    else:
        files, _dirs = local.list_dir(prefix)
        names = [i.key[len(prefix):] for i in files]
    out = []
    for n in names:
        if (n.startswith(layout.TMP_PREFIX) or layout.replica_record_rank(n) is not None or layout.marker_rank(n) is not None
                or layout.is_writer_record(n)):
            continue
        out.append(f"{layout.attempt_dir(attempt)}/{n}")
    return out


def _attempts_in(local, enc: str) -> list[str]:
    prefix = f"{layout.VERSIONS}/{enc}/{layout.ATTEMPTS}"
    path = local.local_path(prefix)
    if path is not None:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
    _files, dirs = local.list_dir(prefix + "/")
    return [d[len(prefix) + 1 : -1] for d in dirs]


def root_report(local, known=frozenset(), *, first: bool = False) -> tuple[dict, dict]:
    """What the root ``local`` holds (``choice`` module docstring): ``(report, manifests)`` where
    ``manifests`` holds the facts of every manifest there whose digest is not in ``known``. One
    listing of ``versions/``, one of each version directory and of each attempt directory in it,
    and a read of each manifest (parsed unless its digest is in ``known``) and damage mark; on the
    first rank also the restore log."""
    committed: dict[str, list] = {}
    held: dict[str, dict] = {}
    invalid: dict[str, str] = {}
    manifests: dict[str, dict] = {}
    if local is not None:
        for enc, vd in catalogue.version_dirs(local).items():
            try:
                v = decode_version(enc)
            except Exception:  # noqa: BLE001 - not a version directory: catalogue/scrub report it
                continue
            if vd.manifest is not None:
                entry = _committed(local, v, vd, known, manifests, invalid)
                if entry is not None:
                    committed[v] = entry
            if vd.attempts:
                for a in _attempts_in(local, enc):
                    names = _objects_in(local, enc, a)
                    if names:
                        held.setdefault(v, {})[a] = ObjSet.of_names(a, names).to_json()
    rep: dict[str, Any] = {"root": None if local is None else local.url, "committed": committed, "held": held,
                           "invalid": invalid}
    if first:
        rep["restores"] = read_restore_log(local)
    return rep, manifests


def _committed(local, v: str, vd, known, manifests: dict, invalid: dict) -> list | None:
    """``[digest, damaged]`` of the manifest of ``v`` in ``local`` (None: gone, or invalid — then in
    ``invalid``); its facts go into ``manifests`` unless ``known`` has its digest. A manifest whose
    bytes the first rank already parsed (the same MD5: the copies of one commit are byte-identical)
    is not parsed again."""
    try:
        data = local.get(vd.manifest_key)
    except ObjectNotFoundError:
        return None  # un-committed while we listed
    digest = hashlib.md5(data, usedforsecurity=False).hexdigest()
    attempt = None
    if digest not in known or vd.damaged:
        try:
            m = parse(data, expect_version=v).manifest
        except (ManifestError, UnsupportedFormatError, InvalidNameError) as e:
            log.warning("ignoring invalid manifest %s in %s tier: %s", vd.manifest_key, local.name, e)
            invalid[v] = f"{e} (in {local.url})"
            return None
        attempt = m.attempt
        if digest not in known:
            manifests[digest] = facts_of(m)
    damaged = vd.damaged and catalogue._mark_applies(local, f"{layout.VERSIONS}/{vd.enc}/{layout.DAMAGED}", attempt)
    return [digest, bool(damaged)]


def _listed(local, known, first: bool):
    """:func:`root_report`, or ``({"error": exception}, {})``: every rank must reach the collectives."""
    try:
        return root_report(local, known, first=first)
    except Exception as e:  # noqa: BLE001 - raised on every rank after the exchange
        return {"error": e, "root": None if local is None else local.url}, {}


def _remote_view(remote, job: dict, want: str | None = None, everything: bool = False) -> tuple[dict, dict, dict]:
    """``(remote, manifests, invalid)`` of the remote tier from one listing of its version
    directories (docs/FORMAT.md, Read rule 6): ``remote`` maps each version to ``{"manifest":
    digest or None (not read), "damaged"}``, ``manifests`` the facts of the manifests read.

    A remote manifest whose listed MD5 (``ObjectInfo.md5`` on a tier with ``listing_md5``) is that
    of a root's copy is that copy (no GET). Otherwise it is
    read when a root holds another copy of the name (a possibly divergent copy: docs/FORMAT.md, "One
    name, one content"), or when no root holds the version and its remote manifest is newer
    (LastModified, the server's one clock) than that of every version the roots hold; the others are
    listed unread (older than what the roots hold). LastModified has a resolution of one second on
    many servers: a remote-only version committed in the same second as the newest local one is not
    considered newer. ``want`` (an explicitly named version) and, with ``everything``, every version
    is read. A damage mark is read to check its attempt."""
    known: dict[str, set] = {}
    for rep in job["roots"]:
        for v, (digest, _d) in rep["committed"].items():
            known.setdefault(v, set()).add(digest)
    listing: dict[str, Any] = {}
    for enc, vd in catalogue.version_dirs(remote).items():
        if vd.manifest is None:
            continue
        try:
            listing[decode_version(enc)] = vd
        except Exception:  # noqa: BLE001 - not a version directory: catalogue/scrub report it
            continue
    both = [vd.manifest.mtime for v, vd in listing.items() if v in known]
    newest_both = max(both) if both else None
    out: dict[str, dict] = {}
    new: dict[str, dict] = {}
    invalid: dict[str, str] = {}
    for v, vd in listing.items():
        info = vd.manifest
        digests = known.get(v) or set()
        if remote.listing_md5 and info.md5 and info.md5 in digests:  # docs/FORMAT.md, "Tiers", rule 3
            digest = info.md5
            attempt = job["manifests"][digest]["attempt"]
        elif digests or newest_both is None or info.mtime > newest_both or v == want or everything:
            try:
                data = remote.get(vd.manifest_key)
                m = parse(data, expect_version=v).manifest
            except ObjectNotFoundError:  # un-committed since the listing
                continue
            except (ManifestError, UnsupportedFormatError, InvalidNameError) as e:
                # invalid: not a candidate (scrub reports it). A storage error is raised: transient
                # is never absent (docs/FORMAT.md, Read rule 5)
                log.warning("ignoring remote manifest of %r: %s", v, e)
                invalid[v] = f"{e} (in {remote.url})"
                continue
            digest = hashlib.md5(data, usedforsecurity=False).hexdigest()
            if digest not in job["manifests"]:
                new[digest] = facts_of(m)
            attempt = m.attempt
        else:
            out[v] = {"manifest": None, "damaged": vd.damaged}
            continue
        damaged = vd.damaged and catalogue._mark_applies(remote, f"{layout.VERSIONS}/{vd.enc}/{layout.DAMAGED}", attempt)
        out[v] = {"manifest": digest, "damaged": bool(damaged)}
    return out, new, invalid


def _add_remote(job: dict, remote, want: str | None, everything: bool = False) -> None:
    """The first rank: put the remote tier's view (given what every root holds) into ``job``."""
    try:
        rem, new, invalid = _remote_view(remote, job, want, everything)
    except TransientStorageError as e:
        # the remote tier does not answer: restore from what the roots hold (docs/FORMAT.md, Read
        # rule 9); transient is never absent, so nothing is marked or deleted because of it
        job["remote"], job["remote_error"] = None, str(e)
        return
    job["manifests"].update(new)
    job["remote"], job["remote_error"] = rem, None
    job["invalid"] = {**job.get("invalid", {}), **invalid}


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


def _root_order(leaders: list) -> list[int]:
    """The leaders (group ranks) of the job's roots, in the order of each root's lowest group rank."""
    first: dict[int, int] = {}
    for i, lead in enumerate(leaders):
        if lead is not None and lead >= 0 and lead not in first:
            first[lead] = i
    return sorted(first, key=first.get)


def _assemble(order: list, got: dict) -> dict:
    """The job report from each leader's ``(report, manifests)`` (``got``, keyed by leader), roots in
    ``order``. Equal strings become one object, so the broadcast pickles each version name, attempt
    and digest once (pickle's memo)."""
    canon: dict = {}

    def c(x):
        return canon.setdefault(x, x)

    roots, manifests, errors = [], {}, []
    restores: list = []
    for lead in order:
        rep, facts = got[lead]
        if "error" in rep:
            errors.append((lead, rep["error"]))
            rep = {"root": rep.get("root"), "committed": {}, "held": {}, "invalid": {}}
        manifests.update({c(d): f for d, f in facts.items()})
        if "restores" in rep:
            restores = rep["restores"]
        roots.append({"root": rep["root"], "leader": lead,
                      "committed": {c(v): [c(d), dmg] for v, (d, dmg) in rep["committed"].items()},
                      "held": {c(v): {c(a): st for a, st in per.items()} for v, per in rep["held"].items()},
                      "invalid": rep["invalid"]})
    return {"roots": roots, "manifests": manifests, "remote": None, "remote_error": None, "invalid": {},
            "restores": restores, "errors": errors}


def _raise_errors(job: dict, me: int, own: dict | None) -> None:
    """The same error on every rank when a root could not be listed (its leader raises its own)."""
    for lead, err in job.get("errors") or ():
        if lead == me and own is not None and "error" in own:
            raise own["error"]
        if isinstance(err, CkptStoreError):
            try:
                raise type(err)(f"rank {lead} of the load could not read its root: {err}")
            except TypeError:
                pass
        raise CkptStoreError(f"rank {lead} of the load could not read its root: {err!r}")


def _chain_findings(local, remote, master) -> list:
    """The catalogue chain's findings (docs/FORMAT.md, "Catalogue chain") of the first rank's root and
    the remote tier, as dicts for the job report; none without a key. Never raises: a chain that
    cannot be read is warned about and checked nothing."""
    if master is None:
        return []
    from ..manifest import chain

    try:
        found = chain.check_store({k: t for k, t in (("local", local), ("remote", remote)) if t is not None}, master)
    except Exception as e:  # noqa: BLE001 - the check must not stop a restore
        log.warning("ckptstore: could not check the catalogue chain: %s", e)
        return []
    for f in found:
        log.warning("ckptstore: catalogue chain (%s tier, %s): %s", f.tier, f.kind, f.message)
    return [f.to_json() for f in found]


def exchange(local, remote, pg, version: str | None, key_id: str | None = None, master=None,
             **choice) -> tuple[View, int]:
    """Build the job report and decide (see the module docstring; ``choice``: keyword arguments of
    :func:`ckptstore.choice.decide`; ``key_id``: the id of the master key this rank loads with — the
    first rank's is the load's, ``job["key_id"]``); returns the view and this rank's index in the group. Outside a
    job of more than one rank, the one root is this process's. Raises the same error on every rank
    when nothing can be loaded."""
    if not in_job(pg):
        own = _listed(local, frozenset(), True)
        me_global = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        job = _assemble([0] if local is not None else [], {0: own})
        _raise_errors(job, 0, own[0])
        if remote is not None:
            _add_remote(job, remote, version)
        job["ranks"] = [[me_global, 0 if local is not None else None]]
        job["key_id"] = key_id
        job["chain"] = _chain_findings(local, remote, master)
        return _said(_decide(job, version, local, remote, None, 0, choice)), 0
    me = dist.get_rank(pg)
    first = _first(pg)
    _roots.wait_for_copies(local)  # docs/FORMAT.md, "Placement": dcp.save may return before them
    own = None
    head: list = [None]
    if me == 0:
        token = "load-" + secrets.token_hex(8)
        lead = _roots.claim(local, token, 0)
        if lead == 0:
            own = _listed(local, frozenset(), True)
        head = [(token, sorted(own[1]) if own else [])]
    dist.broadcast_object_list(head, src=first, group=pg)
    token, known = head[0]
    if me != 0:
        lead = _roots.claim(local, token, me)
        if lead == me:
            own = _listed(local, frozenset(known), False)
    leaders: list = [None] * dist.get_world_size(pg)
    dist.all_gather_object(leaders, lead, group=pg)
    if lead == me:
        _roots.release(local, token)  # every rank of the load has claimed by now
    order = _root_order(leaders)
    box: list = [None]
    if me == 0:
        try:
            got = {0: own} if own is not None else {}
            for other in order:
                if other != 0:
                    msg: list = [None]
                    dist.recv_object_list(msg, src=_global(pg, other), group=pg)
                    got[other] = msg[0]
            job = _assemble(order, got)
            job["key_id"] = key_id  # the load's master key: the first rank's (docs/FORMAT.md, Read rule 12)
            if remote is not None and not job["errors"]:  # the remote tier, knowing what every root holds
                _add_remote(job, remote, version)
            job["chain"] = _chain_findings(local, remote, master)
            box = [job]
        except Exception as e:  # noqa: BLE001 - every rank must reach the broadcast
            box = [e]
    elif lead == me:
        dist.send_object_list([own], dst=first, group=pg)
    dist.broadcast_object_list(box, src=first, group=pg)
    if isinstance(box[0], BaseException):
        raise box[0]
    job = box[0]
    _raise_errors(job, me, own[0] if own is not None else None)
    index = {lead: k for k, lead in enumerate(order)}
    job["ranks"] = [[_global(pg, i), index.get(lead)] for i, lead in enumerate(leaders)]
    view = _decide(job, version, local, remote, pg, me, choice)
    return (_said(view) if me == 0 else view), me


def _decide(job: dict, version, local, remote, pg, me: int, choice: dict):
    """:func:`decide`; when nothing is loadable while the first rank left remote manifests unread
    (older than what the roots hold: a fallback past every local version), the first rank reads them
    all and every rank decides again (one broadcast in a job) — the same on every rank, since every
    rank got the same error from the same job report."""
    try:
        return decide(job, version, where=_where(local, remote), **choice)
    except VersionNotFoundError:
        rem = job.get("remote") or {}
        if version is not None or not any(e.get("manifest") is None for e in rem.values()):
            raise
    full: list = [None]
    if me == 0:
        try:
            again = {**job, "manifests": dict(job["manifests"])}
            _add_remote(again, remote, None, everything=True)
            full = [(again["remote"], again["manifests"], again["remote_error"], again.get("invalid", {}))]
        except Exception as e:  # noqa: BLE001 - every rank must reach the broadcast
            full = [e]
    if pg is not None:
        dist.broadcast_object_list(full, src=_first(pg), group=pg)
    if isinstance(full[0], BaseException):
        raise full[0]
    rem, manifests, err, invalid = full[0]
    job = {**job, "remote": rem, "manifests": manifests, "remote_error": err, "invalid": invalid}
    return decide(job, version, where=_where(local, remote), **choice)


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
    return _global(pg, 0)


def _global(pg, i: int) -> int:
    """The global rank of group rank ``i`` (the default group: ``i``)."""
    return i if pg is None else dist.get_global_rank(pg, i)


def _where(local, remote) -> str:
    return " or ".join(f"{t.name} tier {t.url}" for t in (local, remote) if t is not None)


def opens(view: View, i: int) -> bool:
    """Group rank ``i``'s copy of the view's manifest opens with the master key the load uses (the
    first rank's, ``job["key_id"]``): it is not encrypted, or wrapped by that key (by key id). A copy
    wrapped by another key — a root a ``ckptstore rekey`` missed — is not used while another copy
    opens (docs/FORMAT.md, Read rule 12). Without a key nothing opens an encrypted copy: the reader
    says so."""
    kid = view.manifest_key_id(i)
    mine = view.job.get("key_id")
    return kid is None or mine is None or kid == mine


def fetch_manifest(view: View, me: int, local, remote, pg) -> tuple[bytes, bytes | None, str]:
    """The manifest file of the view's version for rank ``me``, the stored bytes of its metadata
    object when it came from another rank (else None), and where it came from (for messages). Ranks
    whose root lacks the manifest — or holds a copy wrapped by another master key than the load's
    (:func:`opens`) — get both from a root whose copy opens (one broadcast, made by every rank when
    any rank needs it), else from the remote tier; a root holding objects of the attempt without its
    manifest is repaired on the way, by the rank that listed it (a copy under another key is left
    for ``ckptstore rekey``)."""
    usable = [h for h in view.holders if opens(view, h)]
    holder = usable[0] if usable else (view.holders[0] if view.holders else None)
    need = [i for i in range(view.size) if holder is not None and i != holder
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
            if not view.has_manifest(me) and local is not None and view.lists_root(me) and view.present(me):
                _repair(local, view, got)
    from_holder = f"the root of rank {view.global_rank(holder)} ({view.root_url(holder)})" if holder is not None else ""
    mine = f"the root of rank {view.global_rank(me)} ({view.root_url(me)})"
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
    kid = view.manifest_key_id(me)
    root = view.root_url(me)
    log.warning("ckptstore: the manifest of version %r in %s is wrapped by master key id %s, not by the key given "
                "(id %s): a key rotation missed this root. Loading with the copy of %s (the data keys are the "
                "same). Run 'ckptstore rekey %s --key-file OLD --new-key-file NEW' on that node",
                view.version, root, kid, view.job.get("key_id"), used, root)


def _repair(local, view: View, got: tuple) -> None:
    """Install the manifest (and metadata object) in this root: a crash between the commit and the
    copy left its objects without them (docs/FORMAT.md, "Placement"). Reported only when this call
    wrote the manifest."""
    mkey = layout.manifest_key(view.version)
    try:
        if local.exists(mkey):
            return  # installed meanwhile (a copy that was late, not lost)
        m = parse(got[0], expect_version=view.version).manifest
        if copy_into(local, view.version, view.attempt, got[0], got[1], _ranks_present(m, local, view)) is not None:
            log.warning("ckptstore: repaired root %s: it held objects of version %r but not its manifest "
                        "(a crash after the commit); copied from another rank's root", local.url, view.version)
    except CkptStoreError as e:
        log.warning("ckptstore: could not repair root %s for version %r: %s", local.url, view.version, e)


def _ranks_present(m, local, view: View) -> set:
    present = set(_objects_in(local, layout.version_dir(view.version).split("/", 1)[1], view.attempt))
    return {o.rank for o in m.objects if o.name in present}
