"""A load never leaves a target silently unchanged: tensor subclasses without memory of their own.

``tests/qtensor.QInt8Tensor`` is a wrapper subclass in the shape of quantized / Float8 training
weights (``_make_wrapper_subclass``, int8 payload + fp32 scale, ``__tensor_flatten__``, ``copy_``
handled, other ops dequantized). ckptstore stores it by its values (through its ``copy_`` into a plain
tensor, as ``async_save``'s staging does) and loads it back through its ``copy_``, reading it back to
check; DCP's own FileSystemWriter/Reader is the reference. Before: sync ``dcp.save`` failed with
"Attempted to access the data pointer on an invalid python storage." (no key), async saves committed,
and loading into a subclass target returned without error and left the target unchanged (the reader
wrote into ``target.reshape(-1).view(torch.uint8).numpy()``, a temporary for such a tensor).
"""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import ckptstore
from ckptstore.testing.dist import run_ranks

import subclass_ranks
from helpers import failures, load, load_error, save
from qtensor import OpaqueQInt8Tensor, QInt8Tensor, RefusingQInt8Tensor, TemporaryQInt8Tensor


def _state(seed: int, cls=QInt8Tensor) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": cls.from_float(torch.randn(64, 32, generator=g) * 10), "b": torch.randn(8, generator=g)}


def _same(a, b) -> bool:
    return torch.equal(a.qdata, b.qdata) and torch.equal(a.scale.view(torch.int32), b.scale.view(torch.int32))


def _save(sd, root, version, how):
    if how == "sync":
        save(sd, root, version)
        return
    w = ckptstore.StorageWriter(root)
    dcp.async_save(sd, checkpoint_id=version, storage_writer=w, async_checkpointer_type=AsyncCheckpointerType.THREAD).result()
    w.close()


@pytest.mark.parametrize("how", ["sync", "thread"])
def test_wrapper_subclass_round_trips_bit_exact_like_dcp(tmp_path, how):
    src = _state(0)
    root = str(tmp_path / "cs")
    _save(src, root, "v1", how)
    ours = load(_state(1), root, "v1")
    dcp.save(src, checkpoint_id=str(tmp_path / "fs"))  # DCP's own writer and reader: the reference
    theirs = _state(1)
    dcp.load(theirs, checkpoint_id=str(tmp_path / "fs"))
    assert type(ours["w"]) is QInt8Tensor
    assert _same(ours["w"], src["w"]) and _same(theirs["w"], src["w"])
    assert torch.equal(ours["b"], src["b"])
    # stored as its values (dtype and shape DCP's metadata gives): a plain target gets them
    plain = load({"w": torch.zeros(64, 32), "b": torch.zeros(8)}, root, "v1")
    assert torch.equal(plain["w"], src["w"].dequantize())


@pytest.mark.parametrize("cls", [RefusingQInt8Tensor, TemporaryQInt8Tensor, OpaqueQInt8Tensor], ids=lambda c: c.__name__)
def test_subclass_that_cannot_take_its_values_is_refused_before_any_write(tmp_path, cls):
    """Refusing: copy_ takes no plain tensor (torchao's AffineQuantizedTensor); Temporary: copy_ writes
    a dequantized temporary (a silent no-op); Opaque: cannot give its values at all."""
    root = str(tmp_path)
    save({"a": torch.arange(5.0), "w": torch.randn(64, 32), "z": torch.arange(3.0)}, root, "v1")
    tgt = {"a": torch.zeros(5), "w": cls.from_float(torch.ones(64, 32)), "z": torch.zeros(3)}
    before = tgt["w"].qdata.clone(), tgt["w"].scale.clone()
    e = load_error(tgt, root, "v1")
    (f,) = failures(e)
    assert isinstance(f, ckptstore.UnsupportedStateError), f
    assert "'w'" in str(f) and cls.__name__ in str(f)
    # nothing written into any target, the plain ones included
    assert torch.equal(tgt["a"], torch.zeros(5)) and torch.equal(tgt["z"], torch.zeros(3))
    assert torch.equal(tgt["w"].qdata, before[0]) and torch.equal(tgt["w"].scale, before[1])


def test_values_a_subclass_would_re_encode_need_allow_cast(tmp_path):
    """Plain float weights into a quantized target: its copy_ quantizes them, which is not the stored
    values — refused, unless allow_cast=True (as for a dtype cast)."""
    root = str(tmp_path)
    src = {"w": torch.randn(64, 32)}
    save(src, root, "v1")
    (f,) = failures(load_error({"w": QInt8Tensor.from_float(torch.ones(64, 32))}, root, "v1"))
    assert isinstance(f, ckptstore.UnsupportedStateError) and "'w'" in str(f) and "allow_cast=True" in str(f), f
    tgt = load({"w": QInt8Tensor.from_float(torch.ones(64, 32))}, root, "v1", allow_cast=True)
    assert _same(tgt["w"], QInt8Tensor.from_float(src["w"]))


@pytest.mark.parametrize("how", ["sync", "thread"])
def test_save_of_a_subclass_without_values_is_refused_naming_the_key(tmp_path, how):
    root = str(tmp_path)
    with pytest.raises(BaseException) as ei:
        _save({"layer": {"w": OpaqueQInt8Tensor.from_float(torch.randn(4, 4))}}, root, "v1", how)
    (f,) = failures(ei.value)
    assert isinstance(f, ckptstore.UnsupportedStateError), repr(f)
    assert "layer.w" in str(f) and "OpaqueQInt8Tensor" in str(f)
    assert ckptstore.Store(root).versions() == []


