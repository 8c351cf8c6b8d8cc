"""The DCP StorageWriter/StorageReader on the local tier, as users drive them."""

from __future__ import annotations

import io
import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan

import ckptstore
from ckptstore.manifest import layout
from ckptstore.testing.dist import run_ranks, run_ranks_raw

import dcp_ranks
from helpers import bits_equal, failures, load, load_error, save

FAST = dict(start_method="forkserver", preload=["dcp_ranks"])  # one torch import per job, not per rank


# ---------------------------------------------------------------------------------------------
# Case 1: 2-rank DTensor save, load on 1, 2, 3 ranks
# the plain case in the slow set: the encrypted one runs the same layout through every stage (suite time)
@pytest.mark.parametrize("key", [pytest.param(None, marks=pytest.mark.slow), os.urandom(32)], ids=["plain", "encrypted"])
def test_dtensor_save_2_load_1_2_3(tmp_path, key):
    root = str(tmp_path)
    run_ranks(dcp_ranks.save_sharded, 2, root, "v1", 11, key, **FAST)
    recs = ckptstore.Store(root).versions()
    assert [r.version for r in recs] == ["v1"] and recs[0].world_size == 2 and recs[0].step == 11
    assert recs[0].encrypted == (key is not None)
    for world in (1, 2, 3):
        outs = run_ranks(dcp_ranks.load_sharded, world, root, "v1", 11, key, **FAST)
        for o in outs:
            assert o["dt"] and o["dbig"]
            assert o["i32"] == [16777217, -5, 2**31 - 1]
            assert o["meta"] == {"epoch": 20, "args": {"lr": 3e-4, "name": "run/ü", "tags": ["a", "b"], "note": None}}
        assert sum(o["local_shape"][0] for o in outs) == 37


# Case 2: async_save THREAD and PROCESS; in-place mutation right after the call must not leak in
@pytest.mark.parametrize("kind", ["thread", pytest.param("process", marks=pytest.mark.slow)])  # process: slow (suite time)
def test_async_save_snapshot_at_call_time(tmp_path, kind):
    outs = run_ranks(dcp_ranks.async_mutate, 2, str(tmp_path), "a1", kind, **FAST)
    for o in outs:
        assert o == {"dt": True, "plain": [3.0] * 5, "step": 7.0}


# Case 3: uneven sharding with an empty shard; save on 4, load on 3 and 5
def test_uneven_and_empty_shards(tmp_path):
    root = str(tmp_path)
    locals_ = run_ranks(dcp_ranks.uneven_save, 4, root, "u1", **FAST)
    assert [s[0] for s in locals_] == [2, 2, 2, 0]
    for world in (3, 5):
        for o in run_ranks(dcp_ranks.uneven_load, world, root, "u1", **FAST):
            assert o["v6"] == [0.5, 1.5, 2.5, 3.5, 4.5, 5.5]
            assert o["e"] == ((0, 4), True, (0,))


# Case 4 + 5: shapes and dtypes bit-exact
def _dtype_state():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(8, 6, generator=g)
    return {
        "t11": torch.tensor([[1.5]]),
        "t1": torch.tensor([2.5]),
        "s_fp32": torch.tensor(7.0),
        "s_bf16": torch.tensor(7.0, dtype=torch.bfloat16),
        "fp32": base,
        "bf16": base.to(torch.bfloat16),
        "fp16": base.to(torch.float16),
        "fp8": base.to(torch.float8_e4m3fn),
        "bool": base > 0,
        "c64": torch.complex(base, -base),
        "i32": torch.tensor([16777217, 16777216, -1], dtype=torch.int32),
        "u8": torch.arange(256, dtype=torch.uint8),
        "view": base.t()[1:5, ::2],  # non-contiguous
        "nan": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]),
    }


