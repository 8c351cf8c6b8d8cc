"""Repairing what scrub found: restore damaged objects from another tier, mark what stays damaged.

A damaged or missing object is restored from another tier where the same version is committed by
the **same attempt** and whose copy verifies (to the same depth); the copy is verified again before
it replaces the damaged one (locally through a ``.tmp-*`` file and an atomic rename):
:func:`repair_objects`, :func:`restore_object`. A damaged replica is this root's copy of another
node's object: with ``repair`` it is dropped from the root and its record (docs/FORMAT.md,
"Replicas"). Damage that cannot be repaired marks the version damaged in that tier
(``versions/<v>/damaged.json`` with the reason, the attempt and the objects); ``Store.latest()``
skips, and ``StorageReader`` refuses, such a version. A version marked damaged that now verifies
(at least as deeply as when it was marked, or whose mark names another attempt) has its mark
removed: :func:`settle_mark`. Fault point ``scrub.repair`` precedes every repair write (object
restore, replica removal, mark, unmark).
"""

from __future__ import annotations

import json

from .. import _faults
from ..errors import CkptStoreError, IntegrityError
from ..manifest import layout
from ..manifest.schema import ObjectEntry, utcnow
from ..tiers.base import Tier
from .read import Window
from .report import DAMAGED, OK, REPAIRED, UNCHECKED, Issue, ObjectCheck, VersionCheck
from .verify import Verifier, check_object, verify_stream


def repair_objects(tiers, holders, checks: dict[str, VersionCheck], codecs: dict, verifier: Verifier | None = None) -> None:
    """Restore every damaged object of ``checks`` (``{tier: VersionCheck}`` of one version) from a
    tier whose copy of the same attempt checked OK (and as deeply), then check it again there
    (``codecs[tier]``, ``verifier``): only a copy that verifies counts as repaired."""
    for n, vc in checks.items():
        for oc in vc.damaged_objects():
            sources = [
                s for s, svc in checks.items()
                if s != n and holders[s].manifest.attempt == holders[n].manifest.attempt
                and any(so.name == oc.name and so.status == OK for so in svc.objects)
                and (not vc.deep or svc.deep)
            ]
            entry = next(o for o in holders[n].manifest.all_objects() if o.name == oc.name)
            errors = []
            for s in sources:
                try:
                    restore_object(tiers[s], tiers[n], oc.key, entry)
                except (CkptStoreError, OSError) as e:
                    errors.append(f"restore from the {s} tier failed: {e}")
                    continue
                again = check_object(tiers[n], n, vc.version, entry, codecs[n], verifier=verifier)
                if again.status == OK:
                    oc.status, oc.repaired_from, oc.frames = REPAIRED, s, again.frames
                    oc.detail += f"; restored from the {s} tier"
                    break
                errors.append(f"copy from the {s} tier does not verify after restore: {again.kind} {again.detail}")
            if oc.status == DAMAGED:
                if not sources:
                    errors.append("no other tier holds a verified copy of the same attempt")
                oc.detail += "; not repaired: " + "; ".join(errors)


def restore_object(src: Tier, dst: Tier, key: str, entry: ObjectEntry) -> None:
    """Copy ``key`` from ``src`` to ``dst``, replacing the damaged copy only with a verified one."""
    _faults.point("scrub.repair")

    def verify(fetch, size):
        kind, detail, _fr = verify_stream(Window(lambda s, e: fetch(s, e - s), size), size, entry)
        if kind is not None:
            raise IntegrityError(f"the {src.name} copy of {key} does not verify: {kind} {detail}", object=key)

    dst.put_verified(key, lambda path: src.get_file(key, path), verify)


def _read_mark(tier: Tier, version: str) -> dict:
    try:
        d = json.loads(tier.get(layout.damaged_key(version)))
        return d if isinstance(d, dict) else {}
    except Exception:  # noqa: BLE001 - an unreadable mark is still a mark
        return {}


def _drop_bad_replicas(tier: Tier, vc: VersionCheck, repair: bool) -> None:
    """A damaged replica (that no other tier repaired) is this root's copy of another node's object,
    not the version: it never marks the version damaged. With ``repair`` it is removed from the root
    and from its record, so no restore reads it, and the job's next restore copies it again from the
    node that holds the primary (docs/FORMAT.md, "Replicas")."""
    for o in vc.objects:
        if not (o.replica and o.status == DAMAGED):
            continue
        if not repair:
            o.detail += " (a replica: the primary is on its own node; --repair removes this copy and the next restore " \
                        "re-replicates it)"
            continue
        _faults.point("scrub.repair")
        tier.delete(o.key)
        o.status = REPAIRED
        o.detail += " (a replica: removed; the next restore of the job copies it again from its primary)"
        prefix = layout.version_dir(vc.version) + "/" + layout.attempt_dir(vc.attempt or "") + "/"
        for info in list(tier.list(prefix)):
            if layout.replica_record_rank(info.key) is None:
                continue
            rec = json.loads(tier.get(info.key))
            if o.name in rec.get("objects", []):
                rec["objects"] = [n for n in rec["objects"] if n != o.name]
                tier.put(info.key, json.dumps(rec, sort_keys=True).encode())


def settle_mark(tier: Tier, vc: VersionCheck, te, repair: bool, deep: bool) -> None:
    """Mark versions that stay damaged; clear marks of versions that verify (with ``repair``)."""
    _drop_bad_replicas(tier, vc, repair)
    unrepaired = [o for o in vc.objects if o.status == DAMAGED and not o.replica] + \
        [i for i in vc.issues if i.status == DAMAGED]
    if vc.was_marked:
        mark = _read_mark(tier, vc.version)
        if unrepaired:
            vc.issues.append(Issue("marked", f"marked damaged: {mark.get('reason', '?')}"))
            return
        stale = mark.get("attempt") not in (None, vc.attempt)
        needs_deep = bool(mark.get("deep")) and not vc.deep and not stale
        if UNCHECKED in [o.status for o in vc.objects]:
            vc.issues.append(Issue("marked", f"marked damaged: {mark.get('reason', '?')}"))
            return
        if not repair or needs_deep:
            hint = "run 'ckptstore scrub --deep --repair' to re-check it" if needs_deep else "run 'ckptstore scrub --repair' to clear the mark"
            vc.issues.append(Issue("marked", f"marked damaged ({mark.get('reason', '?')}), but verifies clean now; {hint}"))
            return
        _faults.point("scrub.repair")
        tier.delete(layout.damaged_key(vc.version))
        vc.mark = "mark removed"
        return
    if unrepaired and repair:
        reasons = [f"{o.name}: {o.kind} ({o.detail})" for o in unrepaired if isinstance(o, ObjectCheck)]
        reasons += [f"{i.kind}: {i.detail}" for i in unrepaired if isinstance(i, Issue)]
        body = {
            "reason": "; ".join(reasons),
            "attempt": vc.attempt,
            "objects": {o.name: o.kind for o in unrepaired if isinstance(o, ObjectCheck)},
            "deep": vc.deep,
            "time": utcnow(),
            "by": "ckptstore scrub",
        }
        _faults.point("scrub.repair")
        tier.put(layout.damaged_key(vc.version), json.dumps(body, sort_keys=True).encode())
        vc.mark = "marked damaged"
