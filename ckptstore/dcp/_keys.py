"""Data keys (docs/FORMAT.md, "Terms": a fresh random 32-byte key per attempt, stored only wrapped by
the master key): the one place where the writer and the reader turn the master key into the
ciphers of a version — drawn and wrapped by the coordinator at plan time, unwrapped by every rank to
encrypt its frames, by the coordinator to seal the manifest, by readers to verify it and decrypt.
"""

from __future__ import annotations

from ..codec.crypto import FrameCipher, key_id, new_data_key, unwrap_key, wrap_key


class DataKeys:
    """This process's master key (32 bytes; None: nothing is encrypted) and the data keys it wraps."""

    def __init__(self, master: bytes | None) -> None:
        self.master = master

    def draw(self, version: str, attempt: str) -> tuple[str | None, str | None]:
        """A fresh data key for ``attempt`` of ``version``, as ``(wrapped key, key id)`` (the
        manifest's ``encryption``); ``(None, None)`` without a master key."""
        if self.master is None:
            return None, None
        return wrap_key(self.master, new_data_key(), version, attempt), key_id(self.master)

    def unwrap(self, wrapped: str, version: str, attempt: str, kid: str | None) -> bytes:
        """The data key of ``attempt`` of ``version`` (``KeyMismatchError``: another master key;
        ``IntegrityError``: the wrapped key does not authenticate)."""
        return unwrap_key(self.master, wrapped, version, attempt, kid)

    def cipher(self, wrapped: str, version: str, attempt: str, kid: str | None) -> FrameCipher:
        """The frame cipher of ``attempt`` of ``version`` (see :meth:`unwrap`)."""
        return FrameCipher(self.unwrap(wrapped, version, attempt, kid))


__all__ = ["DataKeys"]
