"""AWS KMS as the master key: envelope encryption (docs/FORMAT.md, "Manifest" ``encryption``, "Threat model").

``ckptstore.KmsKey(key_id)`` (also ``key="kms://<key id>"``, ``CKPTSTORE_KMS_KEY_ID``, the command
line's ``--kms-key``) is a master key that never leaves KMS:

* **save** — the coordinator asks KMS for each attempt's data key: ``GenerateDataKey`` with
  ``KeySpec=AES_256`` and the encryption context of the version and attempt
  (:func:`ckptstore.codec.crypto.kms_context`). KMS returns the key twice, in the clear
  (``Plaintext``, used in memory only) and wrapped (``CiphertextBlob``), which the manifest records
  with the KMS key's ARN (``encryption.alg`` ``AES-256-GCM/KMS``). Every other rank gets the data key
  from the wrapped copy in its plan with ``Decrypt``; frames and the manifest HMAC use it exactly as
  with a raw master key.
* **load, scrub --deep** — ``Decrypt`` of the ``CiphertextBlob`` under the same encryption context
  (and the KMS key as ``KeyId``). KMS refuses a blob moved to another version or attempt.
* **rekey** — ``Encrypt`` of the data key under the new key: rekey holds the data key anyway, to
  verify the manifest's HMAC before and to seal it again after (the HMAC is keyed from the data key),
  so ``ReEncrypt`` would keep nothing more inside KMS; ``Encrypt`` works the same from a raw key, needs
  only ``kms:Encrypt`` on the new key, and the new wrapping is checked with a ``Decrypt`` before any
  manifest is replaced (which also proves the caller may decrypt under the new key).

**Calls.** A :class:`KmsKey` keeps every data key it generated or unwrapped (per wrapped key,
version and attempt; the newest 1,024) for its lifetime, so each is asked for once per process: a
save costs one ``GenerateDataKey`` (the coordinator) plus one ``Decrypt`` per other rank; a load one
``Decrypt`` per rank, plus one per earlier version its items reference. Before its first request a
``KmsKey`` reads the key's state once (``DescribeKey``: exists, enabled, a symmetric encryption
key; its ARN), so a disabled key or a key pending deletion is named before anything is written; a
caller without ``kms:DescribeKey`` skips that check (KMS still refuses such a key at the crypto
request). A data key already in memory stays usable after the KMS key is disabled, until the
process ends. ``key="kms://…"`` and ``CKPTSTORE_KMS_KEY_ID`` give one shared ``KmsKey`` per
process and key (:func:`shared`), so readers made one after another share its data keys.

**Client.** One botocore KMS client per process (made on first use, re-made after a fork, shared by
threads), from the standard chain: region (``region=``, else the region of a key ARN, else
``AWS_REGION``/``AWS_DEFAULT_REGION``/the profile), endpoint (``endpoint_url=``, else
``AWS_ENDPOINT_URL_KMS``/``AWS_ENDPOINT_URL``), credentials (environment, profile, instance role).
Retries are botocore's (``retry_mode``/``max_attempts``, else ``AWS_RETRY_MODE``/``AWS_MAX_ATTEMPTS``,
else its ``standard`` mode, 3 attempts); there are none of our own. Errors are translated once, here,
by KMS error code (never by message text): :class:`~ckptstore.errors.KeyServiceUnavailableError`
(no answer, throttling, KMS internal errors, after the retries), :class:`~ckptstore.errors.KeyMismatchError`
(a version wrapped by another key), :class:`~ckptstore.errors.IntegrityError` (``InvalidCiphertextException``:
the wrapped key or its context was altered), :class:`~ckptstore.errors.KeyServiceError` (everything
else: not found, disabled, pending deletion, access denied, no credentials). None of them marks,
skips or deletes anything (docs/FORMAT.md, Read rule 5); a save that meets one has written
nothing (docs/FORMAT.md, Save rule 10).
"""

from __future__ import annotations

import base64
import collections
import logging
import os
import threading

from .codec.crypto import KMS_SOURCES, WrappedKey, kms_context, kms_key_id
from .errors import IntegrityError, KeyMismatchError, KeyServiceError, KeyServiceUnavailableError

