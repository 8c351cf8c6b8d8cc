"""Rank bodies for tests/test_recovery.py: a 2-rank training loop through ``CheckpointManager`` that a
test runs again after each fault, as a scheduler restarts a job (module-level so ranks can import it).

Every rank has its own root ``base/node<rank>`` (node-local disks). The training is deterministic
(``async_ranks.make_state``/``train_step``: the same model on every rank, per-rank data order and
RNG), so the state after step *s* is the same in every run that reaches it, whichever versions were
restored on the way: after each resume the rank compares its state bit for bit with the snapshot an
earlier run wrote for the restored step (``base/ref/<step>.r<rank>.pt``).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from async_ranks import make_state, same, snapshot, train_step

PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict", "ckptstore",
           "ckptstore.manager", "ckptstore.dcp", "async_ranks", "recovery_ranks"]


def root_of(base: str, rank: int, per_node: int = 1) -> str:
    """Rank ``rank``'s root: ``base/node<rank // per_node>`` (``per_node`` ranks share a node's disk),
    or ``base/shared`` for every rank when that exists."""
    shared = os.path.join(base, "shared")
    return shared if os.path.isdir(shared) else os.path.join(base, f"node{rank // per_node}")


def _ref(base: str, step: int, rank: int) -> str:
    return os.path.join(base, "ref", f"{step}.r{rank}.pt")


def remote_tier(url, attempts=None):
    """The remote tier ``url``; with ``attempts``, botocore tries each request that often (an
    outage then fails a request within seconds, not after the default 8 tries)."""
    if url is None or attempts is None:
        return url
    from ckptstore.tiers.s3 import S3Tier

    return S3Tier(url, max_attempts=attempts, connect_timeout=2.0)


def job(rank, world, base, saves, remote=None, mgr=None, version=None, attempts=None):
    """Resume (``version``: restore that one), check the restored state against the reference, then
    train and save ``saves`` more steps. Returns what a test asserts on (``close_error``: what
    ``close()`` raised, e.g. ``UploadError`` while the remote tier is down)."""
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    from ckptstore import CheckpointManager, Store

    state = make_state(rank)
    torch.manual_seed(4242 + rank)  # a resume must bring the saved RNG state back
    os.makedirs(os.path.join(base, "ref"), exist_ok=True)
    out: dict = {"rank": rank, "close_error": None}
    saved: list = []
    mgr = dict(mgr or {})
    per_node = mgr.pop("per_node", 1)
    if mgr.pop("frozen", False):  # a frozen block that never changes (what incremental saves reference)
        state["frozen"] = {"base": torch.randn(1 << 16, generator=torch.Generator().manual_seed(7))}  # 256 KiB
    m = CheckpointManager(root_of(base, rank, per_node), state, remote=remote_tier(remote, attempts), interval_steps=1,
                          per_rank_keys=("data",), **mgr)
    frozen = state.get("frozen", {}).get("base")
    if frozen is not None and os.path.exists(_ref(base, 1, rank)):  # a later run: only a restore brings it back
        frozen.zero_()
    try:
        if version is None:
            start = m.resume()
        else:
            start = m.restore(version=version) + 1
        info = m.last_restore
        out["start"] = start
        out["restore"] = None if info is None else {
            **{k: v for k, v in dataclasses.asdict(info).items() if k not in ("skipped",)},
            "skipped": [dataclasses.asdict(s) for s in info.skipped]}
        if info is not None and os.path.exists(_ref(base, start - 1, rank)):
            ref = torch.load(_ref(base, start - 1, rank), weights_only=False)
            got = snapshot(state)
            out["same"] = {k: same(got[k], ref[k]) for k in ref}
            if frozen is not None:
                out["same"]["frozen"] = torch.equal(frozen, torch.randn(1 << 16, generator=torch.Generator().manual_seed(7)))
        for step in range(start, start + saves):
            train_step(state, world)
            torch.save(snapshot(state), _ref(base, step, rank))
            m.save(step)
            saved.append(step)
        m.wait()
    finally:
        try:
            m.close()
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["close_error"] = f"{type(e).__name__}: {e}"
    out["saved"] = saved
    out["replica_stats"] = None if m._writer._replicator is None else dict(m._writer._replicator.stats)
    root = root_of(base, rank, per_node)  # a root a restore-only job never wrote is no store (nothing in it)
    out["versions"] = ([(r.version, r.attempt, [a for a, _ in r.supersedes]) for r in Store(root).versions()]
                       if os.path.isdir(root) else [])
    dist.barrier()
    return out


def load_newest(rank, world, base, remote=None):
    """A plain ``dcp.load`` through ``StorageReader`` without a version (the newest every rank can load)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    import ckptstore

    state = make_state(rank)
    sd = {"model": get_model_state_dict(state["model"])}
    r = ckptstore.StorageReader(root_of(base, rank), remote=remote_tier(remote, 2), allow_partial_load=True)
    dcp.load(sd, storage_reader=r)
    return {"version": r.version, "remote_reads": r.stats["remote_reads"],
            "remote_error": None if r.view is None else r.view.remote_error}
