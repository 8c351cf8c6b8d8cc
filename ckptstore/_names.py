"""Validation and encoding of version names and object keys (docs/FORMAT.md, Format rule 4).

Version names are arbitrary Unicode strings (no control characters, at most 200 UTF-8 bytes, not
``.`` or ``..``). On disk and in object stores they are percent-encoded into one path component with the
alphabet ``[A-Za-z0-9._-]``, so a name can never introduce a separator or a traversal, and the
name listed back is the exact string that was given. Object keys inside a tier are ``/``-joined
components of that same alphabet, plus ``%`` for encoded version names.
"""

from __future__ import annotations

import functools
import re
import urllib.parse

from .errors import InvalidNameError

MAX_VERSION_BYTES = 200
_SAFE = "-._"  # plus ASCII letters and digits, which quote() never encodes
_COMPONENT = re.compile(r"^[A-Za-z0-9._%-]{1,255}$")
_ATTEMPT = re.compile(r"^[A-Za-z0-9-]{1,64}$")
_OBJECT_FILE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: the directory of a version's attempts: object names are ``attempts/<attempt>/<file>``
#: (docs/FORMAT.md, "Layout by example"); :mod:`ckptstore.manifest.layout` builds its keys with it
ATTEMPTS = "attempts"


def check_version(name: object) -> str:
    """Return ``name`` if it is a valid version name, else raise :class:`InvalidNameError`."""
    if isinstance(name, bytes) or not isinstance(name, str):
        raise InvalidNameError(
            f"version name must be a str, got {type(name).__name__}: {name!r}"
        )
    if name in ("", ".", ".."):
        raise InvalidNameError(f"version name {name!r} is not allowed; use e.g. 'step-100'")
    if _CONTROL.search(name):
        raise InvalidNameError(f"version name {name!r} contains control characters")
    if len(name.encode("utf-8")) > MAX_VERSION_BYTES:
        raise InvalidNameError(
            f"version name is {len(name.encode('utf-8'))} UTF-8 bytes; the limit is {MAX_VERSION_BYTES}"
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidNameError(f"version name {name!r} is not valid Unicode: {e}") from None
    return name


def encode_version(name: str) -> str:
    """Percent-encode a version name into one safe path component (reversible)."""
    if type(name) is not str:
        check_version(name)  # raises
    return _encode(name)


# names and components are encoded and decoded for every key a listing, a retention pass or a
# manifest check builds (thousands per commit): each distinct string is worked out once
@functools.lru_cache(maxsize=1 << 14)
def _encode(name: str) -> str:
    check_version(name)
    enc = urllib.parse.quote(name, safe=_SAFE)
    if enc.startswith("."):  # '.hidden' names: keep them visible and unambiguous
        enc = "%2E" + enc[1:]
    return enc


def decode_version(component: str) -> str:
    """The version name a path component encodes (:func:`encode_version`'s inverse); raises
    :class:`InvalidNameError` for anything that is not the canonical encoding of a valid name."""
    if type(component) is not str:
        raise InvalidNameError(f"not an encoded version name: {component!r}")
    return _decode(component)


@functools.lru_cache(maxsize=1 << 14)
def _decode(component: str) -> str:
    if not _COMPONENT.match(component):
        raise InvalidNameError(f"not an encoded version name: {component!r}")
    try:
        name = urllib.parse.unquote(component, errors="strict")
    except UnicodeDecodeError:
        raise InvalidNameError(f"not an encoded version name (bad UTF-8): {component!r}") from None
    check_version(name)
    if encode_version(name) != component:
        raise InvalidNameError(f"not the canonical encoding of a version name: {component!r}")
    return name


def check_attempt(attempt: object) -> str:
    if not isinstance(attempt, str) or not _ATTEMPT.match(attempt):
        raise InvalidNameError(f"invalid attempt id {attempt!r}")
    return attempt


def check_object_name(name: object) -> str:
    """An object name inside a version: ``attempts/<attempt>/<file>``; anything else is refused."""
    if not isinstance(name, str):
        raise InvalidNameError(f"object name must be a string, got {type(name).__name__}")
    parts = name.split("/")
    if len(parts) != 3 or parts[0] != ATTEMPTS:
        raise InvalidNameError(f"object name {name!r} is outside the layout 'attempts/<attempt>/<file>'")
    check_attempt(parts[1])
    if not _OBJECT_FILE.match(parts[2]) or parts[2] in (".", ".."):
        raise InvalidNameError(f"object name {name!r} has an invalid file component")
    return name


def check_key(key: object) -> str:
    """A tier key: relative, '/'-separated, each component from the safe alphabet."""
    if type(key) is not str or not key:
        raise InvalidNameError(f"invalid object key {key!r}")
    return _check_key(key)


@functools.lru_cache(maxsize=1 << 14)  # every tier call checks its key: a root's keys recur at every save
def _check_key(key: str) -> str:
    for part in key.split("/"):
        if part in ("", ".", "..") or not _COMPONENT.match(part):
            raise InvalidNameError(f"invalid object key {key!r} (component {part!r})")
    return key
