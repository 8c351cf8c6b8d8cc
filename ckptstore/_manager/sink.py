"""Where a :class:`ckptstore.CheckpointManager`'s events go: the event log, the metrics, ``on_event``.

- **Event log** (:mod:`ckptstore.events`, docs/FORMAT.md "Event log"): rank 0 appends one JSON line
  per save, restore, retention run and preemption, plus ``open``/``close``/``progress`` lines, to
  ``ROOT/events.jsonl`` (``event_log=`` another path, ``{rank}`` in it for one log per rank, False:
  none); every rank passes its events to ``on_event`` and ``metrics_text()``
  (:mod:`ckptstore.metrics`; ``metrics_file=`` keeps a textfile-collector file up to date).
  ``ckptstore goodput LOG`` (:mod:`ckptstore.goodput`) reads the log back.

:meth:`EventSink.emit` never raises: a log or metrics file that cannot be written is warned about, a
failing ``on_event`` callback is logged, and saving and restoring go on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any

from ..events import FORMAT, EventLog, default_path
from ..errors import Preempted
from ..metrics import Metrics, write_textfile

log = logging.getLogger("ckptstore")


def _per_rank_path(path: str, rank: int) -> str | None:
    """``path`` with ``{rank}`` filled in (every rank has one), else ``path`` on rank 0 only."""
    return path.format(rank=rank) if "{rank}" in path else (path if rank == 0 else None)


class EventSink:
    """The events of one manager on rank ``rank`` of a job of ``world`` ranks.

    ``root``: the local root (its ``events.jsonl`` is the default log); ``remote``: the manager's
    remote URL or None; ``writer``: the manager's :class:`ckptstore.StorageWriter`, which says the
    phases, sizes and retention runs of each save. ``event_log``, ``on_event``, ``metrics_file`` and
    ``progress_s`` as :class:`ckptstore.CheckpointManager` takes them."""

    def __init__(self, *, rank: int, world: int, root: str, remote: str | None, writer, event_log: Any,
                 on_event, metrics_file, progress_s: float) -> None:
        self.rank, self.world, self.remote, self._writer = rank, world, remote, writer
        self.attempt_id = uuid.uuid4().hex[:12]  # this manager's part of the run (the lines' "a")
        self.on_event = on_event
        self.progress_s = float(progress_s)
        path = None
        if event_log is True:
            path = default_path(root) if rank == 0 else None
        elif event_log not in (None, False):
            path = _per_rank_path(os.fspath(event_log), rank)
        #: the event log this rank appends to (None: this rank writes none)
        self.event_log = path
        self._elog = EventLog(path) if path else None
        self._elog_failed = False
        self.metrics_file = None if metrics_file is None else _per_rank_path(os.fspath(metrics_file), rank)
        self._metrics = Metrics(rank)
        self._metrics_lock = threading.Lock()
        self._last_progress = float("-inf")
        self._save_extra: dict[str, dict] = {}

    def emit(self, kind: str, **fields: Any) -> dict:
        """One event of this rank: to the log (rank 0), the metrics and ``on_event``; never raises."""
        e = {"ev": FORMAT, "kind": kind, "t": time.time(), "a": self.attempt_id, "rank": self.rank, **fields}
        if self._elog is not None:
            try:
                self._elog.write(e)
            except OSError as ex:
                if not self._elog_failed:
                    self._elog_failed = True
                    log.warning("ckptstore: cannot append to the event log %s: %s (events are not logged)", self.event_log, ex)
        self._metrics.observe(e)
        if self.metrics_file and kind != "progress":
            try:
                with self._metrics_lock:
                    write_textfile(self.metrics_file, self._metrics.text())
            except OSError as ex:
                log.warning("ckptstore: cannot write the metrics file %s: %s", self.metrics_file, ex)
        if self.on_event is not None:
            try:
                self.on_event(dict(e))
            except Exception:  # noqa: BLE001 - a callback must not break saving
                log.exception("ckptstore: on_event callback failed")
        return e

    def metrics_text(self, openmetrics: bool = False) -> str:
        """This rank's figures in the Prometheus text format 0.0.4 (OpenMetrics with ``openmetrics``)."""
        return self._metrics.text(openmetrics)

    def progress(self, step: int, t_call: float, version: str | None) -> None:
        """A ``progress`` line: always for a save (``version``), else at most every ``progress_s``."""
        now = time.monotonic()
        if version is None and now - self._last_progress < self.progress_s:
            return
        self._last_progress = now
        fields: dict[str, Any] = {"step": int(step)}
        if version is not None:
            fields.update(save=version, blocked_s=now - t_call)
        self.emit("progress", **fields)

    def save_called(self, version: str, t0: float, forced: bool) -> dict:
        """Note the ``save()`` call (monotonic ``t0``) of ``version`` for its save line; returns the
        record, to which the caller adds ``stage_s``."""
        extra = self._save_extra[version] = {"t_call": time.time() - (time.monotonic() - t0), "forced": forced}
        return extra

    def _manifest_of(self, info):
        """The manifest of the save ``info`` (for its sizes), or None."""
        m = self._writer.last_manifest
        if m is not None and m.version == info.version:
            return m
        if self.rank == 0 and info.local_commit_s is not None and self._elog is not None:
            try:  # PROCESS executor: the subprocess committed it; its manifest says the sizes
                from ..manifest import catalogue

                return catalogue.read_manifest(self._writer._tier, info.version).manifest
            except Exception:  # noqa: BLE001 - the figures are optional
                return None
        return None

    def save_event(self, info) -> None:
        """The ``save`` line of the save ``info`` (a :class:`~.info.SaveInfo`), then a ``gc`` line per
        version retention pruned after it."""
        extra = self._save_extra.pop(info.version, {})
        tm = self._writer.timings(info.version)
        m = self._manifest_of(info)
        remote_ok = info.remote_commit_s is not None
        if info.local_commit_s is None:
            outcome = "failed"
        elif self.remote is not None and self.rank == 0 and not remote_ok and info.error:
            outcome = "committed-local"
        else:
            outcome = "committed"
        upload_s = info.remote_commit_s - info.local_commit_s if remote_ok and info.local_commit_s is not None else None
        self.emit(
            "save", step=info.step, version=info.version, ranks=self.world, t_call=extra.get("t_call"),
            forced=bool(extra.get("forced")), blocked_s=info.blocked_s, stage_s=extra.get("stage_s"),
            write_s=tm.get("write_s"), commit_s=tm.get("commit_s"), local_commit_s=info.local_commit_s,
            upload_s=upload_s, replicate_s=tm.get("replicate_s"), remote_commit_s=info.remote_commit_s,
            durable_lag_s=info.remote_commit_s, logical_bytes=None if m is None else m.nbytes,
            stored_bytes=None if m is None else m.stored_bytes,
            uploaded_bytes=(None if m is None else m.stored_bytes) if remote_ok else (0 if self.remote else None),
            durability="remote" if remote_ok else ("local" if info.local_commit_s is not None else None),
            outcome=outcome, error="; ".join(e for e in (info.error, info.replica_error) if e) or None,
            replicas=info.replicas, nonfinite=None if m is None else m.nonfinite_count, paused_s=info.paused_s,
        )
        for pruned in self._writer.pruned():
            self.emit("gc", source="retention", **pruned)

    def restore_event(self, t_wall: float, r, e: BaseException | None, rollback: bool = False) -> None:
        """The ``restore`` line of a restore begun at wall time ``t_wall``: ``r`` (a
        :class:`~.info.RestoreInfo`) what it loaded, None with ``e`` None: nothing to load, else
        ``e`` what it raised; ``rollback``: made by ``CheckpointManager.rollback``. Never raises."""
        try:
            self._restore_line(t_wall, r, e, rollback)
        except Exception:  # noqa: BLE001 - the event log never changes what restore() returns or raises
            log.exception("ckptstore: could not record the restore event")

    def _restore_line(self, t_wall: float, r, e: BaseException | None, rollback: bool = False) -> None:
        fields: dict[str, Any] = {"t0": t_wall, "seconds": time.time() - t_wall, "ranks": self.world}
        if rollback:
            fields["rollback"] = True
        if r is not None:
            fields.update(
                outcome="restored", version=r.version, step=r.step, saved_ranks=r.world_size, attempt_loaded=r.attempt,
                skipped=[{"version": sk.version, "kind": sk.kind, "reason": sk.reason} for sk in r.skipped],
                remote_error=r.remote_error, restore_count=r.restore_count, rng_restored=r.rng_restored,
                reads={k: v for k, v in r.reads.items() if isinstance(v, (int, float))})
        elif e is None:
            fields.update(outcome="none")
        else:
            fields.update(outcome="failed", error=f"{type(e).__name__}: {e}")
        self.emit("restore", **fields)

    def close(self, t_wall: float, err: BaseException | None, loop_error: BaseException | None) -> None:
        """The ``close`` line of a close begun at wall time ``t_wall`` (``err``: what it raised;
        ``loop_error``: the exception that left the manager's ``with`` block), then close the log."""
        # the loop's own exception (not a preemption): the attempt ended in a failure (ckptstore goodput)
        failed = loop_error is not None and not isinstance(loop_error, (Preempted, KeyboardInterrupt))
        self.emit("close", t0=t_wall, seconds=time.time() - t_wall, outcome="ok" if err is None else "error",
                  error=None if err is None else f"{type(err).__name__}: {err}",
                  loop_error=f"{type(loop_error).__name__}: {loop_error}"[:500] if failed else None)
        if self._elog is not None:
            self._elog.close()