def test_shapes_and_dtypes_bit_exact(tmp_path):
    sd = _dtype_state()
    save(sd, str(tmp_path), "d1")
    tgt = {k: torch.zeros_like(v.contiguous()) for k, v in sd.items()}
    load(tgt, str(tmp_path), "d1")
    for k, v in sd.items():
        assert bits_equal(tgt[k], v.contiguous()), k
    assert tgt["s_fp32"].dim() == 0 and tgt["s_bf16"].dim() == 0
    assert tgt["i32"][0].item() == 16777217


def test_dtype_mismatch_needs_opt_in(tmp_path):
    save({"i32": torch.tensor([16777217], dtype=torch.int32)}, str(tmp_path), "d1")
    e = load_error({"i32": torch.zeros(1, dtype=torch.float32)}, str(tmp_path), "d1")
    errs = failures(e)
    assert any(isinstance(x, ckptstore.DtypeMismatchError) and "'i32'" in str(x) and "allow_cast" in str(x) for x in errs)
    out = load({"i32": torch.zeros(1, dtype=torch.int64)}, str(tmp_path), "d1", allow_cast=True)
    assert out["i32"].item() == 16777217


# Case 6: non-tensor state
def test_non_tensor_state_round_trips(tmp_path):
    blob = bytes([0x00, 0xFF] * 10)
    sd = {"epoch": 20, "args": {"lr": 3e-4, "name": "run/ü", "tags": ["a", "b"], "note": None}, "blob": blob, "hist": [{"k1": 1}, {"k2": 2}]}
    save(sd, str(tmp_path), "n1")
    tgt = {"epoch": 0, "args": {"lr": 0.0, "name": "", "tags": ["", ""], "note": 5}, "blob": b"", "hist": [{"k1": 0}, {"k2": 0}]}
    load(tgt, str(tmp_path), "n1")
    assert tgt == sd


def test_empty_state_dict(tmp_path):
    save({}, str(tmp_path), "e1")
    assert ckptstore.Store(str(tmp_path)).latest().version == "e1"
    assert load({}, str(tmp_path), "e1") == {}


# Case 7: one key, different contents on two ranks
def test_divergent_plain_tensors_are_refused(tmp_path):
    outs = run_ranks(dcp_ranks.divergent_plain, 2, str(tmp_path), "x1", **FAST)
    assert all(o is not None and "'rng_like'" in o and "different values" in o for o in outs)
    assert ckptstore.Store(str(tmp_path)).versions() == []


# Case 8: per-rank entries saved on 2, loaded on 4 or 1
def test_per_rank_entries_are_never_dropped_silently(tmp_path):
    root = str(tmp_path)
    run_ranks(dcp_ranks.per_rank_save, 2, root, "p1", **FAST)
    one = run_ranks(dcp_ranks.per_rank_load, 1, root, "p1", False, **FAST)
    assert one[0][0] == "error" and "dataloader.dp_rank_1" in one[0][1] and "allow_partial_load" in one[0][1]
    assert run_ranks(dcp_ranks.per_rank_load, 1, root, "p1", True, **FAST) == [("ok", {"cursor": 100})]
    four = run_ranks(dcp_ranks.per_rank_load, 4, root, "p1", False, **FAST)
    assert [o[0] for o in four] == ["error"] * 4
    assert any("dataloader.dp_rank_2" in o[1] for o in four)


# Case 9: corruption of every object kind is detected, naming the object
def _objects(root, version):
    m = ckptstore.Store(root).manifest(version).manifest
    return m, [os.path.join(root, layout.object_key(version, o.name)) for o in m.objects], os.path.join(
        root, layout.object_key(version, m.metadata_object.name)
    )


def _corrupt_state():
    g = torch.Generator().manual_seed(9)
    return {"a": torch.randn(64, 1024, generator=g), "b": torch.randn(5000, generator=g).bfloat16()}


