"""The contents of a version's DCP metadata object (docs/FORMAT.md, "DCP metadata object").

Format 3 (the current one): the line ``CKPTSTORE-DCPMETA 3\n``, the length of the pickle that
follows (8 bytes, little-endian), one pickle (protocol 5, read with the reader's allow-list
unpickler) of a dict of plain values, then the columns' bytes, in the order the dict names them::

    {"format": 3,
     "metadata": Metadata(...),  # DCP's, with storage_data=None and packed chunk lists emptied
     "names":    [str, ...],     # fqns, object names and dtypes, referred to by position
     "items":    int,            # storage_data entries
     "frames":   int,            # FrameRefs of all entries
     "chunks":   int,            # packed ChunkStorageMetadata
     "item_chunks": int,         # optional: the first tensors whose chunk lists are their items
     "columns":  {name: int}}    # bytes of each column (little-endian arrays, see COLUMNS)

The per-item locations (``MetadataIndex → ItemLocation(FrameRef, ...)``) and the chunk lists of
``TensorStorageMetadata`` are stored as columns of fixed-width integers instead of one pickled
object each, so writing and reading them costs a few vectorised passes, not hundreds of thousands
of pickled objects. The columns follow the pickle as raw bytes, so no pickler copies them and the
reader reads them where they lie. A sharded tensor's chunk list as DCP's planner makes it is its
items ordered by ``MetadataIndex.index``; such lists (the first ``item_chunks`` tensors) are not
stored twice: the reader takes them from the item columns (docs/FORMAT.md, "DCP metadata object").
:func:`unpack` rebuilds the same ``Metadata`` that format 1 held.

Format 2 (older ckptstore releases, still read): the line ``CKPTSTORE-DCPMETA 2\n`` and one
pickle of the same dict whose ``columns`` hold the bytes themselves. Format 1: a pickle of DCP
``Metadata`` whose ``storage_data`` maps ``MetadataIndex`` to ``ItemLocation``; still read.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import gc
import itertools
import operator
import pickle
import struct
from typing import Any, Callable

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from ..codec.frame import FrameRef
from ..errors import IntegrityError
from ._types import ItemLocation

MAGIC = b"CKPTSTORE-DCPMETA 3\n"
FORMAT = 3
#: format 2 (read, not written): the columns' bytes inside the pickle
MAGIC_2 = b"CKPTSTORE-DCPMETA 2\n"
#: format 3: the pickle's length after the magic line
_PICKLE_LEN = 8

# column name → (numpy dtype, what it counts: one value per item / frame / chunk, or a flat list)
COLUMNS: dict[str, tuple[str, str]] = {
    # one per storage_data entry, in the order of the dict
    "item.fqn": ("<i4", "items"),  # position in names of MetadataIndex.fqn
    "item.offset_ndim": ("<i2", "items"),  # len(MetadataIndex.offset), -1 for None
    "item.index": ("<i8", "items"),  # MetadataIndex.index, -1 for None
    "item.object": ("<i4", "items"),  # position in names of ItemLocation.object
    "item.nbytes": ("<i8", "items"),
    "item.dtype": ("<i4", "items"),  # position in names, -1 for None (bytes items)
    "item.shape_ndim": ("<i2", "items"),  # len(ItemLocation.shape), -1 for None
    "item.frames": ("<i8", "items"),  # number of FrameRefs
    "item.offsets": ("<i8", "flat"),  # all MetadataIndex.offset values, concatenated
    "item.shapes": ("<i8", "flat"),  # all ItemLocation.shape values, concatenated
    # one per FrameRef, items in order, each item's frames in order
    "frame.offset": ("<i8", "frames"),
    "frame.length": ("<i8", "frames"),
    "frame.raw_len": ("<i8", "frames"),
    "frame.xxh3": ("<u8", "frames"),
    "frame.index": ("<i8", "frames"),
    # packed TensorStorageMetadata.chunks: per tensor (those whose chunk lists are their items
    # first, then the others in state_dict_metadata order) its fqn and chunk count; offsets and
    # sizes of every chunk of the others (tensor ndim values each), concatenated
    "tensor.fqn": ("<i4", "tensors"),
    "tensor.chunks": ("<i8", "tensors"),
    "chunk.offsets": ("<i8", "flat"),
    "chunk.sizes": ("<i8", "flat"),
}

#: columns a writer may add (one value per item, in the same order); a reader that does not know
#: them ignores them. ``item.xxh128_lo``/``_hi``: the XXH3-128 of each item's raw bytes, low and high
#: 64 bits — written by incremental writers (docs/FORMAT.md, "References": the baseline of a save
#: that starts without one in memory comes from the store)
OPTIONAL_COLUMNS: dict[str, tuple[str, str]] = {
    "item.xxh128_lo": ("<u8", "items"),
    "item.xxh128_hi": ("<u8", "items"),
}

_G = operator.attrgetter


def _col(values, dtype: str, count: int | None = None) -> bytes:
    return np.fromiter(values, dtype=dtype, count=-1 if count is None else count).tobytes()


class _Names:
    """Strings stored once, referred to by position (``names`` of the header)."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def ids_of(self, strings: list) -> "map":
        ids = self.ids
        for x in dict.fromkeys(strings):  # unique values only: a short Python loop
            if x not in ids:
                ids[x] = len(ids)
        return map(ids.__getitem__, strings)

    @property
    def table(self) -> list[str]:
        return list(self.ids)


