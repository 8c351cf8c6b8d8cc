"""The prefix rules every remote tier's URL shares (``SCHEME://BUCKET[/PREFIX]``), checked before
any request; each tier checks its own bucket/container name.

``PREFIX`` is parsed literally (not percent-decoded; ``?`` and ``#`` are ordinary characters) and
normalised: empty components are dropped (``a//b/`` is ``a/b/``), a non-empty prefix always ends in
``/``. Components may hold any printable Unicode except control characters and backslash, and
must not be ``.`` or ``..``; at most 512 UTF-8 bytes in all. Anything else raises
:class:`~ckptstore.errors.InvalidNameError`.
"""

from __future__ import annotations

from ..errors import InvalidNameError

MAX_PREFIX_BYTES = 512


def split_url(url: object, scheme: str, what: str) -> tuple[str, str]:
    """``"gs://bucket/a//b"`` → ``("bucket", "a/b/")`` for ``scheme="gs"``; ``what`` names the
    bucket in messages (``"bucket"``, ``"container"``). The bucket is not checked here."""
    head = f"{scheme}://"
    if not isinstance(url, str) or not url.startswith(head):
        raise InvalidNameError(f"remote must be a '{head}{what}/prefix' URL, got {url!r}")
    bucket, _, path = url[len(head):].partition("/")
    if not bucket:
        raise InvalidNameError(f"URL {url!r} has no {what} name; use '{head}{what}/prefix'")
    return bucket, normalise_prefix(path, url)


def normalise_prefix(path: str, url: str) -> str:
    """The prefix of ``path`` (see the module docstring), or :class:`InvalidNameError`."""
    parts = []
    for comp in path.split("/"):
        if not comp:
            continue
        if comp in (".", ".."):
            raise InvalidNameError(f"prefix in {url!r} must not contain a {comp!r} component")
        bad = [c for c in comp if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c == "\\"]
        if bad:
            raise InvalidNameError(
                f"prefix in {url!r} contains unsupported character {bad[0]!r} "
                "(control characters and backslash are not allowed)")
        try:
            comp.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidNameError(f"prefix in {url!r} is not valid Unicode") from None
        parts.append(comp)
    prefix = "/".join(parts) + "/" if parts else ""
    n = len(prefix.encode("utf-8"))
    if n > MAX_PREFIX_BYTES:
        raise InvalidNameError(f"prefix in {url!r} is {n} UTF-8 bytes; the limit is {MAX_PREFIX_BYTES}")
    return prefix


def check_listing_prefix(prefix: object) -> str:
    """``prefix`` if it can be listed (a str, no control characters, relative), else
    :class:`InvalidNameError`."""
    if not isinstance(prefix, str) or any(ord(c) < 0x20 for c in prefix) or prefix.startswith("/"):
        raise InvalidNameError(f"invalid listing prefix {prefix!r}")
    return prefix
