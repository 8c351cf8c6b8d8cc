"""The ckptstore side of the PyTorch Lightning integration; imports nothing of Lightning.

:class:`LightningStore` saves, loads and drops Lightning checkpoints as versions of one store:

* **Names.** A checkpoint path names a version by its stem (:func:`version_of`):
  ``DIR/epoch=0-step=50.ckpt`` → ``epoch=0-step=50``, ``DIR/last.ckpt`` → ``last``. The directory
  part names no store: every path's version lives in the store's ``root``. A path the caller
  marks as Lightning's "last" checkpoint loads the newest version every rank can load and verify
  (the restore choice, docs/FORMAT.md "Restore choice"), whatever its name.
* **Layout of a version.** A checkpoint is a nested dict of tensors and plain values. Every tensor
  becomes one DCP item named by its path (keys joined by ``.``: ``state_dict.net.0.weight``,
  ``optimizer_states.0.state.0.exp_avg``); everything else — the dict's structure with ``None``
  where the tensors were, its exact key types (the optimizer's integer parameter ids), tuples and
  dict subclasses, plus the list of tensor paths — is one ``torch.save`` blob stored as the uint8
  tensor item :data:`SKELETON` (:func:`split`, :func:`join`). So everything is framed, checksummed,
  compressed and (with a key) encrypted like any item, and the blob is unpickled only after it
  verified, with the caller's ``weights_only`` (``torch.load``'s rule, as Lightning's own loader).
  A sharded save (every rank) adds the ranks' DTensor state under the top-level keys the strategy
  gives (``state_dict``, ``optimizer_0``), as DCP flattens them.
* **Pointer files.** After each commit the caller's path gets a small JSON file (``format``
  :data:`POINTER_FORMAT`, ``version``, ``root``, ``remote``, ``attempt``, ``step``) written
  atomically, so Lightning's file-based logic (``ModelCheckpoint``'s version counter and
  ``_find_last_checkpoints``, ``ckpt_path="last"``) sees the checkpoint. A pointer is a hint for
  Lightning only: loads resolve names in the store (docs/FORMAT.md, "Terms": committed), never
  through a pointer.
* **Replacing and removing.** Saving to a path whose version exists replaces it, as a file save
  replaces a file (Lightning's ``last.ckpt``): the save supersedes the attempts it found
  (docs/FORMAT.md, "Superseding"); the old attempt's objects become garbage for ``ckptstore gc``
  unless a committed version references them. :meth:`LightningStore.drop` removes a version
  through ``gc.plan_drop`` (every un-commit first, then the objects no other committed version
  references; a pinned version is kept), then its pointer file.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import CkptStoreError, InvalidNameError, VersionNotFoundError, typed

log = logging.getLogger("ckptstore.integrations.lightning")

#: the DCP item holding a checkpoint's structure and non-tensor values (:func:`split`)
SKELETON = "ckptstore.lightning"
SKELETON_FORMAT = 1
POINTER_FORMAT = "ckptstore-lightning/1"
DURABILITY = ("local", "remote")


# -- names ------------------------------------------------------------------------------------------
def version_of(path: str | os.PathLike) -> str:
    """The version a checkpoint path names: its stem (``DIR/epoch=0-step=50.ckpt`` →
    ``epoch=0-step=50``). Raises :class:`InvalidNameError` for an empty stem."""
    stem = Path(os.fspath(path)).stem
    if not stem:
        raise InvalidNameError(f"checkpoint path {os.fspath(path)!r} has no file name to use as the version name")
    from .._names import check_version

    return check_version(stem)


# -- a checkpoint as tensors + skeleton -------------------------------------------------------------
def _fqn(path: tuple) -> str:
    return ".".join(str(k) for k in path)


def split(checkpoint: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``checkpoint`` (a nested dict) → ``({path: tensor}, skeleton)``: every tensor reachable through
    dicts (and subclasses), lists and tuples under its dotted path, and the rest as one uint8 tensor
    (``torch.save`` of ``{"format", "tree", "tensors": [(path, name), …]}``, the tree with ``None``
    where the tensors were). Containers without a tensor inside are kept as they are (same object);
    tensors inside other objects stay in the skeleton."""
    tensors: dict[str, torch.Tensor] = {}
    where: list[tuple[tuple, str]] = []

    def walk(o: Any, path: tuple) -> tuple[Any, bool]:
        if isinstance(o, torch.Tensor):
            name = _fqn(path)
            if name in tensors or name == SKELETON or name.startswith(SKELETON + "."):
                name = f"{name}#{len(where)}"  # two paths with one dotted spelling: keep both
            tensors[name] = o
            where.append((path, name))
            return None, True
        if isinstance(o, dict):
            items = [(k, *walk(v, path + (k,))) for k, v in o.items()]
            if not any(found for _k, _v, found in items):
                return o, False
            c = copy.copy(o)
            for k, v, _found in items:
                c[k] = v
            return c, True
        if isinstance(o, (list, tuple)):
            items = [walk(v, path + (i,)) for i, v in enumerate(o)]
            if not any(found for _v, found in items):
                return o, False
            vals = [v for v, _found in items]
            if isinstance(o, list):
                return vals, True
            return (type(o)(*vals) if hasattr(type(o), "_fields") else tuple(vals)), True
        return o, False

    tree, _ = walk(checkpoint, ())
    buf = io.BytesIO()
    torch.save({"format": SKELETON_FORMAT, "tree": tree, "tensors": where}, buf)
    return tensors, torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)


