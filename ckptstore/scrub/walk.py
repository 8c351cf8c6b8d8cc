"""Walking a store for scrub: tiers → committed versions → the part of each that a tier holds →
its objects, each verified once (:func:`scrub`).

Every version committed in a tier (its ``manifest.json`` parses with a valid seal) is checked there;
a manifest that is present but fails to parse is reported as damage of kind ``manifest``, a tier
that cannot be listed as not checked.

**Which objects** (docs/FORMAT.md, "Scrub"): per tier, the part of the version that tier holds —
the whole version in the remote tier; on a local root of a version split over several node-local
roots, the metadata object and the shard objects of that root's group
(:func:`ckptstore.manifest.placement.part_held`). Another root's objects are never reported
missing; :attr:`VersionCheck.part` (``"part"`` in JSON) says what was checked. An object of an
earlier version that a version references (docs/FORMAT.md, "References") is checked once: with its
origin when that is committed in the tier, else with the first version that references it.

Tiers that hold different attempts of one name are reported (kind ``divergent``,
:func:`_check_divergence`). A version whose manifest records NaN/Inf values is reported as a finding
(kind ``nonfinite``, status ``finding``: not damage, never marked or repaired; exit 13).
Verifying is :mod:`ckptstore.scrub.verify`'s, repairing
:mod:`ckptstore.scrub.repair`'s, the report :mod:`ckptstore.scrub.report`'s.
"""

from __future__ import annotations

from typing import Callable

from ..codec.frame import FrameCodec
from ..errors import CkptStoreError, IntegrityError, KeyMismatchError, KeyServiceError, version_not_found
from ..keys import resolve_master
from ..manifest import catalogue, layout, placement
from ..tiers.base import tiers_of
from .repair import repair_objects, settle_mark
from ..manifest.schema import nonfinite_text
from .report import FINDING, Issue, ScrubReport, VersionCheck
from .verify import Verifier, check_metadata, check_object, codec_for, ref_codec


def scrub(
    store,
    *,
    version: str | None = None,
    deep: bool = False,
    repair: bool = False,
    key=None,
    on_total: Callable[[int], None] | None = None,
    on_bytes: Callable[[int], None] | None = None,
    jobs: int | None = None,
) -> ScrubReport:
    """Verify (and with ``repair`` fix) the committed versions of ``store`` (a :class:`Store` or a
    ``{name: Tier}`` mapping). ``version``: only that one (raises :class:`VersionNotFoundError` when
    no reachable tier commits it). ``key``: master key for ``deep`` — 32 bytes, a key provider, a
    :class:`ckptstore.KmsKey` or ``"kms://…"`` (default ``CKPTSTORE_KEY`` / ``CKPTSTORE_KEY_FILE`` /
    ``CKPTSTORE_KMS_KEY_ID``); a key service that refuses or does not answer leaves the deep part
    of the versions it wraps *not checked* (exit 12), never damaged. ``on_total(bytes)``/``on_bytes(n)``: progress callbacks (``on_bytes``
    may be called from several threads). ``jobs``: worker threads that verify objects and frames
    (and run ranged GETs on a remote tier); default :func:`default_jobs`.

    Per tier, the part of each version that tier holds is checked
    (:func:`ckptstore.manifest.placement.part_held`): the whole version in the ``remote`` tier; on a
    local root of a version split over several roots, the metadata object and the shard objects of
    that root's group — the other groups' objects live on other roots and are never reported
    missing. :attr:`VersionCheck.part` says which part was checked.
    """
    tiers = tiers_of(store)
    report = ScrubReport(deep=deep, repair=repair)
    master = None
    key_problem = None
    if deep:  # an invalid key, however given (key=, CKPTSTORE_KEY, CKPTSTORE_KEY_FILE): KeyMismatchError, exit 5
        master = resolve_master(key if key is not None else getattr(store, "key", None))
    entries: dict[str, dict] = {}
    for name, t in tiers.items():
        problems: list = []
        try:
            entries[name] = catalogue.scan(t, problems)
        except (CkptStoreError, OSError) as e:
            report.unreachable.append((name, f"{type(e).__name__}: {e}"))
            continue
        for _t, mkey, why in problems:
            v = layout.version_of_key(mkey)
            if version is not None and v != version:
                continue
            report.versions.append(VersionCheck(name, v or mkey, None, issues=[Issue("manifest", f"{mkey}: {why}")]))
    names = {v for e in entries.values() for v in e}
    if version is not None:
        if version not in names and not report.unreachable and not report.versions:
            raise version_not_found(version, " or ".join(f"the {n} tier ({t.url})" for n, t in tiers.items()) or "no tier",
                                    names)
        names &= {version}
    recs = catalogue.merge({n: {v: e[v] for v in names if v in e} for n, e in entries.items()})
    order = [r.version for r in recs]
    parts: dict[tuple[str, str], placement.Part] = {}
    for n, e in entries.items():
        for v in order:
            if v in e:
                try:
                    parts[n, v] = placement.part_held(tiers[n], e[v].manifest, remote=n != "local")
                except (CkptStoreError, OSError):  # the listing failed: check (and report) everything
                    parts[n, v] = placement.whole(e[v].manifest)
    orphans = _orphan_refs(entries, order)
    if on_total is not None:
        on_total(sum(o.size for p in parts.values() for o in p.objects) + sum(r.size for rs in orphans.values() for r in rs))
    with Verifier(jobs) as verifier:
        for v in order:
            _scrub_version(tiers, entries, v, parts, verifier, deep, repair, master, key_problem, on_bytes, report, orphans)
    return report


