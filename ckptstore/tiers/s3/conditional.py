"""Conditional writes of the remote tier: put-if-absent, and the probe that checks an endpoint
enforces it (docs/FORMAT.md, "Conditional writes").

``put_if_absent`` is a PUT with ``If-None-Match: *``. Some S3-compatible servers accept the header
and ignore it (an emulator answered 200 and overwrote, pithings/mountx #19; Ceph's conformance
suite does not test conditional writes, ceph/s3-tests #583), so before the first ``put_if_absent``
of a process to an endpoint and prefix the tier checks that the endpoint enforces it: it writes a
probe key ``probes/put-if-absent.<nonce>`` under the prefix twice with ``If-None-Match: *``,
expects 412 the second time, and deletes it. The answer is cached per process for that endpoint,
bucket and prefix. An endpoint that overwrites raises
:class:`~ckptstore.errors.ConditionalWritesError` from every ``put_if_absent`` (so every remote
commit is refused), naming the endpoint and the opt-out: ``conditional_writes="trust"`` (or
``CKPTSTORE_S3_CONDITIONAL_WRITES=trust``) for servers known to serialise writers another way.

If the PUT was retried by botocore and the final answer is 412, the stored object's ETag is
compared with the MD5 of our body: an earlier attempt of *this* call may have landed with its
response lost. A ``409 ConditionalRequestConflict`` (another conditional write in flight) is
retried a few times, then reported as :class:`ObjectExistsError`.

Conditional replace (``replace_if_match``, what a superseding save commits with) is a PUT with
``If-Match: "<ETag>"``, the ETag ``stat`` returned (:attr:`ObjectInfo.token`). Before the first one
of a process to an endpoint and prefix a second probe checks that the endpoint enforces it: it
writes ``probes/if-match.<nonce>``, PUTs it again with an ``If-Match`` of another ETag (must be
refused with 412 and leave the body), then with its own ETag (must succeed), and deletes it.
SeaweedFS 4.x and moto enforce it (measured: 412 for a wrong ETag, 200 for the right one; a
missing key is 412 on SeaweedFS, 404 on moto — both mean "not replaced"). An endpoint that fails
the probe gets no conditional replace: :class:`~ckptstore.errors.ConditionalWritesError`, never an
overwrite; ``conditional_writes="trust"`` skips the probe as for put-if-absent.

Fault points (see :mod:`ckptstore._faults`): ``s3.put_if_absent`` before the conditional PUT,
``s3.replace_if_match`` before the conditional replace.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

import botocore.exceptions as bce

from ... import _faults
from ...errors import ConditionalWritesError, ObjectExistsError, ObjectNotFoundError, PreconditionFailedError
from ...manifest.layout import conditional_probe_key, if_match_probe_key
from .client import (
    BAD_CREDENTIALS,
    CONFLICT,
    NOT_FOUND,
    PRECONDITION,
    TRANSIENT,
    Connection,
    body_of,
    error_code,
)

#: ``CKPTSTORE_S3_CONDITIONAL_WRITES``: the default of ``S3Tier(conditional_writes=...)``
CONDITIONAL_WRITES_ENV = "CKPTSTORE_S3_CONDITIONAL_WRITES"
_CONDITIONAL_MODES = ("verify", "trust")
#: (endpoint, bucket, prefix) -> None (enforced) or the reason it is not: the probe's answers
_conditional: dict[tuple[str, str, str], str | None] = {}
_conditional_lock = threading.Lock()


def mode(conditional_writes: str | None) -> str:
    """``"verify"`` or ``"trust"``: the value given, else ``$CKPTSTORE_S3_CONDITIONAL_WRITES``, else
    ``"verify"``; raises ``ValueError`` for anything else."""
    if conditional_writes is None:
        conditional_writes = os.environ.get(CONDITIONAL_WRITES_ENV) or "verify"
    if conditional_writes not in _CONDITIONAL_MODES:
        raise ValueError(f"conditional_writes must be 'verify' or 'trust' (also ${CONDITIONAL_WRITES_ENV}), "
                         f"got {conditional_writes!r}")
    return conditional_writes


def check(conn: Connection) -> None:
    """Raise :class:`~ckptstore.errors.ConditionalWritesError` unless this endpoint enforces
    put-if-absent under this prefix (module docstring; one probe per process, endpoint, bucket and
    prefix, answer cached). :class:`~ckptstore.errors.TransientStorageError` and other storage
    errors of the probe's requests are raised as they are (and not cached)."""
    where = (str(conn.client.meta.endpoint_url), conn.bucket, conn.prefix)
    with _conditional_lock:
        known = where in _conditional
        why = _conditional.get(where)
    if not known:
        why = _probe(conn)
        with _conditional_lock:
            _conditional[where] = why
    if why is not None:
        raise ConditionalWritesError(
            f"the S3 endpoint {where[0]} does not enforce put-if-absent (If-None-Match: *) for "
            f"s3://{conn.bucket}/{conn.prefix}: {why}. Two writers could both commit one version there, so "
            "ckptstore refuses remote commits. Use a server that answers 412 PreconditionFailed to a "
            "conditional PUT of an existing key (AWS S3, MinIO, SeaweedFS, moto); if the writers of this "
            f"prefix are serialised another way, opt out with {CONDITIONAL_WRITES_ENV}=trust "
            "(or S3Tier(url, conditional_writes='trust'))"
        )


