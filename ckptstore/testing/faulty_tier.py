"""A tier wrapper that injects storage errors, for tests of what callers do with them.

``FaultyTier(inner, fail={"get": ("versions/v2/manifest.json", TransientStorageError)})`` behaves
like ``inner`` except that ``get`` of a key matching the pattern (an exact key, or a callable
``key -> bool``) raises the exception (class or instance) — every time, or the first ``times``
times. ``calls`` counts the failures raised. Everything else (``local_path``, multipart uploads,
``name``, ``url``) is the inner tier's.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

from ..errors import TransientStorageError
from ..tiers.base import ObjectInfo, ObjectWriter, Tier

Match = str | Callable[[str], bool]


class FaultyTier(Tier):
    """``inner`` with injected failures. ``fail``: ``{operation: (key pattern, exception)}`` for the
    operations ``get``, ``stat``, ``list``, ``put``, ``put_if_absent``, ``delete``; ``times``: how
    many failures per operation (None: every matching call fails)."""

    def __init__(self, inner: Tier, fail: Mapping[str, tuple[Match, BaseException | type]] | None = None,
                 *, times: int | None = None):
        self.inner = inner
        self.fail = dict(fail or {})
        self.times = times
        self.calls: dict[str, int] = {}
        self.name = inner.name
        self.url = inner.url

    @classmethod
    def transient_get(cls, inner: Tier, key: Match, **kw) -> "FaultyTier":
        """``inner`` whose ``get(key)`` raises :class:`TransientStorageError` (as the S3 tier does
        once botocore's retries are spent)."""
        return cls(inner, {"get": (key, TransientStorageError(f"injected: S3 GET {key} failed after retries: 503 SlowDown"))}, **kw)

    def _check(self, op: str, key: str) -> None:
        spec = self.fail.get(op)
        if spec is None:
            return
        match, exc = spec
        hit = match(key) if callable(match) else (key == match or (op == "list" and key.startswith(match)))
        if not hit or (self.times is not None and self.calls.get(op, 0) >= self.times):
            return
        self.calls[op] = self.calls.get(op, 0) + 1
        raise exc() if isinstance(exc, type) else exc

    def get(self, key, start=None, end=None) -> bytes:
        self._check("get", key)
        return self.inner.get(key, start, end)

    def get_ranges(self, key, ranges):
        self._check("get", key)
        return self.inner.get_ranges(key, ranges)

    def put(self, key, data) -> None:
        self._check("put", key)
        self.inner.put(key, data)

    def put_if_absent(self, key, data) -> None:
        self._check("put_if_absent", key)
        self.inner.put_if_absent(key, data)

    def open_writer(self, key) -> ObjectWriter:
        return self.inner.open_writer(key)

    def stat(self, key) -> ObjectInfo:
        self._check("stat", key)
        return self.inner.stat(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self._check("list", prefix)
        return self.inner.list(prefix)

    def list_dir(self, prefix: str = ""):
        self._check("list", prefix)
        return self.inner.list_dir(prefix)

    def delete(self, key) -> None:
        self._check("delete", key)
        self.inner.delete(key)

    def put_file(self, key, path, size=None) -> None:
        self._check("put", key)
        self.inner.put_file(key, path, size)

    def get_file(self, key, path) -> None:
        self._check("get", key)
        self.inner.get_file(key, path)

    def local_path(self, key: str) -> str | None:
        return self.inner.local_path(key)

    def close(self) -> None:
        self.inner.close()

    @property
    def listing_md5(self) -> bool:  # a declared capability of the inner tier
        return self.inner.listing_md5

    def __getattr__(self, attr):  # optional features of the inner tier (multipart uploads, ...)
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)
