"""The exchange of a load (docs/FORMAT.md, Read rules 7 and 11): bytes that several ranks need from
the same place, or that a rank's root lacks, are read once, verified, and relayed to the ranks that
need them — as stored (encrypted, checksummed), so that every receiver verifies them again as it
decodes them, like any read (:class:`PeerTier` serves the received bytes to the reader's sources).

**Plan** (:func:`plan`; the coordinator, in ``prepare_global_plan``, which sees every rank's load
plan). For each frame a read item needs from somewhere other than the rank's own root — another
rank's root (``View.source``: a peer), or the remote tier — or from a root it shares with other
ranks of the load (when the view knows which ranks share a root: ``View.root_id(i)``, an identity of
rank i's root, None when unknown), the ranks that need it from that place form its *audience*. Frames with the same place and audience travel together, in chunks of at most
:data:`CHUNK_BYTES` stored bytes. A chunk has one *reader*: the rank whose root serves it, or, from
the remote tier or a shared root, the member of its audience with the fewest bytes to read so far
(how DCP's ``CooperativeLoadPlanner`` picks its leaders), so that those reads spread over the job. A chunk that
one rank alone needs from the remote tier is not exchanged: that rank reads it, as it always did.
The reader and the audience (in rank order, starting after the reader) form a binary tree: a chunk
goes down one level per *round*, every rank forwarding it to at most two others. Each rank's plan
holds only the chunks it reads, receives or forwards and its messages (:class:`ExchangePlan`): what a
rank is sent grows with its own share of the load, not with ranks × items; the coordinator's work is
linear in the plans it was given, like DCP's own global planning.

**Run** (:func:`run`; every rank, first thing in ``read_data``). The reader reads its chunks through
the load's sources and verifies every frame (index entry, checksum, AEAD tag), falling back to the
other places that hold the object like any read; a chunk it cannot read verified is sent as *not
available*. Then round by round every rank posts its sends of the round (bytes it read or received in
an earlier round) and receives its messages of the round: sends do not block, and whatever a round
sends was in hand before it began, so no order of ranks can deadlock. A message is one status byte per
chunk (1: follows; 0: not available) and the chunks' frames as stored, in plan order, sent in pieces of
at most :data:`PIECE_BYTES`. A receiver keeps the bytes of the chunks that came, and reads the others
itself from their other places.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from ..errors import CkptStoreError, ObjectNotFoundError
from ._types import Chunk, ExchangePlan

log = logging.getLogger("ckptstore")

#: stored bytes per chunk: the unit of a reader's assignment and of a relay
CHUNK_BYTES = 16 << 20
#: bytes per point-to-point message (a larger message is sent in pieces)
PIECE_BYTES = 64 << 20


class _Roles:
    """One rank's part of the exchange while the plan is built."""

    __slots__ = ("chunks", "idx", "read", "msgs")

    def __init__(self) -> None:
        self.chunks: list = []
        self.idx: dict = {}
        self.read: list = []
        self.msgs: dict = {}

    def local(self, gid: int, chunk: Chunk) -> int:
        k = self.idx.get(gid)
        if k is None:
            k = self.idx[gid] = len(self.chunks)
            self.chunks.append(chunk)
        return k

    def message(self, rnd: int, peer: int, send: bool, gid: int, chunk: Chunk) -> None:
        self.msgs.setdefault((rnd, peer, send), []).append(self.local(gid, chunk))

    def plan(self, make_group: bool) -> ExchangePlan:
        steps = tuple((rnd, peer, send, tuple(ks)) for (rnd, peer, send), ks in sorted(self.msgs.items()))
        return ExchangePlan(tuple(self.chunks), tuple(self.read), steps, make_group)


