"""Data keys (docs/FORMAT.md, "Terms": a fresh random 32-byte key per attempt, stored only wrapped by
the master key): the one place where the writer and the reader turn the master key into the
ciphers of a version — drawn and wrapped by the coordinator at plan time, unwrapped by every rank to
encrypt its frames, by the coordinator to seal the manifest, by readers to verify it and decrypt.

The master key is a raw key or an AWS KMS key (:mod:`ckptstore.keys`); which one is the master
key's business (``draw``/``unwrap``), not this stage's.
"""

from __future__ import annotations

from ..codec.crypto import FrameCipher, RawKey, WrappedKey


class DataKeys:
    """This process's master key (:class:`~ckptstore.codec.crypto.RawKey` or :class:`ckptstore.KmsKey`;
    None: nothing is encrypted) and the data keys it wraps."""

    def __init__(self, master) -> None:
        self.master = master

    @property
    def given(self):
        """The master key as ``key=`` takes it again (32 bytes, or the ``KmsKey``), or None."""
        m = self.master
        return m.master if isinstance(m, RawKey) else m

    def draw(self, version: str, attempt: str) -> WrappedKey | None:
        """A fresh data key for ``attempt`` of ``version``, wrapped (the manifest's ``encryption``);
        None without a master key. With KMS the coordinator keeps the data key it was given, so
        its own unwraps of this attempt ask KMS nothing."""
        if self.master is None:
            return None
        return self.master.draw(version, attempt)[1]

    def unwrap(self, w: WrappedKey, version: str, attempt: str) -> bytes:
        """The data key of ``attempt`` of ``version`` (``KeyMismatchError``: another master key;
        ``IntegrityError``: the wrapped key does not authenticate; ``KeyServiceError``: KMS refused
        or did not answer)."""
        return self.master.unwrap(w, version, attempt)

    def cipher(self, w: WrappedKey, version: str, attempt: str) -> FrameCipher:
        """The frame cipher of ``attempt`` of ``version`` (see :meth:`unwrap`)."""
        return FrameCipher(self.unwrap(w, version, attempt))


__all__ = ["DataKeys"]