def _put(c: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    k, rest = path[0], path[1:]
    if isinstance(c, tuple):
        vals = list(c)
        vals[k] = _put(vals[k], rest, value)
        return type(c)(*vals) if hasattr(type(c), "_fields") else tuple(vals)
    c[k] = _put(c[k], rest, value)
    return c


def join(skeleton: torch.Tensor, tensors: dict[str, torch.Tensor], *, weights_only: bool | None = None) -> Any:
    """The checkpoint :func:`split` took apart: the skeleton unpickled with ``torch.load(...,
    weights_only=weights_only)`` (None: torch's default), the tensors put back at their paths.
    Raises :class:`CkptStoreError` when the skeleton is not one of ours or a tensor is missing."""
    blob = skeleton.contiguous().numpy().tobytes()
    info = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=weights_only)
    if not isinstance(info, dict) or info.get("format") != SKELETON_FORMAT:
        raise CkptStoreError(f"item {SKELETON!r} is not a Lightning checkpoint skeleton of format {SKELETON_FORMAT}")
    tree = info["tree"]
    for path, name in info["tensors"]:
        if name not in tensors:
            raise CkptStoreError(f"the checkpoint names tensor {name!r}, which the version does not hold")
        tree = _put(tree, tuple(path), tensors[name])
    return tree