def _nd_and_flat(values: list) -> tuple[bytes, bytes]:
    """(lengths, concatenated values) of a list of int tuples or None (length -1)."""
    if None not in values:
        return _col(map(len, values), "<i2", len(values)), _col(itertools.chain.from_iterable(values), "<i8")
    return (_col((-1 if v is None else len(v) for v in values), "<i2", len(values)),
            _col(itertools.chain.from_iterable(v for v in values if v is not None), "<i8"))


def _only(values, cls: type) -> bool:
    return not values or set(map(type, values)) == {cls}


class ItemTable:
    """One rank's ``storage_data`` entries, packed: the ``item.*`` and ``frame.*`` columns of format 2
    (:data:`COLUMNS`) for ``items`` entries holding ``frames`` FrameRefs, with their own ``names``
    table. A rank returns one of these from ``write_data`` instead of one ``WriteResult`` per item,
    so DCP gathers, and the coordinator merges, a few byte strings per rank rather than hundreds of
    thousands of objects (:func:`pack` concatenates them).

    The names travel as one UTF-8 byte string and the byte offset where each ends (``<i8``), not as
    a tuple of strings: the coordinator tells which names a rank shares with the rank before it by
    comparing two byte strings (one ``memcmp``), and decodes only the names that differ. ``names``
    decodes them all on first use."""

    __slots__ = ("items", "frames", "columns", "_names", "_blob", "_ends")

    def __init__(self, names, items: int, frames: int, columns: dict) -> None:
        self.items = items
        self.frames = frames
        self.columns = columns
        self._names = tuple(names)
        self._blob = self._ends = None

    @property
    def names(self) -> tuple:
        if self._names is None:
            self._names = tuple(_decode_names(self._blob, self._ends, 0))
        return self._names

    def encoded(self) -> tuple[bytes, bytes]:
        """``(blob, ends)``: the names as UTF-8 bytes one after the other, and each one's end offset
        (``<i8``). Raises ``TypeError`` when a name is not a string."""
        if self._blob is None:
            if not _only(self._names, str):
                raise TypeError("an item table's names are not strings")
            raw = [x.encode("utf-8", "surrogatepass") for x in self._names]
            self._blob = b"".join(raw)
            self._ends = _col(itertools.accumulate(map(len, raw)), "<i8", len(raw))
        return self._blob, self._ends

    def __reduce__(self):
        return (_table_of_blob, (*self.encoded(), self.items, self.frames, self.columns))

    def __eq__(self, other) -> bool:
        return (type(other) is ItemTable and (self.items, self.frames, self.columns) == (other.items, other.frames, other.columns)
                and self.encoded() == other.encoded())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ItemTable({self.items} items, {self.frames} frames, {len(self.names)} names)"


def _table_of_blob(blob: bytes, ends: bytes, items: int, frames: int, columns: dict) -> ItemTable:
    """An :class:`ItemTable` as it arrives from another rank: its names encoded, decoded on use."""
    t = ItemTable.__new__(ItemTable)
    t.items, t.frames, t.columns = items, frames, columns
    t._names, t._blob, t._ends = None, blob, ends
    return t


def _decode_names(blob, ends: bytes, start: int) -> list:
    """Names ``start ..`` of an encoded table (:meth:`ItemTable.encoded`); ``TypeError`` when the
    ends are not whole, not in order within ``blob`` or a name is not UTF-8."""
    if type(blob) is not bytes or type(ends) is not bytes or len(ends) % 8:
        raise TypeError("an item table's names are not strings")
    count = len(ends) // 8
    if (int.from_bytes(ends[-8:], "little", signed=True) if count else 0) != len(blob):
        raise TypeError("an item table's names do not fill its name bytes")
    lo = int.from_bytes(ends[8 * start - 8 : 8 * start], "little", signed=True) if start else 0
    if not 0 <= lo <= len(blob):
        raise TypeError("an item table's name ends are not in order")
    tail = struct.unpack_from(f"<{count - start}q", ends, 8 * start) if start < count else ()
    out = []
    for hi in tail:
        if hi < lo:
            raise TypeError("an item table's name ends are not in order")
        try:
            out.append(blob[lo:hi].decode("utf-8", "surrogatepass"))
        except UnicodeDecodeError:
            raise TypeError("an item table's names are not strings") from None
        lo = hi
    return out


# the order the columns are pickled in (as before item tables existed): the metadata object is
# compressed in 2 MiB frames, and this order measured 0.46 MB against 0.65 MB for COLUMNS' order on
# the 1,024-rank commit of benchmarks/README.md
_TABLE_COLUMNS = ("item.fqn", "item.offset_ndim", "item.offsets", "item.index", "item.object", "item.nbytes",
                  "item.dtype", "item.shape_ndim", "item.shapes", "item.frames",
                  "frame.offset", "frame.length", "frame.raw_len", "frame.xxh3", "frame.index")
assert set(_TABLE_COLUMNS) == {k for k in COLUMNS if k.startswith(("item.", "frame."))}


