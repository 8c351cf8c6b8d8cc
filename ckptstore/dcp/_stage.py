"""What the stages of the writer and the reader share: a lock of their own that pickling leaves out.

``StorageWriter`` is pickled, with its stages, for DCP's checkpoint subprocess
(``AsyncCheckpointerType.PROCESS``), and a ``StorageReader`` may be pickled with its load's state; a
lock does not travel, nor do a pool, a client or the futures of this process (:attr:`OwnLock._fresh`).
"""

from __future__ import annotations

import threading


class OwnLock:
    """A stage with ``self._lock``: pickled without it, unpickled with a new one."""

    #: ``{attribute: factory}``: attributes pickled as a fresh value (what belongs to this process)
    _fresh: dict = {}

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __getstate__(self):
        s = self.__dict__.copy()
        del s["_lock"]
        for name, make in self._fresh.items():
            s[name] = make()
        return s

    def __setstate__(self, s) -> None:
        self.__dict__.update(s)
        self._lock = threading.Lock()


__all__ = ["OwnLock"]