def _probe(conn: Connection) -> str | None:
    """None when a second conditional PUT of a fresh probe key is refused with 412 (and the first
    body stays), else what the endpoint did instead. The probe is deleted either way."""
    key = conditional_probe_key()
    full = conn.key(key)
    first, second = b"ckptstore put-if-absent probe 1\n", b"ckptstore put-if-absent probe 2\n"
    try:
        try:
            conn.client.put_object(Bucket=conn.bucket, Key=full, Body=first, IfNoneMatch="*")
        except bce.ClientError as e:
            code, status = error_code(e)
            if code in PRECONDITION and _is_ours(conn, key, memoryview(first)):
                pass  # a retried first PUT: the earlier try landed
            elif code in TRANSIENT or (status >= 500 and status != 501) or status == 429:
                raise conn.error(e, "conditional PUT of", key) from e
            elif code in ("AccessDenied", "403") or code in BAD_CREDENTIALS or code == "NoSuchBucket":
                raise conn.error(e, "conditional PUT of", key) from e
            else:
                return f"a conditional PUT of a new key was answered {code} (HTTP {status})"
        except bce.BotoCoreError as e:
            raise conn.error(e, "conditional PUT of", key) from e
        for attempt in range(6):
            try:
                conn.client.put_object(Bucket=conn.bucket, Key=full, Body=second, IfNoneMatch="*")
            except bce.ClientError as e:
                code, _status = error_code(e)
                if code in PRECONDITION:
                    break
                if code in CONFLICT and attempt < 5:
                    time.sleep(0.05 * 2**attempt)
                    continue
                raise conn.error(e, "conditional PUT of", key) from e
            except bce.BotoCoreError as e:
                raise conn.error(e, "conditional PUT of", key) from e
            return f"a second conditional PUT of the probe key {conn.where(key)} succeeded (expected 412)"
        if conn.get(key, None) != first:
            return f"the probe key {conn.where(key)} was overwritten although the second PUT got 412"
        return None
    finally:
        try:
            conn.delete(key)
        except Exception:  # noqa: BLE001 - a leftover probe is garbage for gc (probes/, after the grace period)
            pass


def put_if_absent(conn: Connection, key: str, data, *, verify: bool) -> None:
    """PUT ``data`` at ``key`` with ``If-None-Match: *``: :class:`ObjectExistsError` when the key
    exists. ``verify``: first :func:`check` that the endpoint enforces it."""
    full = conn.key(key)
    mv = memoryview(data).cast("B")
    if verify:
        check(conn)
    for attempt in range(6):
        try:
            _faults.point("s3.put_if_absent")
            conn.client.put_object(Bucket=conn.bucket, Key=full, Body=body_of(data), IfNoneMatch="*")
            break
        except bce.ClientError as e:
            code, _ = error_code(e)
            if code in PRECONDITION:
                retried = (e.response.get("ResponseMetadata") or {}).get("RetryAttempts", 0)
                if retried and _is_ours(conn, key, mv):
                    break  # an earlier try of this call landed; its response was lost
                raise ObjectExistsError(f"object {conn.where(key)} already exists") from None
            if code in CONFLICT:  # a concurrent conditional write is in flight
                if attempt < 5:
                    time.sleep(0.05 * 2**attempt)
                    continue
                raise ObjectExistsError(
                    f"object {conn.where(key)} is being written concurrently by another writer"
                ) from None
            raise conn.error(e, "conditional PUT of", key) from e
        except bce.BotoCoreError as e:
            raise conn.error(e, "conditional PUT of", key) from e


def _is_ours(conn: Connection, key: str, mv: memoryview) -> bool:
    """Whether the object at ``key`` holds ``mv`` (its ETag is the MD5 of ``mv``)."""
    try:
        etag = str(conn.head(key).get("ETag", "")).strip('"')
    except ObjectNotFoundError:
        return False
    return etag == hashlib.md5(mv, usedforsecurity=False).hexdigest()


#: (endpoint, bucket, prefix) -> None (If-Match enforced) or the reason it is not
_if_match: dict[tuple[str, str, str], str | None] = {}


