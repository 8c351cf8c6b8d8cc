"""What one rank receives through ``torch.distributed``, and how often it lists or stats a
directory, while a block of code runs: the per-rank costs docs/FORMAT.md ("Restore choice",
"Placement") keeps from growing with the job (``benchmarks/restore_bytes.py``, tests).

:func:`metered` wraps, in this process, torch's object collectives (``all_gather_object``,
``broadcast_object_list``, ``gather_object``, ``scatter_object_list``, ``send_object_list`` /
``recv_object_list``) and its tensor collectives and point-to-point calls (``all_gather``,
``all_gather_into_tensor``, ``broadcast``, ``gather``, ``scatter``, ``all_reduce``, ``recv``,
``irecv``), and ``os.listdir``, ``os.scandir``, ``os.stat``, ``os.lstat`` (``os.path.exists``,
``isdir`` and ``os.walk`` go through them). Received bytes are what lands on this rank: the pickled
size of every object an object collective leaves in its output (a gather's own entry included, a
broadcast's source receives nothing), the bytes of every tensor a tensor collective fills. A call made
inside another wrapped call (an object collective's own tensor collectives) is not counted again.
Each call is charged to whoever made it — ``"ckptstore"`` (code under ``ckptstore/`` outside
``ckptstore/testing/``), ``"dcp"`` (``torch/distributed/checkpoint/``) or ``"other"`` — by the
first caller frame outside ``torch/distributed/distributed_c10d.py``.

Not thread-safe as a measurement: calls from every thread of the process are counted (filesystem
calls of a background thread included).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import pickle
import sys
import threading
from typing import Iterator

__all__ = ["Meter", "metered"]

_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")
_DCP = os.path.join("torch", "distributed", "checkpoint") + os.sep
_PKG = os.sep + "ckptstore" + os.sep
_TESTING = os.sep + os.path.join("ckptstore", "testing") + os.sep
_HERE = os.path.abspath(__file__)


@dataclasses.dataclass
class Meter:
    """Counters of one :func:`metered` block: ``received[who]`` bytes, ``calls[(who, function)]``,
    ``fs[(who, function)]`` filesystem calls (``listdir``, ``scandir``, ``stat``, ``lstat``)."""

    received: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fs: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def fs_calls(self, who: str | None = None) -> int:
        """Filesystem calls (all, or ``who``'s)."""
        return sum(n for (w, _f), n in self.fs.items() if who is None or w == who)

    def to_json(self) -> dict:
        return {"received": dict(self.received), "calls": {f"{w}:{f}": n for (w, f), n in self.calls.items()},
                "fs": {f"{w}:{f}": n for (w, f), n in self.fs.items()}}


_tls = threading.local()


_kinds: dict = {}  # code file -> "skip" | "ckptstore" | "dcp" | "other"


def _kind(fn: str) -> str:
    k = _kinds.get(fn)
    if k is None:
        path = os.path.abspath(fn)
        if fn.endswith(_C10D) or path == _HERE or fn.endswith("contextlib.py"):
            k = "skip"
        elif _PKG in path and _TESTING not in path:
            k = "ckptstore"
        elif _DCP in path:
            k = "dcp"
        else:
            k = "other"
        _kinds[fn] = k
    return k


def _who() -> str:
    f = sys._getframe(2)
    while f is not None:
        k = _kind(f.f_code.co_filename)
        if k != "skip":
            return k
        f = f.f_back
    return "other"


def _size(o) -> int:
    try:
        return len(pickle.dumps(o))
    except Exception:  # noqa: BLE001 - not picklable here: not counted
        return 0


def _tbytes(t) -> int:
    return t.nelement() * t.element_size()


@contextlib.contextmanager
def metered() -> Iterator[Meter]:
    """Count what this process receives and lists while the block runs (see the module docstring)."""
    import torch.distributed as dist

    m = Meter()
    me = dist.get_rank() if dist.is_initialized() else 0

    def arg(args, kw, i, name, default=None):
        return args[i] if len(args) > i else kw.get(name, default)

    # function -> bytes this rank received, from its arguments after the call
    recv = {
        "all_gather_object": lambda a, k: sum(_size(o) for o in arg(a, k, 0, "object_list")),
        "broadcast_object_list": lambda a, k: 0 if _src(a, k, 1, "src") == me else sum(_size(o) for o in arg(a, k, 0, "object_list")),
        "gather_object": lambda a, k: sum(_size(o) for o in (arg(a, k, 1, "object_gather_list") or ())) if _src(a, k, 2, "dst") == me else 0,
        "scatter_object_list": lambda a, k: sum(_size(o) for o in arg(a, k, 0, "scatter_object_output_list")),
        "send_object_list": lambda a, k: 0,
        "recv_object_list": lambda a, k: sum(_size(o) for o in arg(a, k, 0, "object_list")),
        "all_gather": lambda a, k: sum(_tbytes(t) for t in arg(a, k, 0, "tensor_list")),
        "all_gather_into_tensor": lambda a, k: _tbytes(arg(a, k, 0, "output_tensor")),
        "broadcast": lambda a, k: 0 if _src(a, k, 1, "src") == me else _tbytes(arg(a, k, 0, "tensor")),
        "gather": lambda a, k: sum(_tbytes(t) for t in (arg(a, k, 1, "gather_list") or ())) if _src(a, k, 2, "dst") == me else 0,
        "scatter": lambda a, k: _tbytes(arg(a, k, 0, "tensor")),
        "all_reduce": lambda a, k: _tbytes(arg(a, k, 0, "tensor")),
        "recv": lambda a, k: _tbytes(arg(a, k, 0, "tensor")),
        "irecv": lambda a, k: _tbytes(arg(a, k, 0, "tensor")),
    }

    def _src(a, k, i, name):
        s = arg(a, k, i, name)
        if s is None:  # group_src / group_dst given instead: a group rank
            g = k.get("group")
            gs = k.get("group_src", k.get("group_dst"))
            return dist.get_global_rank(g, gs) if g is not None and gs is not None else 0
        return s

    def wrap_coll(name, fn):
        def wrapped(*a, **k):
            if getattr(_tls, "depth", 0):
                return fn(*a, **k)
            _tls.depth = 1
            try:
                out = fn(*a, **k)
            finally:
                _tls.depth = 0
            who = _who()
            m.calls[(who, name)] += 1
            m.received[who] += recv[name](a, k)
            return out
        return wrapped

    def wrap_fs(name, fn):
        def wrapped(*a, **k):
            m.fs[(_who(), name)] += 1
            return fn(*a, **k)
        return wrapped

    saved = []
    for name in recv:
        fn = getattr(dist, name, None)
        if fn is not None:
            saved.append((dist, name, fn))
            setattr(dist, name, wrap_coll(name, fn))
    for name in ("listdir", "scandir", "stat", "lstat"):
        fn = getattr(os, name)
        saved.append((os, name, fn))
        setattr(os, name, wrap_fs(name, fn))
    try:
        yield m
    finally:
        for mod, name, fn in reversed(saved):
            setattr(mod, name, fn)
