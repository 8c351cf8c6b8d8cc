"""The rooms of :class:`ckptstore.CheckpointManager` (private; the manager is the public surface).

The manager (``ckptstore/manager.py``) is the training loop's API; each concern it carries lives in
one module here, behind a small object the manager calls (as Orbax's ``CheckpointManager`` hands its
work to handlers and policies, and torchtitan's ``BaseCheckpointManager`` to ``_save``/``_load``):

- :mod:`.info` — ``SaveInfo`` and ``RestoreInfo``, the records the manager hands back;
- :mod:`.job` — :class:`~.job.Job`: the manager's own process group and whether the job is whole;
- :mod:`.state` — :class:`~.state.StateDicts`: the state dict saved and loaded for the loop's state;
- :mod:`.save_queue` — :class:`~.save_queue.SaveQueue`: the THREAD worker and its bounded queue,
  the PROCESS executor's one save in flight, failed saves kept to be raised;
- :mod:`.restore` — :class:`~.restore.Restorer`: the restore choice, the fallback past
  unverifiable copies and versions, the restore log, re-replication, ``RestoreInfo``;
- :mod:`.preempt` — :class:`~.preempt.Preemption`: the agreement round, the last save, the watchdog;
- :mod:`.signals` — :data:`~.signals.HUB`: the process's signal handlers and wakeup fd, which every
  manager of the process registers with, and the one step every manager saves after a signal;
- :mod:`.sink` — :class:`~.sink.EventSink`: event log lines, metrics, ``on_event``;
- :mod:`.registry` — the open managers of the process ("one manager per root").

Each takes what it works on (the writer, the job, callbacks) from the manager's arguments; inside
the package only :mod:`.save_queue` imports :mod:`.job`, :mod:`.restore` imports :mod:`.info` and
:mod:`.preempt` imports :mod:`.signals`, and nothing here imports :mod:`ckptstore.manager`.
"""
