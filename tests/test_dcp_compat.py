"""What code written against DCP expects.

Each test is written from the user's side: the same call that works with DCP's FileSystemWriter/
Reader works with ckptstore, or is refused with a typed error that says what to do.
"""

from __future__ import annotations

import fractions
import logging
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as ShardedTensorProperties
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import ckptstore
from ckptstore.manifest import layout
from ckptstore.testing.dist import run_ranks

import dcp_ranks
from helpers import bits_equal, failures, load, load_error, save


# ---------------------------------------------------------------------------------------------
# typos in keyword arguments are refused, with the close match named
def test_unknown_keyword_arguments_are_refused(tmp_path):
    with pytest.raises(TypeError, match=r"'durabilty'.*did you mean 'durability'"):
        ckptstore.StorageWriter(str(tmp_path), durabilty="remote")
    with pytest.raises(TypeError, match=r"'alow_cast'.*did you mean 'allow_cast'"):
        ckptstore.StorageReader(str(tmp_path), alow_cast=True)
    with pytest.raises(TypeError, match=r"'colour'"):
        ckptstore.StorageWriter(str(tmp_path), colour="blue")
    assert ckptstore.Store(str(tmp_path)).versions() == []


# ---------------------------------------------------------------------------------------------
# every class DCP puts in Metadata loads; anything else is refused at save
class _LegacyPropertiesPlanner(DefaultSavePlanner):
    """Writes the sharded-tensor ``TensorProperties`` (and so ``MEM_FORMAT_ENCODING``) into the
    metadata, as DCP releases that took the class from ``torch.distributed._shard`` did."""

    def create_global_plan(self, all_plans):
        plans, md = super().create_global_plan(all_plans)
        for v in md.state_dict_metadata.values():
            if isinstance(v, TensorStorageMetadata):
                p = v.properties
                v.properties = ShardedTensorProperties(
                    dtype=p.dtype, layout=p.layout, requires_grad=p.requires_grad,
                    memory_format=torch.channels_last, pin_memory=p.pin_memory,
                )
        return plans, md


class _ForeignClassPlanner(DefaultSavePlanner):
    def create_global_plan(self, all_plans):
        plans, md = super().create_global_plan(all_plans)
        md.planner_data = (md.planner_data, fractions.Fraction(1, 3))
        return plans, md


def test_sharded_tensor_properties_metadata_round_trips(tmp_path):
    root = str(tmp_path)
    sd = {"w": torch.randn(6, 4), "b": torch.arange(5, dtype=torch.int64), "cfg": {"lr": 0.1}}
    dcp.save(sd, checkpoint_id="v1", storage_writer=ckptstore.StorageWriter(root), planner=_LegacyPropertiesPlanner())
    tgt = {"w": torch.zeros(6, 4), "b": torch.zeros(5, dtype=torch.int64), "cfg": {"lr": 0.0}}
    load(tgt, root, "v1")
    assert torch.equal(tgt["w"], sd["w"]) and torch.equal(tgt["b"], sd["b"]) and tgt["cfg"] == {"lr": 0.1}
    r = ckptstore.StorageReader(root)
    r.reset("v1")
    props = r.read_metadata().state_dict_metadata["w"].properties
    assert isinstance(props, ShardedTensorProperties) and props.memory_format == torch.channels_last
    from ckptstore.scrub import scrub

    assert scrub(ckptstore.Store(root), deep=True).exit_code == 0  # scrub --deep agrees


def test_metadata_with_a_foreign_class_is_refused_at_save(tmp_path):
    root = str(tmp_path)
    with pytest.raises(BaseException) as ei:
        dcp.save({"w": torch.ones(3)}, checkpoint_id="v1", storage_writer=ckptstore.StorageWriter(root),
                 planner=_ForeignClassPlanner())
    errs = [e for e in failures(ei.value) if isinstance(e, ckptstore.UnsupportedStateError)]
    assert errs and "fractions.Fraction" in str(errs[0]) and "nothing was committed" in str(errs[0]), failures(ei.value)
    assert ckptstore.Store(root).versions() == []
    assert not os.path.exists(os.path.join(root, layout.manifest_key("v1")))


# ---------------------------------------------------------------------------------------------
# storage_meta is recorded like FileSystemWriter records it
def test_storage_meta_is_recorded(tmp_path):
    root = str(tmp_path)
    w = ckptstore.StorageWriter(root)
    dcp.save({"a": torch.ones(2)}, checkpoint_id="v1", storage_writer=w)
    r = ckptstore.StorageReader(root)
    r.reset("v1")
    sm = r.read_metadata().storage_meta
    assert (sm.checkpoint_id, sm.save_id, sm.load_id) == ("v1", w.save_id, r.load_id)