@pytest.mark.parametrize("key", [None, os.urandom(32)], ids=["plain", "encrypted"])
@pytest.mark.parametrize("damage", ["bitflip", "truncate", "zero_metadata", "edit_manifest", "extend", "swap_frames"])
def test_corruption_is_detected(tmp_path, damage, key):
    root = str(tmp_path)
    sd = _corrupt_state()
    # raw frames all have one length, so two of them can be swapped in place
    save(sd, root, "c1", key=key, frame_size=16384, compression="none" if damage == "swap_frames" else "auto")
    m, shards, meta = _objects(root, "c1")
    shard = shards[0]
    if damage == "bitflip":
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
        expect = shard
    elif damage == "truncate":
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) - 1)
        expect = shard
    elif damage == "extend":
        with open(shard, "ab") as f:
            f.write(b"\0" * 100)
        expect = None  # extra bytes after the last frame are not read by loads; scrub reports them
    elif damage == "zero_metadata":
        with open(meta, "r+b") as f:
            f.write(b"\0" * min(4096, os.path.getsize(meta)))
        expect = meta
    elif damage == "swap_frames":
        data = bytearray(open(shard, "rb").read())
        from ckptstore.codec.frame import iter_frames

        fr = list(iter_frames(lambda o, n: bytes(data[o : o + n]), len(data), "x"))
        (o1, h1, _), (o2, h2, _) = fr[1], fr[2]
        l1, l2 = h1.header_len + h1.stored_len, h2.header_len + h2.stored_len
        assert l1 == l2
        if True:
            f1, f2 = bytes(data[o1 : o1 + l1]), bytes(data[o2 : o2 + l2])
            data[o1 : o1 + l1], data[o2 : o2 + l2] = f2, f1
            open(shard, "wb").write(data)
        expect = shard
    else:  # edit one field of the manifest
        mp = os.path.join(root, layout.manifest_key("c1"))
        raw = open(mp, "rb").read()
        open(mp, "wb").write(raw.replace(b'"world_size":1', b'"world_size":2'))
        expect = "manifest"
    tgt = {"a": torch.zeros(64, 1024), "b": torch.zeros(5000).bfloat16()}
    if expect is None:
        load(tgt, root, "c1", key=key)
        assert bits_equal(tgt["a"], sd["a"]) and bits_equal(tgt["b"], sd["b"])
        return
    e = load_error(tgt, root, "c1", key=key)
    errs = failures(e)
    assert all(isinstance(x, ckptstore.IntegrityError) for x in errs), errs
    if expect == "manifest":
        assert any(isinstance(x, ckptstore.ManifestError) for x in errs)
    else:
        rel = os.path.relpath(expect, os.path.join(root, layout.version_dir("c1"))).replace(os.sep, "/")
        assert any(rel in str(x) for x in errs), (rel, errs)
    # no unverified byte reached a destination: frames are decoded straight into the tensors, each
    # only after its checksum verified, so a failed load leaves every element untouched (zero) or right
    a, want = tgt["a"].view(torch.int32), sd["a"].view(torch.int32)
    assert bool(torch.all((a == 0) | (a == want)))


# Case 10: keys
def test_key_errors(tmp_path):
    root = str(tmp_path)
    k1, k2 = os.urandom(32), os.urandom(32)
    save({"a": torch.ones(3)}, root, "enc", key=k1)
    save({"a": torch.ones(3)}, root, "plain")
    for kw, needle in (({"key": k2}, "key id"), ({}, "no key was given"), ):
        errs = failures(load_error({"a": torch.zeros(3)}, root, "enc", **kw))
        assert any(isinstance(x, ckptstore.KeyMismatchError) and needle in str(x) for x in errs), errs
    errs = failures(load_error({"a": torch.zeros(3)}, root, "plain", key=k1))
    assert any(isinstance(x, ckptstore.KeyMismatchError) and "not encrypted" in str(x) for x in errs)
    assert load({"a": torch.zeros(3)}, root, "plain", key=k1, allow_unencrypted=True)["a"].sum() == 3
    # the env var works like key=
    os.environ["CKPTSTORE_KEY"] = __import__("base64").b64encode(k1).decode()
    try:
        assert load({"a": torch.zeros(3)}, root, "enc")["a"].sum() == 3
    finally:
        del os.environ["CKPTSTORE_KEY"]
    # a wrong-length key is refused up front
    with pytest.raises(ckptstore.KeyMismatchError):
        ckptstore.StorageWriter(root, key=b"short")


