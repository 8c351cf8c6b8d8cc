"""The CUDA staging path (ckptstore/dcp/staging.py): ``dcp.async_save`` of tensors on a GPU.

``async_save`` returns once every tensor has been copied to host memory (pinned buffers, copies on
the current stream, the stream synchronized before the call returns); the training step that runs
next may change the GPU tensors at once. These tests check the values a user gets back: each
version holds exactly the values of its ``async_save`` call, also when the next step's kernels are
queued right behind the copies and when the next save reuses the pinned buffers, and a load into
GPU tensors is bit-exact.

CI has no GPU, so they are skipped there; run them on a machine with one:
``python -m pytest tests/test_cuda.py`` (docs/TESTING.md, "GPU checks").
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")

KEY = bytes(range(32))


def _state(mib: int, seed: int) -> dict:
    """bf16 weights and their fp32 Adam moments on the GPU, ``mib`` MiB of weights."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = (mib << 20) // 2 // 4096
    w = {f"layer{i}.weight": torch.randn(n // 8, 4096, device="cuda", generator=g).mul_(0.02).to(torch.bfloat16) for i in range(8)}
    m = {k: torch.randn(v.shape, device="cuda", generator=g).mul_(1e-3) for k, v in w.items()}
    return {"model": w, "optim": {"exp_avg": m}, "step": 7}


def _cpu(sd):
    if isinstance(sd, dict):
        return {k: _cpu(v) for k, v in sd.items()}
    return sd.detach().cpu().clone() if isinstance(sd, torch.Tensor) else sd


def _step(sd) -> None:
    """What the next training step does to the state: GPU kernels on the current stream."""
    for t in sd["model"].values():
        t.add_(1.0)
    for t in sd["optim"]["exp_avg"].values():
        t.mul_(-3.0)
    sd["step"] += 1


def _load(root: str, cid: str, like: dict) -> dict:
    dest = {
        "model": {k: torch.zeros_like(v) for k, v in like["model"].items()},
        "optim": {"exp_avg": {k: torch.zeros_like(v) for k, v in like["optim"]["exp_avg"].items()}},
        "step": 0,
    }
    dcp.load(dest, checkpoint_id=cid, storage_reader=ckptstore.StorageReader(root, key=KEY), no_dist=True)
    for t in list(dest["model"].values()) + list(dest["optim"]["exp_avg"].values()):
        assert t.is_cuda
    return dest


def _equal(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _equal(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8), b.detach().cpu().view(torch.uint8))
    else:
        assert a == b


@pytest.mark.parametrize("mib", [64, pytest.param(1024, marks=pytest.mark.skipif(
    os.environ.get("CKPTSTORE_CUDA_BIG") != "1", reason="CKPTSTORE_CUDA_BIG=1: 3 GiB on the GPU"))])
def test_async_save_from_gpu_holds_the_values_of_the_call(tmp_path, mib):
    """The next step's kernels are queued right after async_save returns; the version keeps the old values
    (``mib`` MiB of weights, twice that of moments; 1,024 with ``CKPTSTORE_CUDA_BIG=1``)."""
    sd = _state(mib, seed=1)
    before = _cpu(sd)
    root = str(tmp_path / "store")
    w = ckptstore.StorageWriter(root, key=KEY)
    fut = dcp.async_save(sd, checkpoint_id="v1", storage_writer=w, no_dist=True)
    _step(sd)  # no synchronize in between: exactly what a training loop does
    fut.result()
    w.close()
    assert [v.version for v in ckptstore.Store(root).versions()] == ["v1"]
    _equal(before, _load(root, "v1", sd))
    assert not torch.equal(before["model"]["layer0.weight"], sd["model"]["layer0.weight"].cpu())


def test_back_to_back_gpu_saves_reusing_pinned_buffers_keep_their_own_values(tmp_path):
    """Saves 2 and 3 reuse the host buffers of earlier ones (the stager's cache); each version holds its own step."""
    sd = _state(32, seed=2)
    root = str(tmp_path / "store")
    w = ckptstore.StorageWriter(root, key=KEY)
    expect = {}
    futs = []
    for i in range(3):
        cid = f"v{i}"
        expect[cid] = _cpu(sd)
        futs.append(dcp.async_save(sd, checkpoint_id=cid, storage_writer=w, no_dist=True))
        _step(sd)
        if i == 1:
            futs[0].result()  # the first save done: its buffers go back to the cache for the third
    for f in futs:
        f.result()
    w.close()
    assert sorted(v.version for v in ckptstore.Store(root).versions()) == ["v0", "v1", "v2"]
    for cid, vals in expect.items():
        _equal(vals, _load(root, cid, sd))


def test_gpu_staging_copies_land_in_pinned_memory():
    """Pinned host buffers are what lets the copies run asynchronously at full PCIe speed."""
    from ckptstore.dcp.staging import Stager

    st = Stager(max_staged=2, timeout=30)
    out = st.stage({"w": torch.ones(1 << 20, device="cuda"), "cpu": torch.ones(8)})
    assert out["w"].device.type == "cpu" and out["w"].is_pinned()
    assert not out["cpu"].is_pinned()  # host tensors need no pinned copy
    assert torch.equal(out["w"], torch.ones(1 << 20))