log = logging.getLogger("ckptstore")

#: the prefix of a KMS key given as a string: ``key="kms://alias/ckpt"``
URL_PREFIX = "kms://"
#: data keys a :class:`KmsKey` keeps (the newest): a save or a load needs one per version it touches
CACHE_SIZE = 1024

#: KMS error codes (https://docs.aws.amazon.com/kms/latest/APIReference/CommonErrors.html and the
#: Errors of GenerateDataKey, Decrypt, Encrypt, DescribeKey) that may pass on retry
TRANSIENT = frozenset({
    "ThrottlingException", "Throttling", "TooManyRequestsException", "RequestLimitExceeded", "LimitExceededException",
    "KMSInternalException", "DependencyTimeoutException", "KeyUnavailableException", "InternalFailure",
    "InternalError", "ServiceUnavailable", "ServiceUnavailableException", "RequestTimeout", "RequestTimeoutException",
})
WRONG_KEY = frozenset({"IncorrectKeyException"})
BAD_CIPHERTEXT = frozenset({"InvalidCiphertextException"})
STATE = frozenset({"DisabledException", "KMSInvalidStateException"})
NOT_FOUND = frozenset({"NotFoundException"})
DENIED = frozenset({"AccessDeniedException", "AccessDenied", "NotAuthorizedException"})
BAD_CREDENTIALS = frozenset({"UnrecognizedClientException", "InvalidSignatureException", "ExpiredTokenException",
                             "ExpiredToken", "InvalidClientTokenId", "IncompleteSignature", "MissingAuthenticationToken"})


