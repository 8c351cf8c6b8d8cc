"""The ignoring-server probe of the GCS and Azure tiers (docs/FORMAT.md, "Conditional writes"; the
S3 tier keeps its own in ``s3/conditional.py``).

Some emulators and gateways accept a put-if-absent precondition and ignore it. Before the first
``put_if_absent`` of a process to an endpoint, bucket and prefix, the tier writes a fresh probe key
``probes/put-if-absent.<nonce>`` twice with its precondition (GCS ``ifGenerationMatch=0``, Azure
``If-None-Match: *``), expects the second write refused and the first body kept, and deletes the
probe. The answer is cached per process. An endpoint that overwrote makes every ``put_if_absent``
raise :class:`~ckptstore.errors.ConditionalWritesError` (every remote commit is refused), naming
the opt-out: ``conditional_writes="trust"`` or the tier's ``CKPTSTORE_<TIER>_CONDITIONAL_WRITES=trust``.
Storage errors of the probe's requests are raised as they are and not cached.
"""

from __future__ import annotations

import os
import threading
from typing import Callable

from ..errors import ConditionalWritesError, ObjectExistsError
from ..manifest.layout import conditional_probe_key

MODES = ("verify", "trust")
_answers: dict[tuple, str | None] = {}
_lock = threading.Lock()


def mode(value: str | None, env: str) -> str:
    """``"verify"`` or ``"trust"``: ``value``, else ``$env``, else ``"verify"``; ``ValueError`` else."""
    if value is None:
        value = os.environ.get(env) or "verify"
    if value not in MODES:
        raise ValueError(f"conditional_writes must be 'verify' or 'trust' (also ${env}), got {value!r}")
    return value


def check(where: tuple, describe: str, precondition: str, env: str,
          put_if_absent: Callable[[str, bytes], None], get: Callable[[str], bytes],
          delete: Callable[[str], None]) -> None:
    """Raise :class:`ConditionalWritesError` unless the endpoint ``where`` (a cache key:
    endpoint, bucket, prefix) refuses a second ``put_if_absent`` of a fresh probe key with
    :class:`ObjectExistsError` and keeps the first body. ``describe`` names the endpoint and prefix
    in the message, ``precondition`` the header or parameter."""
    with _lock:
        known = where in _answers
        why = _answers.get(where)
    if not known:
        why = _probe(put_if_absent, get, delete)
        with _lock:
            _answers[where] = why
    if why is not None:
        raise ConditionalWritesError(
            f"{describe} does not enforce put-if-absent ({precondition}): {why}. Two writers could both "
            "commit one version there, so ckptstore refuses remote commits. Use a server that refuses a "
            "conditional write of an existing object; if the writers of this prefix are serialised "
            f"another way, opt out with {env}=trust (or conditional_writes='trust')")


def _probe(put_if_absent, get, delete) -> str | None:
    key = conditional_probe_key()
    first, second = b"ckptstore put-if-absent probe 1\n", b"ckptstore put-if-absent probe 2\n"
    try:
        put_if_absent(key, first)
        try:
            put_if_absent(key, second)
        except ObjectExistsError:
            pass
        else:
            return f"a second conditional write of the probe key {key} succeeded (expected a refusal)"
        if get(key) != first:
            return f"the probe key {key} was overwritten although the second write was refused"
        return None
    finally:
        try:
            delete(key)
        except Exception:  # noqa: BLE001 - a leftover probe is garbage for gc (probes/, after the grace period)
            pass
