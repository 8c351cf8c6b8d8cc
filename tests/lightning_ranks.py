"""Rank bodies of ``tests/test_lightning.py``: real ``Trainer.fit`` runs of PyTorch Lightning 2.6 on
gloo ranks started by ``ckptstore.testing.dist`` (which makes the default process group and ends every
rank through ``ckptstore._groups.exit_process``; Lightning finds ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``
and does not launch processes itself).

The job: a 2-layer MLP on a fixed random regression set (64 samples, 4 per batch and rank: 8 steps an
epoch on 2 ranks), AdamW with a per-step ``StepLR``, a torchdata ``StatefulDataLoader`` (Lightning
injects its ``DistributedSampler`` and saves the loader's position, so a mid-epoch checkpoint resumes
at the next batch). Every rank appends ``{step, epoch, loss (float.hex), ids}`` per training step to
``LOG/losses.r<rank>.jsonl``; ``kill_at`` SIGKILLs rank 1 at that global step (before it trains it).
"""

from __future__ import annotations

import json
import os
import signal

import torch
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

import ckptstore
from ckptstore.integrations.lightning import ModelParallelStrategy, StoreCheckpointIO

SAMPLES, BATCH = 64, 4
PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "ckptstore",
           "pytorch_lightning", "torchdata.stateful_dataloader", "ckptstore.integrations.lightning",
           "ckptstore.testing.dist", "lightning_ranks"]


class Net(pl.LightningModule):
    def __init__(self, lr: float = 0.02, sharded: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.log_path: str | None = None
        self.kill_at: int | None = None

    def configure_model(self) -> None:
        if self.hparams.sharded:  # FSDP2 over the data-parallel mesh (ModelParallelStrategy)
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for m in self.net:
                if isinstance(m, torch.nn.Linear):
                    fully_shard(m, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        if self.kill_at is not None and self.global_step == self.kill_at and self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(json.dumps({"step": self.global_step, "epoch": self.current_epoch,
                                    "loss": loss.item().hex(), "ids": ids.tolist()}) + "\n")
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        return [opt], [{"scheduler": sched, "interval": "step"}]


class EpochSampler(StatefulDistributedSampler):
    """torchdata's ``StatefulDistributedSampler`` (its position is in the loader's state) that also saves
    its epoch. Lightning 2.6 makes a resumed run's first iterator (``FitLoop.setup_data``, loader state
    loaded, one batch prefetched) before it calls ``set_epoch`` (``FitLoop.on_advance_start``): a
    sampler shuffled by ``seed + epoch`` would resume a mid-epoch checkpoint of epoch 1 in epoch 0's
    order."""

    def state_dict(self) -> dict:
        return {**super().state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.epoch = state_dict["epoch"]


def data(rank: int, world: int) -> StatefulDataLoader:
    """The loader of ``rank``: shuffled by (seed, epoch), resumed at its saved position."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, 16, generator=g)
    y = (x[:, :4].sum(1, keepdim=True) + 0.1 * torch.randn(SAMPLES, 1, generator=g))
    ds = TensorDataset(x, y, torch.arange(SAMPLES))
    sampler = EpochSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=99)
    return StatefulDataLoader(ds, batch_size=BATCH, sampler=sampler)


def fit(rank: int, world: int, cfg: dict) -> dict:
    """One ``Trainer.fit``. ``cfg``: ``log`` (directory), ``max_steps``, ``root`` (None: no checkpoints),
    ``every`` (``ModelCheckpoint(every_n_train_steps=)``), ``top_k``, ``kill_at``, ``ckpt_path``,
    ``sharded`` (``ModelParallelStrategy`` instead of DDP), ``io`` (extra ``StoreCheckpointIO`` options)."""
    pl.seed_everything(7, verbose=False)
    model = Net(sharded=cfg.get("sharded", False))
    os.makedirs(cfg["log"], exist_ok=True)
    model.log_path = os.path.join(cfg["log"], f"losses.r{rank}.jsonl")
    model.kill_at = cfg.get("kill_at")
    plugins, callbacks = [], []
    root = cfg.get("root")
    if root:
        plugins.append(StoreCheckpointIO(root, **cfg.get("io", {})))
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=cfg["every"], save_top_k=cfg["top_k"],
                                         monitor="step", mode="max", save_last=True))
    if cfg.get("sharded"):
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, process_group_backend="gloo")
    else:
        from pytorch_lightning.strategies import DDPStrategy

        strategy = DDPStrategy(process_group_backend="gloo")
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=cfg["max_steps"],
                         plugins=plugins, callbacks=callbacks, enable_checkpointing=bool(root), logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         use_distributed_sampler=False)
    trainer.fit(model, train_dataloaders=data(rank, world), ckpt_path=cfg.get("ckpt_path"))
    out = {"global_step": trainer.global_step, "epoch": trainer.current_epoch}
    if root and rank == 0:
        out["versions"] = [(r.version, r.step, r.world_size) for r in ckptstore.Store(root).versions()]
        out["files"] = sorted(f for f in os.listdir(root) if f.endswith(".ckpt"))
    return out


def fits(rank: int, world: int, cfgs: list) -> list:
    """:func:`fit` for each of ``cfgs`` in turn, in one process."""
    return [fit(rank, world, c) for c in cfgs]


def losses(log: str, rank: int) -> list[dict]:
    with open(os.path.join(log, f"losses.r{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]
