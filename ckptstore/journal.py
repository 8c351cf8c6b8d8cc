"""Journals: an append-only log of small records per writer, in a local root (docs/FORMAT.md, "Journals").

A version costs a commit (plans, manifest, fsyncs, retention); some state changes every step and is
needed only by the process that wrote it, or by its next launch on the same node: a data loader's
position after every step of a torchft replica group (``ckptstore.integrations.torchft``). A
journal records it for the price of one small write::

    j = Journal(root, "loader-g3.rank1", scope="loader-g3", keep=52, master=RawKey(k))
    j.append(step, body)          # one frame, one write(2); no fsync
    j.reset()                     # the timeline restarted: every record before this one is abandoned
    j.read()                      # [(step, body), ...] of the current timeline, oldest first

What it is, in the frame layout of objects (docs/FORMAT.md, "Frame byte layout"):

* ``journals/<name>.log``: frame 0 is the header, raw JSON ``{"journal": 1, "name", "scope", "id",
  "key"}`` (``id``: 16 random hex digits; ``key``: None, or the data key's ``encryption`` and the
  ``[version, attempt]`` it was wrapped for); frames 1, 2, … are records. A record's raw bytes are
  ``kind`` (u8: 0 a record, 1 a reset), ``step`` (i64, little-endian) and the body; with a master key
  they are AES-256-GCM encrypted like a shard frame, the associated data naming ``scope`` as the
  version, ``id`` as the attempt and ``name`` as the object, so a record moved to another file, name
  or position does not authenticate.
* When the file holds ``keep`` records it becomes ``journals/<name>.prev.log`` (replacing the one
  before) and a new file starts, so the two hold at least the newest ``keep`` records and at most
  ``2 × keep + 2`` frames.

Reading (:meth:`Journal.read`) takes the previous file, then the current one, each up to its first
frame that does not verify (a torn tail after a kill: the records before it count), and applies
them in order: a reset drops every record before it; a record of step ``s`` drops the records of
steps ≥ ``s`` before it (a step taken again, or a timeline restarted at an older step). Opening for
appends truncates a torn tail first, so a new record never lands behind bytes a reader stops at.

Durability: records are written without ``fsync`` — they survive the writer's process being killed
(the page cache), not the node losing power; the header of a new file is fsync'd. A journal has one
writer at a time (torchft launches a group's replacement after the old one exited). Never unpickled:
the body is bytes the caller decodes after the frame verified.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import struct

from .codec import FrameCodec
from .codec.crypto import WrappedKey
from .codec.frame import FrameWalk
from .errors import CkptStoreError, IntegrityError
from .manifest import layout
from .tiers.local import fsync_dir

__all__ = ["Journal", "JOURNAL_FORMAT"]

log = logging.getLogger("ckptstore.journal")

JOURNAL_FORMAT = 1
_REC = struct.Struct("<Bq")  # kind, step
RECORD, RESET = 0, 1


class Journal:
    """One writer's journal ``name`` in the local root ``root`` (see the module docstring).

    Args:
        root: the local root (a directory).
        name: the journal's name (``[A-Za-z0-9._-]``; one writer per name).
        scope: what the records belong to (bound into their associated data), e.g. ``"loader-g3"``.
        keep: records a file holds before the next starts (≥ 1).
        master: the master key (``RawKey``/``KmsKey``, as ``ckptstore.keys.resolve_master`` gives),
            or None: records are checksummed, not encrypted.

    Opening reads the current file (to append after its last good record); a file that cannot be
    read (not a journal, another key) is replaced by a new one, with a warning. Raises ``OSError``
    when the directory cannot be written.
    """

    def __init__(self, root: str | os.PathLike, name: str, *, scope: str, keep: int, master=None) -> None:
        if not name or not all(c.isalnum() or c in "._-" for c in name):
            raise ValueError(f"journal name {name!r}: use letters, digits, '.', '_' and '-'")
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.name, self.scope, self.keep, self.master = name, scope, int(keep), master
        self._dir = os.path.join(os.fspath(root), layout.JOURNALS)
        self.path = os.path.join(self._dir, f"{name}.log")
        self.prev_path = os.path.join(self._dir, f"{name}.prev.log")
        self._keys: dict[tuple, bytes] = {}  # (wrapped, version, attempt) -> data key (one unwrap each)
        self._wrap: tuple | None = None  # this writer's (WrappedKey, version, attempt, data key)
        self._fd: int | None = None
        self._codec: FrameCodec | None = None
        self._count = 0  # frames in the current file (its header included)
        os.makedirs(self._dir, exist_ok=True)
        try:
            got = self._scan(self.path)
        except (CkptStoreError, OSError, ValueError) as e:
            if os.path.exists(self.path):
                log.warning("ckptstore: journal %s is not readable (%s); a new one starts", self.path, e)
            got = None
        if got is not None and got[2] - 1 < self.keep:
            codec, end, frames, _recs = got
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            if os.fstat(self._fd).st_size > end:
                os.ftruncate(self._fd, end)  # a torn tail: the next record follows the last good one
            self._codec, self._count = codec, frames
        else:
            self._start(rotate=got is not None)

    # -- writing -----------------------------------------------------------------------------------
    def append(self, step: int, body: bytes = b"") -> None:
        """Record ``body`` at ``step`` (one frame, one ``write``). Raises ``OSError`` (a full disk)."""
        self._write(RECORD, step, body)

    def reset(self) -> None:
        """Mark the timeline restarted: :meth:`read` ignores every record before this one."""
        self._write(RESET, 0, b"")

    def _write(self, kind: int, step: int, body: bytes) -> None:
        if self._fd is None:
            raise CkptStoreError(f"journal {self.path} is closed")
        if self._count - 1 >= self.keep:
            self._start(rotate=True)
        raw = _REC.pack(kind, int(step)) + bytes(body)
        head, payload, _h = self._codec.encode(self.name, self._count, raw)
        data = head + bytes(payload)
        n = os.write(self._fd, data)
        if n != len(data):  # a short write (a full disk): cut it off, so readers stop before it
            os.ftruncate(self._fd, os.fstat(self._fd).st_size - n)
            raise OSError(f"journal {self.path}: {n} of {len(data)} bytes written")
        self._count += 1

    def _start(self, rotate: bool) -> None:
        """A new current file (the full one, when ``rotate``, becomes the previous file)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if rotate and os.path.exists(self.path):
            os.replace(self.path, self.prev_path)
        fid = secrets.token_hex(8)
        key = None
        if self.master is not None:
            if self._wrap is None:  # one data key per writer: files after the first refer to its wrapping
                dk, w = self.master.draw(self.scope, fid)
                self._wrap = (w, self.scope, fid, dk)
            w, kv, ka, dk = self._wrap
            key = {"encryption": w.encryption(), "version": kv, "attempt": ka}
        header = json.dumps({"journal": JOURNAL_FORMAT, "name": self.name, "scope": self.scope, "id": fid,
                             "key": key}, sort_keys=True).encode()
        head, payload, _h = FrameCodec(self.scope, fid, None, compress="none").encode(self.name, 0, header)
        tmp = os.path.join(self._dir, f"{layout.TMP_PREFIX}{self.name}.{fid}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, head + bytes(payload))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        fsync_dir(self._dir)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._codec = self._codec_of(fid, key)
        self._count = 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # -- reading -----------------------------------------------------------------------------------
    def read(self) -> list[tuple[int, bytes]]:
        """The records of the current timeline, ``[(step, body), ...]`` oldest first (see the module
        docstring). A file that cannot be read contributes nothing (logged)."""
        out: list[tuple[int, bytes]] = []
        for path in (self.prev_path, self.path):
            try:
                got = self._scan(path)
            except (CkptStoreError, OSError, ValueError) as e:
                if os.path.exists(path):
                    log.warning("ckptstore: journal %s is not readable: %s", path, e)
                continue
            if got is None:
                continue
            for kind, step, body in got[3]:
                if kind == RESET:
                    out.clear()
                else:
                    while out and out[-1][0] >= step:
                        out.pop()
                    out.append((step, body))
        return out

    def _codec_of(self, fid: str, key: dict | None) -> FrameCodec:
        cipher = None
        if key is not None:
            from .codec.crypto import FrameCipher

            if self.master is None:
                raise IntegrityError(f"journal {self.name} is encrypted and no key was given")
            w = WrappedKey.of_encryption(key["encryption"])
            ident = (w, str(key["version"]), str(key["attempt"]))
            dk = self._keys.get(ident)
            if dk is None:
                if self._wrap is not None and self._wrap[:3] == ident:
                    dk = self._wrap[3]
                else:
                    dk = self.master.unwrap(w, ident[1], ident[2])
                self._keys[ident] = dk
            cipher = FrameCipher(dk)
        elif self.master is not None:
            raise IntegrityError(f"journal {self.name} is not encrypted although a key was given")
        return FrameCodec(self.scope, fid, cipher, compress="none")

    def _scan(self, path: str):
        """``(codec, end of the last good frame, frames, [(kind, step, body), ...])`` of the file at
        ``path``, None when there is none; raises IntegrityError when its header does not verify."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        mv = memoryview(data)
        walk = FrameWalk(lambda off, n: mv[off : off + n], len(mv), f"journal {path}")
        it = iter(walk)
        try:
            _off, hd, length = next(it)  # raises IntegrityError when even the header is bad
        except StopIteration:
            raise IntegrityError(f"journal {path} is empty") from None
        try:
            meta = json.loads(bytes(FrameCodec(self.scope, "", None).decode(self.name, mv[:length], None)))
        except (ValueError, UnicodeDecodeError) as e:
            raise IntegrityError(f"journal {path}: header is not JSON ({e})") from None
        if not isinstance(meta, dict) or meta.get("journal") != JOURNAL_FORMAT or meta.get("name") != self.name \
                or meta.get("scope") != self.scope or not isinstance(meta.get("id"), str):
            raise IntegrityError(f"journal {path}: not journal {self.name!r} of {self.scope!r} (format {JOURNAL_FORMAT})")
        key = meta.get("key")
        try:
            codec = self._codec_of(meta["id"], key)
        except (KeyError, TypeError, AttributeError) as e:
            raise IntegrityError(f"journal {path}: bad key entry ({type(e).__name__}: {e})") from None
        end, frames, recs = length, 1, []
        try:
            for off, hd, length in it:
                raw = bytes(codec.decode(self.name, mv[off : off + length], None))
                if len(raw) < _REC.size or raw[0] not in (RECORD, RESET):
                    raise IntegrityError(f"journal {path}: record {hd.index} is malformed")
                kind, step = _REC.unpack_from(raw, 0)
                recs.append((kind, step, raw[_REC.size :]))
                end, frames = off + length, frames + 1
        except IntegrityError as e:  # a torn or damaged tail: the records before it count
            log.info("ckptstore: journal %s read up to byte %d: %s", path, end, e)
        return codec, end, frames, recs
