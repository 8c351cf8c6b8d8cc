"""Everything that depends on torchft's private surface (tested with :data:`TESTED_VERSIONS`).

:mod:`ckptstore.integrations.torchft` reads these facts of a ``torchft.Manager`` and its lighthouse;
a torchft release that changes any of them needs this module changed (and a new entry in
:data:`TESTED_VERSIONS`):

* ``Manager`` attributes: ``_timeout`` and ``_quorum_timeout`` (``timedelta``, after torchft's
  ``TORCHFT_TIMEOUT_SEC`` / ``TORCHFT_QUORUM_TIMEOUT_SEC``), ``_quorum_id``, ``_quorum_future`` (the
  ``concurrent.futures.Future`` of the newest quorum), ``_participating_replica_rank`` (None when the
  group is not at the quorum's max step), ``_healing``, ``_group_rank``, ``_group_world_size``,
  ``_replica_id`` (the prefix the user gave; the lighthouse sees ``"<prefix>:<uuid>"``),
  ``_load_state_dict_fns`` and ``_user_state_dicts`` (the registered state dict functions, by key);
  ``OptimizerWrapper.optim`` (the wrapped optimizer);
* the lighthouse's HTTP page ``GET <lighthouse>/status`` (``templates/status.html``): the previous
  quorum's members as ``<b>REPLICA_ID</b> <br/> Step: N``, and the heartbeats as
  ``REPLICA_ID: seen AGE s ago``.

Public torchft API used elsewhere: ``Manager.current_step()``, ``state_dict()``/``load_state_dict()``,
``participating_rank()``, ``is_participating()``, ``num_participants()``.
"""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass, field
from typing import Any

#: torchft releases this module was tested with
TESTED_VERSIONS = ("0.2.0",)


def register_state(manager: Any, key: str, load_fn: Any, state_fn: Any) -> None:
    """``manager.register_state_dict_fn(key, ...)``, replacing an earlier registration of ``key`` (torchft
    asserts on a key registered twice: a second tier on one Manager) through ``_load_state_dict_fns``
    and ``_user_state_dicts``."""
    getattr(manager, "_load_state_dict_fns", {}).pop(key, None)
    getattr(manager, "_user_state_dicts", {}).pop(key, None)
    manager.register_state_dict_fn(key, load_fn, state_fn)


def timeouts_s(manager: Any) -> tuple[float, float]:
    """torchft's ``timeout`` and ``quorum_timeout`` of ``manager``, in seconds."""
    return manager._timeout.total_seconds(), manager._quorum_timeout.total_seconds()


def quorum_id(manager: Any) -> int:
    return int(manager._quorum_id)


def replica_prefix(manager: Any) -> str | None:
    """The ``replica_id`` the user gave torchft (without torchft's per-restart uuid), or None."""
    return manager._replica_id


def group_rank_world(manager: Any) -> tuple[int, int]:
    return int(manager._group_rank), int(manager._group_world_size)


def inner_optimizer(opt: Any) -> Any:
    """The optimizer inside a ``torchft.optim.OptimizerWrapper`` (else ``opt``)."""
    from torchft.optim import OptimizerWrapper

    return opt.optim if isinstance(opt, OptimizerWrapper) else opt


def claim_lost(manager: Any) -> str | None:
    """Why this replica group no longer owns the step it is saving, or None while it does: its newest
    quorum failed (it could not reach the lighthouse: it is out of the quorum), or in its newest quorum
    it is not a participant at the max step (another group got ahead of it: it heals, it does not
    own that step). Called from the writer's thread right before the commit point."""
    fut = manager._quorum_future
    if fut is not None and fut.done():
        e = fut.exception()
        if e is not None:
            return f"its newest torchft quorum failed ({type(e).__name__}: {e})"
    if manager._participating_replica_rank is None and fut is not None:
        return f"it is not a participant at the max step of its newest quorum (quorum {manager._quorum_id})"
    return None


# -- the lighthouse's status page ----------------------------------------------------------------
@dataclass
class LighthouseView:
    """What the lighthouse's ``/status`` page says: ``members`` of the previous quorum
    (``{replica_id: step}``) and ``heartbeats`` (``{replica_id: age in seconds}``)."""

    members: dict[str, int] = field(default_factory=dict)
    heartbeats: dict[str, float] = field(default_factory=dict)


_MEMBER = re.compile(r"<b>\s*([^<\s]+)\s*</b>\s*<br/?>\s*Step:\s*(-?\d+)")
_HEARTBEAT = re.compile(r"^\s*([^\s:<>][^\s<>]*):\s*seen\s+([0-9.eE+-]+)s\s+ago", re.M)


def parse_status(html: str) -> LighthouseView:
    """Parse the lighthouse's ``/status`` page (torchft 0.2 ``templates/status.html``)."""
    view = LighthouseView()
    for rid, step in _MEMBER.findall(html):
        view.members[rid] = int(step)
    for rid, age in _HEARTBEAT.findall(html):
        try:
            view.heartbeats[rid] = float(age)
        except ValueError:
            continue
    return view


def lighthouse_view(addr: str, timeout_s: float) -> LighthouseView:
    """``GET addr/status`` within ``timeout_s`` seconds; raises ``OSError``/``ValueError`` when the
    lighthouse does not answer."""
    url = addr.rstrip("/")
    if "://" not in url:
        url = "http://" + url
    with urllib.request.urlopen(url + "/status", timeout=timeout_s) as r:  # noqa: S310 - the job's own lighthouse
        return parse_status(r.read().decode("utf-8", "replace"))


__all__ = ["TESTED_VERSIONS", "LighthouseView", "claim_lost", "group_rank_world", "inner_optimizer",
           "lighthouse_view", "parse_status", "quorum_id", "replica_prefix", "timeouts_s"]