class KmsKey:
    """A master key in AWS KMS (envelope encryption): pass it as ``key=`` to
    :class:`ckptstore.StorageWriter`, :class:`ckptstore.StorageReader`, :class:`ckptstore.CheckpointManager`,
    :func:`ckptstore.scrub.scrub` and :func:`ckptstore.rekey.rekey`.

    ``key_id``: the KMS key as KMS's ``KeyId`` takes it — key id (``1234abcd-…``), key ARN, alias
    (``alias/ckpt``) or alias ARN; a symmetric encryption key (``SYMMETRIC_DEFAULT``,
    ``ENCRYPT_DECRYPT``). ``region``: its region (default: the region of a key ARN, else the boto
    chain). ``endpoint_url``: a KMS endpoint (default: ``AWS_ENDPOINT_URL_KMS``/``AWS_ENDPOINT_URL``,
    else AWS's). ``profile``: a named profile of the shared config files. ``retry_mode`` /
    ``max_attempts``: botocore's retries (``"standard"``/``"adaptive"``; tries in all, the first
    included); None: botocore's defaults and ``AWS_RETRY_MODE``/``AWS_MAX_ATTEMPTS``.
    ``connect_timeout``/``read_timeout``: seconds per request (defaults 5 and 10).

    The caller needs ``kms:GenerateDataKey`` (saves), ``kms:Decrypt`` (every rank of a save, loads,
    ``scrub --deep``), ``kms:Encrypt`` (rekey to this key) and ``kms:DescribeKey`` (optional: the
    early check of the key's state). Picklable (configuration only), for
    ``AsyncCheckpointerType.PROCESS``; thread-safe. See the module docstring for the calls it makes
    and the errors it raises.
    """

    kind = "kms"

    def __init__(self, key_id: str, *, region: str | None = None, endpoint_url: str | None = None,
                 profile: str | None = None, retry_mode: str | None = None, max_attempts: int | None = None,
                 connect_timeout: float = 5.0, read_timeout: float = 10.0) -> None:
        if isinstance(key_id, str) and key_id.startswith(URL_PREFIX):
            key_id = key_id[len(URL_PREFIX):]
        if not isinstance(key_id, str) or not key_id.strip() or len(key_id) > 2048 or any(c.isspace() for c in key_id):
            raise KeyMismatchError(f"an AWS KMS key id must be a key id, key ARN, alias name or alias ARN; got {key_id!r}")
        if retry_mode not in (None, "standard", "adaptive", "legacy"):
            raise ValueError(f"retry_mode must be 'standard' or 'adaptive', got {retry_mode!r}")
        if max_attempts is not None and max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.key_id = key_id
        self.region = region or _arn_region(key_id)
        self.endpoint_url = endpoint_url
        self.profile = profile
        self.retry_mode = retry_mode
        self.max_attempts = max_attempts
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._client_obj = None
        #: the key's ARN, once known (DescribeKey, or a response); None: not yet
        self._arn: str | None = self.key_id if _is_key_arn(self.key_id) else None
        self._checked = False  # DescribeKey said the key is usable (or the caller may not describe it)
        self._keys: collections.OrderedDict = collections.OrderedDict()  # {(blob, version, attempt): data key}
        #: requests made to KMS by this object, by operation (measured in tests and README figures)
        self.calls: collections.Counter = collections.Counter()

    def __getstate__(self) -> dict:
        return {k: getattr(self, k) for k in ("key_id", "region", "endpoint_url", "profile", "retry_mode", "max_attempts",
                                              "connect_timeout", "read_timeout")}

    def __setstate__(self, s: dict) -> None:
        self.__dict__.update(s)
        self._init_runtime()

    def __repr__(self) -> str:
        where = "".join(f", {k}={getattr(self, k)!r}" for k in ("region", "endpoint_url") if getattr(self, k))
        return f"KmsKey({self.key_id!r}{where})"

    # -- the interface of a master key (ckptstore.codec.crypto.RawKey has the same) -------------------------
    def describe(self) -> str:
        return f"AWS KMS key {self._arn or self.key_id}"

    @property
    def arn(self) -> str:
        """The key's ARN (``DescribeKey`` on first use when ``key_id`` is not a key ARN)."""
        self.check()
        if self._arn is None:
            raise KeyServiceError(
                f"cannot tell which AWS KMS key {self.key_id!r} names: the caller may not call kms:DescribeKey on it; "
                "give the key ARN instead of an alias or key id, or allow kms:DescribeKey", code="AccessDeniedException",
                key=self.key_id)
        return self._arn

    @property
    def key_id_hex(self) -> str:
        """The manifest's ``key_id`` of versions this key wraps (:func:`ckptstore.codec.crypto.kms_key_id`)."""
        return kms_key_id(self.arn)

    def check(self) -> None:
        """Once per object: the key exists, is enabled and is a symmetric encryption key
        (``DescribeKey``; learns its ARN). A caller without ``kms:DescribeKey`` skips the check.
        Raises :class:`KeyServiceError` naming the key's state and what to do."""
        if self._checked:
            return
        try:
            md = self._call("DescribeKey", "describe_key", "check the key", KeyId=self.key_id)["KeyMetadata"]
        except KeyServiceError as e:
            if e.code not in DENIED:
                raise
            log.debug("ckptstore: no kms:DescribeKey on %s; KMS itself checks the key at each request", self.key_id)
            self._checked = True
            return
        arn = md.get("Arn") or self._arn
        state = md.get("KeyState") or ("Enabled" if md.get("Enabled", True) else "Disabled")
        usage = md.get("KeyUsage", "ENCRYPT_DECRYPT")
        spec = md.get("KeySpec") or md.get("CustomerMasterKeySpec") or "SYMMETRIC_DEFAULT"
        if state != "Enabled":
            raise KeyServiceError(_state_message(arn or self.key_id, state, md.get("DeletionDate")), code=f"KeyState:{state}",
                                  key=self.key_id)
        if usage != "ENCRYPT_DECRYPT" or spec != "SYMMETRIC_DEFAULT":
            raise KeyServiceError(
                f"AWS KMS key {arn or self.key_id} is a {spec} key for {usage}; ckptstore needs a symmetric encryption key "
                "(KeySpec SYMMETRIC_DEFAULT, KeyUsage ENCRYPT_DECRYPT) to generate and decrypt data keys",
                code="InvalidKeyUsageException", key=self.key_id)
        with self._lock:
            self._arn = arn
            self._checked = True

    def owns(self, w: WrappedKey) -> bool:
        """``w`` was wrapped by this KMS key (a multi-Region key's replicas count as the key)."""
        return w.kms_key_arn is not None and same_key(self.arn, w.kms_key_arn)

    def draw(self, version: str, attempt: str) -> tuple[bytes, WrappedKey]:
        """A fresh data key for ``attempt`` of ``version`` (``GenerateDataKey``, ``KeySpec=AES_256``)
        and its wrapping. Raises :class:`KeyServiceError` before anything is written."""
        self.check()
        r = self._call("GenerateDataKey", "generate_data_key", f"generate the data key of {version!r}: the save was not "
                       "started, nothing was written", KeyId=self.key_id, KeySpec="AES_256",
                       EncryptionContext=kms_context(version, attempt))
        dk, blob, arn = r["Plaintext"], r["CiphertextBlob"], r["KeyId"]
        if len(dk) != 32:
            raise KeyServiceError(f"AWS KMS returned a {len(dk)}-byte data key for {version!r}; AES-256 needs 32",
                                  code="GenerateDataKey", key=self.key_id)
        w = WrappedKey(base64.b64encode(blob).decode(), kms_key_id(arn), arn)
        with self._lock:
            self._arn = self._arn or arn
            self._remember((w.wrapped_key, version, attempt), dk)
        return dk, w

    def wrap(self, data_key: bytes, version: str, attempt: str) -> WrappedKey:
        """``data_key`` wrapped by this KMS key (``Encrypt``; rekey)."""
        self.check()
        r = self._call("Encrypt", "encrypt", f"wrap the data key of {version!r}", KeyId=self.key_id, Plaintext=data_key,
                       EncryptionContext=kms_context(version, attempt))
        return WrappedKey(base64.b64encode(r["CiphertextBlob"]).decode(), kms_key_id(r["KeyId"]), r["KeyId"])

    def unwrap(self, w: WrappedKey, version: str, attempt: str, *, cached: bool = True) -> bytes:
        """The data key ``w`` wraps (``Decrypt``, once per wrapped key, version and attempt; with
        ``cached=False`` KMS is asked again). Raises :class:`KeyMismatchError` (another key, or a raw
        one, wrapped it), :class:`IntegrityError` (KMS refuses the blob under this version's context:
        altered or moved), :class:`KeyServiceError`/:class:`KeyServiceUnavailableError`."""
        if w.kms_key_arn is None:
            raise KeyMismatchError(
                f"version {version!r} was encrypted with a raw master key (key id {w.key_id}), but the AWS KMS key "
                f"{self.key_id} was given; supply the raw key (key=, CKPTSTORE_KEY or CKPTSTORE_KEY_FILE)")
        ck = (w.wrapped_key, version, attempt)
        if cached:
            with self._lock:
                dk = self._keys.get(ck)
                if dk is not None:
                    self._keys.move_to_end(ck)
                    return dk
        self.check()
        if self._arn is not None and not same_key(self._arn, w.kms_key_arn):
            raise KeyMismatchError(
                f"version {version!r} was encrypted with the AWS KMS key {w.kms_key_arn}, but the key given is "
                f"{self._arn}; supply that key ({KMS_SOURCES})")
        try:
            blob = base64.b64decode(w.wrapped_key, validate=True)
        except ValueError:
            raise IntegrityError(f"the wrapped data key of version {version!r} is not base64: the manifest is damaged") from None
        r = self._call("Decrypt", "decrypt", f"unwrap the data key of {version!r}: the version was not read and is not "
                       "damaged", wrapped=w, version=version, CiphertextBlob=blob,
                       EncryptionContext=kms_context(version, attempt), KeyId=self._arn or self.key_id)
        dk = r["Plaintext"]
        if len(dk) != 32:
            raise IntegrityError(f"the wrapped data key of version {version!r} unwraps to {len(dk)} bytes, not 32")
        with self._lock:
            self._remember(ck, dk)
        return dk

    def _remember(self, ck: tuple, dk: bytes) -> None:  # with self._lock held
        self._keys[ck] = bytes(dk)
        self._keys.move_to_end(ck)
        while len(self._keys) > CACHE_SIZE:
            self._keys.popitem(last=False)

    # -- requests ---------------------------------------------------------------------------------------------
    @property
    def client(self):
        """This process's botocore KMS client (made on first use; thread-safe)."""
        if self._pid != os.getpid():  # forked: never share a client (or a lock held elsewhere) with the parent
            self._lock = threading.Lock()
            self._client_obj = None
            self._pid = os.getpid()
        c = self._client_obj
        if c is None:
            with self._lock:
                c = self._client_obj
                if c is None:
                    c = self._client_obj = self._make_client()
        return c

    def _make_client(self):
        import botocore.exceptions as bce
        import botocore.session
        from botocore.config import Config

        retries = {}
        if self.retry_mode is not None:
            retries["mode"] = self.retry_mode
        if self.max_attempts is not None:
            retries["total_max_attempts"] = self.max_attempts
        cfg = Config(retries=retries or None, connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                     user_agent_extra="ckptstore")
        try:
            s = botocore.session.get_session()
            if self.profile:
                s.set_config_variable("profile", self.profile)
            return s.create_client("kms", region_name=self.region, endpoint_url=self.endpoint_url, config=cfg)
        except bce.NoRegionError:
            raise KeyServiceError(
                f"no AWS region for the KMS key {self.key_id!r}: set AWS_REGION, give the key ARN, or pass "
                "KmsKey(..., region=...)", code="NoRegionError", key=self.key_id) from None
        except bce.BotoCoreError as e:
            raise KeyServiceError(f"cannot create an AWS KMS client for {self.key_id!r}: {e}", code=type(e).__name__,
                                  key=self.key_id) from e

    def close(self) -> None:
        """Close this process's client (a later request makes a new one)."""
        with self._lock:
            c, self._client_obj = self._client_obj, None
        if c is not None:
            c.close()

    def _call(self, op: str, method: str, what: str, *, wrapped: WrappedKey | None = None, version: str | None = None,
              **kw):
        import botocore.exceptions as bce

        client = self.client
        with self._lock:
            self.calls[op] += 1
        try:
            return getattr(client, method)(**kw)
        except (bce.ClientError, bce.BotoCoreError) as e:
            raise self._error(e, op, what, wrapped, version) from e

    def _error(self, e, op: str, what: str, wrapped: WrappedKey | None, version: str | None) -> Exception:
        """ckptstore's exception for a botocore error of ``op`` (by KMS error code, never by message)."""
        import botocore.exceptions as bce

        key = self._arn or self.key_id
        where = self.endpoint_url or getattr(getattr(self._client_obj, "meta", None), "endpoint_url", None) or "AWS KMS"
        if isinstance(e, bce.ClientError):
            err = e.response.get("Error") or {}
            status = int((e.response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
            code = str(err.get("Code") or status)
            detail = f"{code}" + (f": {err['Message']}" if err.get("Message") else "")
            if code in TRANSIENT or status >= 500 or status == 429:
                return KeyServiceUnavailableError(
                    f"AWS KMS ({where}) could not {what} ({detail}) after botocore's retries; try again later",
                    code=code, key=self.key_id)
            if code in WRONG_KEY:
                arn = wrapped.kms_key_arn if wrapped is not None else "another key"
                return KeyMismatchError(f"version {version!r} was encrypted with the AWS KMS key {arn}, not {key} ({code}); "
                                        f"supply that key ({KMS_SOURCES})")
            if code in BAD_CIPHERTEXT:
                return IntegrityError(
                    f"AWS KMS refuses the wrapped data key of version {version!r} under its encryption context ({code}): "
                    "the manifest's wrapped key was altered or moved from another version", version=version)
            if code in NOT_FOUND:
                return KeyServiceError(
                    f"AWS KMS key {self.key_id!r} does not exist in region {self._region()} ({detail}); could not {what}. "
                    f"Check the key id ({KMS_SOURCES}), the region (AWS_REGION) and the account", code=code, key=self.key_id)
            if code in STATE:
                return KeyServiceError(
                    f"AWS KMS key {key} cannot be used ({detail}): it is disabled or pending deletion; could not {what}. "
                    "Enable it ('aws kms enable-key', or cancel its deletion with 'aws kms cancel-key-deletion'), or use "
                    "another key", code=code, key=self.key_id)
            if code in DENIED:
                return KeyServiceError(
                    f"AWS KMS denied kms:{op} on key {key} ({detail}); could not {what}. Allow kms:{op} for this "
                    "caller in the key policy or its IAM policy, or use another key", code=code, key=self.key_id)
            if code in BAD_CREDENTIALS:
                return KeyServiceError(
                    f"AWS KMS rejected the credentials ({detail}); could not {what}. Check AWS_ACCESS_KEY_ID / "
                    "AWS_PROFILE / the instance role", code=code, key=self.key_id)
            return KeyServiceError(f"AWS KMS refused {op} on key {key} ({detail}); could not {what}", code=code,
                                   key=self.key_id)
        if isinstance(e, (bce.NoCredentialsError, bce.PartialCredentialsError)):
            return KeyServiceError(
                f"no AWS credentials for KMS; could not {what}. Set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
                "or use an instance role", code=type(e).__name__, key=self.key_id)
        if isinstance(e, (bce.ConnectionError, bce.HTTPClientError)):
            return KeyServiceUnavailableError(
                f"AWS KMS ({where}) did not answer; could not {what} ({type(e).__name__}: {e}) after botocore's "
                "retries; try again when KMS is reachable", code=type(e).__name__, key=self.key_id)
        return KeyServiceError(f"AWS KMS {op} failed; could not {what}: {e}", code=type(e).__name__, key=self.key_id)

    def _region(self) -> str:
        c = self._client_obj
        return self.region or (c.meta.region_name if c is not None else "?")


def _is_key_arn(key_id: str) -> bool:
    return key_id.startswith("arn:") and ":key/" in key_id


def _arn_region(key_id: str) -> str | None:
    """The region of a key or alias ARN (``arn:aws:kms:REGION:ACCOUNT:key/ID``), else None."""
    parts = key_id.split(":")
    return parts[3] or None if key_id.startswith("arn:") and len(parts) >= 6 else None


def same_key(a: str, b: str) -> bool:
    """The ARNs ``a`` and ``b`` name one KMS key: equal, or replicas of one multi-Region key
    (``mrk-`` key ids: same partition, account and key id, any region)."""
    if a == b:
        return True
    pa, pb = a.split(":"), b.split(":")
    if len(pa) < 6 or len(pb) < 6:
        return False
    ka, kb = ":".join(pa[5:]), ":".join(pb[5:])
    return ka == kb and ka.startswith("key/mrk-") and pa[1] == pb[1] and pa[4] == pb[4]


def _state_message(key: str, state: str, deletion) -> str:
    if state == "Disabled":
        return (f"AWS KMS key {key} is disabled: enable it ('aws kms enable-key --key-id {key}') or use another key; "
                "nothing was written, and nothing stored is damaged")
    if state == "PendingDeletion":
        when = f" on {deletion}" if deletion else ""
        return (f"AWS KMS key {key} is scheduled for deletion{when}: every version it wraps becomes unreadable then. Cancel "
                f"the deletion ('aws kms cancel-key-deletion --key-id {key}') and enable the key; then 'ckptstore rekey' "
                "its versions to another key if it is to go")
    return f"AWS KMS key {key} is in state {state}, not Enabled: wait until it is enabled, or use another key"


_shared_lock = threading.Lock()
_shared: dict[tuple, KmsKey] = {}


def shared(key_id: str, *, region: str | None = None, endpoint_url: str | None = None) -> KmsKey:
    """The one :class:`KmsKey` of this process for ``key_id`` (``key="kms://…"``, ``CKPTSTORE_KMS_KEY_ID``):
    readers and writers made one after another share its data keys and its client."""
    if key_id.startswith(URL_PREFIX):
        key_id = key_id[len(URL_PREFIX):]
    k = (key_id, region, endpoint_url, os.getpid())
    with _shared_lock:
        kk = _shared.get(k)
        if kk is None:
            kk = _shared[k] = KmsKey(key_id, region=region, endpoint_url=endpoint_url)
        return kk


__all__ = ["KmsKey", "same_key", "shared", "URL_PREFIX"]
