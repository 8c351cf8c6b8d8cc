"""Rank bodies for tests/test_errors_unwrap.py: real ``dcp.save``/``dcp.load`` on a gloo job whose
failures are caught with ``except ckptstore.<TypedError>`` (docs/howto/errors.md)."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore.errors import typed


def wrong_key_and_missing_version(rank: int, world: int, root: str) -> dict:
    """Save one version with key A, then (a) load it with key B and (b) load a version that does not
    exist, each inside ``typed()`` and caught by its typed ``except``; also through a manager."""
    key_a, key_b = b"a" * 32, b"b" * 32
    state = {"w": torch.full((4,), float(rank)), "shared": torch.ones(3)}
    dcp.save({"w/rank%d" % rank: state["w"], "shared": state["shared"]}, checkpoint_id="v1",
             storage_writer=ckptstore.StorageWriter(root, key=key_a))
    out: dict = {}
    target = {"w/rank%d" % rank: torch.zeros(4), "shared": torch.zeros(3)}
    try:
        with typed():
            dcp.load(target, checkpoint_id="v1", storage_reader=ckptstore.StorageReader(root, key=key_b))
        out["key"] = "no error"
    except ckptstore.KeyMismatchError as e:
        out["key"] = type(e).__name__
        out["key_cause"] = type(e.__cause__).__name__
        out["key_cause_text"] = str(e.__cause__)
        out["key_cause_ranks"] = sorted(e.__cause__.failures)
    try:
        with typed():
            dcp.load(target, checkpoint_id="v9", storage_reader=ckptstore.StorageReader(root, key=key_a))
        out["missing"] = "no error"
    except ckptstore.VersionNotFoundError as e:
        out["missing"] = type(e).__name__
        out["missing_text"] = str(e)
    # the manager re-raises the typed error itself (no typed() needed)
    torch.manual_seed(0)  # the same weights on every rank (plain tensors are saved once for all ranks)
    m = torch.nn.Linear(2, 2)
    mroot = os.path.join(root, "mgr")
    os.makedirs(mroot, exist_ok=True)
    mgr = ckptstore.CheckpointManager(mroot, {"model": m}, interval_steps=1, key=key_a, save_on_signal=None)
    mgr.save(1)
    mgr.close()
    try:
        with ckptstore.CheckpointManager(mroot, {"model": m}, interval_steps=1, key=key_b, save_on_signal=None) as mgr:
            mgr.restore()
        out["manager"] = "no error"
    except ckptstore.KeyMismatchError as e:
        out["manager"] = type(e).__name__
        out["manager_cause_text"] = str(e.__cause__)
    return out