class _CopyingReshape(torch.Tensor):
    """A plain Python subclass (real storage) whose reshape returns a copy."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out.clone() if func is torch.Tensor.reshape else out


class _CountingCopies(torch.Tensor):
    """A plain Python subclass that counts ``copy_`` calls."""

    copies = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            cls.copies += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_fast_path_writes_only_memory_that_is_the_targets(tmp_path):
    """The reader's fast path copies frames into ``target.reshape(-1).view(uint8).numpy()`` only when that
    is the target's own memory: a class whose reshape copies is written through ``copy_`` instead."""
    root = str(tmp_path)
    src = {"w": torch.randn(32, 16), "p": torch.randn(7)}
    save(src, root, "v1")
    tgt = {"w": torch.zeros(32, 16).as_subclass(_CopyingReshape), "p": torch.zeros(7)}
    load(tgt, root, "v1")
    assert torch.equal(tgt["w"].as_subclass(torch.Tensor), src["w"]) and torch.equal(tgt["p"], src["p"])


def test_plain_subclasses_and_parameters_keep_the_fast_path(tmp_path):
    root = str(tmp_path)
    src = {"w": torch.randn(32, 16), "p": torch.randn(7)}
    save(src, root, "v1")
    w = torch.zeros(32, 16).as_subclass(_CountingCopies)
    p = torch.nn.Parameter(torch.zeros(7))
    ptrs = w.data_ptr(), p.data_ptr()
    _CountingCopies.copies = 0
    load({"w": w, "p": p}, root, "v1")
    assert torch.equal(w.as_subclass(torch.Tensor), src["w"]) and torch.equal(p.detach(), src["p"])
    assert (w.data_ptr(), p.data_ptr()) == ptrs
    assert _CountingCopies.copies == 0  # the frames went straight into its memory


class _TemporaryPlanner(DefaultLoadPlanner):
    """A planner that loads into a temporary per item and copies it back in commit_tensor (the DCP
    LoadPlanner contract); records how many temporaries were alive at once."""

    def __init__(self):
        super().__init__()
        self.live: list = []  # weak references to the numpy arrays that own the temporaries' memory
        self.most = 0

    def resolve_tensor(self, read_item):
        arr = np.empty(tuple(super().resolve_tensor(read_item).shape), dtype=np.float32)
        self.live.append(weakref.ref(arr))  # dead once no tensor uses that memory any more
        self.most = max(self.most, sum(r() is not None for r in self.live))
        return torch.from_numpy(arr)

    def commit_tensor(self, read_item, tensor):
        super().resolve_tensor(read_item).copy_(tensor)


def test_a_planners_temporaries_are_resolved_one_at_a_time(tmp_path):
    root = str(tmp_path)
    src = {f"t{i}": torch.randn(100) for i in range(20)}
    save(src, root, "v1")
    tgt = {k: torch.zeros(100) for k in src}
    planner = _TemporaryPlanner()
    dcp.load(tgt, checkpoint_id="v1", storage_reader=ckptstore.StorageReader(root), planner=planner)
    assert all(torch.equal(tgt[k], src[k]) for k in src)
    assert planner.most <= 2  # never every item's temporary at once


def test_manager_round_trips_a_module_with_a_wrapper_subclass_parameter(tmp_path):
    class QLinear(torch.nn.Module):
        def __init__(self, seed):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.weight = torch.nn.Parameter(QInt8Tensor.from_float(torch.randn(16, 8, generator=g)), requires_grad=False)
            self.bias = torch.nn.Parameter(torch.randn(16, generator=g))

    src, dst = QLinear(0), QLinear(1)
    with ckptstore.CheckpointManager(str(tmp_path), {"model": src}, save_rng=False) as mgr:
        mgr.save(1, force=True)
    with ckptstore.CheckpointManager(str(tmp_path), {"model": dst}, save_rng=False) as mgr:
        assert mgr.restore() == 1
    assert _same(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)


def _check_ranks(outs):
    for src, ours, theirs in outs:
        assert src[0] == ours[0] == theirs[0] == "QInt8Tensor"
        assert ours == src and theirs == src  # qdata, scale and the plain tensor, bit for bit


def test_dtensor_with_subclass_local_round_trips_2_ranks(tmp_path):
    _check_ranks(run_ranks(subclass_ranks.round_trip, 2, str(tmp_path), "thread", timeout=300))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sync", "process"])
def test_dtensor_with_subclass_local_round_trips_2_ranks_more(tmp_path, how):
    _check_ranks(run_ranks(subclass_ranks.round_trip, 2, str(tmp_path), how, timeout=400))


@pytest.mark.slow
def test_subclass_dtensor_reshards_2_to_1_and_refuses_a_lossy_reshard(tmp_path):
    root = str(tmp_path)
    run_ranks(subclass_ranks.save_sharded, 2, root, 0, timeout=300)
    ((status, got),) = run_ranks(subclass_ranks.load_resharded, 1, root, 0, timeout=300)
    assert status == "ok", got
    whole = QInt8Tensor.from_float(subclass_ranks.full_values(0))  # per-row scales: the rows are unchanged
    assert got == ("QInt8Tensor", whole.qdata.numpy().tobytes(), whole.scale.numpy().tobytes())
    # sharded on the other dim, each local re-quantizes its rows over fewer columns: not the stored values
    for status, errs in run_ranks(subclass_ranks.load_resharded, 2, root, 1, timeout=300):
        assert status == "err" and any("UnsupportedStateError" in e and "'q'" in e and "QInt8Tensor" in e for e in errs), errs