def pack_items(idx: list, locs: list, digests: list | None = None) -> ItemTable:
    """The :class:`ItemTable` of ``MetadataIndex`` keys ``idx`` and their ``ItemLocation`` ``locs``
    (same length, in order), with ``digests`` (the XXH3-128 of each item's raw bytes, ints) as the
    optional ``item.xxh128_*`` columns. Raises ``TypeError`` for anything else."""
    n = len(locs)
    if len(idx) != n or not (_only(locs, ItemLocation) and _only(idx, MetadataIndex)):
        raise TypeError("storage_data must map MetadataIndex to ItemLocation")
    names = _Names()
    cols: dict[str, bytes] = {}
    cols["item.fqn"] = _col(names.ids_of(list(map(_G("fqn"), idx))), "<i4", n)
    cols["item.offset_ndim"], cols["item.offsets"] = _nd_and_flat(list(map(_G("offset"), idx)))
    index = list(map(_G("index"), idx))
    cols["item.index"] = _col(index if None not in index else (-1 if i is None else i for i in index), "<i8", n)
    cols["item.object"] = _col(names.ids_of(list(map(_G("object"), locs))), "<i4", n)
    cols["item.nbytes"] = _col(map(_G("nbytes"), locs), "<i8", n)
    dts = list(map(_G("dtype"), locs))
    if None not in dts:
        cols["item.dtype"] = _col(names.ids_of(dts), "<i4", n)
    else:
        it = names.ids_of([d for d in dts if d is not None])
        cols["item.dtype"] = _col((-1 if d is None else next(it) for d in dts), "<i4", n)
    cols["item.shape_ndim"], cols["item.shapes"] = _nd_and_flat(list(map(_G("shape"), locs)))
    frame_lists = list(map(_G("frames"), locs))
    cols["item.frames"] = _col(map(len, frame_lists), "<i8", n)
    frames = list(itertools.chain.from_iterable(frame_lists))
    if not _only(frames, FrameRef):
        raise TypeError("ItemLocation.frames must hold FrameRef")
    nf = len(frames)
    for field in ("offset", "length", "raw_len", "xxh3", "index"):
        cols["frame." + field] = _col(map(_G(field), frames), COLUMNS["frame." + field][0], nf)
    if digests is not None:
        if len(digests) != n:
            raise TypeError("one digest per item")
        mask = (1 << 64) - 1
        cols["item.xxh128_lo"] = _col((d & mask for d in digests), "<u8", n)
        cols["item.xxh128_hi"] = _col((d >> 64 for d in digests), "<u8", n)
    t = ItemTable(names.table, n, nf, cols)
    t.encoded()  # on the rank, which packs its table in parallel with the others (not on the coordinator)
    return t


_ID_COLUMNS = ("item.fqn", "item.object", "item.dtype")
#: columns joined once when the tables are merged (the checks and the chunk lists read them whole);
#: the others (offsets and shapes too: the chunk-list check reads its few rows from the pieces) stay
#: the ranks' pieces until framing cuts them into frames
_JOINED = frozenset(_ID_COLUMNS + ("item.index", "item.offset_ndim", "item.shape_ndim"))
_ITEMSIZE = {k: np.dtype(dt).itemsize for k, (dt, _per) in COLUMNS.items()}


