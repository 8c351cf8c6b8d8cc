"""ckptstore as the durable tier under torchft's per-step fault tolerance.

torchft keeps a job training through failures: a failed replica group drops out of the quorum and a
group that comes back heals live from a healthy peer. It persists nothing. :class:`DurableTier`
adds the durable tier for when every group is lost or the job is stopped (``pip install
'ckptstore[torchft]'``; torchft is never a dependency of ckptstore itself)::

    manager = torchft.Manager(pg=ProcessGroupGloo(), min_replica_size=2, ..., replica_id=f"g{GROUP}")
    model = torchft.ddp.DistributedDataParallel(manager, model)
    optim = torchft.optim.OptimizerWrapper(manager, torch.optim.AdamW(model.parameters()))
    tier = DurableTier("/nvme/ckpt", manager, {"model": model, "optim": optim, "sched": sched},
                       group=GROUP, num_groups=NUM_GROUPS, loader=loader, remote="s3://bucket/run-7",
                       interval_steps=500)
    tier.resume()                        # cold start: restores; joining a live job: torchft heals
    for batch in tier.batches():         # the loader, re-positioned after a step that did not commit
        optim.zero_grad(); loss_fn(model(batch)).backward(); optim.step()
        tier.step_done()                 # never blocks on storage, never raises a storage error
        if manager.current_step() >= steps:
            break
    tier.close()

What it does (docs/torchft.md; docs/FORMAT.md, "torchft"):

* **One writer per step, fenced.** At a due step (``step % interval_steps == 0``) only the group
  that is rank 0 among the quorum's participants writes the main version ``step-N`` (model,
  optimizer, schedulers and torchft's ``Manager.state_dict()``), with the quorum id and the group in
  the manifest's user metadata. One version name per step makes the commit's put-if-absent the
  fence: two groups that both believe they own a step cannot both commit (the other gets
  :class:`~ckptstore.errors.VersionExistsError`, its attempt's objects are deleted); and right before
  the commit point the writer asks torchft whether the group still owns the step
  (:func:`._torchft_v0_2.claim_lost`): a group that left the quorum while its save was in flight
  commits nothing (:class:`~ckptstore.errors.FencedError`).
* **Per-rank positions: a journal, and versions beside the main ones.** Every rank appends its
  data-loader position and RNG after every step to its journal in the local root
  (:class:`ckptstore.journal.Journal`, ``journals/loader-g<G>.w<K>.rank<r>.log``: one ``write``, no
  commit; docs/FORMAT.md, "Journals"). Every group also saves them as versions
  (``loader-g<G>-<N>``, under the group's *stable* index ``group``, not torchft's per-restart uuid) at
  the first step after a start and at every due step, asynchronously, on its own manager (never on
  torchft's process group), with its own retention (:data:`KeepLast` of ``positions_keep``). Each
  such save holds, of the last ``positions_keep`` positions, the one of each due step and the newest
  (:func:`._torchft_store.due_positions`), so one skipped while the previous still ran
  loses no position a restore asks for.
* **Cold start only.** :meth:`resume` asks the lighthouse (its ``/status`` page) whether a live job
  exists: then torchft heals this group from a peer and the durable tier's main version is not
  read (the group's loader continues from its own newest position, its journal's); otherwise the whole job is
  starting and every group restores the newest main version whose every active group's position is
  saved, and pairs its loader with its own position *no newer than* that step.
* **A live job lost while joining it.** A group that joined a live job whose replicas all died before
  they healed it restores from the store as a cold start would (no peer healed it: the quorum started
  over below the step it joined at), or, healed by a peer of a job that restarted from the store
  meanwhile (``ckptstore.timeline``, a state every group registers with torchft), moves its loader
  back to its position at the restarted step and refuses that step (docs/torchft.md).
* **Never in the way.** Saves never wait (a due save while the previous still runs is skipped and
  reported); a failed save is reported (event, metric, log), never raised; ckptstore's timeouts
  (its gloo groups, S3 connect/read, the lighthouse probe) sit below torchft's ``timeout`` and
  ``quorum_timeout``; nothing runs on torchft's process group; ``enabled=False`` or
  ``CKPTSTORE_TORCHFT_DURABLE=0`` turns the tier off (every method a no-op, :meth:`batches` the
  plain loader).

* **Replica groups of several ranks (HSDP).** A group of K ranks (FSDP2 or TP inside the group,
  torchft across groups) runs as its own ``torch.distributed`` job (one ``torchrun`` per group: its
  default process group is the group's ranks). The main save of a due step is written by every rank
  of the writing group, each its own shards, in parallel, through the normal DCP save on the
  managers' gloo groups of the group's ranks; the skip, busy and positions-interval decisions are
  one decision per group per step (a MIN-reduction of every rank's view after the step before, on a
  gloo group of the group's own, never torchft's or FSDP's), so a group's save is never half
  started; restore and the cold-start/join choice are taken by the group's rank 0 and broadcast.
  Each rank keeps its own journal and its own key ``positions/rank<r>`` in the versions. A cold start at another
  shape (M groups of K ranks from N groups of J) reshards the main version (DCP's planner) and
  reports per rank what its loader continues from (:class:`LoaderChoice`; docs/torchft.md).

* **Healing from the durable tier.** :class:`DurableTransport` is a torchft ``CheckpointTransport``:
  a healing group heals from a live peer (torchft's HTTP transport) and, when no peer can serve the
  quorum's step N, loads ``step-N`` from ckptstore with its loader position (docs/torchft.md).

Importing this module needs torchft (:data:`TESTED_VERSIONS`; another release warns once); what
depends on torchft's private surface is in ``ckptstore/integrations/_torchft_v0_2.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import random
import time
import warnings
from typing import Any, Callable, Iterator

try:
    import torchft as _torchft  # noqa: F401
    from importlib.metadata import version as _dist_version
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"ckptstore.integrations.torchft needs torchft ({e}); install it with "
                      "pip install 'ckptstore[torchft]'") from e

import torch
from torchft.checkpointing import CheckpointTransport as _CheckpointTransport

from ..errors import CkptStoreError, JobBrokenError, TransientStorageError, typed
from . import _torchft_store as _st
from . import _torchft_v0_2 as _ft
from ._torchft_v0_2 import TESTED_VERSIONS

__all__ = ["DurableTier", "DurableTransport", "RestoreReport", "LoaderChoice", "TESTED_VERSIONS", "ENV_DISABLE"]

log = logging.getLogger("ckptstore.integrations.torchft")

#: the kill switch: ``CKPTSTORE_TORCHFT_DURABLE=0`` (or ``off``/``false``/``no``) turns the tier off
ENV_DISABLE = "CKPTSTORE_TORCHFT_DURABLE"
LoaderChoice = _st.LoaderChoice
#: the share of its wall time a tier's save thread spends on CPU in a save's bookkeeping (``background_duty``
#: of :class:`ckptstore.CheckpointManager`; docs/torchft.md, "The tier in the step-time tail")
_DUTY = 0.02
#: the most steps between two decisions of a group of several ranks (a positions save, or seeing
#: that the previous one finished, waits at most this many steps beyond the positions interval)
_MAX_DECISION_GAP = 64

try:
    _version = _dist_version("torchft")
except Exception:  # noqa: BLE001 - not installed as a distribution
    _version = "unknown"
if _version.split("+")[0] not in TESTED_VERSIONS:
    warnings.warn(
        f"ckptstore.integrations.torchft was tested with torchft {', '.join(TESTED_VERSIONS)}, not {_version}: it reads "
        "private attributes of torchft's Manager and its lighthouse's status page (listed in ckptstore/integrations/"
        "_torchft_v0_2.py); check that they still exist", RuntimeWarning, stacklevel=2)


@dataclasses.dataclass
class RestoreReport:
    """What :meth:`DurableTier.resume` did. ``kind``: ``"cold-start"`` (restored ``version``),
    ``"fresh"`` (nothing to restore), ``"join"`` (a live job: torchft heals this group; ``why``),
    ``"disabled"``. ``step``: torchft's step now; ``writer``: the manifest's ``torchft`` entry (quorum
    id, group) of the restored version; ``skipped``: newer main versions passed over and why;
    ``loader``: what this group's loader continues from (:class:`LoaderChoice`); ``orphaned``:
    ``{group: batches}`` of stored groups with an index ≥ ``num_groups``; ``seconds``."""

    kind: str
    step: int = 0
    version: str | None = None
    why: str = ""
    writer: dict | None = None
    skipped: list = dataclasses.field(default_factory=list)
    loader: Any = None
    orphaned: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


_HEAL_KEY = "ckptstore"
#: the state every group registers with torchft: the step the job's timeline (re)started from, which a
#: healing group receives from its peer (docs/torchft.md, "A live job lost while joining it")
_TIMELINE_KEY = "ckptstore.timeline"


def _clone_tree(obj: Any) -> Any:
    """``obj`` with every tensor cloned (dicts keep their type and a ``back`` spelling map)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        out = type(obj)({k: _clone_tree(v) for k, v in obj.items()}) if type(obj) is not dict else {
            k: _clone_tree(v) for k, v in obj.items()}
        if hasattr(obj, "back"):
            out.back = obj.back
        return out
    if isinstance(obj, list):
        return [_clone_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone_tree(v) for v in obj)
    return obj