# Case 11: killed before the manifest
def test_killed_before_manifest_is_invisible(tmp_path):
    root = str(tmp_path)
    run_ranks(dcp_ranks.plain_save, 2, root, "v1", 1.0, **FAST)
    codes = run_ranks_raw(dcp_ranks.killed_save, 2, root, "v2", env={"CKPTSTORE_FAULT": "commit.manifest"}, timeout=60)
    assert codes[0] != 0
    st = ckptstore.Store(root)
    assert [r.version for r in st.versions()] == ["v1"]
    assert st.latest().version == "v1"
    # the shards of the dead attempt exist on disk but are not a version
    assert any(p.endswith(".ckd") for p in _all_files(os.path.join(root, layout.version_dir("v2"))))
    tgt = {"x.rank0": torch.zeros(1000)}
    load(tgt, root, allow_partial_load=True)
    assert tgt["x.rank0"].eq(1.0).all()


def _all_files(d):
    for dp, _dn, fn in os.walk(d):
        for f in fn:
            yield os.path.join(dp, f)


# ---------------------------------------------------------------------------------------------
# Version exists / overwrite
def test_version_exists_and_overwrite(tmp_path):
    root = str(tmp_path)
    save({"a": torch.ones(2)}, root, "v")
    with pytest.raises(BaseException) as ei:
        save({"a": torch.zeros(2)}, root, "v")
    errs = failures(ei.value)
    assert any(isinstance(x, ckptstore.VersionExistsError) and "already exists" in str(x) for x in errs)
    save({"a": torch.full((2,), 5.0)}, root, "v", overwrite=True)
    assert load({"a": torch.zeros(2)}, root, "v")["a"].tolist() == [5.0, 5.0]
    assert [r.version for r in ckptstore.Store(root).versions()] == ["v"]


def test_latest_and_versions_order(tmp_path):
    root = str(tmp_path)
    for i, v in enumerate(["step-1", "step-10", "step-2"]):
        save({"a": torch.full((2,), float(i))}, root, v, step=i)
    st = ckptstore.Store(root)
    assert [r.version for r in st.versions()] == ["step-1", "step-10", "step-2"]  # commit order
    assert st.latest().version == "step-2"
    assert load({"a": torch.zeros(2)}, root)["a"].tolist() == [2.0, 2.0]  # no version → latest
    with pytest.raises(ckptstore.VersionNotFoundError):
        st.get("nope")
    errs = failures(load_error({"a": torch.zeros(2)}, root, "nope"))
    assert any(isinstance(x, ckptstore.VersionNotFoundError) for x in errs)


def test_version_names_awkward_but_exact(tmp_path):
    root = str(tmp_path)
    names = ["run 1/step+5%#", "ü-ñ", ".hidden", "a..b"]
    for n in names:
        save({"a": torch.ones(1)}, root, n)
    assert sorted(r.version for r in ckptstore.Store(root).versions()) == sorted(names)
    for bad in ["", ".", "..", "x\ny", "a" * 300]:
        assert not ckptstore.StorageWriter.validate_checkpoint_id(bad)
        with pytest.raises(ckptstore.CkptStoreError):
            ckptstore.StorageWriter(root, version=bad)


# ---------------------------------------------------------------------------------------------
# DCP contract details
def test_validate_checkpoint_id_never_raises():
    for cls in (ckptstore.StorageWriter, ckptstore.StorageReader):
        assert cls.validate_checkpoint_id("step-100") is True
        for foreign in (None, 5, b"x", object(), "", "a\x00b"):
            assert cls.validate_checkpoint_id(foreign) is False


