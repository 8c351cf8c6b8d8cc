"""The DCP metadata object in format 3 (pickled skeleton, then the packed columns as raw bytes),
formats 2 (the columns inside the pickle) and 1 still read, and the allow-list guarding everything unpickled (docs/FORMAT.md, "DCP metadata object")."""

from __future__ import annotations

import io
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore.dcp import _metadata
from ckptstore.manifest import catalogue
from ckptstore.tiers import LocalTier

from helpers import bits_equal, failures, forge_metadata


def _state():
    torch.manual_seed(3)
    return {
        "w": torch.randn(3000, 7),
        "half": torch.randn(1 << 16).bfloat16(),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "ints": torch.arange(100, dtype=torch.int32),
        "extra": {"epoch": 3, "tags": ["a", "b"], "blob": b"\x00\x01"},
    }


def _blank(sd):
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"epoch": 0, "tags": ["", ""], "blob": b""}
            for k, v in sd.items()}


def _metadata_bytes(root, version):
    """The decoded bytes of ``version``'s metadata object (unencrypted store)."""
    tier = LocalTier(root)
    m = catalogue.read_manifest(tier, version).manifest
    r = ckptstore.StorageReader(root)
    r.reset(version)
    r.read_metadata()
    return r._read_whole_object(m.metadata_object)


def _load(root, version, sd):
    tgt = _blank(sd)
    dcp.load(tgt, checkpoint_id=version, storage_reader=ckptstore.StorageReader(root), no_dist=True)
    return tgt


def _same(a, b):
    return all(bits_equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


@pytest.fixture
def saved(tmp_path):
    root = str(tmp_path / "root")
    sd = _state()
    w = ckptstore.StorageWriter(root, frame_size=4096)  # several frames per item
    md = dcp.save(sd, checkpoint_id="v1", storage_writer=w, no_dist=True)
    return root, sd, md


def test_format3_written_and_read_back_identically(saved):
    root, sd, md = saved
    blob = _metadata_bytes(root, "v1")
    assert blob.startswith(b"CKPTSTORE-DCPMETA 3\n")
    r = ckptstore.StorageReader(root)
    r.reset("v1")
    back = r.read_metadata()
    assert back.state_dict_metadata == md.state_dict_metadata
    assert list(back.storage_data.items()) == list(md.storage_data.items())
    assert [k.index for k in back.storage_data] == [k.index for k in md.storage_data]
    assert _same(_load(root, "v1", sd), sd)


def test_format1_metadata_still_loads(saved):
    """A version whose metadata object is a plain pickle of DCP Metadata (older ckptstore releases)."""
    root, sd, _md = saved
    r = ckptstore.StorageReader(root)
    r.reset("v1")
    md = r.read_metadata()
    md.storage_meta.load_id = None
    forge_metadata(root, "v1", pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL))
    assert not _metadata_bytes(root, "v1").startswith(_metadata.MAGIC)
    assert _same(_load(root, "v1", sd), sd)


def _head(root):
    """The header of the written (format 3) object with its columns as bytes — format 2's dict."""
    blob = _metadata_bytes(root, "v1")
    start = len(_metadata.MAGIC) + 8
    n = int.from_bytes(blob[len(_metadata.MAGIC):start], "little")
    head = pickle.loads(blob[start : start + n])  # test-only: our own, verified bytes
    pos, cols = start + n, {}
    for k, nb in head["columns"].items():
        cols[k] = bytes(blob[pos : pos + nb])
        pos += nb
    assert pos == len(blob)
    return {**head, "columns": cols}


def _format2(head) -> bytes:
    return _metadata.MAGIC_2 + pickle.dumps({**head, "format": 2} if type(head) is dict and head.get("format") == 3 else head,
                                            protocol=5)


def _format3(head, lengths=None, tail=b"") -> bytes:
    """Format 3 bytes of a header whose columns are bytes; ``lengths`` overrides the byte counts."""
    cols = head["columns"] if type(head) is dict and type(head.get("columns")) is dict else {}
    counts = lengths if lengths is not None else {k: len(v) if isinstance(v, bytes) else 0 for k, v in cols.items()}
    h = {**head, "columns": counts} if type(head) is dict else head
    p = pickle.dumps(h, protocol=5)
    body = b"".join(v for v in cols.values() if isinstance(v, bytes))
    return _metadata.MAGIC + len(p).to_bytes(8, "little") + p + body + tail