def check_replace(conn: Connection) -> None:
    """Raise :class:`~ckptstore.errors.ConditionalWritesError` unless this endpoint enforces
    ``If-Match`` on PutObject under this prefix (module docstring; one probe per process, endpoint,
    bucket and prefix, answer cached; storage errors of the probe are raised as they are)."""
    where = (str(conn.client.meta.endpoint_url), conn.bucket, conn.prefix)
    with _conditional_lock:
        known = where in _if_match
        why = _if_match.get(where)
    if not known:
        why = _probe_if_match(conn)
        with _conditional_lock:
            _if_match[where] = why
    if why is not None:
        raise ConditionalWritesError(
            f"the S3 endpoint {where[0]} does not enforce a conditional replace (If-Match) for "
            f"s3://{conn.bucket}/{conn.prefix}: {why}. Two superseding saves of one name could both commit "
            "there, so ckptstore refuses to supersede a version remotely (the local commit stands; "
            "save under a new name). Use a server that answers 412 PreconditionFailed to a PUT whose "
            f"If-Match names another ETag (AWS S3, MinIO, SeaweedFS 4, moto), or, if the writers of this prefix "
            f"are serialised another way, opt out with {CONDITIONAL_WRITES_ENV}=trust"
        )


def _probe_if_match(conn: Connection) -> str | None:
    """None when a PUT with ``If-Match`` of another ETag is refused with 412 (and the body stays)
    and a PUT with the object's own ETag succeeds, else what the endpoint did instead."""
    key = if_match_probe_key()
    full = conn.key(key)
    first, second, third = (b"ckptstore if-match probe 1\n", b"ckptstore if-match probe 2\n",
                            b"ckptstore if-match probe 3\n")
    wrong = '"' + hashlib.md5(second, usedforsecurity=False).hexdigest() + '"'
    try:
        try:
            etag = conn.client.put_object(Bucket=conn.bucket, Key=full, Body=first)["ETag"]
            try:
                conn.client.put_object(Bucket=conn.bucket, Key=full, Body=second, IfMatch=wrong)
            except bce.ClientError as e:
                code, status = error_code(e)
                if code not in PRECONDITION:
                    if code in TRANSIENT or status >= 500 or status == 429:
                        raise conn.error(e, "conditional PUT of", key) from e
                    return f"a PUT with a wrong If-Match was answered {code} (HTTP {status}), not 412"
            else:
                return f"a PUT of {conn.where(key)} whose If-Match named another ETag succeeded (expected 412)"
            if conn.get(key, None) != first:
                return f"the probe key {conn.where(key)} was overwritten although the PUT got 412"
            try:
                conn.client.put_object(Bucket=conn.bucket, Key=full, Body=third, IfMatch=etag)
            except bce.ClientError as e:
                code, status = error_code(e)
                if code in TRANSIENT or status >= 500 or status == 429:
                    raise conn.error(e, "conditional PUT of", key) from e
                return f"a PUT whose If-Match named the object's own ETag was answered {code} (HTTP {status})"
        except bce.BotoCoreError as e:
            raise conn.error(e, "conditional PUT of", key) from e
        except bce.ClientError as e:
            raise conn.error(e, "PUT of", key) from e
        return None
    finally:
        try:
            conn.delete(key)
        except Exception:  # noqa: BLE001 - a leftover probe is garbage for gc (probes/, after the grace period)
            pass


def replace_if_match(conn: Connection, key: str, data, token: str, *, verify: bool) -> None:
    """PUT ``data`` at ``key`` with ``If-Match: "<token>"`` (``token``: the ETag without quotes):
    :class:`PreconditionFailedError` when the key is gone or holds another object. ``verify``:
    first :func:`check_replace` that the endpoint enforces it."""
    full = conn.key(key)
    mv = memoryview(data).cast("B")
    if verify:
        check_replace(conn)
    lost = PreconditionFailedError(f"object {conn.where(key)} was replaced or deleted by another writer since it "
                                   "was read; not replaced", object=key)
    for attempt in range(6):
        try:
            _faults.point("s3.replace_if_match")
            conn.client.put_object(Bucket=conn.bucket, Key=full, Body=body_of(data), IfMatch=f'"{token.strip(chr(34))}"')
            return
        except bce.ClientError as e:
            code, _ = error_code(e)
            if code in PRECONDITION or code in NOT_FOUND:
                retried = (e.response.get("ResponseMetadata") or {}).get("RetryAttempts", 0)
                if retried and _is_ours(conn, key, mv):
                    return  # an earlier try of this call landed; its response was lost
                raise lost from None
            if code in CONFLICT:  # a concurrent conditional write is in flight
                if attempt < 5:
                    time.sleep(0.05 * 2**attempt)
                    continue
                raise lost from None
            raise conn.error(e, "conditional PUT of", key) from e
        except bce.BotoCoreError as e:
            raise conn.error(e, "conditional PUT of", key) from e
