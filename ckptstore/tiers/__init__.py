"""Tiers: where objects live. ``local`` (a directory) and ``remote`` (an S3 prefix)."""

from __future__ import annotations

from .base import ObjectInfo, ObjectWriter, Tier  # noqa: F401
from .local import LocalTier  # noqa: F401


def make_remote(url: str | None, *, endpoint_url: str | None = None) -> Tier | None:
    """The remote tier for ``url`` (``s3://bucket/prefix``), or None."""
    if url is None:
        return None
    if isinstance(url, Tier):
        return url
    from ..errors import InvalidNameError

    if not isinstance(url, str) or not url.startswith("s3://"):
        raise InvalidNameError(f"remote must be an 's3://bucket/prefix' URL, got {url!r}")
    from .s3 import S3Tier  # only this import pulls boto3

    return S3Tier(url, endpoint_url=endpoint_url)