def _mutations(head):
    cols = head["columns"]

    def with_(**kw):
        h = dict(head)
        h.update(kw)
        return h

    def col(name, raw):
        return with_(columns={**cols, name: raw})

    yield "item count off by one", with_(items=head["items"] + 1)
    yield "frame count off by one", with_(frames=head["frames"] - 1)
    yield "chunk count off by one", with_(chunks=head["chunks"] + 1)
    yield "name out of range", col("item.object", (len(head["names"]) + 5).to_bytes(4, "little") + cols["item.object"][4:])
    yield "negative name", col("item.fqn", (-3).to_bytes(4, "little", signed=True) + cols["item.fqn"][4:])
    yield "column not whole values", col("frame.offset", cols["frame.offset"][:-3])
    yield "column missing", with_(columns={k: v for k, v in cols.items() if k != "item.nbytes"})
    yield "column is not bytes", col("item.nbytes", list(cols["item.nbytes"]))
    yield "names not strings", with_(names=[5] * len(head["names"]))
    yield "format 4", with_(format=4)
    yield "not a dict", [head]
    yield "metadata is not Metadata", with_(metadata={"state_dict_metadata": {}})
    yield "item_chunks past the tensors", with_(item_chunks=head["item_chunks"] + 1)
    yield "item_chunks negative", with_(item_chunks=-1)
    yield "item_chunks not an int", with_(item_chunks=str(head["item_chunks"]))
    # a tensor whose chunk list is its items, but whose item has another index than its chunk's
    yield "an item's index is not its chunk's", col("item.index", (7).to_bytes(8, "little") + cols["item.index"][8:])
    yield "frame offsets past the object", col("frame.offset", b"\xff\xff\xff\x7f\x00\x00\x00\x00" * (len(cols["frame.offset"]) // 8))


def _refused(root, tmp_path, sd, what, blob):
    r2 = str(tmp_path / "m" / what.replace(" ", "_"))
    shutil.copytree(root, r2)
    forge_metadata(r2, "v1", blob)
    with pytest.raises(BaseException) as ei:  # CheckpointException is a BaseException
        _load(r2, "v1", sd)
    errs = failures(ei.value)
    assert errs and all(isinstance(x, ckptstore.CkptStoreError) for x in errs), (what, errs)


def test_the_written_header_read_back_as_format2_loads(saved, tmp_path):
    """The same header and columns in format 2's layout (older releases wrote it) load the same state."""
    root, sd, _md = saved
    r2 = str(tmp_path / "f2")
    shutil.copytree(root, r2)
    forge_metadata(r2, "v1", _format2(_head(root)))
    assert _metadata_bytes(r2, "v1").startswith(_metadata.MAGIC_2)
    assert _same(_load(r2, "v1", sd), sd)


@pytest.mark.parametrize("fmt", [2, 3])
def test_inconsistent_tables_raise_typed_errors(saved, tmp_path, fmt):
    root, sd, _md = saved
    head = _head(root)
    for what, h in _mutations(head):
        if fmt == 3 and what == "column is not bytes":
            continue  # format 3 has no place for a non-bytes column: its byte count is refused below
        _refused(root, tmp_path, sd, f"{fmt}-{what}", _format2(h) if fmt == 2 else _format3(h))
    if fmt == 2:
        _refused(root, tmp_path, sd, "2-format 3 header", _metadata.MAGIC_2 + pickle.dumps(head, protocol=5))
        return
    counts = {k: len(v) for k, v in head["columns"].items()}
    first = next(iter(counts))
    for what, blob in [
        ("format 2 header behind the format 3 line", _format3({**head, "format": 2})),
        ("a column longer than the object", _format3(head, {**counts, first: counts[first] + 10**9})),
        ("a negative byte count", _format3(head, {**counts, first: -8})),
        ("a byte count that is not an int", _format3(head, {**counts, first: "8"})),
        ("bytes after the last column", _format3(head, tail=b"\0" * 8)),
        ("the last column cut short", _format3(head)[:-8]),
        ("the pickle length past the end", _metadata.MAGIC + (10**12).to_bytes(8, "little") + b"\x80\x05."),
        ("nothing after the magic line", _metadata.MAGIC),
    ]:
        _refused(root, tmp_path, sd, f"3-{what}", blob)


@pytest.mark.parametrize("fmt", [2, 3])
def test_the_header_pickle_goes_through_the_allow_list(saved, tmp_path, fmt):
    """A format 2 or 3 object whose pickle calls a function is refused; the function never runs."""
    root, _sd, _md = saved
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    head = _head(root)
    head["metadata"].planner_data = Evil()
    forge_metadata(root, "v1", _format2(head) if fmt == 2 else _format3(head))
    r = ckptstore.StorageReader(root)
    r.reset("v1")
    with pytest.raises(ckptstore.IntegrityError, match="allow"):
        r.read_metadata()
    assert not marker.exists()


def test_writer_refuses_metadata_the_reader_would_refuse(tmp_path):
    """The commit-time check covers the pickled part of format 3 (planner data of a foreign class)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class Planner(DefaultSavePlanner):
        def create_global_plan(self, all_plans):
            plans, md = super().create_global_plan(all_plans)
            md.planner_data = io.BytesIO(b"not allowed")
            return plans, md

    w = ckptstore.StorageWriter(str(tmp_path))
    with pytest.raises(BaseException) as ei:
        dcp.save({"a": torch.ones(3)}, checkpoint_id="v1", storage_writer=w, planner=Planner(), no_dist=True)
    assert "BytesIO" in str(ei.value) and "nothing was committed" in str(ei.value)
    assert ckptstore.Store(str(tmp_path)).versions() == []


def test_pack_cost_is_linear_in_items():
    """The packed size grows linearly with ranks x items; unpack(pack(md)) == md."""
    import time

    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)

    from ckptstore.codec.frame import FrameRef
    from ckptstore.dcp._types import ItemLocation

    def md_of(ranks, items=20):
        sd, sdm = {}, {}
        for i in range(items):
            sdm[f"l{i}"] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([ranks * 8, 4]),
                                                 [ChunkStorageMetadata(torch.Size([r * 8, 0]), torch.Size([8, 4])) for r in range(ranks)])
            for r in range(ranks):
                sd[MetadataIndex(f"l{i}", torch.Size([r * 8, 0]), r)] = ItemLocation(
                    f"attempts/a/r{r:05d}.ckd", (FrameRef(i * 100, 100, 64, i, i),), 64, "bfloat16", (8, 4))
        return Metadata(state_dict_metadata=sdm, storage_data=sd)

    small, big = md_of(32), md_of(256)
    t = []
    for m in (small, big):
        t0 = time.process_time()
        b = _metadata.pack(m)
        t.append((time.process_time() - t0, len(b)))
    assert t[1][1] < 9 * t[0][1]
    assert _metadata.unpack(_metadata.pack(big), pickle.loads, "m") == big


def test_rank_item_tables_concatenate_to_the_same_metadata_and_returned_mapping():
    """Each rank packs its own items (ItemTable); the coordinator concatenates the tables. The
    metadata object must hold exactly what packing the merged dict holds (bytes items with no
    dtype, per-rank object names, repeated fqns), and the mapping dcp.save returns
    (ItemTables) must equal that dict, in order, and survive pickling as the packed tables."""
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    from ckptstore.codec.frame import FrameRef
    from ckptstore.dcp._types import ItemLocation

    per_rank, merged = [], {}
    for r in range(3):
        idx, locs = [], []
        for i in range(4):
            k = MetadataIndex(f"w{i}", torch.Size([r * 8, 0]), r)
            loc = ItemLocation(f"attempts/a/r{r:05d}.ckd", (FrameRef(i * 50, 50, 32, r * 100 + i, 2 * i),
                                                             FrameRef(i * 50 + 50, 40, 16, 7, 2 * i + 1)),
                               48, "bfloat16" if i % 2 else "float32", (8, 3))
            idx.append(k), locs.append(loc)
        idx.append(MetadataIndex(f"extra.r{r}")), locs.append(ItemLocation(f"attempts/a/r{r:05d}.ckd", (FrameRef(999, 9, 3, 1, 8),), 3, None, None))
        per_rank.append(_metadata.pack_items(idx, locs))
        merged.update(zip(idx, locs))
    md = Metadata(state_dict_metadata={})
    from_tables = _metadata.unpack(_metadata.pack(md, per_rank), pickle.loads, "t")
    from_dict = _metadata.unpack(_metadata.pack(Metadata(state_dict_metadata={}, storage_data=merged)), pickle.loads, "t")
    assert list(from_tables.storage_data.items()) == list(merged.items()) == list(from_dict.storage_data.items())
    returned = _metadata.ItemTables(per_rank)
    assert len(returned) == len(merged) == 15
    assert list(returned.items()) == list(merged.items()) and returned == merged
    assert returned[MetadataIndex("extra.r2")].dtype is None
    again = pickle.loads(pickle.dumps(returned))
    assert type(again) is _metadata.ItemTables and list(again.items()) == list(merged.items())
    # the Metadata dcp.save returns (storage_data = ItemTables) packs like the dict it stands for
    repacked = _metadata.unpack(_metadata.pack(Metadata(state_dict_metadata={}, storage_data=again)), pickle.loads, "t")
    assert list(repacked.storage_data.items()) == list(merged.items())
    with pytest.raises(TypeError):  # a rank's table with a column that does not add up
        bad = _metadata.ItemTable(per_rank[0].names, per_rank[0].items + 1, per_rank[0].frames, per_rank[0].columns)
        _metadata.pack(md, [bad])


from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=12), st.integers(1, 33), st.lists(st.booleans(), max_size=12))
def test_frames_of_several_buffers_are_the_frames_of_their_bytes(parts, frame_size, as_view):
    """The metadata object is written from many buffers (the ranks' columns, never joined): its frames
    must be exactly the frames of the joined bytes — every frame ``frame_size`` bytes but the last, one
    empty frame for no bytes — whatever the buffers' sizes (empty ones, ones larger than a frame)."""
    from ckptstore.dcp._frames import split, split_parts

    bufs = [memoryview(p) if as_view[i % len(as_view)] else p for i, p in enumerate(parts)] if as_view else parts
    got = [bytes(c) for c, *_ in split_parts(bufs, frame_size, [])]
    want = [bytes(c) for c, *_ in split(memoryview(b"".join(parts)), frame_size, 0, [])]
    assert got == want


_name = st.sampled_from(["w", "layers.0.w", "é", "attempts/a/r00000.ckd", "attempts/a/r00001.ckd", "", "ab", "a", "b"])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(_name, max_size=8, unique=True), min_size=1, max_size=6))
def test_ranks_names_merge_as_their_strings_whatever_they_share(per_rank):
    """The coordinator compares the ranks' names as encoded bytes (which leading names a rank shares
    with the one before it) and decodes only the rest: the merged names and every item's names must
    be what comparing the strings gives, whatever the ranks share — nothing, everything, a prefix,
    names that differ only where one ends and the next starts ("ab","" against "a","b")."""
    from ckptstore.codec.frame import FrameRef
    from ckptstore.dcp._types import ItemLocation
    from torch.distributed.checkpoint.metadata import MetadataIndex

    tables, want = [], []
    for r, names in enumerate(per_rank):
        # one item per name, naming it as its fqn (the table's names are its fqns, then its objects)
        idx = [MetadataIndex(x, [r]) for x in names]  # (an index alone does not tell keys apart)
        locs = [ItemLocation(f"attempts/a/r{r:05d}.ckd", (FrameRef(0, 1, 1, 0, 0),), 1, None, None) for _ in names]
        t = _metadata.pack_items(idx, locs)
        tables.append(pickle.loads(pickle.dumps(t)))  # as DCP's gather delivers it: names encoded
        assert tables[-1].names == t.names
        want += list(zip(idx, locs))
    got = _metadata.ItemTables(tables)
    assert list(got.items()) == want


def test_rank_tables_whose_name_bytes_do_not_add_up_are_refused():
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    from ckptstore.codec.frame import FrameRef
    from ckptstore.dcp._types import ItemLocation

    idx = [MetadataIndex("w0"), MetadataIndex("w1")]
    locs = [ItemLocation("attempts/a/r00000.ckd", (FrameRef(i, 1, 1, 0, i),), 1, "uint8", (1,)) for i in range(2)]
    t = _metadata.pack_items(idx, locs)
    blob, ends = t.encoded()
    md = Metadata(state_dict_metadata={})
    for what, b, e in [("ends past the bytes", blob, ends[:-8] + (len(blob) + 3).to_bytes(8, "little")),
                       ("ends out of order", blob, (5).to_bytes(8, "little") + ends[8:]),
                       ("not whole ends", blob, ends[:-3]),
                       ("not UTF-8", b"\xff" + blob[1:], ends),
                       ("not bytes", list(blob), ends)]:
        bad = _metadata._table_of_blob(b, e, t.items, t.frames, t.columns)
        with pytest.raises(TypeError):
            _metadata.pack(md, [t, bad])
            pytest.fail(what)


def test_a_rank_table_naming_a_position_past_its_own_names_is_refused():
    """Each rank's name positions are checked against that rank's names, not the merged list: a
    position valid only in a longer table of another rank, or a negative one, is refused."""
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    from ckptstore.codec.frame import FrameRef
    from ckptstore.dcp._types import ItemLocation

    def table(r, k):
        idx = [MetadataIndex(f"w{i}") for i in range(k)]
        locs = [ItemLocation(f"attempts/a/r{r:05d}.ckd", (FrameRef(i, 1, 1, 0, i),), 1, "uint8", (1,)) for i in range(k)]
        return _metadata.pack_items(idx, locs)

    small, big = table(0, 2), table(1, 9)
    md = Metadata(state_dict_metadata={})
    assert _metadata.unpack(_metadata.pack(md, [small, big]), pickle.loads, "t").storage_data  # as packed: fine
    for col, value in [("item.fqn", len(small.names) + 1), ("item.object", -2), ("item.dtype", len(small.names))]:
        cols = dict(small.columns)
        cols[col] = value.to_bytes(4, "little", signed=True) + cols[col][4:]
        bad = _metadata.ItemTable(small.names, small.items, small.frames, cols)
        with pytest.raises(TypeError, match="name that does not exist"):
            _metadata.pack(md, [bad, big])


@pytest.mark.parametrize("layout", ["grid", "ranks-reversed", "one-rank-missing-a-tensor", "ragged-ndim",
                                    "chunks-not-items"])
def test_chunk_lists_packed_from_rank_tables_read_back_exactly(layout):
    """A tensor's chunk list is found in the ranks' item columns (a column of the ranks × items grid
    when every rank holds a shard of every tensor, else its run of the items sorted by name) and is
    then not stored again (``item_chunks``); one that is not its items ordered by index is stored in
    the chunk columns. Whatever the layout, what a reader rebuilds is DCP's own chunk lists and
    items, exactly."""
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)

    from ckptstore.codec.frame import FrameRef
    from ckptstore.dcp._types import ItemLocation

    ranks, tensors = 4, 3
    holders = {t: list(range(ranks)) for t in range(tensors)}
    if layout == "one-rank-missing-a-tensor":
        holders[1] = [0, 1, 3]
    nd_of = {t: (3 if layout == "ragged-ndim" and t == 2 else 2) for t in range(tensors)}
    sdm, tables, merged = {}, [], {}
    for t in range(tensors):
        nd = nd_of[t]
        hs = holders[t]
        chunks = [ChunkStorageMetadata(torch.Size([j * 8] + [0] * (nd - 1)), torch.Size([8] + [5] * (nd - 1)))
                  for j in range(len(hs))]
        sdm[f"layers.{t}.w"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                     torch.Size([8 * len(hs)] + [5] * (nd - 1)), chunks)
    item_sizes = {t: [tuple(c.sizes) for c in sdm[f"layers.{t}.w"].chunks] for t in range(tensors)}
    if layout == "chunks-not-items":  # DCP's chunk list of tensor 1 is not what its items say (a custom planner)
        item_sizes[1][-1] = (7, 5)
    for r in range(ranks):
        idx, locs = [], []
        for t in range(tensors):
            if r not in holders[t]:
                continue
            j = holders[t].index(r)
            if layout == "ranks-reversed":  # rank r holds chunk ranks-1-r: the items' index order is not the rank order
                j = ranks - 1 - r
            nd = nd_of[t]
            c = sdm[f"layers.{t}.w"].chunks[j]
            idx.append(MetadataIndex(f"layers.{t}.w", c.offsets, j))
            locs.append(ItemLocation(f"attempts/a/r{r:05d}.ckd", (FrameRef(t * 64, 64, 40, r * 10 + t, t),), 40 * nd,
                                     "float32", item_sizes[t][j]))
        tables.append(_metadata.pack_items(idx, locs))
        merged.update(zip(idx, locs))
    md = Metadata(state_dict_metadata=sdm)
    back = _metadata.unpack(_metadata.pack(md, tables), pickle.loads, "t")
    assert back.state_dict_metadata == sdm
    assert list(back.storage_data.items()) == list(merged.items())
    head = _metadata.pack_head(md, tables)  # every chunk list was packed (none left in the pickled metadata)
    assert head["chunks"] == sum(len(tm.chunks) for tm in sdm.values())
    stored = sum(map(len, head["columns"]["chunk.offsets"])) // 8  # chunk values stored in the chunk columns
    if layout == "chunks-not-items":
        assert head["item_chunks"] == tensors - 1 and stored == ranks * 2
    else:
        assert head["item_chunks"] == tensors and stored == 0


