"""The apply stage of a load: which frames each read item needs, where its bytes go, and putting
the decoded (verified) bytes there — into the destination tensor's memory, through a tensor
subclass's ``copy_`` (``_subclass.Assembly``), or to ``planner.load_bytes`` for bytes items.

Every destination is resolved and checked (:func:`destinations`: dtype, shape, subclass) before any
byte is written into any of them. ``read_data`` then runs batches (:func:`batches`): it fetches and
decodes one batch's frames while the previous one is applied (:func:`apply`).
"""

from __future__ import annotations

import io

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from ..errors import DtypeMismatchError, IntegrityError
from . import _subclass
from ._types import ItemLocation

_BATCH_BYTES = 32 << 20  # decoded bytes fetched per pipeline stage


def contig_strides(shape) -> tuple:
    strides = []
    acc = 1
    for n in reversed(tuple(shape)):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def needed(ri, loc: ItemLocation):
    """``(frames, start, b0, b1)``: the frames of ``loc`` that overlap the read item ``ri``, the byte
    offset of the first one, and the item's byte range ``[b0, b1)`` in the stored chunk."""
    if ri.type == LoadItemType.BYTE_IO or loc.shape is None:
        return list(loc.frames), 0, 0, loc.nbytes
    itemsize = getattr(torch, loc.dtype).itemsize
    shape = loc.shape
    if len(ri.storage_offsets) != len(shape) or len(ri.lengths) != len(shape) or any(
        o < 0 or n < 0 or o + n > s for o, n, s in zip(ri.storage_offsets, ri.lengths, shape)
    ):
        raise IntegrityError(
            f"{ri.dest_index.fqn!r}: the requested slice (offsets {tuple(ri.storage_offsets)}, lengths "
            f"{tuple(ri.lengths)}) is outside the stored chunk of shape {tuple(shape)}"
        )
    if any(n == 0 for n in ri.lengths) or loc.nbytes == 0:
        return [], 0, 0, 0
    strides = contig_strides(shape)
    first = sum(o * s for o, s in zip(ri.storage_offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(ri.storage_offsets, ri.lengths, strides))
    b0, b1 = first * itemsize, (last + 1) * itemsize
    sel = []
    pos = 0
    start = None
    for f in loc.frames:
        end = pos + f.raw_len
        if end > b0 and pos < b1:
            if start is None:
                start = pos
            sel.append(f)
        pos = end
    return sel, start or 0, b0, b1


def destinations(plan: LoadPlan, planner: LoadPlanner, storage_data, metadata, allow_cast: bool) -> list:
    """``(read item, location, destination, assembly)`` for each item of ``plan``, every tensor
    destination resolved (once) and checked first: its dtype (``DtypeMismatchError`` unless
    ``allow_cast``) and shape, and for a tensor subclass without memory of its own (a wrapper
    subclass: quantized / Float8 weights) an :class:`_subclass.Assembly` — its parts go into a plain
    buffer, then through its ``copy_`` (``UnsupportedStateError`` here when that cannot work). Bytes
    items have no destination, nor do tensors of a planner whose ``resolve_tensor`` is its own (it may
    allocate a temporary per item and copy it back in ``commit_tensor``: resolved again when
    delivered, one at a time). ``metadata``: the load's DCP ``Metadata`` (or None)."""
    out = []
    assemblies: dict = {}
    cls = type(planner)
    views = all(getattr(cls, m, None) is getattr(DefaultLoadPlanner, m) for m in ("resolve_tensor", "lookup_tensor", "transform_tensor"))
    for ri in plan.items:
        loc: ItemLocation = storage_data[ri.storage_index]
        if ri.type == LoadItemType.BYTE_IO:
            out.append((ri, loc, None, None))
            continue
        dtype = getattr(torch, loc.dtype)
        target = planner.resolve_tensor(ri).detach()
        if target.dtype != dtype and not allow_cast:
            raise DtypeMismatchError(
                f"{ri.dest_index.fqn!r} is stored as {dtype} but the destination tensor is {target.dtype}; "
                "load into a tensor of the stored dtype, or pass allow_cast=True to StorageReader"
            )
        if target.numel() and tuple(target.shape) != tuple(ri.lengths):
            raise IntegrityError(f"{ri.dest_index.fqn!r}: read item lengths {tuple(ri.lengths)} do not fit {tuple(target.shape)}")
        whole = _whole_destination(planner, ri, target, metadata)
        if whole.numel() == 0 or _subclass.has_memory(whole):
            out.append((ri, loc, target if views else None, None))
            continue
        k = (ri.dest_index.fqn, tuple(ri.dest_index.offset) if ri.dest_index.offset is not None else None)
        asm = assemblies.get(k)
        if asm is None:
            asm = assemblies[k] = _subclass.Assembly(ri.dest_index.fqn, whole, exact=not allow_cast)
        asm.parts.append((ri, target))
        out.append((ri, loc, asm.part(ri), asm))
    return out


def _whole_destination(planner: LoadPlanner, ri, target: torch.Tensor, metadata) -> torch.Tensor:
    """The tensor ``ri`` loads a part of: ``target`` when ``ri`` spans the whole stored tensor (DCP
    checks that a destination's global size is the stored one, so nothing was narrowed), else the
    planner's ``lookup_tensor`` (DCP's default planners) before ``transform_tensor`` narrowed it."""
    md = metadata.state_dict_metadata.get(ri.dest_index.fqn) if metadata is not None else None
    if tuple(getattr(md, "size", ())) == tuple(ri.lengths):
        return target
    lookup = getattr(planner, "lookup_tensor", None)
    if lookup is None:
        return target
    try:
        whole = lookup(ri.dest_index)
    except Exception:  # noqa: BLE001 - a planner of its own: what resolve_tensor gave is all we know
        return target
    return whole.detach() if isinstance(whole, torch.Tensor) else target


def batches(dests: list) -> list[list]:
    """The items of :func:`destinations` as ``(read item, location, needed, destination, assembly)``
    jobs, in batches of about :data:`_BATCH_BYTES` decoded bytes."""
    out: list[list] = [[]]
    size = 0
    for ri, loc, dest, asm in dests:
        job = (ri, loc, needed(ri, loc), dest, asm)
        out[-1].append(job)
        size += sum(f.raw_len for f in job[2][0])
        if size >= _BATCH_BYTES:
            out.append([])
            size = 0
    return out


class Placed:
    """A frame decoded straight into its destination's memory (``view``: those bytes) by a decoder
    thread: :func:`deliver` has nothing left to copy for it."""

    __slots__ = ("view",)

    def __init__(self, view) -> None:
        self.view = view

    def __len__(self) -> int:
        return len(self.view)


def _fast_dest(ri, loc: ItemLocation, frames, start, b0, b1, target):
    """The destination's own bytes when the item is a whole stored chunk loaded into a tensor of
    its dtype whose memory is its own (the frames then go straight into place), else None."""
    if ri.type == LoadItemType.BYTE_IO or target is None or not frames or target.numel() == 0:
        return None
    if not (b0 == 0 and b1 == loc.nbytes and start == 0 and tuple(ri.lengths) == tuple(loc.shape)):
        return None
    if target.dtype != getattr(torch, loc.dtype):
        return None
    return _subclass.own_bytes(target)


def placements(batch: list) -> dict:
    """``{(object, offset): writable byte view}``: where each frame of ``batch`` may be decoded
    straight into (its item is a whole stored chunk with a destination of its own memory, see
    :func:`_fast_dest`). A frame that two jobs need is decoded into fresh memory as before."""
    out: dict = {}
    seen: dict = {}
    for ri, loc, (frames, start, b0, b1), dest, asm in batch:
        for f in frames:
            seen[(loc.object, f.offset)] = seen.get((loc.object, f.offset), 0) + 1
        if asm is not None:
            continue
        dst = _fast_dest(ri, loc, frames, start, b0, b1, dest)
        if dst is None or sum(f.raw_len for f in frames) != dst.shape[0]:
            continue
        pos = 0
        for f in frames:
            out[(loc.object, f.offset)] = dst[pos : pos + f.raw_len]
            pos += f.raw_len
    return {k: v for k, v in out.items() if seen[k] == 1}


def apply(batch: list, decoded: dict, planner: LoadPlanner, record) -> None:
    """Deliver every job of ``batch`` from ``decoded`` (``{(object, offset): bytes}``) and commit its
    tensor (an assembly's once its last part is in). ``record(ri, loc, parts)``: called for every item
    loaded whole (the incremental baseline), or None."""
    for ri, loc, (frames, start, b0, b1), dest, asm in batch:
        if ri.type == LoadItemType.BYTE_IO:
            deliver(ri, loc, frames, start, b0, b1, decoded, planner, None, record)
        elif asm is None:
            if dest is None:  # a planner's own resolve_tensor may allocate: one at a time
                dest = planner.resolve_tensor(ri).detach()
            deliver(ri, loc, frames, start, b0, b1, decoded, planner, dest, record)
            planner.commit_tensor(ri, dest)
        else:
            deliver(ri, loc, frames, start, b0, b1, decoded, planner, dest, record)
            asm.left -= 1
            if asm.left == 0:  # every part is in: into the subclass, read back and compared
                asm.finish()
                for pri, pt in asm.parts:
                    planner.commit_tensor(pri, pt)


def deliver(ri, loc: ItemLocation, frames, start, b0, b1, decoded, planner, target, record) -> None:
    """Write read item ``ri``'s bytes into ``target`` (bytes items: ``planner.load_bytes``).

    The fast path copies decoded frames straight into ``target``'s memory, only when that memory
    is checked to be ``target``'s own (``_subclass.own_bytes``); otherwise ``target.copy_``."""
    parts = [decoded[(loc.object, f.offset)] for f in frames]
    placed = bool(parts) and all(isinstance(p, Placed) for p in parts)
    parts = [p.view if isinstance(p, Placed) else p for p in parts]
    if record is not None and b0 == 0 and b1 == loc.nbytes and start == 0 and (
            ri.type == LoadItemType.BYTE_IO or tuple(ri.lengths) == tuple(loc.shape)):
        record(ri, loc, parts)
    if ri.type == LoadItemType.BYTE_IO:
        planner.load_bytes(ri, io.BytesIO(b"".join(parts)))
        return
    dtype = getattr(torch, loc.dtype)
    if target.numel() == 0 or not frames:
        return
    whole = b0 == 0 and b1 == loc.nbytes and start == 0 and tuple(ri.lengths) == tuple(loc.shape)
    dst = _subclass.own_bytes(target) if whole and target.dtype == dtype else None
    if dst is not None:
        if placed:  # every frame was decoded straight into place by the decoder threads
            return
        # fast path: the item is the whole stored chunk; copy frames straight into place
        pos = 0
        for p in parts:  # numpy copies release the GIL (a memoryview slice assignment holds it)
            n = len(p)
            np.copyto(dst[pos : pos + n], np.frombuffer(p, dtype=np.uint8))
            pos += n
        return
    total = sum(len(p) for p in parts)
    buf = bytearray(total)
    pos = 0
    for p in parts:
        buf[pos : pos + len(p)] = p
        pos += len(p)
    flat = torch.frombuffer(buf, dtype=torch.uint8).view(dtype)
    src = flat.as_strided(tuple(ri.lengths), contig_strides(loc.shape), (b0 - start) // dtype.itemsize)
    target.copy_(src)


__all__ = ["Placed", "apply", "batches", "placements", "contig_strides", "deliver", "destinations", "needed"]