# ---------------------------------------------------------------------------------------------
# DCP's wording for an existing checkpoint
def test_version_exists_keeps_dcp_wording(tmp_path):
    root = str(tmp_path)
    save({"a": torch.ones(2)}, root, "v")
    with pytest.raises(BaseException) as ei:
        save({"a": torch.zeros(2)}, root, "v")
    errs = [e for e in failures(ei.value) if isinstance(e, ckptstore.VersionExistsError)]
    assert errs and "Checkpoint already exists" in str(errs[0]) and "overwrite=True" in str(errs[0])


# ---------------------------------------------------------------------------------------------
# every tensor DCP can save, ckptstore saves (bit-exact)
def _awkward_tensors() -> dict:
    g = torch.Generator().manual_seed(7)
    c = torch.randn(8, 3, dtype=torch.complex64, generator=g)
    r = torch.randn(5, 4, generator=g)
    big = torch.randn(10, 10, generator=g)
    return {
        "conj": c.conj(),  # lazy conjugate view
        "conj_t": c.t().conj(),  # conjugate and non-contiguous
        "neg": torch._neg_view(r),  # negative-bit view
        "neg_conj": torch._neg_view(c.conj()),
        "expanded": torch.randn(3, 1, generator=g).expand(3, 5),  # zero stride
        "channels_last": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "offset_view": big[3:7, 2:9:3],  # storage offset and steps
        "param": torch.nn.Parameter(r.clone()),
        "bf16_t": big.to(torch.bfloat16).t(),
    }


def test_every_tensor_dcp_saves_round_trips(tmp_path):
    sd = _awkward_tensors()
    expect = {k: v.detach().resolve_conj().resolve_neg().contiguous() for k, v in sd.items()}
    save(sd, str(tmp_path), "t1")
    tgt = {k: torch.zeros_like(v) for k, v in expect.items()}
    load(tgt, str(tmp_path), "t1")
    for k, v in expect.items():
        assert bits_equal(tgt[k], v), k


# ---------------------------------------------------------------------------------------------
# equal values are never "divergent"
def test_equal_values_from_ranks_with_different_hash_seeds_save(tmp_path):
    envs = [{"PYTHONHASHSEED": "1"}, {"PYTHONHASHSEED": "2"}]
    outs = run_ranks(dcp_ranks.equal_sets_save, 2, str(tmp_path), env=envs)
    assert outs[0]["hash"] != outs[1]["hash"]  # the ranks really ran with different seeds
    assert all(o["equal"] is None for o in outs), outs
    assert all(o["different"] and "'cfg.tags'" in o["different"] and "different values" in o["different"] for o in outs)
    assert [r.version for r in ckptstore.Store(str(tmp_path)).versions()] == ["same"]
    tgt = {"cfg": {"tags": set(), "n": 0}, "w": torch.zeros(3)}
    load(tgt, str(tmp_path), "same")
    assert tgt["cfg"]["tags"] == dcp_ranks.TAGS


# ---------------------------------------------------------------------------------------------
# optimizers through DCP's state_dict helpers
def _model_and_optim(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, optim):
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    optim.zero_grad()


def test_pytorchs_fsdp1_recipe_model_then_load_sharded_optimizer_state_dict(tmp_path):
    """PyTorch's documented FSDP1 load (the model alone, then ``load_sharded_optimizer_state_dict``)
    with a default ``StorageReader`` on 2 gloo ranks: both steps load, parameters and optimizer state
    equal the saved ones and a further step stays equal (before: the model load was refused, "holds
    30 key(s) that no rank's state dict asks for", the optimizer's)."""
    assert run_ranks(dcp_ranks.fsdp1_two_step_load, 2, str(tmp_path), timeout=240) == [(True, True, True)] * 2


def test_a_partial_load_may_leave_whole_entries_unread_but_not_part_of_one(tmp_path):
    """The rule behind the recipe: a load that asks nothing of a top-level entry (``optim``) leaves
    it unread; one that asks for part of an entry (the parameter groups of a fresh optimizer, not its
    ``state``) is still refused, naming the entry."""
    root = str(tmp_path)
    model, optim = _model_and_optim(0)
    _step(model, optim)
    save({"model": model.state_dict(), "optim": optim.state_dict(), "rng": {"rank0": 1, "rank1": 2}}, root, "v1")
    m2, o2 = _model_and_optim(1)
    tgt = {"model": m2.state_dict()}
    load(tgt, root, "v1")  # the model alone
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), tgt["model"].values()))
    errs = failures(load_error({"model": m2.state_dict(), "optim": o2.state_dict()}, root, "v1"))
    assert any(isinstance(e, ckptstore.StateDictKeysError) and "under 'optim'" in str(e) for e in errs), errs
    errs = failures(load_error({"rng": {"rank0": 0}}, root, "v1"))  # per-rank entries of more ranks
    assert any(isinstance(e, ckptstore.StateDictKeysError) and "'rng.rank1'" in str(e) for e in errs), errs


