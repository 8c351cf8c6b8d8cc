"""Background staging of committed local objects to the remote tier, and the remote commit.

Per rank (in ``write_data``, after the rank's local object is durable): upload the object (multipart,
part size derived from its size, parts in parallel — see ``tiers/s3.py``), check the remote size,
then write the *rank marker* ``attempts/<attempt>/uploaded.rNNNNN.json`` = ``{"size", "digest"}``.
The digest is recomputed from the local file's frame headers just before the upload, so what is
uploaded is what the manifest describes.

Coordinator (in ``finish``, after the local commit): upload the DCP metadata object, wait until a
marker exists for every rank object named by the manifest (polling the remote listing — rank
completion travels through the store itself, never through collectives on the training process
group), check every marker's size and digest against the manifest, then commit the remote
``manifest.json`` with ``If-None-Match: "*"`` (put-if-absent).

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
from ..codec.frame import FrameWalk
from ..errors import CkptStoreError, IntegrityError, StorageError
from ..manifest import layout
from ..manifest.commit import commit_manifest
from ..manifest.schema import Manifest, ObjectEntry
from ..tiers.base import Tier

log = logging.getLogger("ckptstore")

_live: "weakref.WeakSet[Uploader]" = weakref.WeakSet()


class UploadError(StorageError):
    """Staging a version to the remote tier failed; the remote commit did not happen."""


def local_digest(local: Tier, key: str, size: int) -> tuple[str, int]:
    """Recompute (digest, frames) of a local object by walking its frames (checks payloads too)."""
    with open(local.local_path(key), "rb") as f:
        walk = FrameWalk(lambda off, n: os.pread(f.fileno(), n, off), size, key).walk()
    return walk.digest(), walk.count


class Uploader:
    def __init__(self, local: Tier, remote: Tier, threads: int = 4, timeout: float = 3600.0, retention=None):
        self.local = local
        self.retention = retention
        self.remote = remote
        self.timeout = timeout
        self._pool = cf.ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckptstore-up")
        self._lock = threading.Lock()
        self._pending: list[tuple[str, cf.Future]] = []
        self.errors: list[str] = []
        self._failed_keys: set[str] = set()
        self._versions: dict[cf.Future, str] = {}
        _live.add(self)

    # -- rank side -------------------------------------------------------------------------
    def upload_object(self, version: str, entry: ObjectEntry, rank: int) -> cf.Future:
        def job():
            _faults.point("upload.object")
            key = layout.object_key(version, entry.name)
            digest, frames = local_digest(self.local, key, entry.size)
            if digest != entry.digest or frames != entry.frames:
                raise IntegrityError(f"local object {key} changed after it was written; not uploading it", object=key)
            try:
                self.remote.put_file(key, self.local.local_path(key), entry.size)
            except BaseException:
                with self._lock:
                    self._failed_keys.add(key)
                raise
            got = self.remote.stat(key).size
            if got != entry.size:
                raise UploadError(f"remote object {key} has {got} bytes after upload, expected {entry.size}")
            attempt = entry.name.split("/")[1]
            marker = {"size": entry.size, "digest": entry.digest, "frames": entry.frames, "rank": rank}
            self.remote.put(layout.object_key(version, layout.marker_name(attempt, rank)), json.dumps(marker).encode())
            return key

        return self._submit(f"{version}/{entry.name}", job, version)

    # -- coordinator side ----------------------------------------------------------------------
    def commit(self, m: Manifest, body: bytes, overwrite: bool) -> cf.Future:
        return self._submit(f"{m.version} (remote commit)", lambda: self._commit(m, body, overwrite), m.version)

    def _commit(self, m: Manifest, body: bytes, overwrite: bool) -> str:
        v = m.version
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
            if time.monotonic() > deadline:
                missing = sorted(set(want) - set(seen))
                raise UploadError(
                    f"version {v!r}: ranks {missing} did not finish uploading within {self.timeout:.0f} s; "
                    "the remote commit was not made (the local version is intact)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
        for r, o in want.items():
            mk = seen[r]
            if mk.get("size") != o.size or mk.get("digest") != o.digest:
                raise UploadError(f"version {v!r}: rank {r}'s uploaded object does not match the manifest")
        commit_manifest(self.remote, v, body, overwrite=overwrite, fault="remote.manifest", hint="the remote copy was not replaced")
        key = layout.manifest_key(v)
        log.info("ckptstore: version %s committed in %s", v, self.remote.url)
        pin = layout.pin_key(v)
        if self.local.exists(pin):  # a pin made before the remote commit travels with the version
            self.remote.put(pin, self.local.get(pin))
        if self.retention is not None:
            from ..gc import apply_after_commit

            apply_after_commit(self.remote, self.retention, m, tier_name="remote", others={"local": self.local})
        return key

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
            return {v for f, v in self._versions.items() if not f.done()}

    def _submit(self, what: str, fn, version: str | None = None) -> cf.Future:
        fut = self._pool.submit(fn)
        with self._lock:
            self._pending = [(w, f) for w, f in self._pending if not f.done() or f.exception() is not None]
            self._pending.append((what, fut))
            self._versions = {f: v for f, v in self._versions.items() if not f.done()}
            if version is not None:
                self._versions[fut] = version

        def done(f, what=what):
            e = f.exception()
            if e is not None:
                msg = f"{what}: {type(e).__name__}: {e}"
                with self._lock:
                    self.errors.append(msg)
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
            except Exception as e:  # a failed job; KeyboardInterrupt/SystemExit propagate at once
                not_done.append(f"{what}: {type(e).__name__}: {e}")
        with self._lock:
            self._pending = [(w, f) for w, f in self._pending if not f.done()]
        not_done.extend(self._abort_failed(deadline))
        return not_done

    def _abort_failed(self, deadline: float | None) -> list[str]:
        """Abort multipart uploads left behind by failed uploads (the tier aborts on failure, but
        the abort itself can fail while S3 is unreachable): retried here until ``deadline``."""
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
    left = up.wait(timeout)
    if left:
        raise UploadError("uploads to the remote tier did not complete:\n  " + "\n  ".join(left))


