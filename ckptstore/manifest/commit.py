"""Phase 2 of the commit, shared by every tier: make a version visible (docs/FORMAT.md, Save rule 4).

The manifest is written with put-if-absent (local: ``os.link`` of an fsync'd temp file; a remote
tier: the precondition its server enforces, docs/FORMAT.md "Tiers", rule 1) or, with ``overwrite``, an atomic replace. Of two writers racing for one
version exactly one wins; the other gets :class:`VersionExistsError` and changes nothing.

A superseding save (docs/FORMAT.md, "Superseding") replaces the copy it checked and no other:
:func:`supersede_manifest` is a conditional replace (:meth:`Tier.replace_if_match`) against the
version token :func:`read_token` returned when the writer checked the copy. Of two writers
superseding one copy at once exactly one commits; the other gets :class:`SupersedeConflictError`.
A tier without :attr:`Tier.supports_conditional_replace` refuses to supersede
(:class:`SupersedeRefusedError`) rather than overwrite.
"""

from __future__ import annotations

from .. import _faults
from ..errors import (ObjectExistsError, ObjectNotFoundError, PreconditionFailedError, SupersedeConflictError,
                      SupersedeRefusedError, VersionExistsError)
from ..tiers.base import Tier
from . import layout


def commit_manifest(tier: Tier, version: str, body: bytes, *, overwrite: bool, fault: str, hint: str) -> None:
    """Write ``body`` as the manifest of ``version`` in ``tier``; ``fault`` names the fault point
    passed just before, ``hint`` ends the :class:`VersionExistsError` message."""
    key = layout.manifest_key(version)
    _faults.point(fault)
    try:
        if overwrite:
            tier.put(key, body)
        else:
            tier.put_if_absent(key, body)
    except ObjectExistsError:
        raise VersionExistsError(f"version {version!r} already exists in the {tier.name} tier ({tier.url}); {hint}") from None



def read_token(tier: Tier, version: str) -> str | None:
    """The version token (:attr:`ObjectInfo.token`) of ``version``'s manifest in ``tier``, taken
    *before* the caller reads the manifest (so a copy that changes in between fails the replace);
    None when there is no manifest or the tier reports no token."""
    try:
        return tier.stat(layout.manifest_key(version)).token
    except ObjectNotFoundError:
        return None


def supersede_manifest(tier: Tier, version: str, body: bytes, *, token: str | None, attempt: str, fault: str) -> None:
    """Replace the manifest of ``version`` in ``tier`` with ``body`` only if it is still the copy
    whose token is ``token`` (the copy of ``attempt`` the save checked it may supersede).

    Raises :class:`SupersedeConflictError` (a :class:`VersionExistsError`) when another writer
    replaced or removed it since — nothing was written — and :class:`SupersedeRefusedError` when the
    tier has no conditional replace (or reported no token)."""
    key = layout.manifest_key(version)
    _faults.point(fault)
    if not tier.supports_conditional_replace or token is None:
        raise SupersedeRefusedError(
            f"version {version!r}: the {tier.name} tier ({tier.url}) has no conditional replace, so this save "
            f"cannot supersede its copy of attempt {attempt} without risking another writer's commit; nothing was "
            "replaced there. Save under a new name, or drop the old version first ('ckptstore drop')")
    try:
        tier.replace_if_match(key, body, token)
    except PreconditionFailedError as e:
        raise SupersedeConflictError(
            f"version {version!r} in the {tier.name} tier ({tier.url}) was superseded or removed by another writer "
            f"after this save checked its copy of attempt {attempt}; this save was not committed there (the other "
            "writer's commit stands). If both jobs believe they own this run, stop one of them") from e