def test_format3_objects_without_item_chunks_still_load(saved, tmp_path, monkeypatch):
    """Format 3 objects written before ``item_chunks`` existed hold every chunk list in the chunk
    columns and no ``item_chunks`` key; they load the same state."""
    root, sd, _md = saved
    head = _head(root)
    r = ckptstore.StorageReader(root)
    r.reset("v1")
    md = r.read_metadata()
    md.storage_meta.load_id = None
    monkeypatch.setattr(_metadata._ItemChunks, "positions", lambda self, fid, count, nd: None)
    old = _metadata.pack_head(md, [_metadata.pack_items(list(md.storage_data), list(md.storage_data.values()))])
    monkeypatch.undo()
    assert old.pop("item_chunks") == 0 and head["item_chunks"] == 5
    assert sum(map(len, old["columns"]["chunk.offsets"])) > 0
    r2 = str(tmp_path / "old3")
    shutil.copytree(root, r2)
    forge_metadata(r2, "v1", b"".join(_metadata.dump(old)))
    assert _same(_load(r2, "v1", sd), sd)
    r3 = ckptstore.StorageReader(r2)
    r3.reset("v1")
    assert r3.read_metadata().state_dict_metadata == md.state_dict_metadata


def test_the_returned_mapping_of_an_incremental_save_reads_its_items():
    """``dcp.save`` returns ``Metadata.storage_data`` as ``ItemTables`` over the ranks' tables; an
    incremental writer's tables also carry the optional ``item.xxh128_*`` columns, which the mapping
    must skip, not trip over, when it unpacks."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from ckptstore.codec.frame import FrameRef
    from ckptstore.dcp._types import ItemLocation

    idx = [MetadataIndex("a"), MetadataIndex("b")]
    locs = [ItemLocation("attempts/x/r00000.ckd", (FrameRef(0, 9, 4, 1, 0),), 4, "uint8", (4,)),
            ItemLocation("attempts/x/r00000.ckd", (FrameRef(9, 9, 4, 2, 1),), 4, "uint8", (4,))]
    table = _metadata.pack_items(idx, locs, digests=[1 << 70, 5])
    assert "item.xxh128_lo" in table.columns
    returned = _metadata.ItemTables([table])
    assert returned[MetadataIndex("b")] == locs[1]
    assert list(returned.items()) == list(zip(idx, locs))