def test_reset_clears_per_checkpoint_state(tmp_path):
    w = ckptstore.StorageWriter(str(tmp_path))
    w.reset("v1")
    sid = w.storage_meta().save_id
    w.attempt = "stale"
    w.reset("v2")
    assert w.attempt is None and w.version == "v2" and w.storage_meta().save_id != sid
    assert w.storage_meta() == StorageMeta(checkpoint_id="v2", save_id=w.save_id)
    r = ckptstore.StorageReader(str(tmp_path))
    r.storage_data = {"x": 1}
    lid = r.load_id
    r.reset("v1")
    assert r.storage_data == {} and r.load_id != lid and r.version == "v1"


def test_set_up_accepts_kwargs_and_global_plan_keeps_rank(tmp_path):
    w = ckptstore.StorageWriter(str(tmp_path), version="v")
    w.set_up_storage_writer(True, rank=3, use_collectives=True)
    p = w.prepare_local_plan(SavePlan(items=[]))
    assert p.storage_data.rank == 3
    # use_collectives=False: prepare_global_plan sees only this rank's plan at index 0
    out = w.prepare_global_plan([p])
    assert len(out) == 1 and out[0].storage_data.rank == 3
    plans = [dataclass_plan(r) for r in range(4)]
    out = w.prepare_global_plan([w.prepare_local_plan(x) for x in plans])
    assert [o.storage_data.rank for o in out] == [3, 3, 3, 3]  # every local plan said rank 3
    assert len({o.storage_data.attempt for o in out}) == 1


def dataclass_plan(r):
    return SavePlan(items=[], planner_data=r)


def test_read_metadata_before_set_up(tmp_path):
    root = str(tmp_path)
    save({"a": torch.ones(4), "b": {"x": 1}}, root, "v1")
    r = ckptstore.StorageReader(root)
    r.reset("v1")
    md = r.read_metadata()
    assert isinstance(md, Metadata) and md.storage_data and md.storage_meta.load_id == r.load_id
    r.set_up_storage_reader(md, True, rank=0, use_collectives=True)


def test_writer_and_metadata_pickle(tmp_path):
    root = str(tmp_path)
    w = ckptstore.StorageWriter(root, key=os.urandom(32))
    dcp.save({"a": torch.ones(4)}, checkpoint_id="v1", storage_writer=w)
    w2 = pickle.loads(pickle.dumps(w))  # no live pools or clients in its state
    assert w2.root == w.root
    r = ckptstore.StorageReader(root, key=w._master)
    r.reset("v1")
    md = r.read_metadata()
    # newer torch's restricted unpickler can read our storage_data records
    from torch._weights_only_unpickler import Unpickler

    vals = list(md.storage_data.values())  # our records (the keys are DCP's MetadataIndex)
    back = Unpickler(io.BytesIO(pickle.dumps(vals, protocol=2))).load()  # torch.save's protocol
    assert back == vals


def test_errors_name_the_failing_rank(tmp_path):
    root = str(tmp_path)
    save({"a": torch.ones(2)}, root, "v")
    with pytest.raises(BaseException) as ei:
        save({"a": torch.ones(2)}, root, "v")
    assert "RANK 0" in str(ei.value) or 0 in ei.value.failures


def test_manifest_lists_objects_with_sizes(tmp_path):
    root = str(tmp_path)
    save({"a": torch.randn(1000)}, root, "v", key=os.urandom(32))
    m = ckptstore.Store(root).manifest("v").manifest
    for o in m.all_objects():
        p = os.path.join(root, layout.object_key("v", o.name))
        assert os.path.getsize(p) == o.size
    assert m.encrypted and m.encryption["alg"] == "AES-256-GCM"
    text = open(os.path.join(root, layout.manifest_key("v")), "rb").read()
    body = json.loads(text)["body"]  # one JSON document (docs/FORMAT.md, "Manifest")
    assert body["format"] == "ckptstore/1" and "wrapped_key" in body["encryption"]
