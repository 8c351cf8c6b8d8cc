"""The DCP metadata object in format 2 (pickled skeleton + packed columns), format 1
still read, and the allow-list guarding everything unpickled (docs/FORMAT.md, "DCP metadata object")."""

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


def test_format2_written_and_read_back_identically(saved):
    root, sd, md = saved
    blob = _metadata_bytes(root, "v1")
    assert blob.startswith(_metadata.MAGIC)
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
    blob = _metadata_bytes(root, "v1")
    return pickle.loads(blob[len(_metadata.MAGIC):])  # test-only: our own, verified bytes


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
    yield "format 3", with_(format=3)
    yield "not a dict", [head]
    yield "metadata is not Metadata", with_(metadata={"state_dict_metadata": {}})
    yield "frame offsets past the object", col("frame.offset", b"\xff\xff\xff\x7f\x00\x00\x00\x00" * (len(cols["frame.offset"]) // 8))


def test_inconsistent_format2_tables_raise_typed_errors(saved, tmp_path):
    root, sd, _md = saved
    head = _head(root)
    for what, h in _mutations(head):
        r2 = str(tmp_path / "m" / what.replace(" ", "_"))
        shutil.copytree(root, r2)
        forge_metadata(r2, "v1", _metadata.MAGIC + pickle.dumps(h, protocol=5))
        with pytest.raises(BaseException) as ei:  # CheckpointException is a BaseException
            _load(r2, "v1", sd)
        errs = failures(ei.value)
        assert errs and all(isinstance(x, ckptstore.CkptStoreError) for x in errs), (what, errs)


def test_format2_pickle_goes_through_the_allow_list(saved, tmp_path):
    """A format 2 object whose pickle calls a function is refused; the function never runs."""
    root, _sd, _md = saved
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    head = _head(root)
    head["metadata"].planner_data = Evil()
    forge_metadata(root, "v1", _metadata.MAGIC + pickle.dumps(head, protocol=5))
    r = ckptstore.StorageReader(root)
    r.reset("v1")
    with pytest.raises(ckptstore.IntegrityError, match="allow"):
        r.read_metadata()
    assert not marker.exists()


def test_writer_refuses_metadata_the_reader_would_refuse(tmp_path):
    """The commit-time check covers the pickled part of format 2 (planner data of a foreign class)."""
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
