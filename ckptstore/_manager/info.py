"""What the manager hands back: :class:`SaveInfo` per save, :class:`RestoreInfo` per restore
(both re-exported by :mod:`ckptstore.manager` and :mod:`ckptstore`).

- **Timings.** Per save: ``blocked_s`` (time ``save()`` held the training loop), ``local_commit_s``
  and ``remote_commit_s`` (from the ``save()`` call to the commit; ``remote_commit_s`` only on the
  coordinator, which makes the remote commit). Passed to ``on_save`` and kept by
  :meth:`CheckpointManager.stats <ckptstore.CheckpointManager.stats>`, which adds the interval advice
  of :mod:`ckptstore.advise` when ``mtbf`` is given.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SaveInfo:
    """Timings of one save (seconds, measured on this rank from the ``save()`` call)."""

    step: int
    version: str
    blocked_s: float
    local_commit_s: float | None = None
    remote_commit_s: float | None = None
    error: str | None = None
    #: with ``replicas``: ``"made"`` (every replica of the version in place) or ``"gap"`` (some were
    #: not made: ``replica_error`` names them; the version is committed on its own roots)
    replicas: str | None = None
    replica_error: str | None = None
    #: seconds the thread that ran the save paused between the pieces of its bookkeeping
    #: (``background_duty``, ckptstore/_pace.py; 0.0: not paced)
    paused_s: float = 0.0


@dataclasses.dataclass
class RestoreInfo:
    """What the last :meth:`CheckpointManager.restore` loaded: ``version``, its ``step``, the
    ``world_size`` that saved it, whether this rank's RNG states and ``per_rank_keys`` values were
    restored (only when the world size is unchanged; otherwise they are left as they are), and
    ``seconds`` spent (agreeing on the version and loading it).

    What the choice passed over (docs/FORMAT.md, "Restore choice"): ``skipped`` — newer versions
    not loaded, newest first, each a :class:`ckptstore.choice.Skipped` with its ``kind``
    (``damaged``, ``missing``, ``unverified``: failed verification while loading, ``shape``,
    ``restarts``, ``nonfinite``: its manifest records NaN/Inf values, ``rolled-back``: the catalogue
    chain shows an older manifest put back under the name, ``missing-newest``: the chain's newest
    commit is gone — nothing was loadable of it, recorded first; docs/FORMAT.md "Catalogue chain")
    and ``reason``;
    ``remote_error`` — why the remote tier was not consulted (None: it was, or there is none);
    ``restore_count`` — restores in a row before this one that loaded the same version with nothing
    newer committed in between (the job died after each: a restart loop);
    ``attempt`` — the attempt loaded; ``stale`` — ``(where, attempt)`` copies of the name that are
    not the version (reported, not loaded)."""

    version: str
    step: int | None
    world_size: int | None
    rng_restored: bool
    per_rank_restored: bool
    seconds: float
    attempt: str | None = None
    skipped: list = dataclasses.field(default_factory=list)
    remote_error: str | None = None
    restore_count: int = 0
    stale: list = dataclasses.field(default_factory=list)
    #: this rank's read counters of the load (``StorageReader.stats``: ``fallback_reads``,
    #: ``remote_reads``, ``peer_bytes``, ``repaired``)
    reads: dict = dataclasses.field(default_factory=dict)

    @property
    def fell_back(self) -> bool:
        """A newer version was skipped."""
        return bool(self.skipped)