def _own_spelling(sd: dict) -> dict:
    """``sd`` (a state dict of :class:`ckptstore._manager.state.StateDicts`) with module and optimizer
    keys in the modules' own spelling, as plain dicts: what torchft's transport pickles and the
    receiving rank's ``StateDicts.apply`` takes as is."""
    from .._state_keys import _Respelled

    return {k: dict(_Respelled.back_of(v)) if isinstance(v, _Respelled) else v for k, v in sd.items()}


class DurableTransport(_CheckpointTransport):
    """A torchft ``CheckpointTransport`` that heals from live peers (``inner``, torchft's
    ``HTTPTransport`` by default) and, when no live peer can serve the step, from ckptstore.

    Give it to the group's ``torchft.Manager(checkpoint_transport=...)`` and to the
    :class:`DurableTier` (``transport=``). Sending is ``inner``'s. Receiving step N: with
    ``prefer="peer"`` (default) the peer first, and when that fails (the peer died or its transfer
    timed out) the durable main version ``step-N`` — local tier, replicas, then the remote tier — with
    this rank's loader position at N; with ``prefer="durable"`` the durable version first (a peer
    need not send what the store holds), the peer when the store has not that step. Only the exact
    step: torchft sets a healed group's step to the quorum's (``max_step``), so an older version
    would silently put the group behind its peers; when ``step-N`` is not committed the peer's error
    is raised (torchft reports it, the step does not commit, the next quorum heals again).
    ``stats``: ``{"peer": n, "durable": n, "failed": n}``."""

    def __init__(self, inner: Any = None, *, prefer: str = "peer", timeout_s: float = 60.0) -> None:
        if prefer not in ("peer", "durable"):
            raise ValueError("prefer must be 'peer' or 'durable'")
        if inner is None:
            import datetime as _dt

            from torchft.checkpointing import HTTPTransport

            inner = HTTPTransport(timeout=_dt.timedelta(seconds=timeout_s), num_chunks=0)
        self.inner = inner
        self.prefer = prefer
        self.stats = collections.Counter()
        self._tier: DurableTier | None = None

    def _attach(self, tier: "DurableTier") -> None:
        self._tier = tier

    def metadata(self) -> str:
        return self.inner.metadata()

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
        self.inner.send_checkpoint(dst_ranks, step, state_dict, timeout)

    def disallow_checkpoint(self) -> None:
        self.inner.disallow_checkpoint()

    def _durable(self, step: int) -> dict | None:
        tier = self._tier
        if tier is None or not tier.enabled or tier._closed:
            return None
        try:
            return tier._durable_heal(step)
        except Exception as e:  # noqa: BLE001 - reported; the peer's outcome stands
            log.warning("ckptstore: step-%d could not be loaded from the durable tier for healing: %s: %s", step,
                        type(e).__name__, e)
            return None

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        if self.prefer == "durable":
            sd = self._durable(step)
            if sd is not None:
                self.stats["durable"] += 1
                return sd
        try:
            sd = self.inner.recv_checkpoint(src_rank, metadata, step, timeout)
            self.stats["peer"] += 1
            return sd
        except Exception as e:
            if self.prefer == "peer":
                got = self._durable(step)
                if got is not None:
                    log.warning("ckptstore: healing from the peer failed (%s: %s); healed from step-%d of the durable "
                                "tier", type(e).__name__, e, step)
                    self.stats["durable"] += 1
                    return got
            self.stats["failed"] += 1
            raise

    def shutdown(self, wait: bool = True) -> None:
        self.inner.shutdown(wait=wait)


class _FtState:
    """torchft's ``Manager.state_dict()`` (``step``, ``batches_committed``) as a stateful value."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def state_dict(self) -> dict:
        return dict(self.manager.state_dict())

    def load_state_dict(self, sd: dict) -> None:
        self.manager.load_state_dict({"step": int(sd["step"]), "batches_committed": int(sd["batches_committed"])})


class _Positions:
    """The positions save's value: the packed history (``{"data": bytes}``), one object in DCP."""

    def __init__(self, data: bytes = b"") -> None:
        self.data = data

    def state_dict(self) -> dict:
        return {"data": self.data}

    def load_state_dict(self, sd: dict) -> None:
        self.data = bytes(sd["data"])


def _enabled(enabled: bool | None) -> bool:
    if enabled is not None:
        return bool(enabled)
    return os.environ.get(ENV_DISABLE, "1").strip().lower() not in ("0", "off", "false", "no")