def _orphan_refs(entries: dict, order: list) -> dict:
    """``{(tier, version): [RefEntry]}``: each referenced object (docs/FORMAT.md, "References") whose
    origin version is not committed in that tier, checked once — with the first version (in order)
    that references it. A reference whose origin is committed there is checked with its origin."""
    out: dict = {}
    for n, e in entries.items():
        committed = {v: te.manifest.attempt for v, te in e.items()}
        seen: set = set()
        for v in order:
            if v not in e:
                continue
            for ref in e[v].manifest.refs:
                if committed.get(ref.version) == ref.attempt or (ref.version, ref.name) in seen:
                    continue
                seen.add((ref.version, ref.name))
                out.setdefault((n, v), []).append(ref)
    return out


def _scrub_version(tiers, entries, v, parts, verifier, deep, repair, master, key_problem, on_bytes, report,
                   orphans=None) -> None:
    holders = {n: e[v] for n, e in entries.items() if v in e}
    checks: dict[str, VersionCheck] = {}
    codecs: dict[str, FrameCodec | None] = {}
    for n, te in holders.items():
        checks[n], codecs[n] = _check_version(tiers[n], n, v, te, parts[n, v], deep, master, key_problem, on_bytes, verifier,
                                              (orphans or {}).get((n, v), ()))
    if repair:
        repair_objects(tiers, holders, checks, codecs, verifier)
    if deep:
        for n, vc in checks.items():
            check_metadata(tiers[n], vc, holders[n], codecs[n], master)
    for n, vc in checks.items():
        settle_mark(tiers[n], vc, holders[n], repair, deep)
    _check_divergence(holders, checks)
    report.versions.extend(checks[n] for n in tiers if n in checks)


def _check_divergence(holders: dict, checks: dict[str, VersionCheck]) -> None:
    """Tiers that hold different attempts of one name (docs/FORMAT.md, "One name, one content"):
    every copy but the one :func:`ckptstore.manifest.order.resolve` chooses is reported (kind
    ``divergent``): it is never loaded, and it is not repaired (it is another save)."""
    from ..manifest.order import resolve

    if len({te.manifest.attempt for te in holders.values()}) < 2:
        return
    chosen = resolve([catalogue.copy_of(te.manifest, remote=(n == "remote")) for n, te in holders.items()])
    winner = next(n for n, te in holders.items() if te.manifest.attempt == chosen)
    for n, te in holders.items():
        if te.manifest.attempt != chosen:
            why = ("supersedes it" if te.manifest.attempt in holders[winner].manifest.superseded_attempts
                   else "is the copy of record")
            checks[n].issues.append(Issue("divergent", (
                f"this copy (attempt {te.manifest.attempt}) is not the version: the {winner} tier holds attempt {chosen}, "
                f"which {why}; this copy is never loaded. Remove it with 'ckptstore drop ROOT {te.manifest.version} "
                f"--tier {n}' (the {winner} copy stays), or let the pending upload replace it")))


def _ref_codec(vc: VersionCheck, ref, master) -> FrameCodec | None:
    """:func:`ref_codec`, or None (shallow check of that object) with the reason as an issue: a key
    that does not fit or a key service that did not answer is *not checked*, a wrapped key that does
    not authenticate is damage (kind ``key``)."""
    from .report import UNCHECKED, Issue

    try:
        if master is None and ref.wrapped_key is not None:
            raise KeyMismatchError(f"{ref.name} of {ref.version!r} is encrypted and no key was given")
        return ref_codec(ref, master)
    except KeyMismatchError as e:
        vc.issues.append(Issue("key", f"{ref.name} of {ref.version!r}: {e}", UNCHECKED))
        vc.wrong_key = master is not None
    except KeyServiceError as e:
        vc.issues.append(Issue("key", f"{ref.name} of {ref.version!r}: not checked: {e}", UNCHECKED))
    except IntegrityError as e:
        vc.issues.append(Issue("key", f"{ref.name} of {ref.version!r}: {e}"))
    return None


def _check_version(tier, name, version, te, part, deep, master, key_problem, on_bytes,
                   verifier: Verifier, refs=()) -> tuple[VersionCheck, FrameCodec | None]:
    m = te.manifest
    # any damaged.json counts here, also one naming another attempt (the catalogue ignores those):
    # scrub reports it and --repair removes it
    marked = te.damaged or tier.exists(layout.damaged_key(version))
    vc = VersionCheck(name, version, m.attempt, encrypted=m.encrypted, deep=deep, was_marked=marked, part=part)
    if m.nonfinite_count:  # a fact the manifest records, not damage: the bytes are what was saved
        vc.issues.append(Issue("nonfinite", f"its tensors hold {nonfinite_text(m.nonfinite)} (recorded at save; the "
                                            "bytes are intact, the version is not the default restore point)", FINDING))
    codec = codec_for(vc, te, master, key_problem) if deep else None
    vc.deep = deep and codec is not None
    futs = [verifier.walkers.submit(check_object, tier, name, version, entry, codec, on_bytes, verifier)
            for entry in part.objects]
    for ref in refs:  # an earlier version's object this one references, whose origin is gone here
        rc = _ref_codec(vc, ref, master) if vc.deep else None
        futs.append(verifier.walkers.submit(check_object, tier, name, ref.version, ref.entry, rc, on_bytes, verifier))
    vc.objects.extend(f.result() for f in futs)
    for o in vc.objects:
        o.replica = o.name in part.replicas
    return vc, codec