def empty_targets(metadata, keep=lambda fqn: True) -> dict[str, torch.Tensor]:
    """``{fqn: torch.empty(size, dtype)}`` for every tensor item of DCP ``metadata`` that ``keep``
    accepts: the destinations of a load that rebuilds a checkpoint from what the version holds."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {fqn: torch.empty(tuple(md.size), dtype=md.properties.dtype)
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata) and keep(fqn)}


# -- pointer files ----------------------------------------------------------------------------------
def write_pointer(path: str | os.PathLike, record: dict) -> None:
    """Write ``record`` (JSON) to ``path`` atomically: a temp file in the same directory, fsync'd,
    ``os.replace``d over ``path`` (a directory left there by a stock sharded save is refused)."""
    path = os.path.abspath(os.fspath(path))
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    if os.path.isdir(path):
        raise CkptStoreError(f"{path} is a directory (a checkpoint saved without ckptstore?); remove it or save "
                             "to another path")
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"format": POINTER_FORMAT, **record}, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def remove_pointer(path: str | os.PathLike, *, version: str | None = None) -> None:
    """Remove a pointer file (with ``version``: only one that points to that version); one that is
    gone already is fine. Anything at ``path`` that is not a ckptstore pointer is left alone (a warning)."""
    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            head = f.read(4096)
    except FileNotFoundError:
        return
    except IsADirectoryError:
        log.warning("ckptstore: %s is a directory, not a ckptstore pointer; left alone", p)
        return
    try:
        rec = json.loads(head)
    except ValueError:
        rec = None
    if not isinstance(rec, dict) or rec.get("format") != POINTER_FORMAT:
        log.warning("ckptstore: %s is not a ckptstore pointer file; left alone", p)
        return
    if version is not None and rec.get("version") != version:
        return
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


# -- the store ---------------------------------------------------------------------------------------
class LightningStore:
    """Lightning checkpoints as versions of the store at ``root`` (and ``remote``).

    Options (``StorageWriter``'s): ``remote`` (``s3://bucket/prefix``), ``key`` (32 bytes or a
    provider; else ``CKPTSTORE_KEY``/``CKPTSTORE_KEY_FILE``), ``durability`` (``"local"``: a save
    returns at the local commit and uploads continue; ``"remote"``: at the remote commit),
    ``retention`` (a :class:`ckptstore.retention.RetentionPolicy` applied after each commit),
    ``incremental`` (items unchanged since the previous save of this process are referenced, not
    written again), ``remote_options`` (docs/tiers.md), ``upload_timeout``.

    Two writers, made on first use: :meth:`save_full` is one process's save of a whole checkpoint
    (``world_size=1``, no collective: Lightning's DDP and single-device strategies save on global
    rank 0 only); :meth:`save_sharded` is a save by every rank of the job.
    """

    def __init__(self, root: str | os.PathLike, *, remote: str | None = None, key: Any = None,
                 durability: str = "local", retention: Any = None, incremental: bool = True,
                 remote_options: dict | None = None, upload_timeout: float = 3600.0, **legacy: Any) -> None:
        from ..tiers import remote_options_of

        remote_options = remote_options_of(remote_options, legacy, where="StoreCheckpointIO")
        if legacy:
            raise TypeError(f"StoreCheckpointIO() got unexpected keyword arguments {sorted(legacy)}")
        if root is None or "://" in os.fspath(root):
            raise CkptStoreError(
                f"root {root!r} must be a local directory (the store's local tier); give an object store as remote='s3://bucket/prefix' (or gs://, az://)")
        if durability not in DURABILITY:
            raise CkptStoreError(f"durability must be one of {DURABILITY}, got {durability!r}")
        if durability == "remote" and not remote:
            raise CkptStoreError("durability='remote' needs a remote tier (remote='s3://bucket/prefix', gs://, az://)")
        self.root = os.path.abspath(os.fspath(root))
        self.remote = remote
        self.key = key
        self.durability = durability
        self.retention = retention
        self.incremental = incremental
        self.remote_options = remote_options
        self.upload_timeout = upload_timeout
        self._writers: dict[str, Any] = {}

    def __getstate__(self) -> dict:  # ddp_spawn pickles the plugin into every rank: no writers travel
        s = self.__dict__.copy()
        s["_writers"] = {}
        return s

    # -- helpers ----------------------------------------------------------------------------------
    def _extra(self) -> dict:
        return {"remote_options": self.remote_options} if self.remote_options else {}

    def store(self):
        from ..store import Store

        return Store(self.root, remote=self.remote, key=self.key, **self._extra())

    def writer(self, kind: str, world_size: int):
        """The writer of ``kind`` (``"full"``: one process; ``"job"``: every rank), made once."""
        w = self._writers.get(kind)
        if w is None:
            from ..dcp.writer import StorageWriter

            w = self._writers[kind] = StorageWriter(
                self.root, remote=self.remote, key=self.key, durability=self.durability, retention=self.retention,
                incremental=self.incremental, world_size=world_size, upload_timeout=self.upload_timeout,
                **self._extra())
        return w

    def existing_attempts(self, version: str, *, remote: bool = True) -> set[str]:
        """The attempts of ``version`` committed in this process's root and (``remote``) the remote tier."""
        from ..dcp._plan import existing_attempt

        store = self.store()
        try:
            tiers = [t for n, t in store.tiers.items() if remote or n == "local"]
            return {a for t in tiers if (a := existing_attempt(t, version)) is not None}
        finally:
            store.close()

    def _pointer(self, path, version: str, writer, step: int | None) -> None:
        """The pointer file of the version just committed; and, for every version that ``retention``
        deleted from the local tier after this commit, its pointer beside this one (``DIR/<version><ext>``),
        when it is a pointer to that version."""
        write_pointer(path, {"version": version, "root": self.root, "remote": self.remote,
                             "attempt": getattr(writer.last_manifest, "attempt", None), "step": step})
        d, ext = os.path.dirname(os.fspath(path)), os.path.splitext(os.fspath(path))[1]
        for run in writer.pruned():
            if run.get("tier") == "local":
                for v in run.get("deleted", ()):
                    remove_pointer(os.path.join(d, v + ext), version=v)

    # -- save -------------------------------------------------------------------------------------
    def save_full(self, checkpoint: dict, path, *, step: int | None, user_metadata: dict | None = None) -> str:
        """Save a whole checkpoint from this process alone (no collective), commit it as
        :func:`version_of` ``(path)``, replacing a committed version of that name, then write the
        pointer file at ``path``. Returns the version name."""
        import torch.distributed.checkpoint as dcp

        version = version_of(path)
        tensors, skeleton = split(checkpoint)
        w = self.writer("full", 1)
        w.save_options(version, step=step, user_metadata=user_metadata,
                       supersede={a: "saved again (Lightning replaces the checkpoint at its path)"
                                  for a in self.existing_attempts(version)})
        with typed():  # the rank's ckptstore error, not DCP's CheckpointException around it
            dcp.save({**tensors, SKELETON: skeleton}, checkpoint_id=version, storage_writer=w, no_dist=True)
        self._pointer(path, version, w, step)
        return version

    def save_sharded(self, sharded: dict, rest: dict | None, path, *, step: int | None, supersede: set[str],
                     world_size: int, write_pointer_here: bool, user_metadata: dict | None = None) -> str:
        """Every rank: ``dcp.save`` of ``sharded`` (DTensor state under the strategy's keys) plus, where
        ``rest`` is given (global rank 0), the rest of the checkpoint as :func:`split` lays it out, on
        the default process group. ``supersede``: the attempts of the name every rank agreed to replace.
        Where ``write_pointer_here`` the pointer file is written after the commit."""
        import torch.distributed.checkpoint as dcp

        version = version_of(path)
        state = dict(sharded)
        if rest is not None:
            tensors, skeleton = split(rest)
            clash = sorted(k for k in tensors if k.split(".", 1)[0] in state)
            if clash:
                raise CkptStoreError(f"checkpoint keys {clash[:5]} clash with the sharded state's top-level keys "
                                     f"{sorted(state)}")
            state.update(tensors)
            state[SKELETON] = skeleton
        w = self.writer("job", world_size)
        w.save_options(version, step=step, user_metadata=user_metadata,
                       supersede={a: "saved again (Lightning replaces the checkpoint at its path)" for a in supersede})
        with typed():  # the rank's ckptstore error, not DCP's CheckpointException around it
            dcp.save(state, checkpoint_id=version, storage_writer=w)
        if write_pointer_here:
            self._pointer(path, version, w, step)
        return version

    # -- load -------------------------------------------------------------------------------------
    def open(self, version: str | None, process_group=None):
        """A :class:`ckptstore.StorageReader` with the chosen version's DCP metadata read (in a job: a
        collective over ``process_group``, every rank agreeing on the version; ``version=None``: the
        newest every rank can load and verify). Returns ``(reader, metadata)``."""
        from ..dcp.reader import StorageReader

        reader = StorageReader(self.root, remote=self.remote, key=self.key, version=version,
                               process_group=process_group, **self._extra())
        return reader, reader.read_metadata()

    def load_full(self, version: str | None, *, weights_only: bool | None = None) -> tuple[str, dict]:
        """Load a checkpoint saved by :meth:`save_full` (or the rest of a sharded one) whole into new CPU
        tensors on every rank (collective in a job). Returns ``(version, checkpoint)``."""
        import torch.distributed.checkpoint as dcp

        reader, md = self.open(version)
        if SKELETON not in md.state_dict_metadata:
            raise CkptStoreError(f"version {reader.version!r} of {self.root} is not a Lightning checkpoint "
                                 f"(no {SKELETON!r} item); it was not saved through ckptstore.integrations.lightning")
        targets = empty_targets(md)
        with typed():  # the rank's ckptstore error, not DCP's CheckpointException around it
            dcp.load(targets, storage_reader=reader)
        skeleton = targets.pop(SKELETON)
        return reader.version, join(skeleton, targets, weights_only=weights_only)

    def load_sharded(self, version: str | None, make_sharded, *, weights_only: bool | None = None
                     ) -> tuple[str, dict, dict]:
        """Every rank: load the version's sharded state in place into ``make_sharded(keys)`` — DTensor
        destinations from the live model and optimizers keyed as saved, for the top-level ``keys`` the
        version holds — and return ``(version, sharded, rest)``: ``rest`` is the rest of the
        checkpoint, rebuilt from rank 0's items."""
        import torch.distributed.checkpoint as dcp

        reader, md = self.open(version)
        if SKELETON not in md.state_dict_metadata:
            raise CkptStoreError(f"version {reader.version!r} of {self.root} is not a Lightning checkpoint "
                                 f"(no {SKELETON!r} item); it was not saved through ckptstore.integrations.lightning")
        sharded = make_sharded({fqn.split(".", 1)[0] for fqn in md.state_dict_metadata})
        prefixes = tuple(f"{k}." for k in sharded)
        rest = empty_targets(md, lambda fqn: not fqn.startswith(prefixes) and fqn not in sharded)
        with typed():  # the rank's ckptstore error, not DCP's CheckpointException around it
            dcp.load({**sharded, **rest}, storage_reader=reader)
        skeleton = rest.pop(SKELETON)
        return reader.version, sharded, join(skeleton, rest, weights_only=weights_only)

    # -- remove -----------------------------------------------------------------------------------
    def drop(self, version: str, *, tiers: list[str] | None = None) -> str:
        """Remove ``version`` (``gc.plan_drop``: every un-commit first, then the objects no other
        committed version references) from ``tiers`` (default: every tier). A version whose upload
        this process still runs is uploaded first. Returns ``"removed"``, ``"absent"`` (no tier holds
        it) or ``"pinned"`` (kept, with a warning). Raises the first storage error."""
        from .. import gc

        for w in self._writers.values():
            fut = w.remote_commit_future(version)
            if fut is not None:
                from ..dcp.upload import Superseded

                try:
                    fut.result(self.upload_timeout)
                except Superseded:
                    pass  # not staged (newer versions were): nothing to wait for
        store = self.store()
        try:
            try:
                plan = gc.plan_drop(store, version, tiers=tiers)
            except VersionNotFoundError:
                return "absent"
            except CkptStoreError as e:
                if "pinned" not in str(e):
                    raise
                log.warning("ckptstore: not removing %r: %s", version, e)
                return "pinned"
            res = gc.apply(store.tiers, plan)
            if res.failed:
                raise res.failed[0][1]
            kept = [s.reason for s in plan.survivors]
            log.info("ckptstore: removed version %r from %s%s", version, self.root,
                     f" ({len(kept)} object(s) kept: referenced by other versions)" if kept else "")
            return "removed"
        finally:
            store.close()

    def close(self) -> None:
        """Wait for every upload and release the writers (``UploadError`` names what was not
        uploaded)."""
        writers, self._writers = list(self._writers.values()), {}
        errors = []
        for w in writers:
            try:
                w.close()
            except Exception as e:  # noqa: BLE001 - close every writer, then raise the first
                errors.append(e)
        if errors:
            raise errors[0]


def last_pattern(name_last: str) -> re.Pattern:
    """The stems of Lightning's "last" checkpoints (to ``fullmatch``): ``name_last`` and the names its
    version counter makes of it (``last-v1``)."""
    return re.compile(rf"{re.escape(name_last)}(-v\d+)?")
