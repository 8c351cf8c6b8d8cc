"""The PyTorch Lightning integration (``ckptstore/integrations/lightning.py``, ``_lightning_v2_6.py``,
``_lightning_store.py``) with real ``Trainer.fit`` runs of pytorch-lightning 2.6.6 (the ``lightning``
extra, which ``scripts/test.sh`` installs).

The crash tests run 2 gloo ranks (``tests/lightning_ranks.py``): a job saving every 3 steps
(``ModelCheckpoint(save_top_k=2, monitor="step", save_last=True)``) whose rank 1 is SIGKILLed at step
11, mid-epoch; then, in one job, an uninterrupted reference run and ``fit(ckpt_path="last")``. Every
step's loss (bits) and sample ids on every rank equal the reference's.
"""

from __future__ import annotations

import collections
import json
import os
import signal

import pytest
import torch

if not os.environ.get("CI"):  # CI installs the extra (scripts/test.sh): a missing one is an error there
    pytest.importorskip("pytorch_lightning", reason="needs the 'lightning' extra: pip install -e '.[lightning]'")

import ckptstore
from ckptstore.integrations import _lightning_store as ls
from ckptstore.integrations.lightning import StoreCheckpointIO
from ckptstore.testing import dist

import lightning_ranks as lr

CKPT = dict(every=3, top_k=2, max_steps=20)


# -- the checkpoint as tensors + skeleton -------------------------------------------------------------
Pair = collections.namedtuple("Pair", "a b")


def test_split_join_round_trips_structure_and_key_types():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    ckpt = {
        "state_dict": collections.OrderedDict([("w", t), ("b", torch.tensor([1.5]))]),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": t * 2}},
                              "param_groups": [{"lr": 0.1, "params": [0, 1]}]}],
        "pair": Pair(torch.ones(2, dtype=torch.bfloat16), "x"),
        "tuple": (1, torch.zeros(0)),
        "plain": {"epoch": 3, "names": ("a", "b"), "size": torch.Size([2, 3])},
    }
    tensors, skeleton = ls.split(ckpt)
    assert set(tensors) == {"state_dict.w", "state_dict.b", "optimizer_states.0.state.0.step",
                            "optimizer_states.0.state.0.exp_avg", "pair.0", "tuple.1"}
    assert skeleton.dtype == torch.uint8
    back = ls.join(skeleton, {k: v.clone() for k, v in tensors.items()}, weights_only=False)  # a namedtuple
    assert type(back["state_dict"]) is collections.OrderedDict and list(back["state_dict"]) == ["w", "b"]
    assert torch.equal(back["state_dict"]["w"], t)
    assert list(back["optimizer_states"][0]["state"]) == [0]  # an int key stays an int (DCP's flattening makes it "0")
    assert torch.equal(back["optimizer_states"][0]["state"][0]["exp_avg"], t * 2)
    assert back["optimizer_states"][0]["param_groups"] == [{"lr": 0.1, "params": [0, 1]}]
    assert type(back["pair"]) is Pair and back["pair"].b == "x" and back["pair"].a.dtype == torch.bfloat16
    assert back["tuple"][0] == 1 and back["tuple"][1].shape == (0,)
    assert back["plain"] == {"epoch": 3, "names": ("a", "b"), "size": torch.Size([2, 3])}


class _Custom:
    def __init__(self, v):
        self.v = v


def test_join_applies_weights_only_to_the_skeleton():
    _tensors, skeleton = ls.split({"hp": _Custom(5)})
    with pytest.raises(Exception, match="[Ww]eights only load failed|_Custom"):
        ls.join(skeleton, {}, weights_only=True)
    assert ls.join(skeleton, {}, weights_only=False)["hp"].v == 5


def test_version_of_is_the_stem():
    assert ls.version_of("/x/ckpts/epoch=0-step=50.ckpt") == "epoch=0-step=50"
    assert ls.version_of("last.ckpt") == "last"
    assert ls.version_of("/x/last-v1.ckpt") == "last-v1"
    with pytest.raises(ckptstore.InvalidNameError):
        ls.version_of("/x/a\x01b.ckpt")  # a control character: no version name
    from ckptstore.integrations._lightning_v2_6 import is_last

    assert [is_last(p) for p in ("/x/last.ckpt", "last-v2.ckpt", "/x/lastly.ckpt", "/x/epoch=0-step=3.ckpt")] == [
        True, True, False, False]


