"""Tiers: where objects live. ``local`` (a directory) and ``remote`` (an object-store prefix).

The remote tiers are registered here by URL scheme, one line each (restic's
``internal/backend/location/registry.go``): a tier's package parses its own URL and options
(endpoint, credentials, region/project/account) with its SDK's usual conventions, and is imported
— with its SDK — only when a URL of its scheme is opened. Adding a tier is a package under
``tiers/`` and one line in :data:`REGISTRY` (docs/ARCHITECTURE.md, "Adding a tier").
"""

from __future__ import annotations

import importlib
import warnings

from .base import ObjectInfo, ObjectWriter, PartLimits, PartUpload, Tier  # noqa: F401
from .local import LocalTier  # noqa: F401

#: URL scheme → ``"module:Class"`` of its :class:`Tier` (imported on first use)
REGISTRY: dict[str, str] = {
    "s3": "ckptstore.tiers.s3:S3Tier",  # Amazon S3 and S3-compatible servers (botocore)
    "gs": "ckptstore.tiers.gcs:GCSTier",  # Google Cloud Storage (google-cloud-storage; extra "gcs")
    "az": "ckptstore.tiers.azure:AzureTier",  # Azure Blob Storage (azure-storage-blob; extra "azure")
}

#: keyword arguments that name one tier's option, accepted by the public constructors for
#: compatibility and mapped once onto ``remote_options`` (docs/tiers.md, "Options")
DEPRECATED_OPTIONS = {"endpoint_url": "s3"}


def tier_class(scheme: str) -> type[Tier]:
    """The :class:`Tier` class registered for ``scheme`` (its package imported now)."""
    mod, _, cls = REGISTRY[scheme].partition(":")
    try:
        return getattr(importlib.import_module(mod), cls)
    except ImportError as e:
        from ..errors import StorageError

        extra = {"gs": "gcs", "az": "azure"}.get(scheme)
        hint = f"; install it with: pip install 'ckptstore[{extra}]'" if extra else ""
        raise StorageError(f"the {scheme}:// tier needs a package that is not installed ({e}){hint}") from e


def make_remote(url, *, timeout_s: float | None = None, **options) -> Tier | None:
    """The remote tier for ``url`` (``"s3://bucket/prefix"``, ``"gs://bucket/prefix"``,
    ``"az://container/prefix"``), a :class:`Tier` given as is, or None for None.

    ``options``: the tier's own keyword arguments (``S3Tier``'s ``endpoint_url``/``region_name``…,
    ``GCSTier``'s ``project``…, ``AzureTier``'s ``account_url``/``connection_string``…; see
    docs/tiers.md); ``timeout_s``: bound each request and its retries to about that many seconds
    (:meth:`Tier.bounded_options`); both are ignored for a :class:`Tier` given ready. Raises
    :class:`~ckptstore.errors.InvalidNameError` for a URL of no registered scheme, ``TypeError``
    for an option the tier does not take, and :class:`~ckptstore.errors.StorageError` when the
    tier's SDK is not installed.
    """
    if url is None:
        return None
    if isinstance(url, Tier):
        return url  # it carries its own options
    from ..errors import InvalidNameError

    scheme = url.partition("://")[0] if isinstance(url, str) and "://" in url else None
    if scheme not in REGISTRY:
        known = ", ".join(f"'{s}://…'" for s in REGISTRY)
        raise InvalidNameError(f"remote must be a URL of a registered tier ({known}), got {url!r}")
    return tier_class(scheme).from_url(url, timeout_s=timeout_s, **options)


def remote_options_of(remote_options: dict | None, legacy: dict, *, where: str) -> dict:
    """``remote_options`` plus the deprecated per-tier keyword arguments in ``legacy`` (popped
    from it; :data:`DEPRECATED_OPTIONS`), each mapped once onto the tier's options with a
    ``DeprecationWarning``. What the public constructors call on their ``**kwargs``."""
    opts = dict(remote_options or {})
    for name in list(legacy):
        if name in DEPRECATED_OPTIONS:
            value = legacy.pop(name)
            if value is None:
                continue
            warnings.warn(f"{where}({name}=...) is deprecated: pass remote_options={{{name!r}: ...}} "
                          f"(an option of the {DEPRECATED_OPTIONS[name]}:// tier)", DeprecationWarning, stacklevel=3)
            opts.setdefault(name, value)
    return opts
