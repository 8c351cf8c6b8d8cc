"""The process's side of preemption: signal handlers, the signal wakeup fd, forked children.

A signal handler belongs to the process, not to one manager. :data:`HUB` (a :class:`SignalHub`) is
the one place that installs ckptstore's handler for a signal and passes each signal on to the
:class:`~.preempt.Preemption` of the manager that listens for it; managers register with it when
created (:meth:`SignalHub.listen`) and leave when closed (:meth:`SignalHub.unlisten`).

- **Every manager hears a signal.** A signal is passed to every manager of the process that listens
  for it (a model manager and a ``prefix="loader-"`` manager, as the README suggests); the program's
  previous handler comes back when the last of them closes. With ``save_on_signal="auto"`` a signal
  that has a handler of the program's own (not ckptstore's) is left alone.
- **One step for the whole process** (:meth:`SignalHub.stop_at`). The first manager whose
  ``save()`` call agrees on a signal sets the process's stop step: that call's step when no other
  listening manager has been called at that step yet (they are called after it in the loop), else
  the next step (one of them already passed this one). Every manager saves that step at its
  ``save()`` call of it; the last one to save raises :class:`~ckptstore.errors.Preempted`, the
  others return (:meth:`SignalHub.saved`). A resumed run then finds model and data loader at the
  same step. In a job every rank calls its managers in the same order and every manager's agreement
  is a collective, so every rank picks the same step.
- **The handler only records** the signal (the listeners' ``on_signal``); the saving happens at
  the next ``save()`` call of the training loop.
- **The wakeup fd** (:class:`Wakeup`): Python's ``signal.set_wakeup_fd``, written by the C-level
  handler at once, so that a watchdog thread hears the signal even when the main thread never gets
  back into the interpreter (a loop blocked in a collective with a stuck rank).
- **Forked children** (a data loader's worker, a forkserver) are not the training loop: the signals
  get their previous handlers back and the wakeup fd (shared with the parent's watchdog) is
  dropped, so a SIGTERM to the child ends it as before and never reaches the parent's watchdog.
"""

from __future__ import annotations

import logging
import os
import signal as _signal
import threading
import weakref
from typing import Any

log = logging.getLogger("ckptstore")


class Wakeup:
    """A socket pair whose write end is Python's signal wakeup fd (``signal.set_wakeup_fd``): the
    C-level handler writes each signal's number there as it arrives, whatever the main thread is
    doing; the watchdog thread reads the other end. Not installed when the program already has a
    wakeup fd (asyncio's): the watchdog then learns of the signal from the Python handler."""

    def __init__(self) -> None:
        import socket

        self.r, self.w = socket.socketpair()
        self.w.setblocking(False)

    @classmethod
    def install(cls) -> "Wakeup | None":
        wk = cls()
        try:
            old = _signal.set_wakeup_fd(wk.w.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):
            wk.close()
            return None
        if old != -1:
            _signal.set_wakeup_fd(old)
            wk.close()
            return None
        return wk

    def wait(self) -> bytes:
        try:
            return self.r.recv(64)
        except OSError:
            return b""

    def poke(self) -> None:
        try:
            self.w.send(b"\0")
        except OSError:
            pass

    def uninstall(self) -> None:
        try:
            cur = _signal.set_wakeup_fd(-1)
            if cur not in (-1, self.w.fileno()):
                _signal.set_wakeup_fd(cur)
        except (ValueError, OSError):
            pass

    def close(self) -> None:
        for sk in (self.r, self.w):
            try:
                sk.close()
            except OSError:
                pass