def plan(view, plans: list, needed_frames, *, make_group: bool = False, share_remote: bool = True,
         chunk_bytes: int = CHUNK_BYTES) -> list[ExchangePlan | None]:
    """This load's :class:`ExchangePlan` per load plan (group-rank order; see the module docstring),
    or None for a rank with no part in it. ``view``: the restore choice's view (``source``,
    ``global_rank``); ``needed_frames(read_item)`` gives the ``(object, [FrameRef])`` the item needs;
    ``make_group``: every rank makes a gloo group for the exchange first (then no plan is None when
    anything is exchanged); ``share_remote``: False when bytes cannot travel between ranks (a
    non-gloo group): every rank then reads from the remote tier what it needs, and only what a peer's
    root alone holds is planned (its run raises the error that explains it)."""
    users, wants = _places_wanted(view, plans, needed_frames, share_remote)
    # pass 2, per frame, only of objects that more than one rank needs, or that a peer serves
    need: dict = {}  # (place, object, offset) -> (FrameRef, [group ranks, ascending])
    for i, mine in enumerate(wants):
        for place, obj, frames in mine:
            if not isinstance(place, int) and len(users[(place, obj)]) == 1:
                continue  # one rank reads it (the remote tier, its shared root) for itself
            for f in frames:
                k = (place, obj, f.offset)
                e = need.get(k)
                if e is None:
                    need[k] = (f, [i])
                elif e[1][-1] != i:
                    e[1].append(i)
    del wants, users
    shared: dict = {}  # (place, audience) -> [(object, FrameRef)]
    for (place, obj, _off), (f, ranks) in need.items():
        if not isinstance(place, int) and len(ranks) == 1:
            continue  # one rank reads it from the remote tier (or its shared root), as without an exchange
        shared.setdefault((place, tuple(ranks)), []).append((obj, f))
    if not shared:
        return [None] * len(plans)
    roles = [_Roles() for _ in plans]
    assigned = [0] * len(plans)  # stored bytes each rank reads from the remote tier for others
    gid = 0
    for (place, audience), frames in shared.items():
        frames.sort(key=lambda x: (x[0], x[1].offset))
        for part in _split(frames, chunk_bytes):
            nbytes = sum(f.length for _o, f in part)
            if not isinstance(place, int):  # the remote tier, or a root the audience shares
                reader = min(audience, key=lambda i: (assigned[i], i))
                assigned[reader] += nbytes
                at = audience.index(reader)
                order = (reader, *audience[at + 1:], *audience[:at])
                chunk = Chunk(None if place == "remote" else view.global_rank(reader), tuple(part))
            else:
                order = (place, *audience)  # a peer's root: its rank reads (it is not in the audience)
                chunk = Chunk(view.global_rank(place), tuple(part))
            roles[order[0]].read.append(roles[order[0]].local(gid, chunk))
            for q in range(1, len(order)):
                parent, child = order[(q - 1) // 2], order[q]
                rnd = (q + 1).bit_length() - 1  # the child's depth in the tree
                roles[parent].message(rnd, view.global_rank(child), True, gid, chunk)
                roles[child].message(rnd, view.global_rank(parent), False, gid, chunk)
            gid += 1
    out = [r.plan(make_group) if (r.chunks or make_group) else None for r in roles]
    return out


def _places_wanted(view, plans: list, needed_frames, share_remote: bool) -> tuple[dict, list]:
    """Pass 1 of :func:`plan`, per object: which ranks need something of it from which place —
    ``(users, wants)``: ``{(place, object): [group ranks, ascending]}`` and, per rank, ``[(place,
    object, frames)]`` it reads from elsewhere than its own (unshared) root. One entry per rank and
    object read from elsewhere: an object only its own rank reads from the remote tier costs no more."""
    users: dict = {}
    wants: list = []
    root_id = getattr(view, "root_id", None)  # shared roots, when the load knows them
    for i, p in enumerate(plans):
        place_of: dict = {}
        mine: list = []
        rid = root_id(i) if root_id is not None else None
        for ri in p.items:
            obj, frames = needed_frames(ri)
            if not frames:
                continue
            place = place_of.get(obj)
            if place is None:
                place = view.source(i, obj)
                if place == "local" and rid is not None and share_remote:
                    place = ("root", rid)  # a root other ranks share: read once for all of them (bytes can travel)
                place_of[obj] = place
            if place == "local" or (place == "remote" and not share_remote):
                continue
            mine.append((place, obj, frames))
            u = users.setdefault((place, obj), [i])
            if u[-1] != i:
                u.append(i)
        wants.append(mine)
    return users, wants


def _split(frames: list, chunk_bytes: int):
    part: list = []
    size = 0
    for obj, f in frames:
        if part and size + f.length > chunk_bytes:
            yield part
            part, size = [], 0
        part.append((obj, f))
        size += f.length
    if part:
        yield part


def run(xp: ExchangePlan, held: dict, pg) -> int:
    """Run this rank's rounds of ``xp`` over the gloo group ``pg``. ``held``: ``{chunk index: [stored
    bytes of each frame] | None}`` for the chunks this rank read (None: no verified copy); the chunks
    received are added to it. Returns ``(bytes received, bytes sent)``."""
    if xp.steps and "gloo" not in str(dist.get_backend(pg)):
        raise CkptStoreError(
            "this load moves bytes between ranks, which needs a gloo-capable process group: pass "
            "process_group=torch.distributed.new_group(backend='gloo') to StorageReader and dcp.load")
    received = sent = 0
    rounds = sorted({s[0] for s in xp.steps})
    for rnd in rounds:
        works = []
        for r, peer, send, ks in xp.steps:
            if r == rnd and send:
                msg = _message(xp, ks, held)
                sent += len(msg)
                works.append(_send(msg, peer, pg, rnd))
        for r, peer, send, ks in xp.steps:
            if r == rnd and not send:
                size = len(ks) + sum(xp.chunks[k].nbytes for k in ks)
                buf = _recv(size, peer, pg, rnd)
                received += size
                _unpack(xp, ks, buf, held)
        for tensor, ws in works:  # the buffers stay referenced until their sends completed
            for w in ws:
                w.wait()
            del tensor
    return received, sent


def _message(xp: ExchangePlan, ks: tuple, held: dict) -> bytearray:
    out = bytearray(len(ks))
    for j, k in enumerate(ks):
        frames = held.get(k)
        if frames is not None:
            out[j] = 1
            for b in frames:
                out += b
        else:
            out += bytes(xp.chunks[k].nbytes)  # not available: the bytes' place, zeroed
    return out


def _unpack(xp: ExchangePlan, ks: tuple, buf: memoryview, held: dict) -> None:
    pos = len(ks)
    for j, k in enumerate(ks):
        chunk = xp.chunks[k]
        if buf[j]:
            frames = []
            for _obj, f in chunk.frames:
                frames.append(bytes(buf[pos : pos + f.length]))
                pos += f.length
            held[k] = frames
        else:
            held.setdefault(k, None)
            pos += chunk.nbytes


def _send(buf: bytearray, peer: int, pg, tag: int) -> tuple:
    """``(tensor, works)``: ``buf`` posted to ``peer`` in pieces (non-blocking)."""
    t = torch.frombuffer(buf, dtype=torch.uint8)
    return t, [dist.isend(t[a : a + PIECE_BYTES], dst=peer, group=pg, tag=tag) for a in range(0, len(buf), PIECE_BYTES)]


def _recv(size: int, peer: int, pg, tag: int) -> memoryview:
    t = torch.empty(size, dtype=torch.uint8)
    for a in range(0, size, PIECE_BYTES):
        dist.recv(t[a : a + PIECE_BYTES], src=peer, group=pg, tag=tag)
    return memoryview(t.numpy())


def broadcast_bytes(parts: list | None, src: int, pg) -> list | None:
    """Byte strings ``parts`` of rank ``src`` (global rank) on every rank of ``pg``, as raw bytes (two
    ``broadcast``s: the lengths, then the bytes; nothing is pickled); None on every rank when ``src``
    passes None (it has nothing verified to send)."""
    n = 2
    head = torch.full((n + 1,), -1, dtype=torch.int64)
    if dist.get_rank() == src and parts is not None:
        head[0] = 1
        head[1:] = torch.tensor([len(p) for p in parts], dtype=torch.int64)
    dist.broadcast(head, src=src, group=pg)
    if int(head[0]) != 1:
        return None
    sizes = [int(x) for x in head[1:]]
    if dist.get_rank() == src:
        data = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8) if sum(sizes) else torch.empty(0, dtype=torch.uint8)
    else:
        data = torch.empty(sum(sizes), dtype=torch.uint8)
    if sum(sizes):
        dist.broadcast(data, src=src, group=pg)
    mv = memoryview(data.numpy())
    out, pos = [], 0
    for n_ in sizes:
        out.append(bytes(mv[pos : pos + n_]))
        pos += n_
    return out


