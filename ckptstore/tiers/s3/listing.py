"""Listing of the remote tier: S3's paginated LIST requests under the tier's prefix.

:func:`pages` runs one of S3's paginated LIST operations (``list_objects_v2``,
``list_multipart_uploads``) for the keys under ``<tier prefix><prefix>``, every page, and
translates its errors once: a listing that fails (after botocore's retries) raises, it is never
reported as empty or short. ``delimiter`` is S3's: keys with the delimiter after the prefix are
rolled up into the page's ``CommonPrefixes`` (``"/"`` on ``versions/`` gives the version
directories instead of every object). :func:`objects` makes ``list_objects_v2`` pages into
:class:`~ckptstore.tiers.base.ObjectInfo` records with tier-relative keys.
"""

from __future__ import annotations

from typing import Iterator

from ...errors import InvalidNameError
from ..base import ObjectInfo
from .client import BOTO_ERRORS, Connection


def _info(key: str, obj: dict) -> ObjectInfo:
    """The record of one ``Contents`` entry; ``md5`` is the ETag of an object written by one PUT
    (32 hex digits; a multipart upload's ETag has a ``-N`` suffix and is no MD5)."""
    etag = str(obj.get("ETag") or "").strip('"') or None
    md5 = etag if etag and len(etag) == 32 and "-" not in etag else None
    return ObjectInfo(key, int(obj["Size"]), obj["LastModified"].timestamp(), etag, md5=md5)


def check_prefix(prefix: object) -> str:
    """``prefix`` if it can be listed (a str, no control characters, relative), else
    :class:`InvalidNameError`."""
    if not isinstance(prefix, str) or any(ord(c) < 0x20 for c in prefix) or prefix.startswith("/"):
        raise InvalidNameError(f"invalid listing prefix {prefix!r}")
    return prefix


def pages(
    conn: Connection,
    operation: str,
    prefix: str = "",
    *,
    what: str = "LIST of",
    page_size: int | None = None,
    delimiter: str | None = None,
) -> Iterator[dict]:
    """Every page of ``operation`` under ``prefix`` (relative to the tier); ``page_size``: keys per
    request (default: the server's maximum, 1000 on S3); ``delimiter``: see the module docstring.
    Errors are raised as :meth:`Connection.error` translates them (``what`` names the request)."""
    kw = {"Bucket": conn.bucket, "Prefix": conn.prefix + prefix}
    if delimiter is not None:
        kw["Delimiter"] = delimiter
    try:
        yield from conn.client.get_paginator(operation).paginate(
            **kw, PaginationConfig={"PageSize": page_size} if page_size else {}
        )
    except BOTO_ERRORS as e:
        raise conn.error(e, what, prefix) from e


def objects(conn: Connection, prefix: str = "", *, page_size: int | None = None) -> Iterator[ObjectInfo]:
    """The objects under ``prefix`` (relative to the tier; checked by :func:`check_prefix` when
    the first one is asked for), in S3's key order, with size, mtime and ETag."""
    check_prefix(prefix)
    n = len(conn.prefix)
    for page in pages(conn, "list_objects_v2", prefix, page_size=page_size):
        for obj in page.get("Contents", ()):
            k = obj["Key"]
            if not k.startswith(conn.prefix) or k.endswith("/"):
                continue
            yield _info(k[n:], obj)


def one_level(conn: Connection, prefix: str = "", *, page_size: int | None = None) -> tuple[list[ObjectInfo], list[str]]:
    """The objects directly under ``prefix`` (``""`` or ending with ``/``) and the prefixes of the
    levels below it (``CommonPrefixes`` of ``Delimiter="/"``), tier-relative and sorted."""
    check_prefix(prefix)
    if prefix and not prefix.endswith("/"):
        raise ValueError(f"one_level takes a prefix ending with '/', not {prefix!r}")
    n = len(conn.prefix)
    files, dirs = [], []
    for page in pages(conn, "list_objects_v2", prefix, page_size=page_size, delimiter="/"):
        for obj in page.get("Contents", ()):
            k = obj["Key"]
            if not k.startswith(conn.prefix) or k.endswith("/"):
                continue
            files.append(_info(k[n:], obj))
        for cp in page.get("CommonPrefixes", ()):
            p = cp.get("Prefix") or ""
            if p.startswith(conn.prefix):
                dirs.append(p[n:])
    return sorted(files, key=lambda i: i.key), sorted(dirs)
