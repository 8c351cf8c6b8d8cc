"""The Google Cloud Storage tier, ``gs://bucket/prefix`` (the extra ``gcs``: google-cloud-storage).

This package is the only part of the library that imports the Google SDK. Its rooms:

* ``client.py`` — :class:`Connection`: the URL rules, the ``storage.Client`` of each process
  (fork-safe), bounded timeouts and the SDK's retries, the one translation of the SDK's errors.
* ``tier.py`` — :class:`GCSTier`: reads (ranged, coalesced, parallel), writes (one request up to
  one part, resumable uploads beyond), put-if-absent (``ifGenerationMatch=0``) and its probe,
  conditional replace (``ifGenerationMatch=<generation>``), paged and delimiter listings.

Options come from the SDK's conventions: the project from ``project=`` or
``GOOGLE_CLOUD_PROJECT`` / application default credentials; credentials from application default
credentials (``GOOGLE_APPLICATION_CREDENTIALS``, ``gcloud auth application-default login``, the
metadata server) or ``credentials=``; the endpoint from ``STORAGE_EMULATOR_HOST`` (the SDK then
uses anonymous credentials) or ``endpoint_url=`` (docs/tiers.md).

Fault points (see :mod:`ckptstore._faults`): ``gcs.put_if_absent`` before the conditional write,
``gcs.part`` before each part of a part upload.
"""

from __future__ import annotations

from .tier import CONDITIONAL_WRITES_ENV, GCSTier  # noqa: F401

__all__ = ["GCSTier"]
