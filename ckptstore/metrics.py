"""The event log's figures as OpenMetrics / Prometheus text (``CheckpointManager.metrics_text()``,
``CheckpointManager(metrics_file=...)`` for a node exporter's textfile collector).

:class:`Metrics` folds events (:mod:`ckptstore.events`) into counters and last-value gauges and
renders them in the Prometheus text format 0.0.4 (what a node exporter's textfile collector reads)
or the OpenMetrics text format (``openmetrics=True``: ``# EOF`` last). Every sample carries the ``rank`` label (several
ranks' files side by side in one textfile directory do not collide). :func:`write_textfile`
replaces a file atomically (temp file, rename), as the textfile collector needs. No dependency.
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any, Iterable

# family -> (type, help)
_FAMILIES: dict[str, tuple[str, str]] = {
    "ckptstore_saves": ("counter", "Saves finished, by outcome (committed, committed-local: the upload failed, failed, skipped: a due save while the previous one still ran, with on_busy='skip')."),
    "ckptstore_save_blocked_seconds": ("counter", "Seconds the training loop spent inside save() (staging, back-pressure)."),
    "ckptstore_saved_bytes": ("counter", "Bytes of committed saves: logical (tensors), stored (after compression), uploaded."),
    "ckptstore_restores": ("counter", "Restores, by outcome (restored, none: nothing to restore, failed)."),
    "ckptstore_restore_skipped_versions": ("counter", "Versions a restore passed over, by kind (damaged, missing, unverified, shape, restarts, nonfinite)."),
    "ckptstore_gc_runs": ("counter", "Retention / gc runs that deleted something or failed, by source."),
    "ckptstore_gc_deleted_versions": ("counter", "Version copies deleted by retention / gc."),
    "ckptstore_preemptions": ("counter", "Preemption signals handled, by outcome (saved, not-saved)."),
    "ckptstore_step": ("gauge", "The last step the training loop passed to save()."),
    "ckptstore_last_save_step": ("gauge", "Step of the last finished save."),
    "ckptstore_last_save_timestamp_seconds": ("gauge", "Unix time the last save finished."),
    "ckptstore_last_save_seconds": ("gauge", "The last finished save's seconds, by phase (blocked, stage, write, commit, local_commit, upload, remote_commit, replicate)."),
    "ckptstore_last_save_bytes": ("gauge", "The last committed save's bytes: logical, stored, uploaded."),
    "ckptstore_durable_lag_seconds": ("gauge", "Seconds from the last save's step (its save() call) to its remote commit."),
    "ckptstore_committed_step": ("gauge", "Newest step committed, by tier (local, remote)."),
    "ckptstore_last_restore_seconds": ("gauge", "Seconds the last restore took (agreeing and loading)."),
    "ckptstore_restore_count": ("gauge", "Restores in a row of the same version before the last one (a restart loop when >= 1)."),
    "ckptstore_preempt_seconds": ("gauge", "Seconds from the last preemption signal to its save's commit."),
}

_PHASES = ("blocked_s", "stage_s", "write_s", "commit_s", "local_commit_s", "upload_s", "remote_commit_s", "replicate_s")


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(x: float) -> str:
    if float(x).is_integer() and abs(x) < 2**53:
        return str(int(x))
    return repr(float(x))


class Metrics:
    """Counters and gauges of one rank's events; :meth:`text` renders them (thread-safe)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple], float] = {}
        self._gauges: dict[tuple[str, tuple], float] = {}

    def _inc(self, name: str, by: float = 1.0, **labels: str) -> None:
        k = (name, tuple(sorted(labels.items())))
        self._counters[k] = self._counters.get(k, 0.0) + by

    def _set(self, name: str, value: float | None, **labels: str) -> None:
        if value is not None:
            self._gauges[(name, tuple(sorted(labels.items())))] = float(value)

    def observe(self, e: dict[str, Any]) -> None:
        """Fold one event (a line of the event log) in."""
        kind = e.get("kind")
        with self._lock:
            if kind == "progress":
                self._set("ckptstore_step", _num(e.get("step")))
                if e.get("save"):
                    self._inc("ckptstore_save_blocked_seconds", _num(e.get("blocked_s")) or 0.0)
            elif kind == "save":
                outcome = str(e.get("outcome") or "unknown")
                self._inc("ckptstore_saves", outcome=outcome)
                self._set("ckptstore_last_save_step", _num(e.get("step")))
                self._set("ckptstore_last_save_timestamp_seconds", _num(e.get("t")))
                for p in _PHASES:
                    self._set("ckptstore_last_save_seconds", _num(e.get(p)), phase=p[:-2])
                if outcome not in ("failed", "skipped"):
                    for b in ("logical", "stored", "uploaded"):
                        n = _num(e.get(f"{b}_bytes"))
                        if n is not None:
                            self._inc("ckptstore_saved_bytes", n, kind=b)
                            self._set("ckptstore_last_save_bytes", n, kind=b)
                    self._set("ckptstore_committed_step", _num(e.get("step")), tier="local")
                    if e.get("remote_commit_s") is not None:
                        self._set("ckptstore_committed_step", _num(e.get("step")), tier="remote")
                    self._set("ckptstore_durable_lag_seconds", _num(e.get("durable_lag_s")))
            elif kind == "restore":
                self._inc("ckptstore_restores", outcome=str(e.get("outcome") or "unknown"))
                self._set("ckptstore_last_restore_seconds", _num(e.get("seconds")))
                self._set("ckptstore_restore_count", _num(e.get("restore_count")))
                for sk in e.get("skipped") or ():
                    if isinstance(sk, dict):
                        self._inc("ckptstore_restore_skipped_versions", kind=str(sk.get("kind") or "unknown"))
            elif kind == "gc":
                self._inc("ckptstore_gc_runs", source=str(e.get("source") or "gc"))
                self._inc("ckptstore_gc_deleted_versions", float(len(e.get("deleted") or ())))
            elif kind == "preempt":
                self._inc("ckptstore_preemptions", outcome="saved" if e.get("saved") else "not-saved")
                self._set("ckptstore_preempt_seconds", _num(e.get("seconds")))

    def text(self, openmetrics: bool = False) -> str:
        """Everything observed so far in the Prometheus text format 0.0.4 (what a node exporter's
        textfile collector reads: counters declared under their ``_total`` name), or with
        ``openmetrics`` in the OpenMetrics format (families without the suffix, ``# EOF`` last)."""
        with self._lock:
            counters, gauges = dict(self._counters), dict(self._gauges)
        lines: list[str] = []
        for fam, (typ, hlp) in _FAMILIES.items():
            src = counters if typ == "counter" else gauges
            samples = sorted((labels, v) for (n, labels), v in src.items() if n == fam)
            name = fam + "_total" if typ == "counter" else fam
            declared = fam if openmetrics else name
            lines.append(f"# HELP {declared} {hlp}")
            lines.append(f"# TYPE {declared} {typ}")
            for labels, v in samples:
                lab = ",".join(f'{k}="{_escape(x)}"' for k, x in (*labels, ("rank", str(self.rank))))
                lines.append(f"{name}{{{lab}}} {_fmt(v)}")
        if openmetrics:
            lines.append("# EOF")
        return "\n".join(lines) + "\n"


def from_events(events: Iterable[dict[str, Any]], rank: int = 0) -> Metrics:
    m = Metrics(rank)
    for e in events:
        m.observe(e)
    return m


def write_textfile(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (a temp file in the same directory, then rename):
    a textfile collector never reads half a file."""
    path = os.fspath(path)
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".part", dir=d)  # not *.prom: never collected half-written
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
