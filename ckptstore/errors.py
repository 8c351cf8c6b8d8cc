"""Exception hierarchy of ckptstore.

Every exception a user can cause is a subclass of :class:`CkptStoreError`, carries a message that
says what happened and what to do, and an ``exit_code`` that the CLI returns unchanged (borg's
convention: the exception class, not the message text, decides the exit status).

Typed errors raised inside ``dcp.save`` / ``dcp.load`` reach the caller wrapped in torch's
``CheckpointException`` (a ``BaseException``, one entry per failed rank): :func:`unwrap` takes the
typed error back out, and :func:`typed` (a context manager and a decorator) re-raises it, so that
``except ckptstore.KeyMismatchError`` works around a plain ``dcp.load``. ``CheckpointManager`` and the
integrations do this themselves.

Exit codes (documented in docs/operations/exit-codes.md):

| code | meaning |
|---|---|
| 0 | success / clean |
| 1 | any other ckptstore error |
| 2 | usage error (bad flags; raised by the CLI library) |
| 3 | version not found |
| 4 | integrity error (stored bytes fail their checksum / tag) |
| 5 | key error (missing, wrong, or unexpected key) |
| 6 | version already exists |
| 7 | storage error (disk full, object-store refusal, permission denied) |
| 8 | unsupported format or codec version |
| 9 | no store: ROOT does not exist, or the remote prefix holds no store |
| 10 | scrub: damage found (not repaired) |
| 11 | scrub: damage found and every damaged object repaired |
| 12 | scrub: some objects could not be checked |
| 13 | scrub: no damage, but a version's tensors hold NaN/Inf values (a finding, not damage) |
| 14 | key service: AWS KMS refused or did not answer a request for a data key |
"""

from __future__ import annotations

import contextlib

__all__ = [
    "CkptStoreError",
    "IntegrityError",
    "ManifestError",
    "VersionNotFoundError",
    "StoreNotFoundError",
    "VersionExistsError",
    "SupersedeConflictError",
    "SupersedeRefusedError",
    "CatalogueRollbackError",
    "DamagedVersionError",
    "KeyMismatchError",
    "KeyServiceError",
    "KeyServiceUnavailableError",
    "InvalidNameError",
    "UnsupportedFormatError",
    "ObjectNotFoundError",
    "ObjectExistsError",
    "PreconditionFailedError",
    "StorageError",
    "TransientStorageError",
    "StorageFullError",
    "DtypeMismatchError",
    "StateDictKeysError",
    "UnsupportedStateError",
    "JobBrokenError",
    "CommitRefusedError",
    "PlacementError",
    "Preempted",
    "unwrap",
    "typed",
    "rank_failures",
    "summary",
]


