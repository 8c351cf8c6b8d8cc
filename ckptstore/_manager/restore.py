"""The restore of a :class:`ckptstore.CheckpointManager`: which version, from which copies, and what
follows the load.

- **The choice** is :func:`ckptstore.choice.decide` (through :meth:`ckptstore.Store.choose`, a
  collective on the manager's group): the newest version in the manager's scope that every rank
  can load, passing over versions marked damaged, missing an object everywhere, saved by another
  number of ranks (unless ``reshard``), restored too often in a row (``fall_back_after``) or recorded
  as holding NaN/Inf values (unless ``allow_nonfinite``) (docs/FORMAT.md, "Restore choice").
  :meth:`Restorer.choose` is the only call into it.
- **The fallback loop.** A load that fails verification (stored bytes that fail their checksum or
  tag, an object missing everywhere, a damage mark) fails on every rank alike (DCP gathers every
  rank's failure), so every rank decides the same: first the load again without the root copies
  that failed, when another root holds one (a replica, the primary: the nearest verified copy);
  then, with none left, the choice again past the version. Any other failure (a key, a state dict
  mismatch, the job itself) is raised: falling back would not cure it. An explicit ``version``
  falls back to nothing.
- **After the load**: the state is applied, the writer's incremental baseline is seeded with what
  was loaded, a replaced node gets its part back from the replicas in the background
  (re-replication, docs/FORMAT.md "Replicas"), the restore is appended to the restore log of rank
  0's root (docs/FORMAT.md, "Restore log"), and the names the next saves supersede are returned
  with the :class:`~.info.RestoreInfo` (docs/FORMAT.md, "Superseding").
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, NamedTuple

import torch.distributed.checkpoint as dcp

from .._state_keys import _SpellingLoadPlanner
from ..errors import raise_typed
from ..dcp.reader import StorageReader
from .info import RestoreInfo

log = logging.getLogger("ckptstore")


@dataclasses.dataclass(frozen=True)
class Source:
    """Where and what a restore reads (the manager's settings at the call): the local ``root``, the
    ``remote`` tier, the master ``key``, options for the readers (``threads``), the
    ``scope`` (regular expression of the manager's version names), ``reshard``,
    ``fall_back_after`` and ``allow_nonfinite`` (see :class:`ckptstore.CheckpointManager`)."""

    root: str
    remote: Any  # a Tier, or None
    key: Any
    reader_options: dict
    scope: Any
    reshard: bool
    fall_back_after: int | None
    allow_nonfinite: bool = False


class Restored(NamedTuple):
    """A restore's result: what was loaded, and ``{name: {attempt: reason}}`` — the versions the next
    save of that name supersedes."""

    info: RestoreInfo
    supersede: dict


@dataclasses.dataclass
class _Tries:
    """What the fallback loop of one restore has learnt so far (the same on every rank)."""

    failed: dict = dataclasses.field(default_factory=dict)  # {(version, attempt): why}: passed over
    unverified: list = dataclasses.field(default_factory=list)  # versions that failed verification
    bad: set = dataclasses.field(default_factory=set)  # {(global rank, object)}: unverifiable root copies
    notes: dict = dataclasses.field(default_factory=dict)  # {(version, attempt): why}: loaded again
    tries: int = 0  # loads again without copies
    retry: tuple | None = None  # (version, why, copies): warned once the choice shows another copy exists

    def learn(self, e: BaseException, view, explicit: bool, rank: int) -> bool:
        """After the load of ``view`` failed with ``e``: True to choose and load again (without the
        copies that failed, or past the version), False when ``e`` is to be raised."""
        why = _unverifiable(e)
        if why is None:
            return False
        more = _bad_copies(e) - self.bad
        if more and self.tries < 4:
            self.bad |= more
            self.notes[(view.version, view.attempt)] = why
            self.retry = (view.version, why[0], more)
            self.tries += 1
            return True
        if explicit:
            return False
        self.failed[(view.version, view.attempt)] = why
        self.unverified.append(view.version)
        if rank == 0:
            log.warning("ckptstore: version %r failed verification while loading (%s); restoring the next "
                        "older loadable version instead", view.version, why[0])
        return True


class Restorer:
    """The restores of one manager: loads through :class:`ckptstore.StorageReader` on ``job``'s group
    into the state dicts ``states`` builds, seeds and heals through ``writer``.

    :attr:`healing`: the re-replication future of the last restore that started one (or None)."""

    def __init__(self, *, writer, job, states) -> None:
        self._writer, self._job, self._states = writer, job, states
        self.healing = None

    def choose(self, src: Source, version: str | None, failed: dict, bad: set = frozenset(), notes: dict | None = None):
        """The restore choice (:func:`ckptstore.choice.decide`) for ``version`` (None: the newest
        loadable in scope), passing over ``failed`` versions; a collective on the manager's group."""
        from ..store import Store

        st = Store(src.root, remote=src.remote, key=src.key)
        world = self._job.group_world()
        try:
            return st.choose(version, self._job.pg if self._job.dist else None, exclude=failed, scope=src.scope,
                             world_size=world, reshard=src.reshard, fall_back_after=src.fall_back_after,
                             bad=frozenset(bad), notes=notes, allow_nonfinite=src.allow_nonfinite)
        finally:
            st.close()

    def restore(self, src: Source, state: dict[str, Any], version: str | None, partial: bool | tuple,
                t0: float) -> Restored | None:
        """Load the version chosen (``version``, or the newest every rank can load and verify) into
        ``state`` and apply it; None when there is none. ``t0``: monotonic start of the restore."""
        world = self._job.group_world()
        tries = _Tries()
        while True:
            view = self._job.guarded(self.choose, src, version, tries.failed, tries.bad, tries.notes)
            if view is None:
                return None
            loaded = self._load(src, view, state, partial, world, tries, explicit=version is not None)
            if loaded is not None:
                break
        sd, reader, same_world = loaded
        self._states.apply(state, sd, per_rank=same_world)
        self._follow_up(view, reader, same_world)
        self._report(src, view, world, same_world, tries.unverified)
        skipped = list(view.skipped)
        supersede = {n: {a: _supersede_reason(n, skipped) for a in atts} for n, atts in view.newer.items()}
        info = RestoreInfo(view.version, view.step, view.world_size, same_world and self._states.save_rng,
                           same_world and bool(self._states.per_rank_keys), time.monotonic() - t0,
                           attempt=view.attempt, skipped=skipped, remote_error=view.remote_error,
                           restore_count=view.restore_count, stale=list(view.stale), reads=dict(reader.stats))
        return Restored(info, supersede)

    def _load(self, src: Source, view, state, partial, world: int, tries: _Tries, explicit: bool):
        """Load ``view``'s version: ``(state dict, reader, same world size)``, or None when the loop
        is to choose again (``tries`` says without what); raises what falling back cannot cure."""
        if tries.retry is not None and tries.retry[0] == view.version and self._job.rank == 0:
            log.warning("ckptstore: %s; loading %s again from another copy", tries.retry[1],
                        ", ".join(f"{o} (not from rank {r}'s root)" for r, o in sorted(tries.retry[2])))
        tries.retry = None
        same_world = view.world_size in (None, 0, world)
        sd = self._states.build(state, for_load=True, per_rank=same_world)
        # resharded: the saving ranks' own values (RNG, per_rank_keys) have no rank here to go to
        unread = () if same_world else tuple(f"{k}/rank" for k in self._states.per_rank_keys) + ("rng/rank",)
        unread = True if partial is True else unread + tuple(partial or ())
        pg = self._job.pg
        reader = StorageReader(src.root, remote=src.remote, key=src.key, process_group=pg,
                               allow_partial_load=unread or False, avoid=frozenset(tries.bad),
                               record_digests=self._writer.incremental and same_world, **src.reader_options)
        try:
            self._job.guarded(lambda: dcp.load(sd, checkpoint_id=view.version, storage_reader=reader,
                                               process_group=pg, planner=_SpellingLoadPlanner(sd)))
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            if not tries.learn(e, view, explicit, self._job.rank):
                raise_typed(e)  # the rank's ckptstore error, not DCP's CheckpointException around it
            return None
        return sd, reader, same_world

    def _follow_up(self, view, reader, same_world: bool) -> None:
        """What the writer does after a load of the job's own world size."""
        if same_world and self._writer.incremental:  # the next save references what did not change since
            self._writer._inc.seed(reader.manifest, reader.item_digests)
        if same_world:  # re-replication: a replaced node gets its part back, in the background
            j = reader._joined
            self.healing = self._writer.heal(view, j[2], j[3]) if j is not None and len(j) > 1 else None

    def _report(self, src: Source, view, world: int, same_world: bool, unverified: list) -> None:
        """The warnings of a restore, and (rank 0) its line in the restore log."""
        if not same_world and (self._states.save_rng or self._states.per_rank_keys):
            log.warning("ckptstore: %s was saved by %s ranks, this job has %s: per-rank values (RNG, %s) not restored",
                        view.version, view.world_size, world, ", ".join(self._states.per_rank_keys) or "-")
        if self._job.rank != 0:
            return
        for sk in view.skipped:
            if sk.version not in unverified:
                log.warning("ckptstore: skipped version %r (%s): %s", sk.version, sk.kind, sk.reason)
        if view.restore_count >= 1:
            log.warning("ckptstore: version %r is restored for the %d%s time in a row and nothing newer was committed "
                        "in between: the job ends after every resume%s", view.version, view.restore_count + 1,
                        _nth(view.restore_count + 1),
                        "" if src.fall_back_after else " (CheckpointManager(fall_back_after=K) skips it after K tries)")
        self._log_restore(src, view)

    def _log_restore(self, src: Source, view) -> None:
        """Append this restore to the restore log of rank 0's root (docs/FORMAT.md, "Restore log")."""
        from ..dcp import _job
        from ..manifest.schema import utcnow

        entry = {"version": view.version, "attempt": view.attempt, "newest": list(view.newest or ()), "time": utcnow(),
                 "world_size": self._job.group_world(), "skipped": [sk.version for sk in view.skipped]}
        try:
            _job.append_restore_log(self._writer._tier, entry)
        except OSError as e:  # the restore stands; only the restart-loop count misses it
            log.warning("ckptstore: could not append to the restore log of %s: %s", src.root, e)


def _unverifiable(e: BaseException) -> tuple | None:
    """Why a failed load shows that its version cannot be loaded and verified (stored bytes that fail
    their checksum or tag, an object missing everywhere, a damage mark): ``(one line naming the rank,
    version, object and place, the object)`` — or None when the failure is of another kind (a key, a
    state dict mismatch, the job itself), which falling back would not cure."""
    from torch.distributed.checkpoint.api import CheckpointException

    from ..errors import DamagedVersionError, IntegrityError, KeyMismatchError, ObjectNotFoundError

    if isinstance(e, CheckpointException):
        fails = sorted((r, f[0] if isinstance(f, tuple) else f) for r, f in e.failures.items())
    else:
        fails = [(None, e)]
    for r, x in fails:
        if isinstance(x, (IntegrityError, DamagedVersionError, ObjectNotFoundError)) and not isinstance(x, KeyMismatchError):
            return ("" if r is None else f"rank {r}: ") + f"{type(x).__name__}: {x}", getattr(x, "object", None)
    return None


def _bad_copies(e: BaseException) -> set:
    """``{(global rank, object)}``: the root copies a failed load found unverifiable (from the
    ``places`` of the readers' ``IntegrityError``s, gathered to every rank by DCP)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from ..errors import IntegrityError

    fails = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()] if isinstance(e, CheckpointException) else [e]
    out = set()
    for x in fails:
        if isinstance(x, IntegrityError) and x.object:
            out.update((r, x.object) for kind, r in getattr(x, "places", ()) if kind == "root" and r is not None)
    return out


def _supersede_reason(name: str, skipped: list) -> str:
    for sk in skipped:
        if sk.version == name:
            return f"skipped at restore ({sk.kind})" + (f": {sk.object}" if sk.object else "")
    return "newer than the restored version (an abandoned timeline)"


def _nth(n: int) -> str:
    return "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
