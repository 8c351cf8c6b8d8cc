"""A :class:`~ckptstore.StorageWriter`'s settings, shared by the writer and its stages.

The writer's public attributes (``overwrite``, ``durability``, ``upload_timeout``, ...) are
:class:`Setting` descriptors onto one :class:`WriterConfig`; every stage holds that same object, so
a setting changed on the writer after construction (``CheckpointManager`` shortens
``upload_timeout`` at a signal) reaches the stages as it reached the writer's methods before.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch.distributed as dist


@dataclasses.dataclass
class WriterConfig:
    """The arguments of ``StorageWriter`` (see its docstring), checked."""

    root: str
    remote_url: str | None
    remote_options: dict
    overwrite: bool
    step: int | None
    user_metadata: dict
    threads: int
    frame_size: int
    compression: str
    level: int
    durability: str
    allow_divergent_replicas: bool
    upload_timeout: float
    retention: Any
    world_size: int | None
    replicas: int
    incremental: bool
    scope: str | None = None  # the version names an incremental save takes its baseline from (regex)
    count_nonfinite: bool = True
    #: ``commit_check(version) -> reason or None``, called right before the local commit point
    commit_check: Any = None
    #: this rank's failure domain (docs/FORMAT.md, "Replicas")
    replica_domain: str = ""


class Setting:
    """A writer attribute that lives in its :class:`WriterConfig` (``obj._cfg``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj._cfg, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj._cfg, self.name, value)


def check_options(*, compression: str, durability: str, replicas: Any, frame_size: int, max_staged: int,
                  world_size: int | None) -> int | None:
    """Raise ``ValueError`` for an argument ``StorageWriter`` does not take; returns the job's world
    size (``world_size``, else the default process group's size when one is initialised, else None)."""
    if compression not in ("auto", "none"):
        raise ValueError("compression must be 'auto' or 'none'")
    if durability not in ("local", "replicated", "remote"):
        raise ValueError("durability must be 'local', 'replicated' or 'remote'")
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ValueError(f"replicas must be a non-negative integer, got {replicas!r}")
    if durability == "replicated" and not replicas:
        raise ValueError("durability='replicated' needs replicas=F (F >= 1)")
    if frame_size < 4096 or frame_size % 16:
        raise ValueError("frame_size must be a multiple of 16 bytes and at least 4096")
    if max_staged < 1:
        raise ValueError("max_staged must be at least 1")
    if world_size is None and dist.is_available() and dist.is_initialized():
        world_size = dist.get_world_size()
    if world_size is not None and int(world_size) < 1:
        raise ValueError("world_size must be at least 1")
    return None if world_size is None else int(world_size)


#: the environment variable that names a rank's failure domain when ``replica_domain=`` is not given
DOMAIN_ENV = "CKPTSTORE_REPLICA_DOMAIN"


def resolve_domain(domain: str | None) -> str:
    """This rank's failure domain (docs/FORMAT.md, "Replicas"): ``domain``, else the environment
    variable ``CKPTSTORE_REPLICA_DOMAIN``, else the host name (``socket.gethostname()``). Raises
    ``ValueError`` for a name a manifest cannot hold (empty, over 256 characters, control characters)."""
    import socket

    from ..manifest.schema import check_domain

    if domain is None:
        domain = os.environ.get(DOMAIN_ENV) or socket.gethostname() or "localhost"
        return check_domain(domain[:256])
    return check_domain(domain)


def multi_rank() -> bool:
    """A job of more than one rank (``torch.distributed`` initialised)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


__all__ = ["DOMAIN_ENV", "Setting", "WriterConfig", "check_options", "multi_rank", "resolve_domain"]
