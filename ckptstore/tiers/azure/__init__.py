"""The Azure Blob Storage tier, ``az://container/prefix`` (the extra ``azure``: azure-storage-blob).

This package is the only part of the library that imports the Azure SDK. Its rooms:

* ``client.py`` — :class:`Connection`: the URL rules, the account and credentials (the SDK's
  conventions, below), the ``BlobServiceClient`` of each process (fork-safe), bounded timeouts and
  the SDK's retries (``ExponentialRetry``), the one translation of the SDK's errors.
* ``tier.py`` — :class:`AzureTier`: reads (ranged, coalesced, parallel), writes (one Put Blob up
  to one part, staged blocks beyond: Put Block + Put Block List), put-if-absent
  (``If-None-Match: *``) and its probe, conditional replace (``If-Match: <ETag>``), paged and
  delimiter listings.

The account, endpoint and credentials, in this order: ``connection_string=``; else
``account_name=`` / ``endpoint_url=`` (the blob endpoint, e.g. an emulator's
``http://127.0.0.1:10000/devstoreaccount1``) with ``account_key=`` or ``credential=``; else
``AZURE_STORAGE_CONNECTION_STRING``; else ``AZURE_STORAGE_ACCOUNT`` (endpoint
``https://<account>.blob.core.windows.net`` or ``AZURE_STORAGE_BLOB_ENDPOINT``) with
``AZURE_STORAGE_KEY``, ``AZURE_STORAGE_SAS_TOKEN``, or azure-identity's ``DefaultAzureCredential``
(docs/tiers.md).

Fault points (see :mod:`ckptstore._faults`): ``azure.put_if_absent`` before the conditional write,
``azure.part`` before each staged block.
"""

from __future__ import annotations

from .tier import CONDITIONAL_WRITES_ENV, AzureTier  # noqa: F401

__all__ = ["AzureTier"]
