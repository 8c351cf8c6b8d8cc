"""Key layout shared by every tier (docs/FORMAT.md, "Layout")::

    versions/<enc(version)>/manifest.json                 commit point (put-if-absent)
    versions/<enc(version)>/pinned                         retention pin (optional)
    versions/<enc(version)>/damaged.json                   scrub's damage mark (optional)
    versions/<enc(version)>/attempts/<attempt>/r00000.ckd  rank 0's shard object (frames)
    versions/<enc(version)>/attempts/<attempt>/metadata.ckd  pickled DCP Metadata (frames)
    versions/<enc(version)>/attempts/<attempt>/uploaded.r00000.json  rank 0 finished its upload (S3)
"""

from __future__ import annotations

import datetime as _dt
import os
import secrets

from .._names import decode_version, encode_version

VERSIONS = "versions"
MANIFEST = "manifest.json"
PINNED = "pinned"
DAMAGED = "damaged.json"
METADATA_OBJECT = "metadata.ckd"


def version_dir(version: str) -> str:
    return f"{VERSIONS}/{encode_version(version)}"


def manifest_key(version: str) -> str:
    return f"{version_dir(version)}/{MANIFEST}"


def object_key(version: str, name: str) -> str:
    return f"{version_dir(version)}/{name}"


def pin_key(version: str) -> str:
    return f"{version_dir(version)}/{PINNED}"


def damaged_key(version: str) -> str:
    return f"{version_dir(version)}/{DAMAGED}"


def shard_name(attempt: str, rank: int) -> str:
    return f"attempts/{attempt}/r{rank:05d}.ckd"


def metadata_name(attempt: str) -> str:
    return f"attempts/{attempt}/{METADATA_OBJECT}"


def new_attempt() -> str:
    """Unique per save attempt: UTC time (sortable) + 48 random bits + pid."""
    t = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{t}-{secrets.token_hex(6)}-{os.getpid() % 100000:05d}"


def version_of_key(key: str) -> str | None:
    """The version whose directory holds ``key`` (None if outside ``versions/``)."""
    parts = key.split("/")
    if len(parts) < 3 or parts[0] != VERSIONS:
        return None
    try:
        return decode_version(parts[1])
    except Exception:
        return None
