"""The upload stage of a save, as the writer drives it (the uploads themselves, the rank markers and
the remote commit are ``upload.Uploader``'s; see ``upload.py`` for the order they follow).

Per rank: the streamed upload of the rank's object while it is written (:meth:`RemoteStage.open_stream`)
and its completion once committed locally (:meth:`RemoteStage.upload_object`). Coordinator: the
remote commit after the local one (:meth:`RemoteStage.commit`), and at the first save of a writer
the versions an earlier run committed locally but not remotely (:meth:`RemoteStage.restage_plan`,
staged by every rank with :meth:`RemoteStage.restage_objects`; docs/FORMAT.md, Save rule 8).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging

from ..errors import CkptStoreError
from ..manifest import layout
from ..manifest.order import order_key
from ..manifest.schema import Manifest, ObjectEntry
from ._reports import UploadFailure
from ._stage import OwnLock
from ._types import ObjectReport, PlanData

log = logging.getLogger("ckptstore")


class RemoteStage(OwnLock):
    """The writer's uploads (nothing without a remote tier). ``cfg``: the writer's settings
    (``durability``, ``threads``, ``upload_timeout``, ``retention``, ``overwrite``, ``remote_url``);
    ``tier``: this rank's root; ``remote``: the remote tier or None; ``guard``: ``_liveness.Guard``.
    The uploader (pool and client) is made at first use and never pickled."""

    _fresh = {"_uploader": lambda: None, "_futs": dict}

    def __init__(self, cfg, tier, remote, guard) -> None:
        super().__init__()
        self.cfg = cfg
        self.tier = tier
        self.remote = remote
        self.guard = guard
        self._uploader = None
        self.skipped_before: list[str] = []  # the skipped versions of uploaders dropped (close())
        self._caught_up = False  # the restage comparison ran (see restage_plan)
        self._futs: dict[str, cf.Future] = {}

    @property
    def uploader(self):
        """The ``upload.Uploader`` (made now if need be); None without a remote tier."""
        with self._lock:
            if self._uploader is None and self.remote is not None:
                from .upload import Uploader

                g = self.guard
                self._uploader = Uploader(
                    self.tier, self.remote, threads=max(2, self.cfg.threads), timeout=self.cfg.upload_timeout,
                    retention=self.cfg.retention, guard=g.check_trainer if g.trainer is not None else None,
                )
            return self._uploader

    def skipped(self) -> list[str]:
        """Versions not staged because newer ones took their place (Save rule 8), oldest first, the last
        1,000: this writer's dropped uploaders' and the current one's."""
        up = self._uploader
        now = list(up.skipped) if up is not None else []
        return (self.skipped_before + [v for v in now if v not in self.skipped_before])[-1000:]

    @property
    def current(self):
        """The uploader if one was made (None otherwise); makes none."""
        return self._uploader

    @property
    def sync(self) -> bool:
        """Wait for uploads inside the save: ``durability="remote"``, or in DCP's checkpoint
        subprocess, which cannot keep uploading after it has answered."""
        return self.cfg.durability == "remote" or self.guard.in_subprocess

    # -- rank side -----------------------------------------------------------------------------
    def abandon(self, version: str) -> None:
        """``version``'s save failed on this rank: its queued uploads are not sent (``Uploader.abandon``)."""
        if self._uploader is not None:
            self._uploader.abandon(version)

    def open_stream(self, version: str, name: str):
        """The streamed upload of the rank object ``name`` (None without a remote tier)."""
        if self.remote is None:
            return None
        return self.uploader.open_stream(layout.object_key(version, name))

    def upload_object(self, version: str, rep: ObjectReport) -> UploadFailure | None:
        """Upload the rank's committed object ``rep``: waited for with ``durability="remote"``; in
        DCP's checkpoint subprocess with ``durability="local"`` a failure is returned (the local
        commit stands, the coordinator reports it). None without a remote tier."""
        if self.remote is None:
            return None
        entry = ObjectEntry(rep.name, rep.size, rep.digest, rep.frames, rep.rank, rep.nbytes)
        fut = self.uploader.upload_object(version, entry, rep.rank, refs=rep.refs)
        if self.cfg.durability == "remote":
            fut.result()
        elif self.guard.in_subprocess:  # PROCESS, durability="local": commit locally, then report it
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001 - travels to the coordinator in the write results
                return UploadFailure(rep.rank, f"{type(e).__name__}: {e}")
        return None

    def restage_objects(self, pd: PlanData) -> None:
        """This rank's part of ``pd.restage``: the objects it uploads of those versions, as its root
        holds them (the upload checks every frame against the manifest before it sends)."""
        from ..manifest import catalogue

        for v, who in pd.restage:
            if who == "coordinator" and pd.rank != pd.coordinator:
                continue
            try:
                m = catalogue.read_manifest(self.tier, v).manifest
            except CkptStoreError:
                continue  # this root holds no copy of it (another node's part)
            for o in m.objects:
                if (who == "coordinator" or o.rank == pd.rank) and self.tier.exists(layout.object_key(v, o.name)):
                    self.uploader.upload_object(v, o, o.rank, retry=False)

    # -- coordinator side ----------------------------------------------------------------------
    def restage_plan(self, version: str, world: int) -> tuple:
        """Coordinator, first save of this writer with a remote tier: ``((version, who), ...)`` for the
        versions committed in its root but not in the remote tier that are ordered after every remote
        commit (a crash or an outage cut their remote commit off). ``who`` says who uploads their
        objects in this save: ``"coordinator"`` (its root holds every object) or ``"ranks"`` (a
        version saved by a job of this size: every rank its own, from its own root — node-local
        roots, where no single root holds every object). The coordinator then commits them remotely
        (docs/FORMAT.md, Save rule 8), so a job restarted after an outage of the remote tier stages what it could
        not. One listing of the remote version directories (not their objects) and one manifest
        read; tried again at the next save when the remote tier does not answer."""
        if self.remote is None or self.guard.in_subprocess or self._caught_up:
            return ()
        from .._names import decode_version
        from ..manifest import catalogue

        try:
            entries = catalogue.scan(self.tier)
            # the version directories, not their objects (docs/FORMAT.md, "Restore choice")
            listed = {enc: d.manifest.mtime for enc, d in catalogue.version_dirs(self.remote).items() if d.manifest is not None}
            local = catalogue.merge({"local": entries})
            todo = [r for r in local if layout.version_dir(r.version).split("/")[1] not in listed and r.version != version]
            newest = None
            if listed and todo:
                m = catalogue.read_manifest(self.remote, decode_version(max(listed, key=lambda k: listed[k]))).manifest
                newest = order_key(m.step, m.seq, m.created, m.version)
        except CkptStoreError as e:
            log.warning("ckptstore: cannot compare the local and remote tiers to stage what an earlier run did not "
                        "upload (%s); trying again at the next save", e)
            return ()
        self._caught_up = True
        out = []
        for r in todo:
            if newest is not None and r.order <= newest:
                continue  # older than the remote tier's newest commit: its retention may have dropped it
            m = entries[r.version].manifest
            if all(self.tier.exists(layout.object_key(r.version, o.name)) for o in m.objects):
                out.append((r.version, "coordinator"))
            elif m.world_size == world:
                out.append((r.version, "ranks"))
            else:
                log.warning("ckptstore: version %r is committed locally but not in %s, and neither this root nor "
                            "this job's ranks hold all its objects; it is not staged", r.version, self.cfg.remote_url)
        if out:
            log.warning("ckptstore: versions %s are committed locally but not in %s; staging them with this save",
                        [v for v, _w in out], self.cfg.remote_url)
        return tuple(out)

    def commit(self, restage: tuple, m: Manifest, body: bytes) -> None:
        """The remote commit of ``m`` (``body``: its bytes), after those of the versions ``restage``
        (see :meth:`restage_plan`); waited for when :attr:`sync`."""
        from ..manifest import catalogue

        for v, _who in restage:  # what an earlier run could not commit remotely (see restage_plan)
            try:
                p = catalogue.read_manifest(self.tier, v)
                self.uploader.commit(p.manifest, self.tier.get(layout.manifest_key(v)), False, retry=False)
            except CkptStoreError as e:
                log.warning("ckptstore: cannot stage version %r again: %s", v, e)
        fut = self.uploader.commit(m, body, self.cfg.overwrite)
        with self._lock:
            self._futs[m.version] = fut
        if self.sync:
            fut.result()

    def failed(self, version: str, failures: list):
        """The ``UploadError`` for a version committed locally whose ranks' uploads ``failures``
        (``UploadFailure``) failed (PROCESS executor, ``durability="local"``)."""
        from .upload import UploadError

        return UploadError(
            f"version {version!r} is committed locally but not uploaded to {self.cfg.remote_url}: "
            + "; ".join(f"rank {f.rank}: {f.error}" for f in sorted(failures, key=lambda f: f.rank))
        )

    def remote_commit_future(self, version: str):
        """The future of ``version``'s remote commit, or None; handed out once."""
        with self._lock:
            return self._futs.pop(version, None)

    def in_flight(self):
        """Versions still uploading or committing remotely (``()`` without an uploader)."""
        up = self._uploader
        return up.in_flight() if up is not None else ()

    # -- the end -------------------------------------------------------------------------------
    def wait(self, timeout: float | None) -> None:
        """Block until the pending uploads and remote commits finish (``upload.check_uploads``)."""
        from .upload import check_uploads

        check_uploads(self._uploader, timeout)

    def check_shipped(self, timeout: float, born) -> None:
        """PROCESS executor: the subprocess commits remotely before its future resolves; a version it
        committed locally since ``born`` (this writer's construction) but not remotely failed to
        upload. Stage those again from here and raise for what still fails."""
        from ..manifest import catalogue
        from .upload import UploadError

        local = {v: e for v, e in catalogue.scan(self.tier).items() if e.manifest.created >= born}
        missing = sorted(set(local) - set(catalogue.scan(self.remote)))
        if not missing:
            return
        up = self.uploader
        up.catch_up(only=missing)
        left = up.wait(timeout)
        still = sorted(set(missing) - set(catalogue.scan(self.remote)))
        if still:
            raise UploadError(
                f"versions {still} were committed locally by DCP's checkpoint subprocess but not in "
                f"{self.cfg.remote_url}; they are intact locally (the next save with this remote stages them, "
                "or run the save again with working credentials):\n  " + "\n  ".join(left)
            )

    def drop(self) -> None:
        """Shut the uploader down and close the remote tier's pool and client (made again at next use)."""
        with self._lock:
            self.skipped_before = self.skipped()
            up, self._uploader = self._uploader, None
        if up is not None:
            up.shutdown()
            self.remote.close()


__all__ = ["RemoteStage"]
