"""The process's side of preemption: signal handlers, the signal wakeup fd, forked children.

A signal handler belongs to the process, not to one manager. :data:`HUB` (a :class:`SignalHub`) is
the one place that installs ckptstore's handler for a signal and passes each signal on to the
:class:`~.preempt.Preemption` of the manager that listens for it; managers register with it when
created (:meth:`SignalHub.listen`) and leave when closed (:meth:`SignalHub.unlisten`).

- **Which manager hears a signal.** One listener per signal: a manager created later takes the
  signal over from an earlier one of the process (which keeps what it had learnt); the program's
  previous handler comes back when the listening manager closes. With ``save_on_signal="auto"``
  a signal that has a handler of the program's own (not ckptstore's) is left alone. (The hub is
  where a signal would be passed on to every registered manager instead, for all of them to save
  the same step.)
- **The handler only records** the signal (the listener's ``on_signal``); the saving happens at
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
    """ckptstore's signal handlers of this process (one instance: :data:`HUB`).

    A listener has ``on_signal(signum)`` (called from the handler: it must only record) and
    ``forked()`` (called in a forked child: forget the signals and the wakeup fd)."""

    def __init__(self) -> None:
        self._owner: dict[int, Any] = {}  # signal -> the listener it is passed to
        self._prev: dict[int, Any] = {}  # signal -> the program's handler before ckptstore's
        self._listeners: "weakref.WeakSet[Any]" = weakref.WeakSet()  # all that listened (reset in children)

    def listen(self, listener, wanted: tuple[int, ...], explicit: bool) -> tuple[int, ...]:
        """Pass the signals ``wanted`` to ``listener`` from now on; return those it gets. Only in the
        main thread (else none: a warning when ``explicit``); without ``explicit`` (``"auto"``), a
        signal with a handler of the program's own is left alone."""
        if threading.current_thread() is not threading.main_thread():
            if explicit:
                log.warning("ckptstore: save_on_signal needs the manager to be created in the main thread; "
                            "signals are not handled")
            return ()
        got: dict[int, None] = {}
        for signum in wanted:
            prev = _signal.getsignal(signum)
            if getattr(prev, "__self__", None) is self:  # an earlier manager's: take over from it
                self._prev.setdefault(signum, _signal.SIG_DFL)
            elif not explicit and prev not in (_signal.SIG_DFL, None):
                log.info("ckptstore: %s has a handler of the program's own; CheckpointManager leaves it alone",
                         _signal.Signals(signum).name)
                continue
            else:
                _signal.signal(signum, self._handle)
                self._prev[signum] = prev
            self._owner[signum] = listener
            got[signum] = None
        if got:
            self._listeners.add(listener)
        return tuple(got)

    def unlisten(self, listener) -> None:
        """Give the signals ``listener`` still gets their previous handlers back (main thread only)."""
        for signum, owner in list(self._owner.items()):
            if owner is not listener:
                continue
            prev = self._prev.pop(signum, _signal.SIG_DFL)
            del self._owner[signum]
            if getattr(_signal.getsignal(signum), "__self__", None) is self:
                _signal.signal(signum, prev if prev is not None else _signal.SIG_DFL)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - the signal handler: records only
        owner = self._owner.get(signum)
        if owner is not None:
            owner.on_signal(signum)

    def _reset_in_child(self) -> None:
        try:
            for signum in list(self._owner):
                if getattr(_signal.getsignal(signum), "__self__", None) is self:
                    prev = self._prev.get(signum)
                    _signal.signal(signum, prev if prev is not None else _signal.SIG_DFL)
        except (ValueError, OSError):  # forked from a thread other than the main one
            pass
        self._owner.clear()
        for listener in list(self._listeners):
            listener.forked()


#: the signal handlers of this process
HUB = SignalHub()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=HUB._reset_in_child)
