"""The open :class:`ckptstore.CheckpointManager` objects of this process.

- **One manager per root and version names in a process.** A manager created on the same
  ``root`` and the same version names (``prefix`` / ``version_format``) as another manager of this
  process that still has saves or uploads in flight closes that one first: it waits for those saves
  and uploads (``close()``, bounded by ``upload_timeout``) and warns (``RuntimeWarning``); an error
  the old manager raises there is part of the warning. So a restart inside the process (a new
  manager after an exception) never races the old one for a version name, and resumes from what the
  old one committed.
- **Interpreter exit.** The watchdog threads of managers never closed end before finalisation.

A manager here is anything with ``close()``, ``_closed``, ``_in_flight()`` and ``_stop_watchdog()``.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import warnings
import weakref
from typing import Any

log = logging.getLogger("ckptstore")

# the open managers of this process by (real root path, version names)
_open: dict[tuple, "weakref.WeakSet[Any]"] = {}
_open_lock = threading.Lock()


def names_of(root, prefix: str, version_format: str | None) -> tuple:
    """The key of a manager's versions: ``(real root path, "format" or "prefix", the pattern)``."""
    return (os.path.realpath(os.fspath(root)), "format" if version_format is not None else "prefix",
            version_format if version_format is not None else prefix)


def add(mgr, names: tuple) -> None:
    with _open_lock:
        _open.setdefault(names, weakref.WeakSet()).add(mgr)


def discard(mgr, names: tuple) -> None:
    with _open_lock:
        _open.get(names, set()).discard(mgr)


def close_previous(names: tuple) -> None:
    """Close every open manager on ``names`` that still has saves or uploads in flight (warning)."""
    with _open_lock:
        busy = [m for m in _open.get(names, ()) if not m._closed and m._in_flight()]
    for first in busy:
        msg = (f"ckptstore: a new CheckpointManager on {names[0]} (version names {names[1]} {names[2]!r}) while "
               "another one of this process still has saves in flight: waited for them and closed the old manager")
        try:
            first.close()
        except BaseException as e:  # noqa: BLE001 - reported in the warning; the new manager goes on
            msg += f"; its close() raised {type(e).__name__}: {e}"
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)  # the caller of CheckpointManager(...)


def _stop_watchdogs_at_exit() -> None:  # managers never closed: their watchdog threads end before finalisation
    with _open_lock:
        mgrs = [m for ms in _open.values() for m in ms]
    for m in mgrs:
        m._stop_watchdog()


atexit.register(_stop_watchdogs_at_exit)