class SignalHub:
    """ckptstore's signal handlers of this process (one instance: :data:`HUB`), and the process's
    stop step once a signal was agreed on (see the module docstring).

    A listener has ``on_signal(signum)`` (called from the handler: it must only record) and
    ``forked()`` (called in a forked child: forget the signals and the wakeup fd)."""

    def __init__(self) -> None:
        self._owners: dict[int, list] = {}  # signal -> the listeners it is passed to, in order
        self._prev: dict[int, Any] = {}  # signal -> the program's handler before ckptstore's
        self._listeners: "weakref.WeakSet[Any]" = weakref.WeakSet()  # all that listened (reset in children)
        self._lock = threading.Lock()
        self._managers: "weakref.WeakSet[Any]" = weakref.WeakSet()  # every manager that asked for signals
        self._calls: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()  # manager -> last save() step
        self._stop: tuple | None = None  # (step, agreed signal tuple): the step every manager saves
        self._members: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the managers the stop step is for
        self._saved: "weakref.WeakSet[Any]" = weakref.WeakSet()  # members that saved the stop step

    def listen(self, listener, wanted: tuple[int, ...], explicit: bool) -> tuple[int, ...]:
        """Pass the signals ``wanted`` to ``listener`` from now on (and to every other manager that
        listens for them); return those it gets. Only in the main thread (else none: a warning when
        ``explicit``); without ``explicit`` (``"auto"``), a signal with a handler of the program's own
        is left alone."""
        if threading.current_thread() is not threading.main_thread():
            if explicit:
                log.warning("ckptstore: save_on_signal needs the manager to be created in the main thread; "
                            "signals are not handled")
            return ()
        got: dict[int, None] = {}
        for signum in wanted:
            prev = _signal.getsignal(signum)
            if getattr(prev, "__self__", None) is self:  # another manager's: this one hears it too
                self._prev.setdefault(signum, _signal.SIG_DFL)
            elif not explicit and prev not in (_signal.SIG_DFL, None):
                log.info("ckptstore: %s has a handler of the program's own; CheckpointManager leaves it alone",
                         _signal.Signals(signum).name)
                continue
            else:
                _signal.signal(signum, self._handle)
                self._prev[signum] = prev
            with self._lock:
                self._owners[signum] = [x for x in self._owners.get(signum, []) if x is not listener] + [listener]
            got[signum] = None
        if got:
            self._listeners.add(listener)
        return tuple(got)

    def unlisten(self, listener) -> None:
        """Stop passing signals to ``listener``; a signal no manager listens for any more gets its
        previous handler back (main thread only)."""
        with self._lock:
            gone = []
            for signum, owners in list(self._owners.items()):
                if listener not in owners:
                    continue
                owners = [x for x in owners if x is not listener]
                if owners:
                    self._owners[signum] = owners
                else:
                    del self._owners[signum]
                    gone.append(signum)
        for signum in gone:
            prev = self._prev.pop(signum, _signal.SIG_DFL)
            if getattr(_signal.getsignal(signum), "__self__", None) is self:
                _signal.signal(signum, prev if prev is not None else _signal.SIG_DFL)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - the signal handler: records only
        for owner in list(self._owners.get(signum, ())):
            owner.on_signal(signum)

    # -- one stop step for every manager of the process ---------------------------------------------
    def join(self, manager) -> None:
        """``manager`` (a manager's preemption) takes part in the process's stop step — every manager
        that asked for signals, also on a rank where no handler could be installed (its peers may hear
        the signal)."""
        with self._lock:
            self._managers.add(manager)

    def leave(self, manager) -> None:
        """``manager`` closed; the stop step is forgotten once no manager is left."""
        with self._lock:
            self._managers.discard(manager)
            self._members.discard(manager)
            self._calls.pop(manager, None)
            if not len(self._members):
                self._stop = None
                self._saved = weakref.WeakSet()

    def called(self, listener, step: int) -> None:
        """``listener``'s manager is at its ``save(step)`` call."""
        with self._lock:
            self._calls[listener] = int(step)

    def stop(self, manager=None) -> tuple | None:
        """``(step, agreed signal)`` once a manager of the process agreed on a signal, else None (also
        for a ``manager`` created after that: the stop step is not its)."""
        st = self._stop
        if st is None or (manager is not None and manager not in self._members):
            return None
        return st

    def stop_at(self, listener, step: int, pre: tuple) -> tuple:
        """``listener``'s manager agreed on the signal ``pre`` at its ``save(step)`` call: the process's
        stop step (set once; see the module docstring), as ``(step, pre)``."""
        with self._lock:
            if self._stop is None or listener not in self._members:
                self._members = weakref.WeakSet(self._managers)
                self._members.add(listener)
                self._saved = weakref.WeakSet()
                others = [x for x in self._members if x is not listener]
                late = any(self._calls.get(x, -1) >= step for x in others)
                self._stop = (int(step) + 1 if late else int(step), pre)
                if late:
                    log.warning("ckptstore: a signal was agreed on at step %d, after another manager of this process "
                                "passed that step: every manager saves step %d", step, step + 1)
            return self._stop

    def saved(self, listener) -> bool:
        """``listener``'s manager saved the stop step; True when it is the last of the process's
        listening managers to do so (it raises ``Preempted``; the others returned)."""
        with self._lock:
            self._saved.add(listener)
            return all(x in self._saved for x in self._members)

    def _reset_in_child(self) -> None:
        try:
            for signum in list(self._owners):
                if getattr(_signal.getsignal(signum), "__self__", None) is self:
                    prev = self._prev.get(signum)
                    _signal.signal(signum, prev if prev is not None else _signal.SIG_DFL)
        except (ValueError, OSError):  # forked from a thread other than the main one
            pass
        self._owners.clear()
        self._managers = weakref.WeakSet()
        self._members = weakref.WeakSet()
        self._calls = weakref.WeakKeyDictionary()
        self._stop = None
        self._saved = weakref.WeakSet()
        self._lock = threading.Lock()
        for listener in list(self._listeners):
            listener.forked()


#: the signal handlers of this process
HUB = SignalHub()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=HUB._reset_in_child)
