"""Background staging of committed local objects to the remote tier, and the remote commit.

Per rank, streamed (:class:`PartStream`, when the remote tier declares ``supports_part_upload``): while
``write_data`` appends frames to the rank's local object, every time a part's worth of bytes
(the tier's declared ``part_limits``: ``part_size``, 8 MiB by default, doubling every
``max_parts // 10`` parts) has been written, the part is queued for upload. Its XXH3-64 is recorded as its bytes are written; the
upload thread re-reads the part from the local file (page cache), checks that XXH3 and sends it
(the server checks the checksum the tier's SDK sends with the part). The writing thread never
waits for the remote tier. Once the local object is committed (fsync), :meth:`Uploader.upload_object` sends the tail
part, waits for every part, completes the upload, checks the remote size and writes the *rank
marker* ``attempts/<attempt>/uploaded.rNNNNN.json`` = ``{"size", "digest", "frames", "rank"}``.
An object smaller than one part is sent with one PUT after the local commit. A failed or aborted
local write aborts the part upload (in the background; on a tier whose unfinished uploads
outlive the writer, ``supports_multipart``, one that cannot be aborted now is retried by
:meth:`Uploader.wait`, else left to ``ckptstore gc``).

Not streamed (catch-up of versions committed locally only, remotes without part uploads): the
committed local file is walked (its frame headers and payload checksums recomputed and compared
with the manifest), then uploaded with ``put_file``, then the marker is written.

Coordinator (in ``finish``, after the local commit): upload the DCP metadata object, wait until a
marker exists for every rank object named by the manifest (polling the remote listing — rank
completion travels through the store itself, never through collectives on the training process
group), check every marker's size and digest against the manifest, then commit the remote
``manifest.json`` with put-if-absent (docs/FORMAT.md, "Tiers").

Bounded queue (docs/FORMAT.md, Save rule 8): once :data:`UPLOAD_BACKLOG` newer versions were
submitted, an older version's jobs not started are skipped and its remote commit stops waiting for
markers (:class:`Superseded`, not a failure): saves that outpace the remote tier hold a bounded
number of versions in flight, and the newest reaches the remote tier first.

``durability="local"``: all of this runs on background threads; ``StorageWriter.close()`` (and
interpreter exit) waits for it, bounded by ``upload_timeout`` seconds, and reports what was not
uploaded. ``durability="remote"``: ``write_data`` waits for the rank's upload and ``finish`` for the
remote commit, so the DCP future resolves only once the version is committed remotely, and any
upload failure reaches the caller as a ``CheckpointException`` naming the rank.

``AsyncCheckpointerType.PROCESS``: DCP's checkpoint subprocess answers and then has nobody to wait
for its threads, so there the save waits for the uploads and the remote commit whatever the
durability; with ``durability="local"`` a failed upload keeps the local commit and fails the future
with :class:`UploadError`. The training process's writer (``close()``, or interpreter exit) stages
again and reports any version committed locally in its lifetime but not remotely.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import json
import logging
import os
import threading
import time
import weakref

from .. import _faults
from ..codec.frame import FrameWalk, xxh3, xxh3_stream
from ..errors import (CkptStoreError, IntegrityError, ManifestError, ObjectNotFoundError, StorageError,
                      VersionExistsError, VersionNotFoundError, CommitRefusedError, SupersedeConflictError)
from ..manifest import layout, leases
from ..manifest.commit import commit_manifest, read_token, supersede_manifest
from ..manifest.schema import Manifest, ObjectEntry
from ..tiers.base import Tier

log = logging.getLogger("ckptstore")

_live: "weakref.WeakSet[Uploader]" = weakref.WeakSet()

#: the remote staging queue's bound (docs/FORMAT.md, Save rule 8): a version is no longer staged once this
#: many newer versions of the same writer were submitted and its upload or remote commit has not finished
#: (a job not started is skipped, a remote commit waiting for markers gives up). Saves that outpace the
#: remote tier (a slow or refusing server, a rank whose requests are refused) then cost at most this many
#: versions' worth of local space in flight, and the newest version reaches the remote tier first.
UPLOAD_BACKLOG = 3


class Superseded(Exception):
    """A staging job of a version :data:`UPLOAD_BACKLOG` newer versions passed: not run (not a failure)."""


class UploadError(StorageError):
    """Staging a version to the remote tier failed; the remote commit did not happen."""


class PartStream:
    """The streamed upload of one rank object while it is written locally (see the module docstring).

    Driven by ``_frames.ObjectSink`` on the writing thread: :meth:`feed` for every byte string
    appended to the local object (returns True when a part is complete), then — after the local
    writer's ``flush()`` — :meth:`send`. :meth:`written` after the local commit, :meth:`abort`
    after a failed or aborted local write. :meth:`finish` runs on the uploader's pool.
    """

    def __init__(self, up: "Uploader", key: str):
        self._up = up
        self.key = key
        self._remote = up.remote
        self._path = up.local.local_path(key)
        self._limits = up.remote.part_limits  # declared by the tier (tiers/base.py, PartLimits)
        self._part_size = self._limits.part_size
        self._hash = xxh3_stream()
        self._start = 0  # offset of the part being filled
        self._fill = 0  # its bytes so far
        self._ready: list[tuple[int, int, int]] = []  # (offset, length, xxh3) cut, not yet sent
        self._mp = None  # the remote PartUpload, opened with the first part
        self._cut = 0  # parts cut so far
        self._fd: int | None = None
        self._fd_lock = threading.Lock()
        self.size: int | None = None  # set by written(): the committed local size
        self.aborted = False

    # -- writing thread ---------------------------------------------------------------------
    def feed(self, data) -> bool:
        """Account ``data``, just appended to the local object; True when a part is complete."""
        mv = memoryview(data).cast("B")
        while len(mv):
            room = self._part_size - self._fill
            chunk = mv[:room]
            self._hash.update(chunk)
            self._fill += len(chunk)
            mv = mv[len(chunk):]
            if self._fill == self._part_size:
                self._ready.append((self._start, self._fill, self._hash.intdigest()))
                self._start += self._fill
                self._fill = 0
                self._hash = xxh3_stream()
                self._cut += 1
                self._part_size = self._limits.grown(self._part_size, self._cut)
        return bool(self._ready)

    def send(self) -> None:
        """Queue the parts cut by :meth:`feed` (their bytes must have reached the local file)."""
        for off, n, h in self._ready:
            if self._mp is None:
                self._mp = self._remote.open_part_upload(self.key)
            self._mp.send(self._mp.parts + 1, lambda off=off, n=n, h=h: self._read(off, n, h))
        self._ready.clear()

    def written(self, size: int) -> None:
        """The local object is committed with ``size`` bytes."""
        self.size = size

    def abort(self) -> None:
        """The local write failed: abort the remote upload (in the background)."""
        if self.aborted:
            return
        self.aborted = True
        self._up._forget_stream(self.key)
        if self._mp is not None:
            self._up._submit(f"{self.key} (abort of its streamed upload)", self._abort_remote)

    def _abort_remote(self) -> None:
        try:
            self._mp.abort()
        finally:
            self._close_fd()
            with self._up._lock:  # Uploader.wait() checks that no incomplete upload is left
                self._up._failed_keys.add(self.key)

    # -- upload threads ---------------------------------------------------------------------
    def _read(self, off: int, n: int, h: int) -> bytes:
        with self._fd_lock:
            if self._fd is None:
                self._fd = os.open(self._path, os.O_RDONLY)
            fd = self._fd
        data = _pread_all(fd, n, off)
        if len(data) != n or xxh3(data) != h:
            raise IntegrityError(
                f"local object {self.key} changed after it was written (bytes {off}..{off + n} do not "
                "match the checksum recorded while writing); not uploading it", object=self.key)
        return data

    def _close_fd(self) -> None:
        with self._fd_lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def finish(self, entry: ObjectEntry) -> None:
        """After the local commit: send the tail, complete the upload, verify the remote size."""
        if self.aborted or self.size is None:
            raise UploadError(f"{self.key}: the local write did not commit; nothing to upload")
        if self._start + self._fill != entry.size or self.size != entry.size:
            raise IntegrityError(
                f"{self.key}: {self._start + self._fill} bytes streamed, the manifest says {entry.size}", object=self.key)
        try:
            if self._mp is None:  # smaller than one part: one PUT of the committed file
                data = self._read(0, self._fill, self._hash.intdigest())
                self._remote.put(self.key, data)
            else:
                if self._fill:
                    self._ready.append((self._start, self._fill, self._hash.intdigest()))
                    self.send()
                self._mp.complete(entry.size)
        except BaseException:
            if self._mp is not None:
                self._mp.abort()
            with self._up._lock:
                self._up._failed_keys.add(self.key)
            raise
        finally:
            self._close_fd()


def _remote_attempt(remote: Tier, version: str) -> str | None:
    from ..manifest import catalogue

    try:
        return catalogue.read_manifest(remote, version).manifest.attempt
    except (VersionNotFoundError, ManifestError):
        return None


def _pread_all(fd: int, n: int, off: int) -> bytes:
    parts = []
    while n > 0:
        b = os.pread(fd, n, off)
        if not b:
            break
        parts.append(b)
        n -= len(b)
        off += len(b)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def local_digest(local: Tier, key: str, size: int) -> tuple[str, int]:
    """Recompute (digest, frames) of a local object by walking its frames (checks payloads too)."""
    with open(local.local_path(key), "rb") as f:
        walk = FrameWalk(lambda off, n: os.pread(f.fileno(), n, off), size, key).walk()
    return walk.digest(), walk.count


class Uploader:
    """``guard(what)``, when given, is called right before each rank marker and remote commit and
    raises to refuse it (the writer's live-trainer check, docs/FORMAT.md Save rule 7)."""

    def __init__(self, local: Tier, remote: Tier, threads: int = 4, timeout: float = 3600.0, retention=None,
                 guard=None, backlog: int = UPLOAD_BACKLOG):
        self.local = local
        self.backlog = max(1, int(backlog))
        self.guard = guard
        self.retention = retention
        self.remote = remote
        self.timeout = timeout
        self._pool = cf.ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckptstore-up")
        self._lock = threading.Lock()
        self._pending: list[tuple[str, cf.Future]] = []
        self.errors: list[str] = []
        self._failed_keys: set[str] = set()
        self._versions: dict[cf.Future, str] = {}
        self._streams: dict[str, PartStream] = {}
        #: failed jobs, submitted again at the next save (or close): ``{what: (kind, args)}``
        self._retry: dict[str, tuple] = {}
        #: version -> order of its first submission (a superseding save of the name moves it to the end)
        self._order: dict[str, int] = {}
        self._seq = 0
        self._cv = threading.Condition()  # notified at each new version: a waiting remote commit re-checks
        #: versions not staged because :data:`UPLOAD_BACKLOG` newer ones were submitted (committed locally only)
        self.skipped: list[str] = []
        #: versions whose save failed on this rank (:meth:`abandon`) until submitted again
        self._abandoned: set[str] = set()
        _live.add(self)

    # -- the bounded queue (docs/FORMAT.md, Save rule 8) -----------------------------------------
    def _note(self, version: str) -> None:
        """``version`` is submitted for staging (a new save, or a catch-up): it becomes the newest."""
        with self._lock:
            self._abandoned.discard(version)
            self._seq += 1
            self._order.pop(version, None)
            self._order[version] = self._seq
            if len(self._order) > 4 * self.backlog + 64:
                for v in list(self._order)[: len(self._order) - 2 * self.backlog - 32]:
                    del self._order[v]
        with self._cv:
            self._cv.notify_all()

    def abandon(self, version: str) -> None:
        """``version``'s save failed on this rank (its local objects are being reclaimed): its jobs
        not started are not run, like a superseded version's (until it is submitted again)."""
        with self._lock:
            self._abandoned.add(version)
            self._retry = {w: r for w, r in self._retry.items()
                           if (r[1][0] if r[0] == "object" else r[1][0].version) != version}

    def superseded(self, version: str) -> bool:
        """True once :attr:`backlog` newer versions than ``version`` were submitted to this uploader
        (or its save failed here: :meth:`abandon`)."""
        with self._lock:
            if version in self._abandoned:
                return True
            seq = self._order.get(version)
            if seq is None:
                return False
            return sum(1 for s in self._order.values() if s > seq) >= self.backlog

    def _mark_skipped(self, version: str) -> None:
        """``version`` goes into :attr:`skipped` (the last 1,000); the caller holds ``_lock``."""
        if version not in self.skipped:
            self.skipped.append(version)
            del self.skipped[:-1000]

    def _skip_if_superseded(self, version: str, what: str) -> None:
        if self.superseded(version):
            with self._lock:
                why = ("its save failed" if version in self._abandoned
                       else f"{self.backlog} newer versions were submitted after it")
            raise Superseded(f"{what}: not staged, {why}")

    # -- rank side -------------------------------------------------------------------------
    def open_stream(self, key: str) -> "PartStream | None":
        """A :class:`PartStream` for the local object ``key`` about to be written, or None when the
        remote tier has no multipart uploads (then :meth:`upload_object` uploads the committed file)."""
        if not self.remote.supports_part_upload:
            return None
        st = PartStream(self, key)
        with self._lock:
            self._streams[key] = st
        return st

    def _forget_stream(self, key: str) -> "PartStream | None":
        with self._lock:
            return self._streams.pop(key, None)

    def upload_object(self, version: str, entry: ObjectEntry, rank: int, *, retry: bool = True,
                      refs: tuple = ()) -> cf.Future:
        """Upload this rank's committed object ``entry`` of ``version`` and write its rank marker.
        ``refs``: the earlier objects its items reference (incremental saves): each is uploaded first
        when the remote tier lacks it (docs/FORMAT.md, "References": upload sends only what the
        remote tier does not hold). First submits again the uploads of earlier versions that failed
        (an unreachable remote tier): the next save stages what an outage held back (docs/FORMAT.md,
        Save rule 8)."""
        if retry:
            self._note(version)
            self.retry_failed("object")
        key = layout.object_key(version, entry.name)
        stream = self._forget_stream(key)

        def job():
            if self.superseded(version):
                if stream is not None:  # its parts were streamed: the multipart upload is aborted
                    stream.aborted = True
                    if stream._mp is not None:
                        stream._abort_remote()
                    else:
                        stream._close_fd()
                self._skip_if_superseded(version, f"{version}/{entry.name}")
            _faults.point("upload.object")
            for ref in refs:
                self._ensure_remote(ref)
            if stream is not None:
                stream.finish(entry)
                return self._after_upload(version, entry, rank, key)
            digest, frames = local_digest(self.local, key, entry.size)
            if digest != entry.digest or frames != entry.frames:
                raise IntegrityError(f"local object {key} changed after it was written; not uploading it", object=key)
            try:
                self.remote.put_file(key, self.local.local_path(key), entry.size)
            except BaseException:
                with self._lock:
                    self._failed_keys.add(key)
                raise
            return self._after_upload(version, entry, rank, key)

        return self._submit(f"{version}/{entry.name}", job, version, retry=("object", (version, entry, rank, refs)))

    def retry_failed(self, kind: str | None = None) -> list[str]:
        """Submit again the failed jobs of ``kind`` (``"object"``, ``"commit"``; None: both, objects
        first) whose version is still committed locally with the same attempt; returns what was
        submitted. A job that fails again is recorded again."""
        from ..manifest import catalogue

        with self._lock:
            todo = [(w, k, a) for w, (k, a) in self._retry.items() if kind is None or k == kind]
        todo.sort(key=lambda t: t[1] != "object")
        done = []
        for what, k, args in todo:
            version = args[0] if k == "object" else args[0].version
            attempt = (args[1].name.split("/")[1]) if k == "object" else args[0].attempt
            if self.superseded(version):
                with self._lock:  # newer versions took its place in the queue: skipped, not a failure
                    self._retry.pop(what, None)
                    self._pending = [(w, f) for w, f in self._pending if not (w == what and f.done())]
                    self._mark_skipped(version)
                continue
            try:
                if k == "object":
                    if self.local.stat(layout.object_key(version, args[1].name)).size != args[1].size:
                        raise ObjectNotFoundError("changed")
                elif catalogue.read_manifest(self.local, version).manifest.attempt != attempt:
                    raise VersionNotFoundError("re-committed")
            except (ObjectNotFoundError, VersionNotFoundError, ManifestError):
                with self._lock:
                    self._retry.pop(what, None)  # gone or replaced locally: nothing left to stage
                continue
            with self._lock:
                self._retry.pop(what, None)
            if k == "object":
                self.upload_object(*args[:3], retry=False, refs=args[3] if len(args) > 3 else ())
            else:
                self.commit(*args, retry=False)
            done.append(what)
        if done:
            log.info("ckptstore: staging again what an earlier save could not upload: %s", done)
        return done

    def _ensure_remote(self, ref) -> None:
        """The referenced object ``ref`` (a ``RefEntry``) in the remote tier: uploaded from the local
        root, checked frame by frame first, when the remote tier does not hold it with its size."""
        key = layout.object_key(ref.version, ref.name)
        try:
            if self.remote.stat(key).size == ref.size:
                return
        except ObjectNotFoundError:
            pass
        digest, frames = local_digest(self.local, key, ref.size)
        if digest != ref.digest or frames != ref.frames:
            raise IntegrityError(f"referenced object {key} does not match its entry; not uploading it", object=key)
        self.remote.put_file(key, self.local.local_path(key), ref.size)
        if self.remote.stat(key).size != ref.size:
            raise UploadError(f"remote object {key} has the wrong size after upload")

    def _ensure_refs(self, m: Manifest, committed: bool = False) -> None:
        """Every object ``m`` references in the remote tier (:meth:`_ensure_remote`), else
        :class:`UploadError` (``committed``: checked again after the remote commit)."""
        for ref in m.refs:
            try:
                self._ensure_remote(ref)
            except (OSError, ObjectNotFoundError) as e:
                what = ("was removed from the remote tier right after its remote commit (by something that ignores "
                        "leases) and this root cannot upload it again" if committed else
                        "the remote tier lacks and this root cannot upload")
                raise UploadError(f"version {m.version!r} references {ref.name} of version {ref.version!r}, which {what} "
                                  f"({e})" + ("" if committed else "; the remote commit was not made")) from e

    def _after_upload(self, version: str, entry: ObjectEntry, rank: int, key: str) -> str:
        got = self.remote.stat(key).size
        if got != entry.size:
            raise UploadError(f"remote object {key} has {got} bytes after upload, expected {entry.size}")
        attempt = entry.name.split("/")[1]
        if self.guard is not None:
            self.guard(f"the upload marker of {key}")
        marker = {"size": entry.size, "digest": entry.digest, "frames": entry.frames, "rank": rank}
        self.remote.put(layout.object_key(version, layout.marker_name(attempt, rank)), json.dumps(marker).encode())
        return key

    # -- coordinator side ----------------------------------------------------------------------
    def commit(self, m: Manifest, body: bytes, overwrite: bool, *, retry: bool = True) -> cf.Future:
        """The remote commit of ``m`` (after every rank's marker); first submits again the remote
        commits of earlier versions that failed (see :meth:`upload_object`)."""
        if retry:
            with self._lock:
                known = m.version in self._order
            if not known:
                self._note(m.version)
            self.retry_failed("commit")
        return self._submit(f"{m.version} (remote commit)", lambda: self._commit(m, body, overwrite), m.version,
                            retry=("commit", (m, body, overwrite)))

    def _commit(self, m: Manifest, body: bytes, overwrite: bool) -> str:
        v = m.version
        self._skip_if_superseded(v, f"{v} (remote commit)")
        meta = m.metadata_object
        mkey = layout.object_key(v, meta.name)
        try:
            self.remote.put_file(mkey, self.local.local_path(mkey), meta.size)
        except BaseException:
            with self._lock:
                self._failed_keys.add(mkey)
            raise
        if self.remote.stat(mkey).size != meta.size:
            raise UploadError(f"remote metadata object {mkey} has the wrong size after upload")
        want = {o.rank: o for o in m.objects}
        prefix = layout.object_key(v, layout.marker_prefix(m.attempt))
        deadline = time.monotonic() + self.timeout
        delay = 0.05
        seen: dict[int, dict] = {}
        while True:
            for info in self.remote.list(prefix):
                r = layout.marker_rank(info.key)
                if r in want and r not in seen:
                    seen[r] = json.loads(self.remote.get(info.key))
            if set(seen) >= set(want):
                break
            self._skip_if_superseded(v, f"{v} (remote commit, waiting for ranks {sorted(set(want) - set(seen))})")
            if time.monotonic() > deadline:
                missing = sorted(set(want) - set(seen))
                raise UploadError(
                    f"version {v!r}: ranks {missing} did not finish uploading within {self.timeout:.0f} s; "
                    "the remote commit was not made (the local version is intact)"
                )
            with self._cv:  # woken early when a newer version is submitted
                self._cv.wait(delay)
            delay = min(delay * 2, 2.0)
        for r, o in want.items():
            mk = seen[r]
            if mk.get("size") != o.size or mk.get("digest") != o.digest:
                raise UploadError(f"version {v!r}: rank {r}'s uploaded object does not match the manifest")
        if m.refs:  # a remote gc must not remove them before this commit names them (docs/FORMAT.md, Delete rule 13)
            leases.write(self.remote, v, m.attempt, "remote", [layout.object_key(r.version, r.name) for r in m.refs])
        try:
            self._ensure_refs(m)  # every referenced object in the remote tier before it commits there
            if self.guard is not None:
                self.guard(f"the remote commit of {v!r}")
            try:
                commit_manifest(self.remote, v, body, overwrite=overwrite, fault="remote.manifest",
                                hint="the remote copy was not replaced")
            except VersionExistsError:
                if not m.superseded_attempts:
                    raise
                self._supersede(m, body)
            if m.refs:  # again after the commit, against a remover that ignores leases: uploaded again if gone
                self._ensure_refs(m, committed=True)
        finally:
            if m.refs:
                leases.release(self.remote, m.attempt, "remote")
        key = layout.manifest_key(v)
        log.info("ckptstore: version %s committed in %s", v, self.remote.url)
        if m.chain:  # the remote tier's catalogue head follows (docs/FORMAT.md, "Catalogue chain")
            from ..manifest import chain

            chain.publish_remote(self.local, self.remote, v, m.attempt, m.chain["n"])
        pin = layout.pin_key(v)
        if self.local.exists(pin):  # a pin made before the remote commit travels with the version
            self.remote.put(pin, self.local.get(pin))
        if self.retention is not None:
            from ..gc import apply_after_commit

            apply_after_commit(self.remote, self.retention, m, tier_name="remote", others={"local": self.local})
        return key

    def _supersede(self, m: Manifest, body: bytes) -> None:
        """A superseding save replaces the remote copy of an attempt it supersedes, and no other,
        conditionally: only if it is still the copy read here (docs/FORMAT.md, "Superseding"). The
        loser raises :class:`SupersedeConflictError` after :meth:`_retract`."""
        v = m.version
        token = read_token(self.remote, v)
        there = _remote_attempt(self.remote, v)
        try:
            if there not in m.superseded_attempts:
                raise SupersedeConflictError(
                    f"version {v!r} in the remote tier ({self.remote.url}) is attempt {there}, which this save "
                    f"does not supersede (another writer committed it); the remote copy was not replaced")
            supersede_manifest(self.remote, v, body, token=token, attempt=there, fault="remote.supersede")
        except (VersionExistsError, CommitRefusedError):
            # the loser's uploads are garbage now, not in an hour (docs/FORMAT.md, Delete rule 14), and
            # its local copy is retracted: nothing it wrote stays loadable under the name ("Superseding")
            self._retract(v, m.attempt)
            raise

    def _retract(self, v: str, attempt: str) -> None:
        """A superseding save lost the remote commit of ``v`` to another writer: delete its uploaded
        objects, un-commit its local copy (only while that still names ``attempt``) and reclaim its
        local objects (docs/FORMAT.md, "Superseding"). Best effort: what is left is garbage for gc."""
        from ..gc import reclaim_failed_attempt

        reclaim_failed_attempt(self.remote, v, attempt)
        try:
            if _remote_attempt(self.local, v) == attempt:
                self.local.delete(layout.manifest_key(v))
                from ..manifest import chain

                raw = chain.read(self.local)
                if raw is not None and chain.parse_head(raw).attempt == attempt:
                    # its head named the retracted commit: without the key it cannot be moved back, so it goes
                    # (the root's chain restarts from the next keyed commit; docs/FORMAT.md, "Catalogue chain")
                    self.local.delete(layout.CATALOGUE_HEAD)
                log.warning("ckptstore: the local copy of %r (attempt %s) was un-committed: another writer superseded "
                            "the name in %s first", v, attempt, self.remote.url)
            reclaim_failed_attempt(self.local, v, attempt)
        except CkptStoreError as e:
            log.warning("ckptstore: could not retract the local copy of %r (attempt %s): %s", v, attempt, e)

    # -- catch-up ---------------------------------------------------------------------------
    def catch_up(self, exclude: str | None = None, only: "list[str] | None" = None) -> list[str]:
        """Stage versions committed locally but not remotely (a crash cut their remote commit), or
        only the versions named in ``only``.

        Only versions whose every object is present in the local root are staged (on a multi-node
        job other nodes' ranks hold their own objects); returns the versions scheduled.
        """
        from ..manifest import catalogue

        try:
            local = catalogue.scan(self.local)
            remote = catalogue.scan(self.remote)
        except CkptStoreError as e:
            log.warning("ckptstore: cannot compare tiers for catch-up staging: %s", e)
            return []
        todo = []
        for v, e in sorted(local.items(), key=lambda kv: kv[1].manifest.created):
            if v == exclude or v in remote or (only is not None and v not in only):
                continue
            m = e.manifest
            if not all(self.local.exists(layout.object_key(v, o.name)) for o in m.all_objects()):
                continue
            body = self.local.get(layout.manifest_key(v))
            for o in m.objects:
                self.upload_object(v, o, o.rank)
            self.commit(m, body, overwrite=False)
            todo.append(v)
        if todo:
            log.info("ckptstore: staging %d version(s) whose remote commit was interrupted: %s", len(todo), todo)
        return todo

    # -- bookkeeping -----------------------------------------------------------------------
    def in_flight(self) -> set[str]:
        """Versions with an upload or a remote commit not finished yet (local retention keeps them)."""
        with self._lock:
            live = {f: v for f, v in self._versions.items() if not f.done()}
        # a superseded version's queued jobs will not run: only a running one still reads its local files
        return {v for f, v in live.items() if f.running() or not self.superseded(v)}

    def _submit(self, what: str, fn, version: str | None = None, retry: tuple | None = None) -> cf.Future:
        fut = self._pool.submit(fn)
        with self._lock:
            # a job submitted again replaces its earlier failure: close() reports the last outcome
            self._pending = [(w, f) for w, f in self._pending
                             if (not f.done() or f.exception() is not None) and not (w == what and f.done())]
            self._pending.append((what, fut))
            self._versions = {f: v for f, v in self._versions.items() if not f.done()}
            if version is not None:
                self._versions[fut] = version

        def done(f, what=what):
            e = f.exception() if not f.cancelled() else None
            if isinstance(e, Superseded):
                if version is not None:
                    with self._lock:
                        self._mark_skipped(version)
                log.info("ckptstore: %s", e)
                return
            if e is not None:
                msg = f"{what}: {type(e).__name__}: {e}"
                with self._lock:
                    self.errors.append(msg)
                    if retry is not None and not isinstance(e, VersionExistsError):
                        self._retry[what] = retry
                log.error("ckptstore upload failed: %s", msg)

        fut.add_done_callback(done)
        return fut

    def wait(self, timeout: float | None = None) -> list[str]:
        """Wait for every pending upload/commit; return descriptions of what did not complete."""
        with self._lock:
            pending = list(self._pending)
        deadline = None if timeout is None else time.monotonic() + timeout
        not_done = []
        for what, f in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                f.result(timeout=left)
            except cf.TimeoutError:
                not_done.append(f"{what}: still running after {timeout:.0f} s")
            except Superseded:
                continue  # newer versions were staged in its place (docs/FORMAT.md, Save rule 8)
            except Exception as e:  # a failed job; KeyboardInterrupt/SystemExit propagate at once
                not_done.append(f"{what}: {type(e).__name__}: {e}")
        with self._lock:
            self._pending = [(w, f) for w, f in self._pending if not f.done()]
        not_done.extend(self._abort_failed(deadline))
        return not_done

    def _abort_failed(self, deadline: float | None) -> list[str]:
        """Abort multipart uploads left behind by failed uploads (the tier aborts on failure, but
        the abort itself can fail while the server is unreachable): retried here until ``deadline``."""
        if not self.remote.supports_multipart:
            return []
        with self._lock:
            keys = sorted(self._failed_keys)
        left = []
        for key in keys:
            delay = 0.2
            while True:
                try:
                    for mp in list(self.remote.list_multipart_uploads(key)):
                        if mp.key == key:
                            self.remote.abort_multipart_upload(mp.key, mp.upload_id)
                    with self._lock:
                        self._failed_keys.discard(key)
                    break
                except CkptStoreError as e:
                    if deadline is None or time.monotonic() + delay > deadline:
                        left.append(f"{key}: incomplete multipart upload not aborted ({e}); 'ckptstore gc' aborts it later")
                        break
                    time.sleep(delay)
                    delay = min(2 * delay, 5.0)
        return left

    def shutdown(self) -> None:
        """Stop the pool; its threads are joined unless an upload is still running (after a
        timed-out :meth:`wait`), which is then left to finish or to the exit-time report."""
        with self._lock:
            running = any(not f.done() for _w, f in self._pending)
        self._pool.shutdown(wait=not running, cancel_futures=False)


@atexit.register
def _wait_at_exit() -> None:  # pragma: no cover - exercised by subprocess tests
    for up in list(_live):
        left = up.wait(timeout=up.timeout)
        for line in left:
            print(f"ckptstore: NOT uploaded before exit: {line}", flush=True)


def check_uploads(up: "Uploader | None", timeout: float | None) -> None:
    if up is None:
        return
    deadline = None if timeout is None else time.monotonic() + timeout
    up.retry_failed()  # what an outage held back gets one more try before it is reported
    left = up.wait(timeout)
    if left and up.retry_failed():  # jobs still retrying at the first call, failed since (the outage ended meanwhile)
        left = up.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    if left:
        raise UploadError("uploads to the remote tier did not complete:\n  " + "\n  ".join(left))