class CkptStoreError(Exception):
    """Base class of every ckptstore error. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class IntegrityError(CkptStoreError):
    """Stored bytes do not match their checksum or authentication tag.

    ``object`` names the stored object (relative to the tier root) when known.
    """

    exit_code = 4

    def __init__(self, message: str, *, object: str | None = None, version: str | None = None):
        super().__init__(message)
        self.object = object
        self.version = version

    def __reduce__(self):  # keep ``object``/``version``/``places`` when DCP gathers a rank's failure to the others
        return (_rebuild, (type(self), str(self), dict(self.__dict__)))


def _rebuild(cls, message, attrs):
    e = cls.__new__(cls)
    Exception.__init__(e, message)
    e.__dict__.update(attrs)
    return e


class ManifestError(IntegrityError):
    """A manifest is malformed, fails its checksum/authentication, or names invalid objects."""


class DamagedVersionError(CkptStoreError):
    """The version was marked damaged by ``ckptstore scrub``; it is skipped by ``latest()``."""

    exit_code = 4


class VersionNotFoundError(CkptStoreError, FileNotFoundError):
    """No committed version with that name exists in the tier(s) looked at."""

    exit_code = 3


def version_not_found(version: str, where: str, committed=()) -> VersionNotFoundError:
    """The one "not found" of a named version (``show``, ``pin``, ``drop``, ``scrub --version``,
    ``Store.get``): where it was looked for, the closest committed names when there are near misses
    (``step-18`` → "did you mean 'step-180'?"), and where to see the versions."""
    import difflib

    close = difflib.get_close_matches(str(version), sorted(set(committed)), n=3, cutoff=0.75)
    hint = ""
    if len(close) == 1:
        hint = f"; did you mean {close[0]!r}?"
    elif close:
        hint = "; did you mean one of " + ", ".join(repr(c) for c in close) + "?"
    return VersionNotFoundError(f"version {version!r} is not committed in {where}{hint} "
                                "('ckptstore list' shows the committed versions)")


class StoreNotFoundError(CkptStoreError, FileNotFoundError):
    """No ckptstore store where one was named: a local root that does not exist, or a remote prefix
    with nothing under ``versions/`` (never written to). An empty but existing root is a store."""

    exit_code = 9


class VersionExistsError(CkptStoreError, FileExistsError):
    """A committed version with that name already exists (pass ``overwrite=True`` to replace it)."""

    exit_code = 6


class SupersedeConflictError(VersionExistsError):
    """Two saves superseded one copy of a name at once and this one lost: the copy it checked was
    replaced (or removed) by another writer before its conditional commit (docs/FORMAT.md,
    "Superseding"). Nothing of this save is committed there; its attempt is reclaimed."""


class KeyMismatchError(CkptStoreError):
    """The master key is missing, wrong, or given for a version that is not encrypted."""

    exit_code = 5


class KeyServiceError(CkptStoreError):
    """The key service (AWS KMS, :class:`ckptstore.KmsKey`) refused a request for a data key: the KMS key
    does not exist, is disabled or pending deletion, is not a symmetric encryption key, or the caller
    may not use it (``AccessDeniedException``, no credentials). The message names the key, the KMS
    error code and what to do.

    Nothing is written unencrypted because of it: a save that cannot get its data key fails before
    any object is written; a load that cannot unwrap one fails without returning any tensor, and
    without marking or skipping anything as damaged (docs/FORMAT.md, "Threat model").
    ``code``: the KMS error code (or the botocore exception's name); ``key``: the KMS key as given."""

    exit_code = 14

    def __init__(self, message: str, *, code: str | None = None, key: str | None = None):
        super().__init__(message)
        self.code = code
        self.key = key

    def __reduce__(self):  # keep ``code``/``key`` when DCP gathers a rank's failure to the others
        return (_rebuild, (type(self), str(self), dict(self.__dict__)))


class KeyServiceUnavailableError(KeyServiceError):
    """AWS KMS did not answer (connection refused or timed out) or kept throttling
    (``ThrottlingException``, ``KMSInternalException``, 5xx) after botocore's retries. Transient, not
    corrupt: try again later; no version is changed, marked or skipped because of it
    (docs/FORMAT.md, Read rule 5)."""


class InvalidNameError(CkptStoreError, ValueError):
    """A version name, object name or remote URL is not acceptable."""

    exit_code = 2


class UnsupportedFormatError(CkptStoreError):
    """The stored format version or a codec descriptor is not known to this release."""

    exit_code = 8


class ObjectNotFoundError(CkptStoreError, FileNotFoundError):
    """A stored object does not exist in a tier (raised by tiers; translated once at the boundary)."""

    exit_code = 3

    def __init__(self, message: str, *, object: str | None = None):
        super().__init__(message)
        self.object = object

    def __reduce__(self):
        return (_rebuild, (type(self), str(self), dict(self.__dict__)))


class ObjectExistsError(CkptStoreError, FileExistsError):
    """A put-if-absent found the object already present."""

    exit_code = 6


class PreconditionFailedError(CkptStoreError):
    """A conditional replace (:meth:`ckptstore.tiers.base.Tier.replace_if_match`) found the object
    changed or gone since the writer read its version token: another writer got there first
    (docs/FORMAT.md, "Conditional writes"). Nothing was written."""

    exit_code = 6

    def __init__(self, message: str, *, object: str | None = None):
        super().__init__(message)
        self.object = object

    def __reduce__(self):
        return (_rebuild, (type(self), str(self), dict(self.__dict__)))


class StorageError(CkptStoreError):
    """The storage refused an operation permanently (permission denied, bad bucket, I/O error)."""

    exit_code = 7


class ConditionalWritesError(StorageError):
    """The remote endpoint does not enforce put-if-absent (S3/Azure ``If-None-Match: *``, GCS
    ``ifGenerationMatch=0``): it overwrote a key a conditional write should have refused. Remote commits are refused there, since two writers could
    both commit one version (docs/FORMAT.md, "Conditional writes")."""


class TransientStorageError(StorageError):
    """The storage failed in a way that may succeed if retried (throttling, connection reset)."""


class StorageFullError(StorageError, OSError):
    """The local tier ran out of space (ENOSPC/EDQUOT). Free space or run ``ckptstore gc``."""


class DtypeMismatchError(CkptStoreError, TypeError):
    """A stored tensor's dtype differs from the destination's and casting was not allowed."""

    exit_code = 1


class StateDictKeysError(CkptStoreError, ValueError):
    """The state dict being loaded and the checkpoint disagree on their keys."""

    exit_code = 1


class UnsupportedStateError(CkptStoreError, TypeError):
    """The state dict holds something ckptstore cannot store so that it loads again (refused at save,
    before anything is committed)."""

    exit_code = 1


class CommitRefusedError(CkptStoreError):
    """A save built a manifest the reader would refuse (its placement, references, replicas or
    metadata; docs/FORMAT.md, Save rule 11): it is not committed, and nothing blocks a retry."""

    exit_code = 1


class PlacementError(CommitRefusedError):
    """The ranks of a save disagree on which of them share a root (docs/FORMAT.md, "Placement")."""


class SupersedeRefusedError(CommitRefusedError):
    """A tier that cannot replace an object conditionally (or whose endpoint does not enforce it)
    refuses a superseding commit instead of overwriting what another writer may have committed
    (docs/FORMAT.md, "Superseding")."""


class CatalogueRollbackError(CkptStoreError):
    """The catalogue chain of a keyed store shows a missing newest version or a manifest put back in
    place of a newer one (docs/FORMAT.md, "Catalogue chain"): someone who can write the storage but
    has no key deleted or replayed manifests, or a lifecycle rule removed them. ``findings``: the
    :class:`ckptstore.manifest.chain.Finding` s. ``list`` and ``scrub`` exit with this code (15)."""

    exit_code = 15

    def __init__(self, message: str, findings=()):
        super().__init__(message)
        self.findings = list(findings)

    def __reduce__(self):
        return (_rebuild, (type(self), str(self), dict(self.__dict__)))


class JobBrokenError(CkptStoreError):
    """The job this save belongs to lost ranks (a peer died, its process group broke or was
    destroyed) or, in DCP's checkpoint subprocess, its trainer: nothing is committed with fewer
    ranks than the job was set up with (docs/FORMAT.md, Save rules 6-7). Restart the whole job;
    it resumes from the newest version every rank committed."""

    exit_code = 1


class FencedError(CkptStoreError):
    """The writer's ``commit_check`` refused the commit right before the commit point: the process
    that planned the save no longer owns it (under torchft: its replica group left the quorum while
    the save was in flight). Nothing is committed; the attempt's objects are garbage for gc
    (docs/FORMAT.md, Save rule 9)."""

    exit_code = 1


class Preempted(SystemExit):
    """The job was told to stop (a preemption signal, e.g. the scheduler's SIGTERM) and
    :class:`ckptstore.CheckpointManager` has saved the step the loop reached: raised by ``save()``.

    Not a failure, so not a :class:`CkptStoreError`: it derives from ``SystemExit``, so it passes
    through the training loop's ``except Exception`` and, when nobody catches it, ends the process
    without a traceback with exit status :attr:`code` (default ``128 + signal``: 143 for SIGTERM, what
    a shell reports for a process the signal ended). Resume with ``mgr.resume()`` in the next run.

    Attributes: ``signal`` (its number), ``step`` and ``version`` saved, ``saved`` (the save
    committed), ``durability`` (``"remote"``, ``"local"``: committed locally only — the upload could
    not finish within the grace period; the next run's first save uploads it — or None), ``seconds``
    (from the signal to the commit, or to giving up), ``reason`` (why nothing was saved, or None)."""

    def __init__(self, message: str, *, signal: int, step: int | None, version: str | None, saved: bool,
                 durability: str | None, seconds: float, reason: str | None = None, code: int | None = None):
        super().__init__(128 + int(signal) if code is None else code)
        self.message = message
        self.signal = int(signal)
        self.step = step
        self.version = version
        self.saved = saved
        self.durability = durability
        self.seconds = seconds
        self.reason = reason

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        kw = {k: getattr(self, k) for k in ("signal", "step", "version", "saved", "durability", "seconds", "reason")}
        return (_rebuild_preempted, (self.message, kw, self.code))


def _rebuild_preempted(message: str, kw: dict, code) -> Preempted:
    return Preempted(message, code=code, **kw)


# -- the typed error out of DCP's CheckpointException ----------------------------------------------
def _is_checkpoint_exception(exc: BaseException) -> bool:
    """``exc`` is torch's ``CheckpointException`` (checked without importing torch: the CLI and the
    catalogue run without it)."""
    return any(c.__name__ == "CheckpointException" and c.__module__.startswith("torch.distributed.checkpoint")
               for c in type(exc).__mro__)


def rank_failures(exc: BaseException) -> list[tuple[int, BaseException]]:
    """``[(rank, exception)]`` of a ``CheckpointException`` in rank order (DCP's ``failures`` maps a
    rank to ``(exception, traceback frames)``); ``[]`` for any other exception."""
    if not _is_checkpoint_exception(exc):
        return []
    out = []
    for r, f in (getattr(exc, "failures", None) or {}).items():
        out.append((int(r), f[0] if isinstance(f, tuple) else f))
    return sorted(out, key=lambda rf: rf[0])


def unwrap(exc: BaseException) -> BaseException:
    """The ckptstore error behind ``exc``.

    Args:
        exc: what ``dcp.save`` / ``dcp.load`` / ``async_save``'s future raised — usually torch's
            ``CheckpointException``, whose ``failures`` hold each failed rank's exception — or any
            other exception.

    Returns:
        The :class:`CkptStoreError` of the **lowest failed rank** that raised one (every rank sees
            the same gathered ``failures``, so every rank picks the same error); else the first
            :class:`CkptStoreError` in ``exc``'s chain of causes (``__cause__``, ``__context__``);
            else ``exc`` itself, unchanged (so ``raise unwrap(e)`` is always valid). Never raises.

    Example:

        try:
            dcp.load(state, storage_reader=ckptstore.StorageReader(root, key=key))
        except BaseException as e:  # CheckpointException is a BaseException
            err = ckptstore.errors.unwrap(e)
            if isinstance(err, ckptstore.KeyMismatchError):
                ...
            raise
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, CkptStoreError):
            return e
        for _, f in rank_failures(e):
            if isinstance(f, CkptStoreError):
                return f
        e = e.__cause__ or e.__context__
    return exc


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def summary(exc: BaseException) -> str:
    """One short line per failed rank of a ``CheckpointException`` — ``rank 1: StorageFullError: …``;
    ranks that failed with the same error share a line (``ranks 0, 1: VersionNotFoundError: …``) —
    instead of DCP's traceback per rank; for any other exception, ``Type: message`` on one line."""
    fails = rank_failures(exc)
    if not fails:
        return _one_line(exc)
    groups: dict[str, list[int]] = {}
    for r, f in fails:
        groups.setdefault(_one_line(f), []).append(r)
    lines = []
    for text, ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        lines.append(f"{who}: {text}")
    return "\n".join(lines)


_RANK_FAILURES: type | None = None


def _rank_failures_class() -> type:
    """``RankFailures``: a ``CheckpointException`` (same ``failures``, same ``isinstance``) that
    prints :func:`summary` instead of every rank's traceback. Made on first use (it needs torch)."""
    global _RANK_FAILURES
    if _RANK_FAILURES is None:
        from torch.distributed.checkpoint.api import CheckpointException

        class RankFailures(CheckpointException):
            """DCP's ``CheckpointException`` of a failed save or load, printed as one line per failed
            rank. ``failures`` is DCP's: rank -> (exception, traceback frames)."""

            def __str__(self) -> str:
                return summary(self)

        RankFailures.__module__ = __name__
        RankFailures.__qualname__ = "RankFailures"
        _RANK_FAILURES = RankFailures
    return _RANK_FAILURES


def __getattr__(name: str):
    if name == "RankFailures":  # unpickling one (it is made on first use)
        return _rank_failures_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def short_cause(exc: BaseException) -> BaseException:
    """``exc`` as the ``__cause__`` of the typed error raised in its place: a ``CheckpointException``
    becomes a ``RankFailures`` (the same ``failures``, printed one line per rank); anything else is
    returned unchanged."""
    if not _is_checkpoint_exception(exc) or type(exc).__name__ == "RankFailures":
        return exc
    cls = _rank_failures_class()
    out = cls(exc.args[0] if exc.args else "", dict(getattr(exc, "failures", None) or {}))
    out.__traceback__ = None
    return out


def typed_error(exc: BaseException) -> BaseException | None:
    """The typed error to raise instead of ``exc`` (``raise err from short_cause(exc)``): the
    :func:`unwrap` of a ``CheckpointException`` when it holds a :class:`CkptStoreError`, else None."""
    if not _is_checkpoint_exception(exc):
        return None
    err = unwrap(exc)
    return None if err is exc else err


def raise_typed(exc: BaseException) -> None:
    """Raise :func:`typed_error` of ``exc`` ``from`` :func:`short_cause` of it when there is one, else
    ``exc`` itself. For ``except BaseException as e: ...; raise_typed(e)`` in ckptstore's own callers of
    DCP (the manager, the integrations)."""
    err = typed_error(exc)
    if err is None:
        raise exc
    raise err.with_traceback(None) from short_cause(exc)


class typed(contextlib.ContextDecorator):
    """Re-raise the typed ckptstore error out of DCP's ``CheckpointException``.

    A context manager and a decorator for users of plain DCP. Inside it, a ``CheckpointException``
    whose ranks raised a :class:`CkptStoreError` is replaced by that error (the lowest failed rank's,
    :func:`unwrap`), raised ``from`` a ``CheckpointException`` that prints one short line per failed
    rank (``err.__cause__.failures`` keeps DCP's per-rank tracebacks). Every other exception, and a
    ``CheckpointException`` with no ckptstore error in it, passes through unchanged.

    Example:

        try:
            with ckptstore.errors.typed():
                dcp.load(state, checkpoint_id="step-100",
                         storage_reader=ckptstore.StorageReader(root, key=key))
        except ckptstore.KeyMismatchError as e:
            print("wrong key:", e)

        @ckptstore.errors.typed()
        def restore(state): ...
    """

    def __enter__(self) -> "typed":
        return self

    def __exit__(self, et, exc, tb) -> bool:
        if exc is None:
            return False
        if typed_error(exc) is None:
            return False
        raise_typed(exc)
        return False  # not reached