def _check_group_world(group_world: int, rank: int) -> None:
    """A replica group of several ranks runs as its own ``torch.distributed`` job (``torchrun`` per
    group, as torchtitan and torchft's examples do): its default process group is the group's ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise CkptStoreError(
            f"DurableTier: this replica group has {group_world} ranks (torchft's Manager world_size), but "
            "torch.distributed is not initialised: start each group as its own torchrun job (its ranks are the "
            "default process group) and call torch.distributed.init_process_group before the DurableTier")
    if dist.get_world_size() != group_world or dist.get_rank() != rank:
        raise CkptStoreError(
            f"DurableTier: torchft's Manager says rank {rank} of {group_world} in this replica group, "
            f"torch.distributed says rank {dist.get_rank()} of {dist.get_world_size()}: the default process "
            "group must be exactly the group's ranks (one torchrun job per replica group)")


def _set_rng(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])


class DurableTier:
    """ckptstore under a ``torchft.Manager`` (see the module docstring).

    Args:
        root: the local tier (a directory); replica groups that share it (a shared filesystem) are
            fenced by the local commit, groups on their own disks by the remote tier's conditional
            writes.
        manager: the group's ``torchft.Manager``.
        state: the main state: modules, optimizers (a ``torchft.optim.OptimizerWrapper`` is unwrapped),
            schedulers and other stateful objects; torchft's own state is added as ``"torchft"``.
        group: this replica group's stable index (0 … ``num_groups`` − 1), the same across restarts.
        num_groups: how many groups the job runs now (for the loader policy when it changed).
        loader: the group's data loader (``state_dict()``/``load_state_dict()``, e.g. torchdata's
            ``StatefulDataLoader``), or None.
        remote: ``"s3://bucket/prefix"``; its client's timeouts are set below ``timeout_s``.
        interval_steps: the main version is written at steps ``N % interval_steps == 0``.
        retention: a :class:`ckptstore.retention.RetentionPolicy` of the main versions (default: keep all).
        positions_keep: positions kept per group: versions (retention ``KeepLast``), the journal's
            records, and the history a positions version keeps the due steps' positions and the newest
            of (default ``2 * interval_steps + 2``).
        positions_every_s: also save the positions every this many seconds (a positions version of
            the group, when the previous one has finished). Default None: positions versions are
            saved at the first step after a start and at every due step, and each rank's journal
            (docs/FORMAT.md, "Journals") records its position after every step.
        enabled: False turns the tier off; None (default): on unless ``CKPTSTORE_TORCHFT_DURABLE=0``.
        lighthouse: the lighthouse address for the cold-start check (default ``TORCHFT_LIGHTHOUSE``);
            None and no variable: every start is taken as a cold start (with a warning).
        live_within_s: a member of the previous quorum counts as alive when its heartbeat is younger
            than this (seconds; default 1.0: torchft heartbeats every 0.1 s).
        timeout_s: ckptstore's timeouts (seconds): its gloo groups, the S3 client's connect/read
            timeouts, the lighthouse probe. Default: half of the smaller of torchft's ``timeout`` and
            ``quorum_timeout``; a value not below both raises ``ValueError``.
        transport: the :class:`DurableTransport` given to this group's ``torchft.Manager``
            (``checkpoint_transport=``): a healing group falls back to the durable tier when no live
            peer can serve the step. The tier then registers the state torchft heals (its ``state``,
            under the key ``"ckptstore"``, with the loader position); the Manager must have no other
            state dict functions (``load_state_dict=None, state_dict=None``), else ``ValueError``.
        durability: as :class:`ckptstore.CheckpointManager`.
        key: as :class:`ckptstore.CheckpointManager`.
        on_event: as :class:`ckptstore.CheckpointManager`.
        event_log: as :class:`ckptstore.CheckpointManager`.
        **writer_options: as :class:`ckptstore.CheckpointManager`. ``background_nice`` (the saves'
            CPU priority) defaults to 19 here, where :class:`ckptstore.CheckpointManager` defaults to
            0 (or ``CKPTSTORE_BACKGROUND_NICE`` when set): the tier's saves never block a step (a due
            save while one runs is skipped), so a lowered save can only be skipped, never hold up
            training, and a due step's cost spreads over more steps (docs/torchft.md).
            ``background_duty`` (the share of its wall time the save thread spends on a save's
            bookkeeping, between pauses) defaults to 0.02 here, where :class:`ckptstore.CheckpointManager`
            leaves it unpaced: a tier's save of a small state is all bookkeeping (10-16 ms of CPU per
            rank), and paced it is spread over about a second of steps instead of lengthening the
            next one or two (docs/torchft.md, "The tier in the step-time tail").
    """

    def __init__(self, root: str | os.PathLike, manager: Any, state: dict[str, Any], *, group: int,
                 num_groups: int | None = None, loader: Any = None, remote: str | None = None, key: Any = None,
                 interval_steps: int = 100, retention: Any = None, positions_keep: int | None = None,
                 positions_every_s: float | None = None,
                 enabled: bool | None = None, lighthouse: str | None = None, live_within_s: float = 1.0,
                 timeout_s: float | None = None, durability: str = "local", transport: "DurableTransport | None" = None,
                 on_event: Callable[[dict], None] | None = None, event_log: Any = True, **writer_options: Any) -> None:
        if interval_steps < 1:
            raise ValueError("interval_steps must be >= 1")
        if int(group) < 0 or (num_groups is not None and int(group) >= int(num_groups)):
            raise ValueError(f"group must be in 0 … num_groups-1, got group={group} num_groups={num_groups}")
        self.rank, self.group_world = _ft.group_rank_world(manager)
        self._agree_pg = None  # the group's own gloo group for its decisions (several ranks per group)
        self._pending = None  # the agreement posted after the previous step: (work, tensor)
        self._next_decision: int | None = None  # the step of the next agreed decision (None: not agreed yet)
        self._step_t: float | None = None  # when the last step_done ran (monotonic)
        self._step_s: float | None = None  # this rank's step time, seconds (EMA)
        self.root = os.fspath(root)
        self.manager = manager
        self.group = int(group)
        self.num_groups = None if num_groups is None else int(num_groups)
        self.loader = loader
        self.interval_steps = int(interval_steps)
        self.positions_keep = int(positions_keep or 2 * self.interval_steps + 2)
        self.enabled = _enabled(enabled)
        self.lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        self.live_within_s = float(live_within_s)
        ft_timeout, ft_quorum = _ft.timeouts_s(manager)
        bound = min(ft_timeout, ft_quorum)
        self.timeout_s = float(timeout_s) if timeout_s is not None else bound / 2
        if not 0 < self.timeout_s < bound:
            raise ValueError(f"timeout_s={self.timeout_s} must be positive and below torchft's timeout ({ft_timeout} s) "
                             f"and quorum_timeout ({ft_quorum} s)")
        self.on_event = on_event
        self.counts = collections.Counter()
        self._state = {k: _ft.inner_optimizer(v) for k, v in state.items()}
        if "torchft" in self._state:
            raise ValueError("state must not have a key 'torchft' (torchft's own state is saved under it)")
        self._state["torchft"] = _FtState(manager)
        self._history: collections.deque = collections.deque(maxlen=self.positions_keep)
        self._batches = 0  # batches this group's loader delivered into committed steps (across runs)
        self._loader_blob: bytes | None = None  # the loader's state after the last batch that counted
        self._rewind = False
        self._last_step = manager.current_step()
        self._positions_saved: int | None = None  # the step of the newest positions save started
        self._main_step: int | None = None  # the step of the newest main save started here
        self._positions_t = float("-inf")  # when it started (monotonic)
        self.positions_every_s = None if positions_every_s is None else float(positions_every_s)
        self._journal = None  # this rank's positions journal (a loader, the tier on)
        self._joined_at: int | None = None  # the live job's step when this group joined it (resume)
        self._joined_timeline = -1  # the timeline of the position a joining group continues from (-1: none)
        #: the :class:`RestoreReport` of the last restore: :meth:`resume`'s, or a cold start after a lost join
        self.last_restore: RestoreReport | None = None
        self._closed = False
        if self.enabled and self.group_world > 1:
            _check_group_world(self.group_world, self.rank)
        self._transport = transport
        if transport is not None:  # also with the tier off: torchft's peer healing needs the state
            others = set(getattr(manager, "_user_state_dicts", {})) - {_HEAL_KEY, _TIMELINE_KEY}
            if others:
                raise ValueError(f"DurableTier(transport=...): the torchft Manager already has state dict functions "
                                 f"{sorted(others)}; create it with load_state_dict=None, state_dict=None: the tier "
                                 "registers the state it heals (a durable step can only fill the tier's own state)")
            from .._manager.state import StateDicts

            self._heal_states = StateDicts(0, (), False)
            manager.register_state_dict_fn(_HEAL_KEY, self._heal_load, self._heal_state)
            transport._attach(self)
        self._timeline: int | None = None  # the step this job's timeline (re)started from (None: not known)
        _ft.register_state(manager, _TIMELINE_KEY, self._timeline_load, self._timeline_state)
        if not self.enabled:
            log.warning("ckptstore: the durable tier is off (%s)", "enabled=False" if enabled is False else f"{ENV_DISABLE}=0")
            self._main = self._positions = None
            return
        if remote is not None and isinstance(remote, str):
            remote = self._remote_tier(remote, writer_options.get("remote_options") or writer_options.get("endpoint_url"))
        self.remote = remote
        self._key = key
        from .._manager.save_queue import resolve_nice

        # a save here never blocks a step (on_busy="skip"): lowered, it can only be skipped
        nice = resolve_nice(writer_options.pop("background_nice", None), 19)
        # and paced: its bookkeeping's CPU spread over many steps, never the next one or two (ckptstore/_pace.py)
        duty = writer_options.pop("background_duty", _DUTY)
        common = dict(remote=remote, key=key, durability=durability, on_busy="skip", raise_errors=False,
                      save_on_signal=None, group_timeout_s=self.timeout_s, save_rng=False, background_nice=nice,
                      background_duty=duty)
        from .. import CheckpointManager
        from ..retention import KeepLast, RetentionPolicy

        self._main = CheckpointManager(
            self.root, None, interval_steps=self.interval_steps, retention=retention, prefix=_st.MAIN_PREFIX,
            reshard=True, event_log=event_log, on_event=self._event("main"), on_save=self._saved("main"),
            commit_check=self._claim, **common, **writer_options)
        self._positions = CheckpointManager(
            self.root, None, interval_steps=1, retention=RetentionPolicy(rules=(KeepLast(self.positions_keep),)),
            prefix=_st.loader_prefix(self.group), event_log=False, on_event=self._event("positions"),
            on_save=self._saved("positions"), per_rank_keys=("positions",), progress_s=3600.0, **common,
            **{k: v for k, v in writer_options.items() if k in ("remote_options", "endpoint_url", "threads")})
        if self.loader is not None:
            self._journal = self._open_journal(key)
        if self.group_world > 1:
            # the group's decisions (restore, skip, coalesce) are agreed on a gloo group of its own
            # ranks, made after the two managers' (every rank creates them in the same order); never
            # torchft's process group, never the one FSDP trains on
            import datetime as _dt

            from .._groups import new_gloo_group

            self._agree_pg = new_gloo_group(_dt.timedelta(seconds=self.timeout_s))

    # -- set-up ------------------------------------------------------------------------------------
    def _open_journal(self, key: Any):
        """This rank's positions journal ``journals/loader-g<G>.w<K>.rank<r>.log`` in the local root
        (docs/FORMAT.md, "Journals"; one per group, shape and rank), or None when it cannot be opened
        (reported; positions versions still carry the positions)."""
        from ..journal import Journal
        from ..keys import resolve_master

        try:
            scope = _st.loader_prefix(self.group)[:-1]
            return Journal(self.root, f"{scope}.w{self.group_world}.rank{self.rank}", scope=scope,
                           keep=self.positions_keep, master=resolve_master(key))
        except (OSError, CkptStoreError) as e:
            self.counts["journal.error"] += 1
            log.warning("ckptstore: the positions journal of group %d rank %d cannot be opened (%s: %s); positions "
                        "versions still carry the positions", self.group, self.rank, type(e).__name__, e)
            return None

    def _journal_do(self, fn: Callable[[Any], Any], what: str) -> Any:
        """``fn(journal)``; a failure (a full disk) stops the journal in this process (reported, never
        raised: positions versions still carry the positions)."""
        j = self._journal
        if j is None:
            return None
        try:
            return fn(j)
        except (OSError, CkptStoreError) as e:
            self.counts["journal.error"] += 1
            log.warning("ckptstore: the positions journal of group %d rank %d stops (%s: %s: %s); positions "
                        "versions still carry the positions", self.group, self.rank, what, type(e).__name__, e)
            self._journal = None
            try:
                j.close()
            except OSError:
                pass
            return None

    def _journal_positions(self) -> list[_st.Position]:
        """This rank's positions in its journal, oldest first (the current timeline; [] without one)."""
        return [p for p, _t in self._journal_records()]

    def _journal_records(self) -> list[tuple[_st.Position, int]]:
        """``(position, timeline)`` of every record of this rank's journal, oldest first."""
        def read(j):
            return [_st.position_of(step, body) for step, body in j.read()]

        return self._journal_do(read, "read") or []

    def _journal_append(self, pos: _st.Position) -> None:
        t = -1 if self._timeline is None else self._timeline
        self._journal_do(lambda j: j.append(pos.step, _st.position_body(pos, t)), "append")

    def _remote_tier(self, url: str, options):
        """The remote tier of ``url`` through the registry, each request bounded below ``timeout_s``
        (``Tier.bounded_options``). ``options``: the tier's options (a dict), or one endpoint URL."""
        from ..tiers import make_remote

        opts = dict(options) if isinstance(options, dict) else ({} if options is None else {"endpoint_url": options})
        return make_remote(url, timeout_s=self.timeout_s, **opts)

    def _event(self, which: str):
        def on_event(e: dict) -> None:
            if e.get("kind") == "save" and e.get("outcome") in ("failed", "skipped"):
                log.log(logging.WARNING if e["outcome"] == "failed" else logging.DEBUG,
                        "ckptstore: %s save of step %s %s: %s", which, e.get("step"), e["outcome"], e.get("error"))
            if self.on_event is not None:
                self.on_event({**e, "tier": which, "group": self.group})
        return on_event

    def _saved(self, which: str):
        def on_save(info) -> None:
            outcome = "failed" if info.error else "committed"
            if info.error and info.local_commit_s is not None:
                outcome = "committed-local"  # the upload or remote commit failed: retried later
            elif info.error and "FencedError" in info.error:
                outcome = "fenced"
            elif info.error and "VersionExistsError" in info.error:
                outcome = "lost-race"
            self.counts[f"{which}.{outcome}"] += 1
        return on_save

    def _claim(self, version: str) -> str | None:
        """The main writer's ``commit_check`` (docs/FORMAT.md, Save rule 9)."""
        why = _ft.claim_lost(self.manager)
        if why:
            self.counts["main.fenced-check"] += 1
            return f"replica group {self.group} no longer owns {version}: {why}"
        return None

    # -- the state torchft heals (with a DurableTransport) ----------------------------------------------
    def _user_state(self) -> dict[str, Any]:
        return {k: v for k, v in self._state.items() if k != "torchft"}

    def _heal_state(self) -> dict:
        """What a peer sends a healing group (torchft's state dict function): the tier's state under the
        same keys as its main versions (so a durable step fills the same dict)."""
        return _own_spelling(self._heal_states.build(self._user_state()))

    def _heal_load(self, sd: dict) -> None:
        """torchft applies a healed state (on the training thread): the state; and, when it came from
        the durable tier, this rank's loader position at that step (``"_position"``)."""
        pos = sd.pop("_position", None) if isinstance(sd, dict) else None
        self._heal_states.apply(self._user_state(), sd)
        if pos is not None and self.loader is not None:
            before = self._loader_blob
            self._apply(_st.Position(*pos), own=True)
            # the loader goes to the healed position; when it is not where the loader was, the next
            # batch is drawn from it (the batch of a step whose heal is applied after it was drawn
            # cannot be taken back: use_async_quorum=False heals before the forward pass, not before
            # the batch is drawn)
            self._rewind = self._rewind or pos[3] != before
            self.counts["heal.position"] += 1

    def _timeline_state(self) -> dict:
        """What a peer sends a healing group under ``ckptstore.timeline``: the step the job's timeline
        (re)started from as this group knows it (-1: not known)."""
        return {"restart": -1 if self._timeline is None else int(self._timeline)}

    def _timeline_load(self, sd: Any) -> None:
        """torchft applies a healed state (on the training thread, before the step's forward pass):
        the step the job's timeline (re)started from, as the peer knows it. At the first heal after
        this group joined, when that is not the timeline of the position its loader continues from
        (its journal records it) — the job restarted from the store while this group was away — the
        loader goes back to this rank's position at that step (its journal's, else the versions'), and
        this step is refused through torchft
        (``report_error``: no group commits it, every group draws its batch again), because this
        rank's batch of it was drawn from the abandoned position (docs/torchft.md, "A live job lost
        while joining it")."""
        try:
            s = int(sd.get("restart", -1))
        except (AttributeError, TypeError, ValueError):
            return
        if s < 0:  # a peer that does not know its timeline (itself joined, not healed yet): decide later
            return
        self._joined_at = None  # a peer of a known timeline healed this group: the job it joined lives
        joined, self._joined_timeline = self._joined_timeline, -1
        self._timeline = s
        # the same on every rank of the group: its ranks' positions are of one timeline, the peer's too
        if joined < 0 or joined == s or not self.enabled or self._closed or self.loader is None:
            return
        pos = self._own_position_at(s)
        was = self._history[-1].step if self._history else None
        if pos is not None:
            self._apply(pos, own=True)
            self._rewind = True
        self.counts["heal.timeline"] += 1
        try:  # this group's positions versions after s belong to the abandoned timeline
            self._supersede_positions(self._store_versions(), s)
        except (CkptStoreError, OSError) as e:
            log.warning("ckptstore: the positions versions of group %d after step %d are not superseded: %s",
                        self.group, s, e)
        why = (f"ckptstore: the job restarted from step {s} after group {self.group}'s loader position of step {was} "
               f"(its timeline restarted from step {joined}): its loader went back to its position of step "
               f"{None if pos is None else pos.step}; this step's batch is drawn again")
        log.warning(why)
        self.manager.report_error(RuntimeError(why))

    def _durable_heal(self, step: int) -> dict | None:
        """The state of main version ``step-<step>`` for this rank, read from the store (the local
        tier, replicas, then the remote tier: the reader's order) into copies of the live state
        (never the live tensors: this runs on torchft's recovery thread), with this rank's loader
        position at that step; None when that exact step is not committed (torchft sets the healing
        group's step to the quorum's, so no other step will do)."""
        import torch.distributed.checkpoint as dcp

        from .._state_keys import _SpellingLoadPlanner
        from ..dcp.reader import StorageReader

        name = f"{_st.MAIN_PREFIX}{int(step)}"
        if name not in self._committed_main():
            return None
        sd = _clone_tree(self._heal_states.build(self._user_state()))
        sd["torchft"] = {"step": 0, "batches_committed": 0}
        reader = StorageReader(self.root, remote=self.remote, key=self._key, version=name)
        dcp.load(sd, storage_reader=reader, no_dist=True, planner=_SpellingLoadPlanner(sd))
        ft = {"step": int(sd["torchft"]["step"]), "batches_committed": int(sd["torchft"]["batches_committed"])}
        del sd["torchft"]
        sd = _own_spelling(sd)
        if self.loader is not None:
            pos = self._own_position_at(step)
            if pos is not None:
                sd["_position"] = (pos.step, pos.batches, pos.participated, pos.blob)
        self.counts["heal.durable"] += 1
        return {"user": {_HEAL_KEY: sd, _TIMELINE_KEY: {"restart": -1}}, "torchft": ft}

    def _committed_main(self) -> set[str]:
        names = set(self._store_versions_local())
        if self.remote is not None:
            from ..store import Store

            try:
                names |= {r.version for r in Store(None, remote=self.remote, key=self._key).versions()}
            except (TransientStorageError, CkptStoreError, OSError) as e:
                log.warning("ckptstore: the remote tier was not consulted for a durable heal: %s", e)
        return names

    def _own_position_at(self, step: int) -> _st.Position | None:
        """This rank's position at ``step`` (the greatest ≤ it): from its journal when the journal
        reaches ``step``, else the newer of the journal's and the positions versions'."""
        mine = self._journal_positions()
        pos = _st.position_at(mine, step)
        if mine and mine[-1].step >= step:
            return pos
        got = self._versions_position_at(step)
        return got if pos is None or (got is not None and got.step > pos.step) else pos

    def _versions_position_at(self, step: int) -> _st.Position | None:
        names = [n for n in self._committed_main() if (_st.parse_loader_version(n) or (None,))[0] == self.group]
        by_step = sorted(_st.parse_loader_version(n)[1] for n in names)
        tries = [s for s in by_step if s >= step][:1] + [s for s in by_step if s < step][-1:]
        for s in tries:
            try:
                pos = _st.position_at(self._read_positions(f"{_st.loader_prefix(self.group)}{s}"), step)
            except Exception as e:  # noqa: BLE001 - the next candidate
                log.warning("ckptstore: positions %s%d unreadable: %s", _st.loader_prefix(self.group), s, e)
                continue
            if pos is not None:
                return pos
        return None

    # -- the loop ------------------------------------------------------------------------------------
    def batches(self) -> Iterator[Any]:
        """The loader's batches, iterated anew after :meth:`resume` and after a step in which this
        group's batch was not committed (torchft's ``should_commit`` said no, or the group was healing):
        the loader goes back to its position after the last batch that counted, so every sample of the
        group's shard goes into exactly one committed step (torchft #309's gap). With the tier off: the
        loader as it is. Making an iterator leaves torch's RNG as it was (a loader without a generator
        of its own draws its base seed from it), so a restored run's random ops draw what the
        uninterrupted run's drew."""
        if self.loader is None:
            raise CkptStoreError("DurableTier.batches() needs loader=")
        it = None
        while True:
            if it is None or self._rewind:
                if self._rewind and self._loader_blob is not None:
                    self.loader.load_state_dict(_st.unpack_blob(self._loader_blob)["loader"])
                self._rewind = False
                # a loader without its own generator draws its iterator's base seed from torch's RNG: not
                # from the RNG a restore just set (the position's, after its step), which the next step uses
                rng = torch.get_rng_state()
                it = iter(self.loader)
                torch.set_rng_state(rng)
            try:
                batch = next(it)
            except StopIteration:
                return
            yield batch

    def step_done(self) -> bool:
        """Call after ``optimizer.step()`` (torchft's ``should_commit``) on every rank of the group.
        Records this group's position, saves it (async; skipped while the previous save runs), and at a
        due step, when this group is the quorum's participating rank 0, starts the main save (async).
        Returns whether the step committed. Never raises a storage error (they are reported)."""
        step = int(self.manager.current_step())
        committed = step != self._last_step
        if not self.enabled or self._closed:
            self._last_step = step
            return committed
        now = time.monotonic()
        if self._step_t is not None:  # this rank's step time (EMA): how many steps a positions interval spans
            dt = now - self._step_t
            self._step_s = dt if self._step_s is None else 0.8 * self._step_s + 0.2 * dt
        self._step_t = now
        self._hurry_saves(step)
        agreed = self._agreed(step)
        if not self.enabled:  # the group lost a rank
            self._last_step = step
            return committed
        if committed and self._joined_at is not None and self._lost_live_job(step):
            return False  # restored from the store instead: this step's batch is drawn again
        counted = committed and bool(self.manager.is_participating())
        if counted and self.loader is not None:
            self._batches += 1
            self._loader_blob = self._capture()
        elif self.loader is not None:
            self._rewind = True  # this step's batch went into no committed step: draw it again
        if committed:
            self._last_step = step
        if self.loader is not None and self._loader_blob is not None and (not self._history
                                                                          or step >= self._history[-1].step):
            # (a step behind the loader's position: a group that joined and is not healed yet)
            pos = _st.Position(step, self._batches, counted, self._loader_blob)
            self._history.append(pos)
            self._journal_append(pos)
            self._save_positions(step, agreed=agreed)
        if counted and step % self.interval_steps == 0 and self._is_writer():
            if agreed is not None and not agreed[0]:
                self._skip_main(step)
            else:
                meta = _st.manifest_user(_ft.quorum_id(self.manager), self.group, _ft.replica_prefix(self.manager),
                                         self.manager.num_participants(), self.manager.state_dict())
                self._guard("main", lambda: self._main.save(step, self._state, force=True, metadata=meta))
                self._main_step = step
        self._post_agreement(step)
        return committed

    def _hurry_saves(self, step: int) -> None:
        """A save of the tier still paused a quarter of an interval after its step pauses no more
        (ckptstore/_pace.py): pacing never carries it into the next due step, also when steps just
        became much faster than the cadence it was paced for."""
        quarter = max(1, self.interval_steps // 4)
        for mgr, started in ((self._main, self._main_step), (self._positions, self._positions_saved)):
            if started is not None and step - started >= quarter:
                mgr._saves.hurry()

    def _lost_live_job(self, step: int) -> bool:
        """At the first committed step after this group joined a live job (at step N, the lighthouse
        said) without being healed by a peer: is the quorum's step below N? Then every replica that
        held the job's state died before it could heal this group — the groups left formed a quorum of
        their own and started over (torchft heals only from a live peer). That is a whole-job loss: the
        group restores from the store as a cold start would (every such group chooses the same main
        version), torchft's step with it, and the quorum heals the others from it. Returns whether it
        restored (docs/torchft.md, "A live job lost while joining it")."""
        joined_at, self._joined_at = self._joined_at, None
        if step >= joined_at:
            return False
        why = (f"the live job this group joined at step {joined_at} was lost before it healed this group (the quorum "
               f"is at step {step}): restored from the store")
        log.warning("ckptstore: group %d: %s", self.group, why)
        self.counts["join.lost"] += 1
        t0 = time.monotonic()
        r = self._cold_start(why)
        r.seconds = time.monotonic() - t0
        self._last_step = r.step = int(self.manager.current_step())
        self._rewind = True  # the loader's iterator starts again at the restored position
        self._next_decision = None
        self._post_agreement()
        self._report_restore(r, lost_join=True)
        return True

    # -- one decision per group (docs/torchft.md, "Replica groups of several ranks") ------------------
    def _post_agreement(self, step: int | None = None) -> None:
        """Post this rank's view for the next decision: ``[main idle, positions idle, positions
        interval passed, steps until the positions interval passes]``, reduced with MIN over the
        group's ranks (asynchronously, on the group's own gloo group); :meth:`_agreed` takes the result
        at the next decision step. A rank's "idle" stays true until a save starts, and saves start only
        on an agreed decision, so a decision taken from the view of the step before holds for every
        rank at this one.

        Posted only before a *decision step* (docs/torchft.md, "Replica groups of several ranks"): the
        step the last agreement named — the positions interval ahead, in steps, as the slowest rank's
        step time estimates it (the MIN of the ranks' estimates), and never past the next due main
        step. Every rank of a group sees the same steps and the same agreed values, so every rank
        posts at the same steps; between them a step costs no collective. ``step``: the step just
        finished (None: post now, as :meth:`resume` does)."""
        if self._agree_pg is None or not self.enabled or self._closed or self._pending is not None:
            return
        if step is not None and self._next_decision is not None and step + 1 < self._next_decision:
            return  # no decision at the next step: no collective after this one
        import torch.distributed as dist

        nxt = None if step is None else step + 1  # the decision step this view is for
        due = self._positions_due(nxt)
        ahead = _MAX_DECISION_GAP  # the next due main step bounds it (see _agreed)
        if due:
            ahead = 1  # a positions save is due: if it cannot start at that step, decide again at the next
        elif self.positions_every_s is not None and self._step_s:  # the steps of one positions interval
            ahead = max(1, min(_MAX_DECISION_GAP, int(self.positions_every_s / self._step_s)))
        view = torch.tensor([int(not self._main._saves.busy()), int(not self._positions._saves.busy()),
                             int(due), ahead], dtype=torch.int64)
        try:
            self._pending = (dist.all_reduce(view, op=dist.ReduceOp.MIN, group=self._agree_pg, async_op=True), view)
        except Exception as e:  # noqa: BLE001 - the group lost a rank: torchft restarts it
            self._group_lost(e)

    def _agreed(self, step: int) -> tuple[bool, bool, bool] | None:
        """The group's decision inputs for ``step`` (see :meth:`_post_agreement`); None for a group of
        one rank (it decides alone); ``(False, False, False)`` at a step that is not a decision step
        (no save starts there). Waits at most ``timeout_s`` for the reduction posted after the step
        before (its peers posted theirs at the same point, so it is normally done)."""
        if self._agree_pg is None:
            return None
        if self._pending is None:
            if self._next_decision is not None:
                return (False, False, False)  # not a decision step
            self._post_agreement()  # the first step (no resume() before it): every rank posts now
            if self._pending is None:
                return (False, False, False)
        work, view = self._pending
        self._pending = None
        try:
            import datetime as _dt

            work.wait(_dt.timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - a rank of the group is gone
            self._group_lost(e)
            return (False, False, False)
        main_idle, pos_idle, pos_due, ahead = view.tolist()
        # the next decision: the agreed steps ahead, and never past the next due main step
        due = (step // self.interval_steps + 1) * self.interval_steps
        self._next_decision = min(step + max(1, int(ahead)), due)
        return (bool(main_idle), bool(pos_idle), bool(pos_due))

    def _group_lost(self, e: BaseException) -> None:
        self.counts["agreement.failed"] += 1
        log.error("ckptstore: replica group %d lost a rank (%s: %s): its saves stop in this process; torchft "
                  "restarts the group", self.group, type(e).__name__, e)
        self.enabled = False

    def _bcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank of the group (identity for a group of one rank)."""
        if self._agree_pg is None:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self._agree_pg, 0), group=self._agree_pg)
        return box[0]

    def _skip_main(self, step: int) -> None:
        self.counts["main.skipped"] += 1
        self._main._events.emit("save", step=int(step), version=self._main.version_name(step),
                                ranks=self.group_world, outcome="skipped",
                                error="the previous save is still running on a rank of the group")

    def _positions_due(self, step: int | None) -> bool:
        """Whether a positions version is due at ``step`` (None: the first step after a start): none was
        started since this start (or the last heal), a due main step (``N % interval_steps == 0``) came
        since the newest one started, or ``positions_every_s`` passed (when set)."""
        saved = self._positions_saved
        if saved is None or step is None:
            return True
        if step // self.interval_steps > saved // self.interval_steps:
            return True
        return self.positions_every_s is not None and time.monotonic() - self._positions_t >= self.positions_every_s

    def _save_positions(self, step: int, force: bool = False, agreed: tuple | None = None) -> None:
        now = time.monotonic()
        if agreed is not None and not force:
            if not (agreed[1] and agreed[2]):
                self.counts["positions.coalesced"] += 1  # the journal has it; the next version carries it
                return
        elif not force and not self._positions_due(step):
            self.counts["positions.coalesced"] += 1  # the journal has it; the next version carries it
            return

        def save():
            kept = _st.due_positions(self._history, self.interval_steps)
            started = self._positions.save(step, {"positions": _Positions(_st.pack_history(kept))}, force=True)
            if started:
                self._positions_saved = step
                self._positions_t = now
            return started

        self._guard("positions", save)

    def _is_writer(self) -> bool:
        try:
            return self.manager.participating_rank() == 0 and bool(self.manager.is_participating())
        except Exception as e:  # noqa: BLE001 - the quorum failed: not the writer
            log.debug("ckptstore: no main save (quorum: %s)", e)
            return False

    def _capture(self) -> bytes:
        return _st.pack_blob(self.loader.state_dict(), torch.get_rng_state(), random.getstate())

    def _guard(self, which: str, fn: Callable[[], Any]) -> None:
        """Run a save call; its failure is counted and logged, never raised (docs/FORMAT.md, Save rule 9)."""
        try:
            started = fn()
            self.counts[f"{which}.{'started' if started else 'skipped'}"] += 1
        except JobBrokenError as e:  # the group lost ranks: torchft restarts it; stop saving here
            self.counts[f"{which}.broken"] += 1
            log.error("ckptstore: %s saves stop in this process: %s", which, e)
            self.enabled = False
        except Exception as e:  # noqa: BLE001 - never fail a training step
            self.counts[f"{which}.error"] += 1
            log.warning("ckptstore: %s save not started: %s: %s", which, type(e).__name__, e)

    # -- the cold start --------------------------------------------------------------------------------
    def resume(self) -> RestoreReport:
        """Before the first step, on every rank of the group (after the torchft ``Manager`` exists). A
        live job (the lighthouse's previous quorum has a member alive past step 0): torchft heals this
        group from a peer; only the group's own newest position is read, for its loader (bounded by
        ``timeout_s``). Otherwise the whole job is starting: restore the newest main version whose
        active groups' positions are all saved (docs/FORMAT.md, "torchft"), torchft's step with it, and
        this group's loader and RNG at its position no newer than that step (the loader policy when
        the number of groups changed: docs/howto/torchft.md). Raises what a restore raises when a version
        cannot be read and no older one can either."""
        t0 = time.monotonic()
        if not self.enabled:
            return RestoreReport("disabled", step=int(self.manager.current_step()))
        live, why, at = self._bcast(self._live() if self.rank == 0 else None)  # one answer per group
        self._joined_at = at if live else None  # checked at the first committed step (_lost_live_job)
        self._timeline = None  # a cold start sets it; a join learns it from the peer that heals it
        if live:
            r = self._join(why)
        else:
            r = self._cold_start(why)
        r.seconds = time.monotonic() - t0
        self._last_step = int(self.manager.current_step())
        r.step = self._last_step
        self._rewind = False
        self._post_agreement()
        self._report_restore(r)
        log.info("ckptstore: resume of group %d: %s (step %d%s)", self.group, r.kind, r.step,
                 f", {r.version}" if r.version else "")
        return r

    def _report_restore(self, r: RestoreReport, **extra: Any) -> None:
        """``r`` becomes :attr:`last_restore` and a ``resume`` event."""
        self.last_restore = r
        self._emit("resume", outcome=r.kind, step=r.step, version=r.version, why=r.why, skipped=r.skipped,
                   loader=dataclasses.asdict(r.loader) if r.loader is not None else None, orphaned=r.orphaned,
                   seconds=r.seconds, **extra)

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.on_event is not None:
            try:
                self.on_event({"kind": kind, "tier": "torchft", "group": self.group, **fields})
            except Exception:  # noqa: BLE001 - a callback never breaks the loop
                log.exception("ckptstore: on_event callback failed")

    def _live(self) -> tuple[bool, str, int | None]:
        """``(live, why, step)``: whether a live job exists (:func:`_torchft_store.job_is_live`) and its step."""
        if not self.lighthouse:
            warnings.warn("DurableTier: no lighthouse address (lighthouse= or TORCHFT_LIGHTHOUSE): every start is taken "
                          "as a cold start, also a group joining a live job", RuntimeWarning, stacklevel=3)
            return False, "no lighthouse address", None
        try:
            view = _ft.lighthouse_view(self.lighthouse, self.timeout_s)
        except Exception as e:  # noqa: BLE001 - an unreachable lighthouse: the job cannot be live either
            return False, f"the lighthouse's status could not be read ({type(e).__name__}: {e})", None
        live, why = _st.job_is_live(view.members, view.heartbeats, self.live_within_s)
        return live, why, _st.live_step(view.members, view.heartbeats, self.live_within_s)

    def _store_versions(self) -> list[str]:
        """The committed version names: the local root's and, when it answers, the remote tier's
        (``self._attempts``: ``{name: {attempt, ...}}`` of both)."""
        from ..store import Store

        recs = list(Store(self.root, key=self._key).versions()) if os.path.isdir(self.root) else []
        if self.remote is not None:
            try:
                recs += list(Store(None, remote=self.remote, key=self._key).versions())
            except (TransientStorageError, CkptStoreError, OSError) as e:
                log.warning("ckptstore: the remote tier was not consulted for the restore: %s", e)
        self._attempts: dict[str, set] = collections.defaultdict(set)
        self._worlds: dict[str, int] = {}
        self._writers: dict[str, dict] = {}  # main versions: their manifest's ``torchft`` entry (docs/FORMAT.md)
        for r in recs:
            self._attempts[r.version].add(r.attempt)
            self._worlds[r.version] = max(self._worlds.get(r.version, 0), int(r.world_size or 1))
            ft = (r.user or {}).get("torchft") if isinstance(r.user, dict) else None
            if isinstance(ft, dict):
                self._writers[r.version] = ft
        return sorted(self._attempts)

    def _supersede_positions(self, names: list[str], step: int) -> None:
        """This group's positions saved after ``step`` belong to the timeline the restart abandoned: its
        next saves of those names replace them (docs/FORMAT.md, "Superseding"), as the main manager's
        restore does for ``step-N`` names after the restored one."""
        why = f"abandoned timeline: the job restarted from {_st.MAIN_PREFIX}{step}"
        for n in names:
            gv = _st.parse_loader_version(n)
            if gv is not None and gv[0] == self.group and gv[1] > step:
                self._positions._supersede[n] = {a: why for a in self._attempts.get(n, ())}

    def _read_positions(self, version: str, rank: int | None = None) -> list[_st.Position]:
        """The position history of rank ``rank`` (default: this rank) in positions save ``version``."""
        import torch.distributed.checkpoint as dcp

        from ..dcp.reader import StorageReader

        rank = self.rank if rank is None else int(rank)
        key = f"positions/rank{rank}"
        sd = {key: {"data": b""}}
        reader = StorageReader(self.root, remote=self.remote, key=self._key, version=version, allow_partial_load=True)
        with typed():  # the ckptstore error, not DCP's CheckpointException around it
            dcp.load(sd, storage_reader=reader, no_dist=True)
        return _st.unpack_history(bytes(sd[key]["data"]))

    def _positions_at(self, names: list[str], step: int, ranks: int | None = None) -> tuple[
            dict[tuple[int, int], _st.Position | None], dict[int, int]]:
        """Every stored rank's position at ``step`` (the greatest ≤ ``step``), ``{(group, rank): position}``,
        and ``{group: ranks}`` of the positions save read: per group, the oldest positions save at or
        after ``step`` (its history reaches back), else the newest before it; each of its ranks read
        (its first ``ranks`` when given)."""
        by_group: dict[int, list[int]] = collections.defaultdict(list)
        for n in names:
            gv = _st.parse_loader_version(n)
            if gv is not None:
                by_group[gv[0]].append(gv[1])
        out: dict[tuple[int, int], _st.Position | None] = {}
        worlds: dict[int, int] = {}
        for g, steps in by_group.items():
            steps.sort()
            after = [s for s in steps if s >= step]
            before = [s for s in steps if s < step]
            tries = after[:1] + before[-1:]
            for s in tries:
                name = f"{_st.loader_prefix(g)}{s}"
                saved = max(1, self._worlds.get(name, 1))
                got: dict[tuple[int, int], _st.Position | None] = {}
                try:
                    for r in range(saved if ranks is None else min(ranks, saved)):
                        got[(g, r)] = _st.position_at(self._read_positions(name, r), step)
                except Exception as e:  # noqa: BLE001 - the next candidate
                    log.warning("ckptstore: positions %s unreadable: %s", name, e)
                    continue
                if any(p is not None for p in got.values()):
                    out.update(got)
                    worlds[g] = saved
                    break
            else:
                out.setdefault((g, 0), None)
        return out, worlds

    def _absent_proofs(self, names: list[str], newest: dict[int, int]) -> dict[int, tuple[list[int], str]]:
        """For each main step some group's saved positions lag behind (:func:`~._torchft_store.lagging_groups`):
        ``{step: (lagging groups, why)}`` when its writer's quorum count proves those groups were not
        in that step's quorum (:func:`~._torchft_store.absent_from_quorum`: the groups that saved a
        position at or after it account for every participant). Reads rank 0's positions of each group
        ahead of such a step (a handful of small versions: only steps within one interval of a group's
        newest position lag). Called by every rank of the group alike: in a group of several ranks a
        load is a collective of its ranks (the reader exchanges what each root holds)."""
        proofs: dict[int, tuple[list[int], str]] = {}
        for name in names:
            s = _st.main_step(name)
            lagging = [] if s is None else _st.lagging_groups(s, newest, self.interval_steps)
            if not lagging:
                continue
            n = self._writers.get(name, {}).get("participants")
            n = n if isinstance(n, int) else None
            ahead = sorted(g for g, k in newest.items() if k >= s)
            if n is None or len(ahead) < n:
                continue
            at, _worlds = self._positions_at([v for v in names if (_st.parse_loader_version(v) or (-1,))[0] in ahead],
                                             s, ranks=1)
            at_s = {g: (p if p is not None and p.step == s else None) for (g, _r), p in at.items()}
            if _st.absent_from_quorum(n, at_s):
                took = sorted(g for g, p in at_s.items() if p is not None and p.participated)
                why = (f"{_st.MAIN_PREFIX}{s}'s quorum had {n} participant(s), group(s) {', '.join(map(str, took))}: "
                       f"group(s) {', '.join(map(str, lagging))} took no part in that step")
                proofs[s] = (lagging, why)
        return proofs

    def _cold_start(self, why: str) -> RestoreReport:
        # the group's rank 0 lists the store, every rank of the group takes its listing (one choice)
        listing = ((self._store_versions(), dict(self._attempts), dict(self._worlds), dict(self._writers))
                   if self.rank == 0 else None)
        names, attempts, self._worlds, self._writers = self._bcast(listing)
        self._attempts = collections.defaultdict(set, attempts)
        journal = self._journal_positions() if self.loader is not None else []  # before the reset below
        main_steps = [s for s in (_st.main_step(n) for n in names) if s is not None]
        newest = _st.newest_positions(names)
        proofs = self._bcast(self._absent_proofs(names, newest))  # every rank reads; rank 0's answer is taken

        def absent(s: int, lagging: list[int]) -> str | None:
            proof = proofs.get(s)
            return proof[1] if proof is not None and set(lagging) <= set(proof[0]) else None

        chosen, skipped = _st.choose_main(main_steps, newest, self.interval_steps, absent)
        version = None
        while chosen is not None:
            version = f"{_st.MAIN_PREFIX}{chosen}"
            try:
                self._main.restore(self._state, version=version)
                break
            except CkptStoreError as e:
                skipped.append(f"{version}: {type(e).__name__}: {e}")
                log.warning("ckptstore: %s could not be restored (%s); trying an older one", version, e)
                chosen, more = _st.choose_main([s for s in main_steps if s < chosen], newest, self.interval_steps, absent)
                skipped.extend(more)
                version = None
        self._journal_do(lambda j: j.reset(), "reset")  # the timeline restarts (at the chosen step, or 0)
        self._timeline = chosen if chosen is not None else 0
        if chosen is None:
            self._supersede_positions(names, 0)
            r = RestoreReport("fresh", why=why, skipped=skipped)
            r.loader = _st.LoaderChoice(self.group, "initial", reason="no main version is restored", rank=self.rank)
            return r
        r = RestoreReport("cold-start", version=version, why=why, writer=self._writers.get(version), skipped=skipped)
        self._supersede_positions(names, chosen)
        if self.loader is not None:
            at, worlds = self._positions_at(names, chosen)
            mine = _st.position_at(journal, chosen)  # this rank's journal (its shape: the name has it)
            if mine is not None and mine.step <= chosen and (at.get((self.group, self.rank)) is None
                                                             or mine.step > at[(self.group, self.rank)].step):
                at[(self.group, self.rank)] = mine
                worlds[self.group] = self.group_world
            choice, pos, r.orphaned = _st.rank_loader_plan(self.group, self.rank, self.num_groups, self.group_world,
                                                           at, worlds)
            proof = proofs.get(chosen)
            if proof is not None and self.group in proof[0] and choice.how.startswith("own"):
                # this group was away at the chosen step: its position there is its newest
                src = ("its journal" if pos is mine else
                       "its newest positions version; its journal is not in this root, so batches it drew after that "
                       "step and before it left are drawn again")
                choice = dataclasses.replace(choice, reason=f"{proof[1]}: this group continues from its own newest "
                                                            f"position (step {choice.step}, {src})")
            r.loader = choice
            if pos is not None:
                self._apply(pos, own=choice.how == "own")
        return r

    def _join(self, why: str) -> RestoreReport:
        r = RestoreReport("join", why=why)
        if self.loader is None:
            return r
        recs = self._journal_records()
        pos = recs[-1][0] if recs else None  # its newest: the journal has every step of this node's launches
        self._joined_timeline = recs[-1][1] if recs else -1  # the timeline that position belongs to
        names = [n for n in self._store_versions_local() if _st.parse_loader_version(n) is not None
                 and _st.parse_loader_version(n)[0] == self.group]
        newest = max((_st.parse_loader_version(n)[1] for n in names), default=None)
        if newest is not None and (pos is None or pos.step < newest):  # a newer positions version (another node's)
            try:
                hist = self._read_positions(f"{_st.loader_prefix(self.group)}{newest}")
                got = max(hist, key=lambda p: p.step) if hist else None
                pos = got if pos is None or (got is not None and got.step > pos.step) else pos
            except Exception as e:  # noqa: BLE001 - reported; the loader stays as built
                r.why += f"; its own position could not be read ({type(e).__name__}: {e})"
        if pos is not None:
            self._apply(pos, own=True)
            r.loader = _st.LoaderChoice(self.group, "peer", self.group, pos.step, pos.batches,
                                        "joining: torchft heals the model; the loader continues from its own newest "
                                        "position", self.rank, self.rank)
        else:
            r.loader = _st.LoaderChoice(self.group, "initial", reason="joining: no position of this rank is stored",
                                        rank=self.rank)
        return r

    def _store_versions_local(self) -> list[str]:
        from ..store import Store

        if not os.path.isdir(self.root):
            return []
        try:
            return [r.version for r in Store(self.root, key=self._key).versions()]
        except CkptStoreError as e:
            log.warning("ckptstore: the local root could not be listed: %s", e)
            return []

    def _apply(self, pos: _st.Position, own: bool) -> None:
        """The loader (and, ``own``, the RNG) at ``pos``. An own position also starts the history and
        is recorded in the journal, so that the next positions version and the journal hold this
        rank's position of the steps it was away for (the greatest step ≤ any of them is ``pos``)."""
        got = _st.unpack_blob(pos.blob)
        self.loader.load_state_dict(got["loader"])
        if own:
            _set_rng(got["rng"])
        self._batches = pos.batches
        self._loader_blob = pos.blob
        self._history.clear()
        self._positions_saved = None  # a positions version is due at the next (decision) step
        if own:
            self._history.append(pos)
            self._journal_append(pos)

    # -- reporting and shutdown ------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters: ``main.started``/``skipped``/``committed``/``committed-local`` (the upload failed;
        retried)/``failed``/``fenced``/``lost-race``, the same for ``positions`` (and
        ``positions.coalesced``: steps whose position only the journal has until the next positions
        save); ``journal.error`` (the journal stopped: a full disk), ``join.lost`` (a restore after the
        live job this group joined was lost), ``heal.timeline`` (the loader moved back to the step the
        job restarted from; docs/torchft.md, "A live job lost while joining it")."""
        return dict(self.counts)

    def metrics_text(self, which: str = "main") -> str:
        """The Prometheus text of the main versions' manager (``which="positions"``: the positions')."""
        if not self.enabled and self._main is None:
            return ""
        return (self._main if which == "main" else self._positions).metrics_text()

    def wait(self) -> None:
        """Save the newest position if no save carries it yet, and wait for every save in flight (the
        end of a job, tests); errors are reported, not raised."""
        if not self.enabled or self._closed:
            return
        self._flush_positions()
        for m in (self._main, self._positions):
            m.wait()

    def _flush_positions(self) -> None:
        if self._history and self._positions_saved != self._history[-1].step:
            try:
                self._positions.wait()
            except CkptStoreError as e:
                log.warning("ckptstore: positions saves: %s", e)
            self._save_positions(self._history[-1].step, force=True)

    def close(self) -> None:
        """Save the newest position if the last one was skipped, wait for the saves in flight and their uploads (the writer's ``upload_timeout``); what was
        not uploaded is logged (a later run's first save uploads it), never raised."""
        if self._closed:
            return
        if self.enabled:  # the newest position, if no save carries it yet: a restart pairs with it
            self._flush_positions()
        self._closed = True
        self._journal_do(lambda j: j.close(), "close")
        self._journal = None
        for name, m in (("main", self._main), ("positions", self._positions)):
            if m is None:
                continue
            try:
                m.close()
            except CkptStoreError as e:
                self.counts[f"{name}.not-uploaded"] += 1
                log.warning("ckptstore: closing the %s saves: %s", name, e)
        self._close_agreement()

    def _close_agreement(self) -> None:
        if self._agree_pg is None:
            return
        if self._pending is not None:
            try:
                import datetime as _dt

                self._pending[0].wait(_dt.timedelta(seconds=self.timeout_s))
            except Exception as e:  # noqa: BLE001 - a rank of the group is gone: nothing to agree on
                log.debug("ckptstore: the last agreement of group %d: %s", self.group, e)
            self._pending = None
        from .._groups import destroy_group

        destroy_group(self._agree_pg)
        self._agree_pg = None

    def __enter__(self) -> "DurableTier":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
