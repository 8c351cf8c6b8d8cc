"""Keys and AES-256-GCM for ckptstore (docs/FORMAT.md, Format rule 3).

* The *master key* (32 bytes) is given by the user (``key=`` bytes or a key provider, else
  ``CKPTSTORE_KEY`` = base64 of 32 bytes, else ``CKPTSTORE_KEY_FILE`` = a file holding 32 raw bytes
  or their base64). It is never written anywhere.
* Each save attempt draws a fresh random 32-byte *data key*; the manifest stores it wrapped
  (AES-256-GCM under the master key, associated data = format, version, attempt).
* The *key id* is ``HMAC-SHA256(master, "ckptstore key id v1")[:8]`` in hex: it tells which master
  key wrapped a version without revealing it.
* Or the master key lives in AWS KMS and never leaves it (:class:`ckptstore.KmsKey`,
  ``ckptstore/kms.py``): KMS generates each attempt's data key and unwraps it again, under an
  encryption context that binds it to the version and attempt (:func:`kms_context`); the manifest
  records the KMS ``CiphertextBlob`` as the wrapped key and the KMS key's ARN (``encryption.alg``
  ``AES-256-GCM/KMS``, docs/FORMAT.md "Manifest"). Frames and the manifest HMAC are the same either
  way. :class:`WrappedKey` is a wrapped data key as a manifest records it, :class:`RawKey` the
  32-byte master key behind the same interface as ``KmsKey`` (``draw``, ``wrap``, ``unwrap``,
  ``owns``, ``describe``).
* Frames use a random 96-bit nonce each (NIST SP 800-38D §8.2.2 random construction; with frames of
  ≥ 1 MiB a data key encrypts far fewer than 2^32 frames, so the collision bound holds).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import threading
import dataclasses
from typing import Any, Callable, Protocol, Union

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..errors import IntegrityError, KeyMismatchError

FORMAT = b"ckptstore/1"
NONCE = 12
TAG = 16

#: ``encryption.alg`` of a manifest whose data key is wrapped by a raw master key (AES-256-GCM), and
#: of one whose data key AWS KMS wrapped (docs/FORMAT.md, "Manifest"); frames are AES-256-GCM in both
ALG = "AES-256-GCM"
ALG_KMS = "AES-256-GCM/KMS"

#: Where a user of this process supplies the master key, as named in key error messages. The
#: library's own words; the ``ckptstore`` command line replaces it with its options.
KEY_SOURCES = "key=, CKPTSTORE_KEY or CKPTSTORE_KEY_FILE"
#: ... and an AWS KMS key (the command line: ``--kms-key``)
KMS_SOURCES = "key=ckptstore.KmsKey(...) or CKPTSTORE_KMS_KEY_ID"


class KeyProvider(Protocol):
    """Anything with ``get_key() -> bytes`` (32 bytes). Must be picklable for PROCESS saves."""

    def get_key(self) -> bytes: ...


KeyArg = Union[bytes, bytearray, KeyProvider, Callable[[], bytes], None]


class EnvKey:
    """The default provider: ``CKPTSTORE_KEY`` (base64) or ``CKPTSTORE_KEY_FILE``."""

    def get_key(self) -> bytes | None:
        v = os.environ.get("CKPTSTORE_KEY")
        if v:
            return _decode_key_text(v, "CKPTSTORE_KEY")
        p = os.environ.get("CKPTSTORE_KEY_FILE")
        if p:
            return load_key_file(p)
        return None


def load_key_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise KeyMismatchError(f"cannot read key file {path!r}: {e.strerror}") from None
    if len(data) == 32:
        return data
    return _decode_key_text(data.decode("ascii", "replace").strip(), f"key file {path!r}")


def _decode_key_text(text: str, where: str) -> bytes:
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except Exception:
        raise KeyMismatchError(f"{where} is not valid base64") from None
    if len(key) != 32:
        raise KeyMismatchError(f"{where} decodes to {len(key)} bytes; a key is 32 bytes (AES-256)")
    return key


def key_or_file(key: Any, key_file: Any) -> Any:
    """The ``key=`` to use when a constructor was given ``key`` and/or ``key_file`` (a path to a key
    file: 32 raw bytes or their base64 on one line, what ``ckptstore keygen`` writes; ``~`` expanded).
    Raises ``ValueError`` when both are given, :class:`KeyMismatchError` for a file that cannot be
    read or holds no key."""
    if key_file is None:
        return key
    if key is not None:
        raise ValueError("give key= or key_file=, not both")
    return load_key_file(os.path.expanduser(os.fspath(key_file)))


def resolve_key(key: Any) -> bytes | None:
    """Turn the ``key=`` argument into 32 bytes (or None: no encryption)."""
    if key is None:
        return EnvKey().get_key()
    if isinstance(key, (bytes, bytearray, memoryview)):
        kb = bytes(key)
    elif hasattr(key, "get_key"):
        kb = key.get_key()
    elif callable(key):
        kb = key()
    else:
        raise KeyMismatchError(f"key must be 32 bytes or a key provider, got {type(key).__name__}")
    if kb is None:
        return None
    if not isinstance(kb, (bytes, bytearray)) or len(kb) != 32:
        raise KeyMismatchError("a master key must be exactly 32 bytes (AES-256)")
    return bytes(kb)


def key_id(master: bytes) -> str:
    return hmac.new(master, b"ckptstore key id v1", hashlib.sha256).hexdigest()[:16]


def new_data_key() -> bytes:
    return secrets.token_bytes(32)


def _wrap_aad(version: str, attempt: str) -> bytes:
    return b"|".join([FORMAT, b"wrap", version.encode(), attempt.encode()])


def wrap_key(master: bytes, data_key: bytes, version: str, attempt: str) -> str:
    nonce = secrets.token_bytes(NONCE)
    ct = AESGCM(master).encrypt(nonce, data_key, _wrap_aad(version, attempt))
    return base64.b64encode(nonce + ct).decode()


def unwrap_key(master: bytes, wrapped: str, version: str, attempt: str, expected_id: str | None) -> bytes:
    if expected_id is not None and key_id(master) != expected_id:
        raise KeyMismatchError(
            f"version {version!r} was encrypted with master key id {expected_id}, but the key "
            f"given has id {key_id(master)}; supply the right key ({KEY_SOURCES})"
        )
    try:
        blob = base64.b64decode(wrapped, validate=True)
        return AESGCM(master).decrypt(blob[:NONCE], blob[NONCE:], _wrap_aad(version, attempt))
    except (InvalidTag, ValueError, TypeError):
        raise IntegrityError(
            f"the wrapped data key of version {version!r} does not authenticate under the given master "
            "key: the manifest is damaged or the key is wrong"
        ) from None


def kms_key_id(arn: str) -> str:
    """The manifest's ``key_id`` of a data key wrapped by the AWS KMS key ``arn``: the first 8 bytes
    of ``SHA-256("ckptstore kms key id v1|" + arn)`` in hex (the ARN itself is in ``encryption.kms``)."""
    return hashlib.sha256(b"ckptstore kms key id v1|" + arn.encode()).hexdigest()[:16]


def kms_context(version: str, attempt: str) -> dict[str, str]:
    """The KMS encryption context of the data key of ``attempt`` of ``version``: KMS binds the
    ``CiphertextBlob`` to it (``GenerateDataKey``/``Encrypt``) and refuses to ``Decrypt`` it under any
    other, as the AES-GCM associated data does for a raw master key (docs/FORMAT.md, "Manifest").
    Not secret: CloudTrail logs it with every request."""
    return {"ckptstore:format": FORMAT.decode(), "ckptstore:version": version, "ckptstore:attempt": attempt}


@dataclasses.dataclass(frozen=True)
class WrappedKey:
    """A data key as a manifest records it (``encryption``, or a reference's fields):
    ``wrapped_key`` (base64), ``key_id`` (16 hex digits) and, when AWS KMS wrapped it,
    ``kms_key_arn`` (then ``wrapped_key`` is the KMS ``CiphertextBlob``)."""

    wrapped_key: str
    key_id: str
    kms_key_arn: str | None = None

    @property
    def alg(self) -> str:
        return ALG if self.kms_key_arn is None else ALG_KMS

    def describe(self) -> str:
        """Which key wrapped it, in words (for messages)."""
        if self.kms_key_arn is not None:
            return f"AWS KMS key {self.kms_key_arn}"
        return f"master key id {self.key_id}"

    def encryption(self) -> dict:
        """The manifest's ``encryption`` object."""
        enc = {"alg": self.alg, "key_id": self.key_id, "wrapped_key": self.wrapped_key}
        if self.kms_key_arn is not None:
            enc["kms"] = {"key_arn": self.kms_key_arn}
        return enc

    @classmethod
    def of_encryption(cls, enc: dict) -> "WrappedKey":
        """From a parsed manifest's ``encryption`` object."""
        return cls(enc["wrapped_key"], enc["key_id"], (enc.get("kms") or {}).get("key_arn"))

    @classmethod
    def of(cls, ref) -> "WrappedKey | None":
        """From anything with ``wrapped_key``/``key_id``/``kms_key_arn`` (a reference, plan data);
        None when it carries no wrapped key (not encrypted)."""
        if getattr(ref, "wrapped_key", None) is None:
            return None
        return cls(ref.wrapped_key, ref.key_id, getattr(ref, "kms_key_arn", None))


class RawKey:
    """A raw 32-byte master key (``key=`` bytes, ``CKPTSTORE_KEY``, ``CKPTSTORE_KEY_FILE``) behind
    the interface :class:`ckptstore.KmsKey` also has: every data key is wrapped here, with AES-256-GCM
    (:func:`wrap_key`/:func:`unwrap_key`)."""

    kind = "raw"

    def __init__(self, master: bytes) -> None:
        self.master = bytes(master)
        self.key_id = key_id(self.master)

    @property
    def key_id_hex(self) -> str:
        """The manifest's ``key_id`` of versions this key wraps."""
        return self.key_id

    def __repr__(self) -> str:
        return f"RawKey(key id {self.key_id})"

    def describe(self) -> str:
        return f"master key id {self.key_id}"

    def draw(self, version: str, attempt: str) -> tuple[bytes, WrappedKey]:
        """A fresh data key for ``attempt`` of ``version`` and its wrapping."""
        dk = new_data_key()
        return dk, self.wrap(dk, version, attempt)

    def wrap(self, data_key: bytes, version: str, attempt: str) -> WrappedKey:
        return WrappedKey(wrap_key(self.master, data_key, version, attempt), self.key_id)

    def owns(self, w: WrappedKey) -> bool:
        """``w`` was wrapped by this key."""
        return w.kms_key_arn is None and w.key_id == self.key_id

    def unwrap(self, w: WrappedKey, version: str, attempt: str, *, cached: bool = True) -> bytes:
        """The data key ``w`` wraps (:class:`KeyMismatchError`: another key; :class:`IntegrityError`:
        it does not authenticate). ``cached``: as :meth:`ckptstore.KmsKey.unwrap` takes it (nothing
        is cached here: unwrapping is local)."""
        if w.kms_key_arn is not None:
            raise KeyMismatchError(
                f"version {version!r} was encrypted with the AWS KMS key {w.kms_key_arn}, but a raw master key "
                f"(id {self.key_id}) was given; supply that KMS key ({KMS_SOURCES})")
        return unwrap_key(self.master, w.wrapped_key, version, attempt, w.key_id)


def manifest_mac_key(data_key: bytes) -> bytes:
    return hmac.new(data_key, b"ckptstore manifest mac v1", hashlib.sha256).digest()


def manifest_mac(data_key: bytes, body: bytes) -> str:
    return hmac.new(manifest_mac_key(data_key), body, hashlib.sha256).hexdigest()


_tls = threading.local()
_SCRATCH_MAX = 16 << 20


def _scratch(nbytes: int):
    """This thread's reusable output buffer of at least ``nbytes`` (fresh memory for every frame
    costs first-touch page faults: measured 0.94 vs 2.09 GB/s for AES-GCM on 1.4 MB frames)."""
    buf = getattr(_tls, "buf", None)
    if buf is None or len(buf) < nbytes:  # grown in whole MiB: frames differ by a few bytes
        buf = _tls.buf = bytearray(-(-nbytes // (1 << 20)) << 20)
    return buf


class FrameCipher:
    """AES-256-GCM with one data key. Thread-safe.

    Frames go through the streaming ``Cipher(...).encryptor().update_into`` API rather than
    ``AESGCM.encrypt``: it writes into a buffer we allocate and releases the GIL, so frames encrypt
    in parallel on every encoder thread (measured here on 2 MiB frames, 2 threads: 3.5 GB/s vs
    0.9 GB/s for the one-shot call). The output is identical: ``nonce ‖ ciphertext ‖ tag``.
    """

    def __init__(self, data_key: bytes):
        self._key = bytes(data_key)
        self._alg = algorithms.AES(self._key)

    def encrypt(self, data, aad: bytes):
        """``nonce ‖ ciphertext ‖ tag`` of ``data`` (a byte memoryview)."""
        data = memoryview(data).cast("B")
        return self.encrypt_parts([data], len(data), aad)

    def encrypt_parts(self, parts: list, total: int, aad: bytes):
        """:meth:`encrypt` of the concatenation of ``parts`` (bytes-likes whose lengths sum to
        ``total``) without joining them first: each part is encrypted straight into the output."""
        nonce = secrets.token_bytes(NONCE)
        enc = Cipher(self._alg, modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(aad)
        # update_into wants len(part) + block - 1 of room; fresh memory that is not zeroed first (every
        # byte returned is written below: a bytearray's zero fill cost ~3 % of a save's CPU)
        mv = memoryview(np.empty(NONCE + total + TAG + 15, np.uint8)).cast("B")
        mv[:NONCE] = nonce
        pos = NONCE
        for p in parts:
            p = memoryview(p).cast("B")
            if len(p):
                pos += enc.update_into(p, mv[pos:])
        enc.finalize()
        mv[pos : pos + TAG] = enc.tag
        return mv[: pos + TAG]

    def decrypt(self, blob, aad: bytes, what: str, scratch: bool = False, out=None):
        """Authenticate and decrypt ``nonce ‖ ciphertext ‖ tag``; returns the plaintext as a byte
        memoryview. With ``scratch`` it lies in this thread's reusable buffer (up to 16 MiB), valid
        until the thread decrypts again: for a caller that decodes it further at once (a frame
        whose chain has stages before ``aesgcm/1``). With ``out`` (a writable byte buffer of exactly
        the plaintext's length: a destination tensor's memory) it is decrypted straight there and
        ``out`` is returned; the tag is checked at the end, so when it fails ``out`` holds
        unauthenticated bytes and the caller must treat it as garbage (the load fails).
        Raises :class:`IntegrityError`."""
        if len(blob) < NONCE + TAG:
            raise IntegrityError(f"{what}: encrypted payload too short", object=what)
        mv = memoryview(blob).cast("B")
        n = len(mv) - NONCE - TAG
        dec = Cipher(self._alg, modes.GCM(bytes(mv[:NONCE]), bytes(mv[NONCE + n :]))).decryptor()
        dec.authenticate_additional_data(aad)
        if out is not None:
            return self._decrypt_into(dec, mv[NONCE : NONCE + n], out, what)
        out = _scratch(n + 15) if scratch and n <= _SCRATCH_MAX else bytearray(n + 15)
        try:
            written = dec.update_into(mv[NONCE : NONCE + n], out) if n else 0
            dec.finalize()
        except InvalidTag:
            raise IntegrityError(
                f"{what}: AES-GCM authentication failed (data altered, moved between objects or "
                "versions, or a different key)",
                object=what,
            ) from None
        return memoryview(out)[:written]

    @staticmethod
    def _decrypt_into(dec, ct: memoryview, out, what: str):
        """``update_into`` wants ``len(data) + 15`` bytes of room: all but the last 32 bytes of the
        ciphertext are decrypted straight into ``out``, the tail through a small buffer."""
        out = memoryview(out).cast("B")
        n = len(ct)
        if len(out) != n:
            raise ValueError(f"out holds {len(out)} bytes, the plaintext {n}")
        head = max(0, n - 32)
        tail = bytearray(n - head + 15)
        try:
            pos = dec.update_into(ct[:head], out) if head else 0
            # GCM is a stream mode: the library writes every byte it is given (checked, not assumed)
            w = dec.update_into(ct[head:], tail) if n > head else 0
            if pos != head or w != n - head:
                raise IntegrityError(f"{what}: AES-GCM wrote {pos + w} of {n} bytes", object=what)
            out[head:n] = tail[:w]
            dec.finalize()
        except InvalidTag:
            raise IntegrityError(
                f"{what}: AES-GCM authentication failed (data altered, moved between objects or "
                "versions, or a different key)",
                object=what,
            ) from None
        return out