# -- one process: last, remove, pin ---------------------------------------------------------------------
def _single(root, max_steps, ckpt_path=None, log=None, **io):
    """A single-device (no torch.distributed) fit; returns the trainer."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    pl.seed_everything(7, verbose=False)
    model = lr.Net()
    model.log_path = log
    cb = ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=2, monitor="step", mode="max", save_last=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, plugins=[StoreCheckpointIO(root, **io)],
                         callbacks=[cb], logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, train_dataloaders=lr.data(0, 1), ckpt_path=ckpt_path)
    return trainer


def _names(root):
    return [r.version for r in ckptstore.Store(root).versions()]


def test_last_loads_the_newest_committed_version_and_removal_goes_through_gc(tmp_path):
    root = str(tmp_path / "ckpt")
    _single(root, 10)  # one device: 16 steps an epoch; saves at 3, 6, 9; top-2 by step, plus last
    assert _names(root) == ["epoch=0-step=6", "epoch=0-step=9", "last"]
    assert sorted(f for f in os.listdir(root) if f.endswith(".ckpt")) == ["epoch=0-step=6.ckpt", "epoch=0-step=9.ckpt",
                                                                          "last.ckpt"]
    pointer = json.load(open(os.path.join(root, "last.ckpt")))
    assert pointer["version"] == "last" and pointer["step"] == 9 and pointer["format"] == ls.POINTER_FORMAT
    # the removed top-k version is un-committed; of its objects only those that a committed version
    # references (incremental: unchanged items) are left
    from ckptstore.manifest import catalogue

    gone = os.path.join(root, "versions", "epoch%3D0-step%3D3")
    left = {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(gone) for f in fs}
    refs = catalogue.referenced(catalogue.scan(ckptstore.Store(root).local))
    assert not os.path.exists(os.path.join(gone, "manifest.json")) and left and left <= set(refs)
    # "last" is the newest committed version, whatever the name: without the version named last
    # (dropped), ckpt_path="last" resumes from epoch=0-step=9
    ckptstore.gc.apply(ckptstore.Store(root).tiers, ckptstore.gc.plan_drop(ckptstore.Store(root), "last"))
    log = str(tmp_path / "losses.jsonl")
    trainer = _single(root, 11, ckpt_path="last", log=log)
    assert [d["step"] for d in map(json.loads, open(log))] == [9, 10] and trainer.global_step == 11
    # a pinned version survives ModelCheckpoint's removal (and keeps its pointer file)
    store = ckptstore.Store(root)
    store.pin("epoch=0-step=9")
    StoreCheckpointIO(root).remove_checkpoint(os.path.join(root, "epoch=0-step=9.ckpt"))
    assert "epoch=0-step=9" in _names(root) and os.path.exists(os.path.join(root, "epoch=0-step=9.ckpt"))
    StoreCheckpointIO(root).remove_checkpoint(os.path.join(root, "epoch=0-step=6.ckpt"))
    assert "epoch=0-step=6" not in _names(root) and not os.path.exists(os.path.join(root, "epoch=0-step=6.ckpt"))


def test_retention_prunes_versions_and_their_pointer_files(tmp_path):
    root = str(tmp_path / "ckpt")
    _single(root, 10, retention=2)  # KeepLast(2) after each commit, besides ModelCheckpoint's top-2
    assert _names(root) == ["epoch=0-step=9", "last"]
    assert sorted(f for f in os.listdir(root) if f.endswith(".ckpt")) == ["epoch=0-step=9.ckpt", "last.ckpt"]


def test_async_checkpoint_io_is_refused(tmp_path):
    # AsyncCheckpointIO saves on a worker thread while ModelCheckpoint removes on the training thread: a
    # removal overtook the save it removes (epoch=0-step=3 stayed) before StoreCheckpointIO refused it
    from pytorch_lightning.plugins.io import AsyncCheckpointIO

    io = AsyncCheckpointIO(StoreCheckpointIO(str(tmp_path / "ckpt")))
    with pytest.raises(ckptstore.CkptStoreError, match="AsyncCheckpointIO"):  # raised by the next call or teardown
        io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, str(tmp_path / "ckpt" / "a.ckpt"))
        io.teardown()
    root = tmp_path / "ckpt"  # nothing written: not even the root (a missing root is no store to list)
    assert not root.exists() or _names(str(root)) == []


def test_loading_a_missing_version_says_so(tmp_path):
    io = StoreCheckpointIO(str(tmp_path / "ckpt"))
    with pytest.raises(ckptstore.VersionNotFoundError):
        io.load_checkpoint(str(tmp_path / "ckpt" / "epoch=9-step=99.ckpt"))
    with pytest.raises(ckptstore.CkptStoreError, match="local directory"):
        StoreCheckpointIO("s3://bucket/run")


# -- 2 gloo ranks: kill mid-epoch, resume from "last", bit for bit ----------------------------------------
def _run_crash_and_resume(base: str, **extra) -> tuple[dict, list]:
    root = os.path.join(base, "store")
    crash = {"log": os.path.join(base, "crash"), "root": root, "kill_at": 11, **CKPT, **extra}
    codes = dist.run_ranks_raw(lr.fit, 2, crash, timeout=120, start_method="forkserver", preload=lr.PRELOAD)
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, codes
    after_crash = [(r.version, r.step) for r in ckptstore.Store(root).versions()]
    ref = {"log": os.path.join(base, "ref"), "max_steps": CKPT["max_steps"], **extra}
    resume = {"log": os.path.join(base, "resume"), "root": root, "ckpt_path": "last", **CKPT, **extra}
    out = dist.run_ranks(lr.fits, 2, [ref, resume], timeout=240, start_method="forkserver", preload=lr.PRELOAD)
    return {"after_crash": after_crash, "root": root, "base": base}, out


def _check_bit_exact(base: str) -> None:
    for rank in range(2):
        ref = {d["step"]: d for d in lr.losses(os.path.join(base, "ref"), rank)}
        assert sorted(ref) == list(range(20))
        crashed, resumed = lr.losses(os.path.join(base, "crash"), rank), lr.losses(os.path.join(base, "resume"), rank)
        assert resumed[0]["step"] == 9 and resumed[0]["epoch"] == 1  # mid-epoch: epoch 1 has steps 8-15
        assert sorted({d["step"] for d in crashed + resumed}) == list(range(20))
        for d in crashed + resumed:
            r = ref[d["step"]]
            assert (d["loss"], d["ids"], d["epoch"]) == (r["loss"], r["ids"], r["epoch"]), (rank, d, r)


def _check_store(root: str, world: int) -> None:
    from click.testing import CliRunner

    from ckptstore.cli import main as cli

    recs = ckptstore.Store(root).versions()
    assert [(r.version, r.step, r.world_size) for r in recs] == [
        ("epoch=1-step=15", 15, world), ("epoch=2-step=18", 18, world), ("last", 18, world)]
    assert sorted(f for f in os.listdir(root) if f.endswith(".ckpt")) == [
        "epoch=1-step=15.ckpt", "epoch=2-step=18.ckpt", "last.ckpt"]
    # every committed version verifies, although save_top_k removed the versions some of them reference
    res = CliRunner().invoke(cli, ["scrub", root], catch_exceptions=False)
    assert res.exit_code == 0, res.output


def test_ddp_kill_mid_epoch_resume_from_last_is_bit_exact(tmp_path):
    info, out = _run_crash_and_resume(str(tmp_path))
    # save_top_k=2 by step kept 6 and 9 (3 was removed through gc.plan_drop); last = step 9
    assert info["after_crash"] == [("epoch=0-step=6", 6), ("epoch=1-step=9", 9), ("last", 9)]
    assert [o[1]["global_step"] for o in out] == [20, 20]
    _check_bit_exact(info["base"])
    _check_store(info["root"], world=1)  # DDP: rank 0 saves the whole checkpoint
    # incremental: the "last" copy of each save references the version saved just before at that step
    last = ckptstore.Store(info["root"]).get("last")
    assert last.stored_bytes < ckptstore.Store(info["root"]).get("epoch=2-step=18").stored_bytes / 2


def test_model_parallel_kill_mid_epoch_resume_from_last_is_bit_exact(tmp_path):
    info, out = _run_crash_and_resume(str(tmp_path), sharded=True)
    assert info["after_crash"] == [("epoch=0-step=6", 6), ("epoch=1-step=9", 9), ("last", 9)]
    _check_bit_exact(info["base"])
    _check_store(info["root"], world=2)  # FSDP2: every rank's shard in one version
    m = ckptstore.Store(info["root"]).manifest("epoch=2-step=18").manifest
    assert sorted(o.rank for o in m.objects if o.rank is not None) == [0, 1]


@pytest.mark.s3
def test_remote_tier_serves_last_after_the_local_root_is_lost(tmp_path, s3_url):
    import shutil

    root = str(tmp_path / "ckpt")
    _single(root, 10, remote=s3_url)  # the teardown at the end of fit waits for the uploads
    remote = ckptstore.Store(None, remote=s3_url)
    assert [r.version for r in remote.versions()] == ["epoch=0-step=6", "epoch=0-step=9", "last"]
    shutil.rmtree(os.path.join(root, "versions"))  # the node's disk is gone; the pointer files are elsewhere
    log = str(tmp_path / "losses.jsonl")
    _single(root, 11, ckpt_path="last", log=log, remote=s3_url)
    assert [d["step"] for d in map(json.loads, open(log))] == [9, 10]
