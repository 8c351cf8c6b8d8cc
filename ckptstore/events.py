"""The event log of a run: one JSON object a line (docs/FORMAT.md, "Event log").

:class:`ckptstore.CheckpointManager` appends one line per save, restore, gc (retention after a
commit) and preemption, plus ``open``/``close`` of each manager, ``progress`` lines (the step the loop
reached) and — from a launcher that wants start-up and shutdown counted — ``launch``/``exit``
markers. ``ckptstore gc`` appends its own ``gc`` line. ``ckptstore goodput LOG``
(:mod:`ckptstore.goodput`) reads it back; :mod:`ckptstore.metrics` renders the same figures as
OpenMetrics text.

Appends are atomic per line: each line is written with one ``write`` on a file opened with
``O_APPEND`` (Linux and macOS local file systems never interleave two such writes), save, restore,
gc and preempt lines are fsynced, progress lines are not (they survive a killed process, not a lost
machine). A writer that finds the file not ending in a newline (a torn line of a process killed
mid-write) starts with one, so a torn line never swallows the next; :func:`read_events` skips any
line that is not a JSON object. Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from typing import Any, Iterable

#: format of the lines (the ``ev`` field of every line)
FORMAT = 1
#: the event log's name at the top of a local root (docs/FORMAT.md, "Layout")
LOG_NAME = "events.jsonl"
#: kinds whose lines are fsynced
_DURABLE = frozenset({"save", "restore", "gc", "preempt", "close", "open", "launch", "exit"})


def default_path(root: str | os.PathLike) -> str:
    """The event log of the local root ``root``: ``ROOT/events.jsonl``."""
    return os.path.join(os.fspath(root), LOG_NAME)


def _clean(v: Any) -> Any:
    """``v`` with floats that JSON cannot hold (NaN, infinities) as None."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def encode(event: dict[str, Any]) -> bytes:
    """One line of the log: the event as compact JSON (keys in the order given) and a newline."""
    return (json.dumps(_clean(event), separators=(",", ":"), default=str) + "\n").encode()


class EventLog:
    """Append-only writer of one event log file (thread-safe; one per process and path is enough).

    ``append(kind, **fields)`` adds ``{"ev": 1, "kind": kind, "t": <time.time()>, **common,
    **fields}`` as one line and returns the event. Raises ``OSError`` when the file cannot be
    opened or written (callers that must not fail log it)."""

    def __init__(self, path: str | os.PathLike, **common: Any) -> None:
        self.path = os.fspath(path)
        self.common = dict(common)
        self._lock = threading.Lock()
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:
            d = os.path.dirname(self.path)
            if d:
                os.makedirs(d, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                size = os.fstat(fd).st_size
                if size:
                    with open(self.path, "rb") as f:
                        f.seek(size - 1)
                        if f.read(1) != b"\n":  # a torn line of a killed writer: end it first
                            os.write(fd, b"\n")
            except OSError:
                os.close(fd)
                raise
            self._fd = fd
        return self._fd

    def append(self, kind: str, *, fsync: bool | None = None, **fields: Any) -> dict[str, Any]:
        event = {"ev": FORMAT, "kind": kind, "t": time.time(), **self.common, **fields}
        self.write(event, fsync=fsync)
        return event

    def write(self, event: dict[str, Any], *, fsync: bool | None = None) -> None:
        """Append ``event`` (a complete event dict) as one line."""
        line = encode(event)
        with self._lock:
            fd = self._open()
            n = os.write(fd, line)
            if n != len(line):  # a short write (disk full): end the torn line so the next one is whole
                os.write(fd, b"\n")
                raise OSError(f"short write to the event log {self.path}")
            if fsync if fsync is not None else event.get("kind") in _DURABLE:
                os.fsync(fd)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def append(path: str | os.PathLike, kind: str, **fields: Any) -> dict[str, Any]:
    """Append one event to the log at ``path`` (e.g. a launcher's ``launch``/``exit`` marker)."""
    with EventLog(path) as log:
        return log.append(kind, **fields)


def parse(lines: Iterable[bytes | str]) -> tuple[list[dict[str, Any]], int]:
    """The events of ``lines`` in file order and the number of lines skipped (torn or not a JSON
    object with a ``kind``)."""
    out: list[dict[str, Any]] = []
    bad = 0
    for raw in lines:
        line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        line = line.strip()
        if not line:
            continue
        try:
            e = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(e, dict) and isinstance(e.get("kind"), str) and isinstance(e.get("t"), (int, float)):
            out.append(e)
        else:
            bad += 1
    return out, bad


def read_events(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every event of the log at ``path``, in file order; torn or foreign lines are skipped.
    Raises ``FileNotFoundError`` when there is no log."""
    with open(os.fspath(path), "rb") as f:
        return parse(f)[0]


def process_start_time() -> float | None:
    """Wall-clock time (``time.time()`` scale) this process started, from ``/proc/self/stat``
    (clock ticks since boot) and ``/proc/uptime``; None where there is no ``/proc``."""
    try:
        with open("/proc/self/stat", "rb") as f:
            ticks = int(f.read().decode("ascii", "replace").rpartition(")")[2].split()[19])
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        now = time.time()
        return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def tail(path: str | os.PathLike, max_bytes: int = 4 << 20) -> list[dict[str, Any]]:
    """The events in the last ``max_bytes`` of the log at ``path`` (all of a smaller log); [] when
    there is none. The first line of a cut is skipped (it may be partial)."""
    try:
        with open(os.fspath(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - max_bytes))
            lines = f.read().split(b"\n")
    except OSError:
        return []
    if size > max_bytes:
        lines = lines[1:]
    return parse(lines)[0]


def last_save(events: Iterable[dict[str, Any]], version: str | None = None) -> dict[str, Any] | None:
    """The ``save`` line of the last save started (of ``version`` when given). Lines are written as
    saves finish, so with a remote tier an earlier save's line may come after a later one's."""
    out = None
    for e in events:
        if e.get("kind") == "save" and (version is None or e.get("version") == version):
            if out is None or _started(e) >= _started(out):
                out = e
    return out


def _started(e: dict[str, Any]) -> float:
    t = e.get("t_call")
    return float(t) if isinstance(t, (int, float)) else float(e["t"])


def durable_lag_text(e: dict[str, Any] | None, now: float | None = None) -> str:
    """``save`` line ``e``'s durable lag in words (for ``ckptstore list`` and ``show``)."""
    if e is None:
        return "- (no save in the event log)"
    lag = e.get("durable_lag_s")
    if isinstance(lag, (int, float)):
        return f"{lag:.1f} s (save() at step {e.get('step')} to the remote commit)"
    if e.get("outcome") == "failed":
        return f"- (the save failed: {e.get('error')})"
    if e.get("uploaded_bytes") is None:
        return "- (no remote tier)"
    since = None if now is None or not isinstance(e.get("t_call"), (int, float)) else now - e["t_call"]
    return "not committed remotely" + ("" if since is None else f" ({since:.0f} s since save() at step {e.get('step')})")