class PeerTier:
    """Stored bytes this load received from other ranks, or read for them (``{(object, offset):
    bytes}``), served to the reader's sources like a tier. ``origin``: where they were read —
    ``("root", global rank)`` (that rank's root) or ``("remote", None)`` — for messages and for the
    manager's retry without an unverifiable copy; ``via``: the rank they came from (None: read here)."""

    name = "peer"

    def __init__(self, got: dict, origin: tuple, via: int | None = None, root: str | None = None) -> None:
        self._got = got
        self.origin = origin
        self.rank = origin[1]
        kind, rank = origin
        where = "the remote tier's copy" if kind == "remote" else f"the root of rank {rank} ({root or '?'})"
        self.url = (f"{where}, as read by this rank for the others" if via is None
                    else f"{where}, as received from rank {via}")

    def get_ranges(self, key: str, ranges) -> list[bytes]:
        obj = key.split("/", 2)[2]  # the object name: past "versions/<version>/" (its origin's, for a reference)
        try:
            return [self._got[(obj, a)] for a, _b in ranges]
        except KeyError:
            raise ObjectNotFoundError(f"{obj!r}: bytes from {self.url} did not arrive (no verified copy there)",
                                      object=obj) from None

    def get(self, key: str) -> bytes:
        raise ObjectNotFoundError(f"{key!r} is read whole only from a tier", object=key)


__all__ = ["CHUNK_BYTES", "PIECE_BYTES", "PeerTier", "broadcast_bytes", "plan", "run"]
