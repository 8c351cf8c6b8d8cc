"""``s3://BUCKET[/PREFIX]``: the URL of a remote tier, checked before any request is made.

``s3://BUCKET[/PREFIX]`` is parsed literally: it is *not* percent-decoded, and ``?`` or ``#`` are
ordinary characters (``s3://b/a%20b`` means the prefix ``a%20b/``, as with the AWS CLI).

* ``BUCKET`` must be a valid S3 bucket name: 3–63 characters from ``[a-z0-9.-]``, starting and
  ending with a letter or digit, no ``..``, ``.-`` or ``-.``, not shaped like an IP address, and
  without the reserved ``xn--``/``sthree-`` prefixes or ``-s3alias``/``--ol-s3``/``.mrap``/
  ``--x-s3`` suffixes. Buckets with dots are allowed; they are addressed path-style.
* ``PREFIX`` is normalised: empty components are dropped, so leading, trailing and repeated
  slashes do not matter — ``s3://b/runs``, ``s3://b/runs/`` and ``s3://b//runs//`` all mean the
  prefix ``runs/`` (objects under ``runs//x`` written by other tools are not reachable). A
  non-empty prefix always ends in ``/``, so ``s3://b/exp1`` never sees ``exp10/...``.
* Prefix components may contain any printable Unicode (spaces, ``+``, ``%``, ``#``, ``[``…)
  except: control characters, backslash (some servers turn it into ``/``), and the components
  ``.`` / ``..`` (HTTP stacks may collapse them). At most 512 UTF-8 bytes. Anything else raises
  :class:`~ckptstore.errors.InvalidNameError` at construction, before any request is made.
"""

from __future__ import annotations

import ipaddress
import re

from ...errors import InvalidNameError

MAX_PREFIX_BYTES = 512

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_BAD_BUCKET_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_BAD_BUCKET_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")


def _check_bucket(bucket: str, url: str) -> None:
    why = None
    if not _BUCKET_RE.match(bucket):
        why = (
            "must be 3-63 characters of lowercase letters, digits, '.' and '-', "
            "starting and ending with a letter or digit"
        )
    elif ".." in bucket or ".-" in bucket or "-." in bucket:
        why = "must not contain '..', '.-' or '-.'"
    elif bucket.startswith(_BAD_BUCKET_PREFIXES) or bucket.endswith(_BAD_BUCKET_SUFFIXES):
        why = "uses a prefix or suffix reserved by S3"
    else:
        try:
            ipaddress.IPv4Address(bucket)
            why = "must not be formatted as an IP address"
        except ValueError:
            pass
    if why:
        raise InvalidNameError(f"invalid S3 bucket name {bucket!r} in {url!r}: {why}")


def parse_s3_url(url: object) -> tuple[str, str]:
    """``"s3://bucket/a//b"`` → ``("bucket", "a/b/")``; raises :class:`InvalidNameError`.

    See the module docstring for the rules.
    """
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise InvalidNameError(f"remote must be an 's3://bucket/prefix' URL, got {url!r}")
    bucket, _, path = url[len("s3://"):].partition("/")
    if not bucket:
        raise InvalidNameError(f"S3 URL {url!r} has no bucket name; use 's3://bucket/prefix'")
    _check_bucket(bucket, url)
    parts = []
    for comp in path.split("/"):
        if not comp:
            continue
        if comp in (".", ".."):
            raise InvalidNameError(f"S3 prefix in {url!r} must not contain a {comp!r} component")
        bad = [c for c in comp if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c == "\\"]
        if bad:
            raise InvalidNameError(
                f"S3 prefix in {url!r} contains unsupported character {bad[0]!r} "
                "(control characters and backslash are not allowed)"
            )
        try:
            comp.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidNameError(f"S3 prefix in {url!r} is not valid Unicode") from None
        parts.append(comp)
    prefix = "/".join(parts) + "/" if parts else ""
    if len(prefix.encode("utf-8")) > MAX_PREFIX_BYTES:
        n = len(prefix.encode("utf-8"))
        raise InvalidNameError(
            f"S3 prefix in {url!r} is {n} UTF-8 bytes; the limit is {MAX_PREFIX_BYTES}"
        )
    return bucket, prefix
