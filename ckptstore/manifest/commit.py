"""Phase 2 of the commit, shared by every tier: make a version visible (docs/FORMAT.md, Save rule 4).

The manifest is written with put-if-absent (local: ``os.link`` of an fsync'd temp file; a remote
tier: the precondition its server enforces, docs/FORMAT.md "Tiers", rule 1) or, with ``overwrite``, an atomic replace. Of two writers racing for one
version exactly one wins; the other gets :class:`VersionExistsError` and changes nothing.
"""

from __future__ import annotations

from .. import _faults
from ..errors import ObjectExistsError, VersionExistsError
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