def test_fresh_optimizer_round_trips_with_get_state_dict(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    root = str(tmp_path)
    # the naive way: a fresh optimizer's state_dict() has no 'state' entries to load into
    model, optim = _model_and_optim(0)
    _step(model, optim)
    save({"model": model.state_dict(), "optim": optim.state_dict()}, root, "naive")
    m2, o2 = _model_and_optim(1)
    errs = failures(load_error({"model": m2.state_dict(), "optim": o2.state_dict()}, root, "naive"))
    assert any(isinstance(e, ckptstore.StateDictKeysError) and "get_state_dict" in str(e) for e in errs), errs

    # the standard way (README): get_state_dict / set_state_dict, trained and fresh optimizers
    for name, steps in (("trained", 2), ("fresh", 0)):
        model, optim = _model_and_optim(2)
        for _ in range(steps):
            _step(model, optim)
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=name, storage_writer=ckptstore.StorageWriter(root))
        m2, o2 = _model_and_optim(3)  # fresh: no step taken
        msd2, osd2 = get_state_dict(m2, o2)
        state = {"model": msd2, "optim": osd2}
        dcp.load(state, checkpoint_id=name, storage_reader=ckptstore.StorageReader(root))
        set_state_dict(m2, o2, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for a, b in zip(model.parameters(), m2.parameters()):
            assert torch.equal(a, b), name
        sa, sb = optim.state_dict()["state"], o2.state_dict()["state"]
        if steps:
            assert sa.keys() == sb.keys()
            for k in sa:
                for f in ("exp_avg", "exp_avg_sq", "step"):
                    assert torch.equal(sa[k][f], sb[k][f]), (name, k, f)
        _step(m2, o2)  # and training goes on


# ---------------------------------------------------------------------------------------------
# the typed error is the first thing a failed load reports
def test_failed_load_logs_no_metadata_fallback(tmp_path):
    root = str(tmp_path)
    save({"a": torch.ones(2)}, root, "v1")
    records: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record):
            records.append(record)

    h = Catch(level=logging.DEBUG)
    lg = logging.getLogger()  # DCP's loader logs through the root logger
    lg.addHandler(h)
    try:
        errs = failures(load_error({"a": torch.zeros(2)}, root, "nope"))
    finally:
        lg.removeHandler(h)
    assert any(isinstance(e, ckptstore.VersionNotFoundError) for e in errs), errs
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []


# ---------------------------------------------------------------------------------------------
# no silent fallback to another tier; opt-in read-repair of the local copy
@pytest.mark.s3
def test_fallback_read_is_warned_counted_and_repairable(tmp_path, s3_url):
    root = str(tmp_path)
    sd = {"w": torch.randn(64, 64), "cfg": {"lr": 0.5}}
    w = ckptstore.StorageWriter(root, remote=s3_url, durability="remote", frame_size=4096)
    dcp.save(sd, checkpoint_id="v1", storage_writer=w)
    w.close()
    m = ckptstore.Store(root).manifest("v1").manifest
    shard = next(o.name for o in m.objects)
    path = os.path.join(root, layout.object_key("v1", shard))
    good = open(path, "rb").read()
    with open(path, "r+b") as f:  # flip one payload byte in the middle of the local shard
        f.seek(len(good) // 2)
        b = f.read(1)
        f.seek(len(good) // 2)
        f.write(bytes([b[0] ^ 0x40]))

    records: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record):
            records.append(record)

    h = Catch(level=logging.WARNING)
    logging.getLogger("ckptstore").addHandler(h)
    try:
        tgt = {"w": torch.zeros(64, 64), "cfg": {"lr": 0.0}}
        r = ckptstore.StorageReader(root, remote=s3_url)
        dcp.load(tgt, checkpoint_id="v1", storage_reader=r)
        assert torch.equal(tgt["w"], sd["w"]) and tgt["cfg"] == {"lr": 0.5}
        assert r.stats["fallback_reads"] >= 1 and r.stats["repaired"] == 0
        msgs = [x.getMessage() for x in records]
        assert any(shard in s and "local" in s and "remote tier" in s and "read_repair" in s for s in msgs), msgs
        assert open(path, "rb").read() != good  # not repaired without the opt-in

        records.clear()
        r = ckptstore.StorageReader(root, remote=s3_url, read_repair=True)
        dcp.load(tgt, checkpoint_id="v1", storage_reader=r)
        assert torch.equal(tgt["w"], sd["w"]) and r.stats["repaired"] == 1
        assert open(path, "rb").read() == good  # the local copy holds the verified remote bytes
        assert any("repaired" in x.getMessage() for x in records)

        r = ckptstore.StorageReader(root, remote=s3_url)
        dcp.load(tgt, checkpoint_id="v1", storage_reader=r)
        assert r.stats["fallback_reads"] == 0 and r.stats["repaired"] == 0 and r.stats["remote_reads"] == 0
    finally:
        logging.getLogger("ckptstore").removeHandler(h)
