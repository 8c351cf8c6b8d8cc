"""The peer exchange of a load (docs/FORMAT.md, "Placement"): the byte ranges of objects that a
rank's root lacks and no remote tier holds travel from a rank whose root holds them, over the
load's process group, as stored (encrypted, checksummed) — the receiver verifies every frame as if
it had read it itself (:class:`PeerTier` serves the received bytes to the reader's sources).

``prepare_global_plan`` (coordinator) computes who sends what to whom (:func:`peer_plans`) from the
restore choice's view; ``read_data`` runs this rank's part (:func:`run_peer_exchange`) before it
reads anything.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..choice import View
from ..errors import CkptStoreError, ObjectNotFoundError


def peer_plans(view: View, plans: list, needed_frames) -> list:
    """``[(send, recv)]`` per plan (group rank): the byte ranges each rank serves from its root to
    the ranks that need them and receives from its peers. ``needed_frames(read_item)`` gives the
    ``(object, [FrameRef])`` a read item needs."""
    req: dict[tuple, dict[str, set]] = {}
    for i, p in enumerate(plans):
        for ri in p.items:
            obj, frames = needed_frames(ri)
            if not frames:
                continue
            src = view.source(i, obj)
            if isinstance(src, int):
                req.setdefault((src, i), {}).setdefault(obj, set()).update((f.offset, f.length) for f in frames)
    send = [[] for _ in plans]
    recv = [[] for _ in plans]
    for (j, i) in sorted(req):
        for obj in sorted(req[(j, i)]):
            ranges = tuple(sorted(req[(j, i)][obj]))
            send[j].append((view.global_rank(i), obj, ranges))
            recv[i].append((view.global_rank(j), obj, ranges))
    return [(tuple(s), tuple(r)) for s, r in zip(send, recv)]


def run_peer_exchange(send: tuple, recv: tuple, local, key_of, pg) -> dict:
    """Serve ``send`` from this rank's root and receive ``recv``; returns ``{(object, offset): bytes}``.

    One message per pair of ranks (the concatenated ranges, in the order both sides list them); every
    send is posted before any receive, so no order of ranks can deadlock. The bytes travel as stored
    (encrypted, checksummed): the receiver verifies every frame as if it had read it itself.
    """
    if (send or recv) and "gloo" not in str(dist.get_backend(pg)):
        raise CkptStoreError(
            "this load fetches objects from other ranks' roots (no remote tier holds them), which needs a "
            "gloo-capable process group: pass process_group=torch.distributed.new_group(backend='gloo') "
            "to StorageReader and dcp.load"
        )
    works = []
    for dst, entries in _by_peer(send):
        chunks = []
        for obj, ranges in entries:
            key = key_of(obj)
            chunks.extend(local.get_ranges(key, [(o, o + n) for o, n in ranges]))
        buf = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
        works.append(dist.isend(buf, dst=dst, group=pg))
    out: dict = {}
    for src, entries in _by_peer(recv):
        total = sum(n for _obj, ranges in entries for _o, n in ranges)
        buf = torch.empty(total, dtype=torch.uint8)
        dist.recv(buf, src=src, group=pg)
        mv = memoryview(buf.numpy())
        pos = 0
        for obj, ranges in entries:
            for o, n in ranges:
                out[(obj, o)] = bytes(mv[pos : pos + n])
                pos += n
    for w in works:
        w.wait()
    return out


def _by_peer(entries: tuple) -> list:
    grouped: dict[int, list] = {}
    for peer, obj, ranges in entries:
        grouped.setdefault(peer, []).append((obj, ranges))
    return sorted(grouped.items())


class PeerTier:
    """Bytes of another rank's root, received in ``read_data`` (``{(object, offset): bytes}``)."""

    name = "peer"

    def __init__(self, version: str, got: dict, rank: int, root: str | None = None) -> None:
        self._got = got
        self.rank = rank
        self.url = f"the root of rank {rank} ({root or '?'})"

    def get_ranges(self, key: str, ranges) -> list[bytes]:
        obj = key.split("/", 2)[2]  # the object name: past "versions/<version>/" (its origin's, for a reference)
        try:
            return [self._got[(obj, a)] for a, _b in ranges]
        except KeyError:
            raise ObjectNotFoundError(f"{obj!r}: bytes from {self.url} did not arrive", object=obj) from None

    def get(self, key: str) -> bytes:
        raise ObjectNotFoundError(f"{key!r} is read whole only from a tier", object=key)


__all__ = ["PeerTier", "peer_plans", "run_peer_exchange"]
