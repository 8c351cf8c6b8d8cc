"""The entry point ``torchrun`` starts on a node of ``ckptstore demo --chaos``: the worker, under the node's clock.

``python -m ckptstore.demo.chaos.clockexec --config CFG`` reads the node's clock file
(``$CKPTSTORE_CHAOS_CLOCK``, written by the supervisor; fault ``clock-jump``). Empty or ``+0``: it runs
:mod:`ckptstore.demo.chaos.worker` in this process. An offset (``+2h``): it replaces itself (same pid, so
``torchrun`` still watches it) by the worker under libfaketime (``LD_PRELOAD`` of ``libfaketime.so.1``,
``FAKETIME=+2h``): every clock the process reads is that far ahead, as on a host whose clock jumped.

Only the workers (and the operator's commands the supervisor runs on that node) get the offset, not the
``torchrun`` agent: torch's c10d rendezvous compares the agents' wall-clock heartbeats across nodes
(``dynamic_rendezvous.py``, ``_sanitize``), so an agent 2 h ahead would count the others dead, which is
torch's matter, not the storage's. libfaketime 0.9.10 cannot move the clock of a running process safely
(``FAKETIME_DONT_FAKE_MONOTONIC=1`` makes ``time.sleep`` fail with EINVAL; a changing offset with a faked
monotonic clock stalls sleeps), so the offset applies from a process's start: the fault restarts the
node's ranks.
"""

from __future__ import annotations

import os
import runpy
import sys

#: where Debian's ``libfaketime`` puts the preload library (``apt-get install faketime``)
LIBFAKETIME = ("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1", "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
               "/usr/lib/faketime/libfaketime.so.1", "/usr/local/lib/faketime/libfaketime.so.1")


def libfaketime() -> str | None:
    """The path of ``libfaketime.so.1``, or None when it is not installed."""
    for p in LIBFAKETIME:
        if os.path.exists(p):
            return p
    return None


def read_offset(path: str | None) -> str:
    """The offset in a node's clock file (``+2h``), or ``""`` for the true clock."""
    if not path:
        return ""
    try:
        with open(path) as f:
            x = f.read().strip()
    except OSError:
        return ""
    return "" if x in ("", "+0", "0") else x


def faketime_env(offset: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default ``os.environ``) with libfaketime preloaded at ``offset``; raises
    ``FileNotFoundError`` when libfaketime is not installed."""
    lib = libfaketime()
    if lib is None:
        raise FileNotFoundError("libfaketime is not installed (Debian: apt-get install faketime)")
    env = dict(os.environ if env is None else env)
    env["LD_PRELOAD"] = ":".join(x for x in (lib, env.get("LD_PRELOAD", "")) if x)
    env["FAKETIME"] = offset
    env.pop("FAKETIME_DONT_FAKE_MONOTONIC", None)
    return env


#: the chaos run's worker (its loop over the demo's model, data and optimizer)
WORKER = "ckptstore.demo.chaos.worker"


def main() -> None:
    offset = read_offset(os.environ.get("CKPTSTORE_CHAOS_CLOCK"))
    if offset and os.environ.get("FAKETIME") != offset:
        os.execve(sys.executable, [sys.executable, "-m", WORKER, *sys.argv[1:]],
                  faketime_env(offset))
    sys.argv[0] = WORKER
    runpy.run_module(WORKER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
