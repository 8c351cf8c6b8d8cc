"""The master key of a process, whichever kind: a raw 32-byte key (:class:`ckptstore.codec.crypto.RawKey`)
or a key in AWS KMS (:class:`ckptstore.KmsKey`). Both wrap and unwrap data keys through one
interface — ``draw(version, attempt)``, ``wrap``, ``unwrap(wrapped, version, attempt)``, ``owns``,
``describe()`` — which the writer, the reader, scrub and rekey use without asking which kind it is
(docs/FORMAT.md, "Manifest" ``encryption``).

Where the key comes from (:func:`resolve_master`): ``key=`` — 32 bytes, a key provider (``get_key()``
or a callable returning 32 bytes), a ``KmsKey``, or ``"kms://<key id, key ARN, alias or alias ARN>"`` —
else the environment: ``CKPTSTORE_KEY`` (base64 of 32 bytes), ``CKPTSTORE_KEY_FILE``, or
``CKPTSTORE_KMS_KEY_ID`` (an AWS KMS key id, key ARN, alias or alias ARN). A raw key and a KMS key
both in the environment are refused rather than one chosen silently.
"""

from __future__ import annotations

import os
from typing import Any

from .codec.crypto import RawKey, resolve_key
from .errors import KeyMismatchError
from .kms import URL_PREFIX, KmsKey, shared

#: the environment variable naming an AWS KMS key
KMS_ENV = "CKPTSTORE_KMS_KEY_ID"


def resolve_master(key: Any) -> RawKey | KmsKey | None:
    """The master key ``key=`` names (None: the environment's, or no encryption when it names none).

    Raises :class:`KeyMismatchError` for a key that cannot be read or decoded, however given."""
    if key is None:
        return from_env()
    if isinstance(key, (RawKey, KmsKey)):
        return key
    if isinstance(key, str):
        if key.startswith(URL_PREFIX):
            return shared(key)
        raise KeyMismatchError(f"key must be 32 bytes, a key provider or 'kms://<AWS KMS key id>', got a string {key[:24]!r}")
    raw = resolve_key(key)
    return None if raw is None else RawKey(raw)


def from_env() -> RawKey | KmsKey | None:
    """``CKPTSTORE_KEY``, ``CKPTSTORE_KEY_FILE`` or ``CKPTSTORE_KMS_KEY_ID`` (None: none is set)."""
    kms_id = os.environ.get(KMS_ENV)
    if kms_id:
        raw_set = [v for v in ("CKPTSTORE_KEY", "CKPTSTORE_KEY_FILE") if os.environ.get(v)]
        if raw_set:
            raise KeyMismatchError(f"both {KMS_ENV} and {' and '.join(raw_set)} are set: one store has one master key; "
                                   "unset the one not meant")
        return shared(kms_id)
    raw = resolve_key(None)
    return None if raw is None else RawKey(raw)


__all__ = ["KMS_ENV", "from_env", "resolve_master"]