def _common_prefix(blob: bytes, ends: bytes, pblob: bytes, pends: bytes, guess: int = -1) -> int:
    """How many leading names two encoded tables (:meth:`ItemTable.encoded`) share: their first j
    names are equal when their first j ends and the bytes up to the j-th end are (two C-level byte
    compares; the ranks' tables usually differ only in their last names, their object and dtype).
    ``guess`` (the answer for the tables before, usually the answer again) is tried first."""
    p = min(len(ends), len(pends)) // 8

    def same(j: int) -> bool:
        if not j:
            return True
        if not pends.startswith(ends[: 8 * j]):
            return False
        end = int.from_bytes(ends[8 * j - 8 : 8 * j], "little", signed=True)
        return 0 <= end <= len(blob) and pblob.startswith(blob[:end])

    if 0 <= guess <= p and same(guess) and (guess == p or not same(guess + 1)):
        return guess
    j = max(0, p - 4)
    if same(j):
        while j < p and same(j + 1):
            j += 1
        return j
    lo, hi = 0, j  # same(lo), not same(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if same(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _merge_tables(tables: list, names: _Names) -> tuple[dict[str, list], int, int]:
    """The columns of ``tables`` (in order) as one set of item/frame columns whose name positions
    refer to ``names``; returns (columns, items, frames), each column a list of buffers (pieces) to
    be read one after the other (:func:`_joined` makes one buffer). Raises ``TypeError`` when a
    table is not an :class:`ItemTable` with whole columns of the right lengths.

    The columns the checks and the chunk lists read whole (:data:`_JOINED`) are the ranks' pieces
    joined once; the others (the offsets and shapes too: :class:`_ItemChunks` reads the few it
    checks from the pieces) stay the ranks' pieces, cut into frames when written (no copy of them
    into one fresh buffer: on a VM, first-touched memory costs about 1 s per GB); the name columns
    are remapped in one vectorised lookup each. The work per table is a few length checks and the
    names it does not share with the table before it."""
    # every check is one pass per column over all tables (C-level map), not a Python loop per
    # table and column
    if not _only(tables, ItemTable):
        raise TypeError("a rank's item table is not an ItemTable")
    counts = list(map(_G("items"), tables))  # items per table
    fcounts = list(map(_G("frames"), tables))
    if not (_only(counts, int) and _only(fcounts, int)) or (tables and (min(counts) < 0 or min(fcounts) < 0)):
        raise TypeError("a rank's item table has no whole item and frame counts")
    tcols = list(map(_G("columns"), tables))
    if not _only(tcols, dict):
        raise TypeError("a rank's item table is not an ItemTable")
    nt = len(tables)
    items_a = np.asarray(counts, np.int64)
    frames_a = np.asarray(fcounts, np.int64)
    raws: dict[str, list] = {}
    for k in _TABLE_COLUMNS:
        col = list(map(operator.methodcaller("get", k), tcols))
        size = _ITEMSIZE[k]
        per = COLUMNS[k][1]
        if not _only(col, bytes):
            raise TypeError(f"item table column {k} is missing or not whole values")
        lens = np.fromiter(map(len, col), np.int64, nt)
        if (lens % size).any():
            raise TypeError(f"item table column {k} is missing or not whole values")
        want = items_a if per == "items" else frames_a if per == "frames" else None
        if want is not None and (lens != want * size).any():
            i = int(np.flatnonzero(lens != want * size)[0])
            raise TypeError(f"item table column {k} has {int(lens[i]) // size} values")
        raws[k] = [b"".join(col)] if k in _JOINED else col
    n_names: list[int] = []  # names per table
    remaps: list = []  # per table: the position in ``names`` of each of its names
    prev: tuple = (b"", b"")
    prev_map = np.empty(0, "<i4")
    ids = names.ids
    j = -1
    for t in tables:
        blob, ends = t.encoded()
        j = _common_prefix(blob, ends, *prev, j)
        tail = [ids.setdefault(x, len(ids)) for x in _decode_names(blob, ends, j)]
        m = np.concatenate((prev_map[:j], np.asarray(tail, "<i4"))) if tail else prev_map[:j]
        remaps.append(m)
        prev, prev_map = (blob, ends), m
        n_names.append(len(ends) // 8)
    n = int(items_a.sum())
    nf = int(frames_a.sum())
    cols: dict[str, list] = dict(raws)
    if n:
        # checked per table (its largest and smallest position against its names), then remapped in
        # one gather: a table's positions shifted by where its names start in the concatenated remaps,
        # through one scratch index array (intp: what take reads without a converted copy) for the
        # three columns, so each column touches one fresh array, its result
        has = items_a > 0
        starts = (np.cumsum(items_a) - items_a)[has]
        limit = np.asarray(n_names, np.int64)[has]
        n_names_a = np.asarray(n_names, np.intp)
        shift = np.repeat(np.cumsum(n_names_a) - n_names_a, counts)
        remap_all = np.concatenate(remaps) if remaps else np.empty(0, "<i4")
        idx = np.empty(n, np.intp)
        for k in _ID_COLUMNS:
            local = np.frombuffer(cols[k][0], "<i4")
            lo = -1 if k == "item.dtype" else 0
            if (np.maximum.reduceat(local, starts) >= limit).any() or (np.minimum.reduceat(local, starts) < lo).any():
                raise TypeError(f"item table column {k} refers to a name that does not exist")
            none = local < 0 if lo < 0 else None
            if none is not None:
                np.maximum(local, 0, out=idx)
                np.add(idx, shift, out=idx)
            else:
                np.add(local, shift, out=idx)
            g = np.take(remap_all, idx)
            if none is not None and none.any():
                g[none] = -1
            cols[k] = [_bytes_of(g.astype("<i4", copy=False))]
    for k, (dt, _per) in OPTIONAL_COLUMNS.items():  # kept only when every table has it
        opt = [t.columns.get(k) for t in tables]
        if tables and all(type(r) is bytes and len(r) == t.items * np.dtype(dt).itemsize for r, t in zip(opt, tables)):
            cols[k] = opt
    return cols, n, nf


class _LazyColumns(collections.abc.Mapping):
    """Item columns given as lists of pieces (:func:`_merge_tables`), each joined into one numpy
    array on first use only (``pieces``: the lists themselves)."""

    def __init__(self, pieces: dict) -> None:
        self.pieces = pieces
        self._arrays: dict = {}

    def __getitem__(self, k: str) -> np.ndarray:
        a = self._arrays.get(k)
        if a is None:
            a = self._arrays[k] = np.frombuffer(_joined(self.pieces[k]), COLUMNS[k][0])
        return a

    def __iter__(self):
        return iter(self.pieces)

    def __len__(self) -> int:
        return len(self.pieces)


def _bytes_of(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without a copy."""
    return memoryview(np.ascontiguousarray(a)).cast("B")


def _joined(pieces: list):
    """One buffer holding ``pieces`` one after the other (the piece itself when there is one)."""
    if len(pieces) == 1:
        return pieces[0]
    return b"".join(pieces)


def _nbytes(pieces: list) -> int:
    return sum(map(len, pieces))  # pieces are bytes or byte-format memoryviews: len is the byte count


#: chunks of one tensor checked against DCP's own objects when its chunk list is taken from the
#: item columns (:func:`_chunks_from_items`): the first, the last and this many spread between
_CHUNK_SAMPLES = 32


def _chunks_from_objects(tm, nd: int):
    """``(offsets, sizes)`` flat int64 arrays of the chunk list of ``tm`` read from DCP's objects,
    or None when it is not a list of plain ``ChunkStorageMetadata`` of ``nd`` dimensions."""
    if not _only(tm.chunks, ChunkStorageMetadata):
        return None
    offs = list(map(_G("offsets"), tm.chunks))
    sizes = list(map(_G("sizes"), tm.chunks))
    if set(map(len, offs)) != {nd} or set(map(len, sizes)) != {nd}:
        return None
    flat = itertools.chain.from_iterable
    return np.fromiter(flat(offs), "<i8", len(offs) * nd), np.fromiter(flat(sizes), "<i8", len(sizes) * nd)


class _ItemChunks:
    """The chunk lists DCP's default planner builds, found in the item columns instead of in
    millions of ``ChunkStorageMetadata`` objects: DCP appends one chunk per write item of a tensor
    and gives the item's ``MetadataIndex`` the chunk's position (``index``), its ``offset`` the
    chunk's offsets; the item's stored ``shape`` is the chunk's sizes. A tensor's chunk list is
    then *its items ordered by index* (docs/FORMAT.md, "DCP metadata object": ``item_chunks``).

    ``a``: the item columns as numpy arrays. Two ways to find a tensor's items, both vectorised:
    with ``counts`` (items per rank table) all equal and every rank's table listing the same names
    in the same order with offsets and shapes of one length (an FSDP/TP save: every rank holds a
    shard of every tensor), a tensor's items are a column of the items viewed as ranks × items;
    otherwise the items are sorted by name once (stable) and a tensor's items are its run."""

    def __init__(self, a: dict, n: int, counts: list | None = None) -> None:
        self.a = a
        self.n = n
        self.col_of: dict[int, int] | None = None  # the rank-grid layout: tensor name -> its column
        self.sorted = False
        self._grid(counts or [])

    def _grid(self, counts: list) -> None:
        a, n = self.a, self.n
        k = counts[0] if counts else 0
        ranks = len(counts)
        if not (k and n == ranks * k and min(counts) == max(counts)):
            return
        on, sn = a["item.offset_ndim"], a["item.shape_ndim"]
        nd = int(on[0])
        if nd < 0 or not ((on == nd).all() and (sn == nd).all()):
            return
        fq = a["item.fqn"].reshape(ranks, k)
        first = fq[0].tolist()
        if len(set(first)) != k or not (fq == fq[0]).all():
            return
        self.nd = nd
        self.k = k
        self.ranks = ranks
        self.col_of = dict(zip(first, range(k)))
        self.index_g = a["item.index"].reshape(ranks, k)  # a view: a tensor's indexes are a strided column
        self.want = np.arange(ranks, dtype=np.int64)
        # with the columns still in the ranks' pieces, each rank's offsets and shapes are k x nd values
        # of its own piece: the few rows :meth:`matches` checks are read from there (no join)
        self.by_rank: dict | None = None
        pieces = getattr(a, "pieces", None)
        if pieces is not None and all(
            len(pieces[c]) == ranks and set(map(len, pieces[c])) == {k * nd * _ITEMSIZE[c]} for c in ("item.offsets", "item.shapes")
        ):
            self.by_rank = {}

    def _sort(self) -> None:
        a, n = self.a, self.n
        fq = a["item.fqn"]
        key = fq.astype(np.uint16) if n and int(fq.max()) < 65536 else fq  # radix sort for up to 65,536 names
        self.order = np.argsort(key, kind="stable")
        # each name's first position in the sorted items, for every name at once (not two binary
        # searches per tensor): items of name f are order[bounds[f]:bounds[f + 1]]
        self.bounds = np.searchsorted(fq[self.order], np.arange(int(fq.max()) + 2 if n else 1), "left")
        on = np.maximum(a["item.offset_ndim"], 0).astype(np.int64)
        sn = np.maximum(a["item.shape_ndim"], 0).astype(np.int64)
        self.ostart = np.cumsum(on) - on
        self.sstart = np.cumsum(sn) - sn
        self.sorted = True

    def positions(self, fid: int, count: int, nd: int):
        """``(item positions, offsets starts, shapes starts)`` of the chunk list of tensor ``fid``
        (``count`` chunks of ``nd`` dimensions) in chunk order, when its items are one per index
        ``0 .. count - 1``, each with ``nd`` offsets and ``nd`` sizes; else None."""
        p = self.col_of.get(fid) if self.col_of is not None else None
        if p is not None and count == self.ranks and nd == self.nd and np.array_equal(self.index_g[:, p], self.want):
            pos = self.want * self.k + p
            return pos, pos * nd, pos * nd, p  # every item has nd offsets and nd sizes; chunk r is rank r's item p
        if not self.sorted:
            self._sort()
        a = self.a
        if fid < 0 or fid + 1 >= len(self.bounds):
            return None
        lo, hi = int(self.bounds[fid]), int(self.bounds[fid + 1])
        if hi - lo != count:
            return None
        pos = self.order[lo:hi]
        idx = a["item.index"][pos]
        want = np.arange(count, dtype=np.int64)
        if not np.array_equal(idx, want):
            perm = np.argsort(idx, kind="stable")
            if not np.array_equal(idx[perm], want):
                return None
            pos = pos[perm]
        if not (np.all(a["item.offset_ndim"][pos] == nd) and np.all(a["item.shape_ndim"][pos] == nd)):
            return None
        return pos, self.ostart[pos], self.sstart[pos], None

    def values(self, got, nd: int, rows=None) -> tuple[np.ndarray, np.ndarray]:
        """Flat ``(offsets, sizes)`` of the chunks :meth:`positions` found (``rows``: only those chunks)."""
        _pos, o, s, p = got
        if p is not None and rows is not None and self.by_rank is not None:
            return self._from_pieces(p, rows)
        if rows is not None:
            o, s = o[rows], s[rows]
        cols = np.arange(nd, dtype=np.int64)
        return (self.a["item.offsets"][(o[:, None] + cols).ravel()], self.a["item.shapes"][(s[:, None] + cols).ravel()])

    def _from_pieces(self, p: int, rows) -> tuple[np.ndarray, np.ndarray]:
        """Flat ``(offsets, sizes)`` of item ``p`` of the ranks ``rows`` (the rank-grid layout), read
        from each rank's own piece of the offsets and shapes columns (``k x nd`` values each)."""
        got = []
        for c in ("item.offsets", "item.shapes"):
            vals = []
            for r in rows.tolist():
                t = self.by_rank.get((c, r))
                if t is None:
                    t = self.by_rank[(c, r)] = np.frombuffer(self.a.pieces[c][r], COLUMNS[c][0]).reshape(self.k, self.nd)
                vals.append(t[p])
            got.append(np.concatenate(vals) if vals else np.empty(0, np.int64))
        return got[0], got[1]

    def matches(self, got, nd: int, tm) -> bool:
        """Whether DCP's own chunk list ``tm.chunks`` is the one found: checked on its first, last and
        :data:`_CHUNK_SAMPLES` chunks spread between."""
        count = len(got[0])
        step = max(1, count // _CHUNK_SAMPLES)
        rows = np.asarray(sorted({0, count - 1, *range(0, count, step)}), np.int64)
        offs, sizes = (x.reshape(len(rows), nd).tolist() for x in self.values(got, nd, rows))
        for s, o, z in zip(rows.tolist(), offs, sizes):
            c = tm.chunks[s]
            if type(c) is not ChunkStorageMetadata or tuple(c.offsets) != tuple(o) or tuple(c.sizes) != tuple(z):
                return False
        return True


def _pack_chunks(md: Metadata, cols: dict, n: int, names: _Names, counts: list) -> tuple[dict, dict, int]:
    """The ``tensor.*`` and ``chunk.*`` columns of ``md``, its ``state_dict_metadata`` with the
    packed chunk lists emptied, and ``item_chunks``. A tensor whose chunk list is its items ordered
    by index (:class:`_ItemChunks`) is listed first and stores no chunk values (the reader takes
    them from the item columns); the others' chunks are read from their objects; a chunk list
    neither way describes stays in the pickled metadata as it is."""
    skeleton_sdm: dict[str, Any] = {}
    from_items: list[tuple[str, int]] = []
    t_fqn: list[str] = []
    t_count: list[int] = []
    c_off: list = []
    c_size: list = []
    by_items = None
    for fqn, tm in md.state_dict_metadata.items():
        if type(tm) is TensorStorageMetadata and tm.chunks:
            nd = len(tm.size)
            fid = names.ids.get(fqn)
            if fid is not None:
                if by_items is None:
                    by_items = _ItemChunks(_LazyColumns({k: cols[k] for k in _CHUNK_COLUMNS}), n, counts)
                got = by_items.positions(fid, len(tm.chunks), nd)
                if got is not None and by_items.matches(got, nd, tm):
                    from_items.append((fqn, len(tm.chunks)))
                    skeleton_sdm[fqn] = TensorStorageMetadata(tm.properties, tm.size, [])
                    continue
            got = _chunks_from_objects(tm, nd)
            if got is not None:
                t_fqn.append(fqn)
                t_count.append(len(tm.chunks))
                c_off.append(got[0])
                c_size.append(got[1])
                tm = TensorStorageMetadata(tm.properties, tm.size, [])
        skeleton_sdm[fqn] = tm
    t_fqn = [f for f, _c in from_items] + t_fqn
    t_count = [c for _f, c in from_items] + t_count
    out = {"tensor.fqn": [_col(names.ids_of(t_fqn), "<i4", len(t_fqn))], "tensor.chunks": [_col(t_count, "<i8", len(t_count))],
           "chunk.offsets": [_bytes_of(x.astype("<i8", copy=False)) for x in c_off] or [b""],
           "chunk.sizes": [_bytes_of(x.astype("<i8", copy=False)) for x in c_size] or [b""]}
    return out, skeleton_sdm, len(from_items)


#: the item columns :class:`_ItemChunks` reads
_CHUNK_COLUMNS = ("item.fqn", "item.index", "item.offset_ndim", "item.offsets", "item.shape_ndim", "item.shapes")


def pack_head(md: Metadata, tables: list | None = None) -> dict:
    """The header of ``md`` (see the module docstring) with each column as a list of buffers
    (:func:`dump` writes it).

    The items come from ``tables`` (the ranks' :class:`ItemTable`, concatenated in order) or, when
    it is None, from ``md.storage_data`` (mapping ``MetadataIndex`` to ``ItemLocation``). ``md`` is
    not modified. Raises ``TypeError`` when the items are anything else.
    """
    if tables is None and isinstance(md.storage_data, ItemTables):  # the Metadata dcp.save returned
        tables = md.storage_data._tables
    if tables is None:
        sd = md.storage_data if md.storage_data is not None else {}
        if not isinstance(sd, dict):
            raise TypeError("storage_data must map MetadataIndex to ItemLocation")
        tables = [pack_items(list(sd.keys()), list(sd.values()))]
    names = _Names()
    cols, n, nf = _merge_tables(tables, names)
    chunk_cols, skeleton_sdm, item_chunks = _pack_chunks(md, cols, n, names, [t.items for t in tables])
    cols.update(chunk_cols)
    skeleton = dataclasses.replace(md, state_dict_metadata=skeleton_sdm, storage_data=None)
    return {
        "format": FORMAT,
        "metadata": skeleton,
        "names": names.table,
        "items": n,
        "frames": nf,
        "chunks": int(np.frombuffer(_joined(chunk_cols["tensor.chunks"]), "<i8").sum()),
        "item_chunks": item_chunks,
        "columns": cols,
    }


def dump(head: dict) -> list:
    """The bytes of a format 3 metadata object for ``head`` (:func:`pack_head`) as a list of
    buffers to be written one after the other: first the magic line, the pickle's length and the
    pickle (the header, each column replaced by its byte count), then every column's pieces as they
    are (no copy)."""
    cols = head["columns"]
    p = pickle.dumps({**head, "columns": {k: _nbytes(v) for k, v in cols.items()}}, protocol=5)
    return [MAGIC + len(p).to_bytes(_PICKLE_LEN, "little") + p, *itertools.chain.from_iterable(cols.values())]


def pack(md: Metadata, tables: list | None = None) -> bytes:
    """Format 3 bytes of ``md`` (:func:`pack_head`, then :func:`dump`), joined."""
    return b"".join(dump(pack_head(md, tables)))


def pickled_part(blob: bytes | memoryview) -> memoryview:
    """The bytes of ``blob`` that are a pickle (all of it for format 1; for format 3 the header,
    also when ``blob`` is only the first part :func:`dump` returns). Raises ``ValueError`` when a
    format 3 pickle length points past the end."""
    mv = memoryview(blob).cast("B")
    if bytes(mv[: len(MAGIC)]) == MAGIC:
        start, end = _header_span(mv)
        return mv[start:end]
    if bytes(mv[: len(MAGIC_2)]) == MAGIC_2:
        return mv[len(MAGIC_2):]
    return mv


def _header_span(mv: memoryview) -> tuple[int, int]:
    """Where a format 3 object's header pickle starts and ends in ``mv``; ``ValueError`` when its
    length field is cut off or points past the end."""
    start = len(MAGIC) + _PICKLE_LEN
    end = start + int.from_bytes(mv[len(MAGIC) : start], "little")
    if len(mv) < start or end > len(mv):
        raise ValueError("the header pickle's length points past the end of the object")
    return start, end


def unpack(blob: bytes | memoryview, loads: Callable[[memoryview], Any], what: str, digests: list | None = None) -> Any:
    """The DCP ``Metadata`` held by a *verified* metadata object's bytes (format 1, 2 or 3).

    ``loads`` is the allow-list unpickler. Raises :class:`IntegrityError` when a format 2 or 3
    object is inconsistent (wrong types, column lengths that do not add up, names out of range). With
    ``digests`` (a list), the items' XXH3-128 (``item.xxh128_*``, in ``storage_data`` order) are
    appended to it when the object has them.
    """
    mv = memoryview(blob).cast("B")
    magic = bytes(mv[: len(MAGIC)])
    if magic not in (MAGIC, MAGIC_2):
        return loads(mv)
    try:
        head = loads(pickled_part(mv))
        if magic == MAGIC:
            head = _with_columns(head, mv)
    except ValueError as e:
        raise IntegrityError(f"{what}: malformed DCP metadata object ({e})", object=what) from None
    paused = gc.isenabled()
    gc.disable()  # hundreds of thousands of new objects, no cycles: skip the collector's passes
    try:
        md = _rebuild(head, FORMAT if magic == MAGIC else 2)
        if digests is not None:
            digests.extend(_digests(head))
        return md
    except IntegrityError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
        raise IntegrityError(f"{what}: malformed DCP metadata tables ({type(e).__name__}: {e})", object=what) from None
    finally:
        if paused:
            gc.enable()


def _with_columns(head: Any, mv: memoryview) -> dict:
    """A format 3 ``head`` with its columns (byte counts) replaced by the bytes that follow the
    pickle in ``mv`` (memoryviews, no copy); they must fill the object exactly."""
    if type(head) is not dict or type(head.get("columns")) is not dict:
        _bad("not a format 3 header")
    pos = _header_span(mv)[1]
    cols = {}
    for name, nb in head["columns"].items():
        if type(name) is not str or type(nb) is not int or nb < 0 or pos + nb > len(mv):
            _bad(f"column {name!r}: byte count {nb!r} does not fit the object")
        cols[name] = mv[pos : pos + nb]
        pos += nb
    if pos != len(mv):
        _bad(f"{len(mv) - pos} bytes after the last column")
    return {**head, "columns": cols}


def _bad(msg: str):
    raise ValueError(msg)


def _is_bytes(x) -> bool:
    return type(x) is bytes or type(x) is memoryview


def _digests(head: dict) -> list:
    """The items' XXH3-128 from the optional ``item.xxh128_*`` columns (``[]`` when absent)."""
    cols, n = head["columns"], head["items"]
    lo, hi = cols.get("item.xxh128_lo"), cols.get("item.xxh128_hi")
    if not (_is_bytes(lo) and _is_bytes(hi)) or len(lo) != 8 * n or len(hi) != 8 * n:
        return []
    return [(h << 64) | low for low, h in zip(np.frombuffer(lo, "<u8").tolist(), np.frombuffer(hi, "<u8").tolist())]


def _rebuild(head: Any, fmt: int) -> Metadata:
    if type(head) is not dict or head.get("format") != fmt:
        _bad(f"not a format {fmt} header")
    md = head["metadata"]
    names = head["names"]
    cols = head["columns"]
    n, nf, nc = head["items"], head["frames"], head["chunks"]
    if not isinstance(md, Metadata) or type(names) is not list or type(cols) is not dict:
        _bad("wrong types in the header")
    if not all(type(s) is str for s in names) or not all(type(x) is int and x >= 0 for x in (n, nf, nc)):
        _bad("wrong types in the header")
    a: dict[str, np.ndarray] = {}
    for name, (dt, _per) in COLUMNS.items():
        raw = cols.get(name)
        if not _is_bytes(raw) or len(raw) % np.dtype(dt).itemsize:
            _bad(f"column {name} is missing or not whole values")
        a[name] = np.frombuffer(raw, dtype=dt)
    nt = len(a["tensor.fqn"])
    for name, (_dt, per) in COLUMNS.items():
        want = {"items": n, "frames": nf, "tensors": nt}.get(per)
        if want is not None and len(a[name]) != want:
            _bad(f"column {name} has {len(a[name])} values, expected {want}")
    for name in ("item.fqn", "item.object", "item.dtype", "tensor.fqn"):
        col = a[name]
        if len(col) and (col.max() >= len(names) or col.min() < (-1 if name == "item.dtype" else 0)):
            _bad(f"column {name} refers to a name that does not exist")
    for name in ("item.offset_ndim", "item.shape_ndim"):
        if len(a[name]) and a[name].min() < -1:
            _bad(f"column {name} has a negative length")
    if int(a["item.frames"].sum()) != nf or (n and a["item.frames"].min() < 0):
        _bad("frame counts do not add up")
    if int(np.maximum(a["item.offset_ndim"], 0).sum()) != len(a["item.offsets"]):
        _bad("item offsets do not add up")
    if int(np.maximum(a["item.shape_ndim"], 0).sum()) != len(a["item.shapes"]):
        _bad("item shapes do not add up")
    if int(a["tensor.chunks"].sum()) != nc or (nt and a["tensor.chunks"].min() < 0):
        _bad("chunk counts do not add up")

    # chunk lists: the first ``item_chunks`` tensors' are their items ordered by index, the
    # others' are in the chunk.* columns
    sdm = md.state_dict_metadata
    if not isinstance(sdm, dict):
        _bad("state_dict_metadata is not a dict")
    m = head.get("item_chunks", 0)
    if type(m) is not int or not 0 <= m <= nt:
        _bad(f"item_chunks {m!r} is not a number of tensors")
    c_off = a["chunk.offsets"].tolist()
    c_size = a["chunk.sizes"].tolist()
    pos = 0
    Size = torch.Size
    CSM = ChunkStorageMetadata
    by_items = _ItemChunks(a, n) if m else None
    for t, (fid, count) in enumerate(zip(a["tensor.fqn"].tolist(), a["tensor.chunks"].tolist())):
        tm = sdm.get(names[fid])
        if not isinstance(tm, TensorStorageMetadata) or tm.chunks:
            _bad(f"packed chunks for {names[fid]!r}, which is not a tensor with an empty chunk list")
        nd = len(tm.size)
        if t < m:
            got = by_items.positions(fid, count, nd)
            if got is None:
                _bad(f"the items of {names[fid]!r} are not its {count} chunks")
            offs, sizes = (x.tolist() for x in by_items.values(got, nd))
            lo, end = 0, count * nd
        else:
            offs, sizes, lo, end = c_off, c_size, pos, pos + count * nd
            if end > len(c_off) or end > len(c_size):
                _bad("chunk offsets do not add up")
            pos = end
        tm.chunks = [CSM(Size(offs[i : i + nd]), Size(sizes[i : i + nd])) for i in range(lo, end, nd)] if nd else [
            CSM(Size(()), Size(())) for _ in range(count)]
    if pos != len(c_off) or pos != len(c_size):
        _bad("chunk offsets do not add up")

    md.storage_data = _storage_data(a, names, n)
    return md


def _storage_data(a: dict, names: list, n: int) -> dict:
    """``MetadataIndex → ItemLocation`` from checked item/frame columns ``a`` (numpy arrays)."""
    fqns = [names[i] for i in a["item.fqn"].tolist()]
    objs = [names[i] for i in a["item.object"].tolist()]
    dtypes = [None if i < 0 else names[i] for i in a["item.dtype"].tolist()]
    index = [None if i < 0 else i for i in a["item.index"].tolist()]
    offsets = _split_flat(a["item.offset_ndim"].tolist(), a["item.offsets"].tolist())
    shapes = _split_flat(a["item.shape_ndim"].tolist(), a["item.shapes"].tolist())
    frames = list(map(FrameRef, a["frame.offset"].tolist(), a["frame.length"].tolist(), a["frame.raw_len"].tolist(),
                      a["frame.xxh3"].tolist(), a["frame.index"].tolist()))
    ends = np.cumsum(a["item.frames"]).tolist()
    nbytes = a["item.nbytes"].tolist()
    sd: dict = {}
    start = 0
    for k in range(n):
        end = ends[k]
        sd[MetadataIndex(fqns[k], offsets[k], index[k])] = ItemLocation(
            objs[k], tuple(frames[start:end]), nbytes[k], dtypes[k], shapes[k])
        start = end
    return sd


class ItemTables(collections.abc.Mapping):
    """``Metadata.storage_data`` as ``dcp.save`` returns it: a read-only mapping ``MetadataIndex →
    ItemLocation`` over the ranks' :class:`ItemTable` objects, unpacked into a dict on first use
    only. It pickles as the packed tables, so DCP's broadcast of the returned ``Metadata`` to every
    rank carries a few byte strings per rank, not one object per item."""

    def __init__(self, tables: list) -> None:
        self._tables = list(tables)
        self._d: dict | None = None

    def _dict(self) -> dict:
        if self._d is None:
            names = _Names()
            cols, n, _nf = _merge_tables(self._tables, names)
            a = {k: np.frombuffer(_joined(v), dtype=COLUMNS[k][0]) for k, v in cols.items() if k in COLUMNS}
            self._d = _storage_data(a, names.table, n)
        return self._d

    def __getitem__(self, key):
        return self._dict()[key]

    def __iter__(self):
        return iter(self._dict())

    def __len__(self) -> int:
        return sum(t.items for t in self._tables) if self._d is None else len(self._d)

    def __reduce__(self):
        return (ItemTables, (self._tables,))

    def __repr__(self) -> str:
        return f"ItemTables({len(self)} items from {len(self._tables)} ranks)"


def _split_flat(ndims: list[int], flat: list[int]) -> list:
    out: list = []
    pos = 0
    for nd in ndims:
        if nd < 0:
            out.append(None)
        else:
            out.append(tuple(flat[pos : pos + nd]))
            pos += nd
    return out


__all__ = ["MAGIC", "MAGIC_2", "FORMAT", "OPTIONAL_COLUMNS", "ItemTable", "ItemTables", "dump", "pack", "pack_head",
           "pack_items", "unpack", "pickled_part"]
