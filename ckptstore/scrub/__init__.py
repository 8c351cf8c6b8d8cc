"""Scrub: verify every committed version's stored objects, per tier, and optionally repair them
(docs/FORMAT.md, "Scrub").

:func:`scrub` walks each tier of a store, verifies the part of every committed version the tier
holds — presence, size, every frame's checksums, the object digest and frame count; with ``deep``
also the key, the manifest's HMAC, every frame's decoding and the DCP metadata — and, with
``repair``, restores damaged objects from another tier's verified copy of the same attempt or
marks the version damaged. The rooms, each with its rules in its docstring:

* :mod:`~ckptstore.scrub.walk` — :func:`scrub`: tiers → committed versions → the part each tier
  holds → objects and references; divergent copies of one name.
* :mod:`~ckptstore.scrub.read` — windows of stored objects: ``mmap`` behind a read-ahead thread or
  ``preadv`` locally, ranged GETs remotely, bounded buffers; the tunables :data:`LOCAL_CHUNK`,
  :data:`LOCAL_MMAP`, :data:`LOCAL_AHEAD`, :data:`REMOTE_PART`.
* :mod:`~ckptstore.scrub.verify` — :class:`Verifier` (the thread pools), :func:`check_object`,
  :func:`verify_stream`, the deep checks (key, manifest HMAC, DCP metadata).
* :mod:`~ckptstore.scrub.repair` — :func:`restore_object`, damaged replicas, ``damaged.json``
  marks.
* :mod:`~ckptstore.scrub.report` — :class:`ObjectCheck`, :class:`Issue`, :class:`VersionCheck`,
  :class:`ScrubReport`, :func:`format_report`, and the exit codes (``EXIT_*``: 10 damage, 5 key,
  12 unchecked, 13 NaN/Inf values recorded (a finding, not damage), 11 repaired, 0 clean).
"""

from __future__ import annotations

import sys
import types

from . import read as _read
from .repair import restore_object
from .report import (  # noqa: F401 - statuses and kinds, for callers that read a report
    DAMAGED,
    EXIT_CLEAN,
    EXIT_DAMAGE,
    EXIT_KEY,
    EXIT_NONFINITE,
    EXIT_REPAIRED,
    EXIT_UNCHECKED,
    FINDING,
    FINDING_KINDS,
    OBJECT_KINDS,
    OK,
    REPAIRED,
    UNCHECKED,
    VERSION_KINDS,
    Issue,
    ObjectCheck,
    ScrubReport,
    VersionCheck,
    format_report,
)
from .verify import Verifier, check_object, default_jobs, verify_stream
from .walk import scrub


def _tunable(name: str) -> property:
    return property(lambda _m: getattr(_read, name), lambda _m, value: setattr(_read, name, value),
                    doc=f"``ckptstore.scrub.read.{name}``")


class _Package(types.ModuleType):
    """``ckptstore.scrub`` itself: the read tunables read and set here are those of
    :mod:`ckptstore.scrub.read`, where the readers look them up, so ``ckptstore.scrub.LOCAL_CHUNK = n``
    (or ``monkeypatch.setattr(scrub, "LOCAL_CHUNK", n)``) changes the next scrub's windows, as it
    did before the package was split."""

    LOCAL_CHUNK = _tunable("LOCAL_CHUNK")
    LOCAL_MMAP = _tunable("LOCAL_MMAP")
    LOCAL_AHEAD = _tunable("LOCAL_AHEAD")
    REMOTE_PART = _tunable("REMOTE_PART")


sys.modules[__name__].__class__ = _Package

__all__ = [
    "EXIT_CLEAN",
    "EXIT_DAMAGE",
    "EXIT_REPAIRED",
    "EXIT_UNCHECKED",
    "EXIT_NONFINITE",
    "ObjectCheck",
    "VersionCheck",
    "Issue",
    "ScrubReport",
    "scrub",
    "default_jobs",
    "Verifier",
    "check_object",
    "verify_stream",
    "restore_object",
    "format_report",
]
