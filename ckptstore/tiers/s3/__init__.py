"""The remote tier: an S3 (or S3-compatible) bucket prefix, ``s3://bucket/prefix``.

This package is the only part of the library that imports botocore. Its rooms, each with the
rules it keeps in its docstring:

* ``url.py`` — :func:`parse_s3_url`: the URL and prefix rules, checked before any request.
* ``client.py`` — requests and retries: the botocore client of each process (fork-safe), its
  retry configuration (botocore's ``standard``/``adaptive`` modes), request bodies, and the one
  translation of botocore's errors (by S3 error code and HTTP status, never by message text).
* ``listing.py`` — paginated LIST requests under the prefix (objects; ``delimiter``-ready).
* ``multipart.py`` — :func:`part_size_for`, the streaming writer, :class:`PartUpload`, and the
  listing and abort of unfinished uploads (:class:`MultipartUploadInfo`).
* ``conditional.py`` — put-if-absent (``If-None-Match: *``) and the per-process probe that checks
  an endpoint enforces it (:data:`CONDITIONAL_WRITES_ENV`; docs/FORMAT.md, "Conditional writes").
* ``tier.py`` — :class:`S3Tier`, the :class:`~ckptstore.tiers.base.Tier`: parameters, reads, and
  the choice between a single PUT and a multipart upload.

Fault points (see :mod:`ckptstore._faults`): ``s3.part`` before each UploadPart, ``s3.complete``
before CompleteMultipartUpload, ``s3.put_if_absent`` before the conditional PUT.
"""

from __future__ import annotations

from .conditional import CONDITIONAL_WRITES_ENV  # noqa: F401
from .multipart import (  # noqa: F401 - the part limits stay importable from here
    DEFAULT_PART_SIZE,
    MAX_PART_SIZE,
    MIN_PART_SIZE,
    GiB,
    KiB,
    MiB,
    MultipartUploadInfo,
    PartUpload,
    part_size_for,
)
from .tier import S3Tier
from .url import MAX_PREFIX_BYTES, parse_s3_url  # noqa: F401

__all__ = ["S3Tier", "MultipartUploadInfo", "PartUpload", "part_size_for", "parse_s3_url"]
