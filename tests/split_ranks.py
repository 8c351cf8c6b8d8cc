"""Rank bodies of tests/test_split_brain.py: superseding saves that race, writers that are killed."""

from __future__ import annotations

import os
import threading
import time

import torch.distributed.checkpoint as dcp

import ckptstore

import crash_ranks


def round_seed(i: int, job: int) -> int:
    """The content job ``job`` saves in round ``i`` (``crash_ranks.expected_state(seed, 1)``)."""
    return 1000 + 10 * i + job


def _install_round_barrier(state: dict, job: str, points: dict) -> None:
    """At the ``points[name]``-th pass of fault point ``name`` in a round (``state["dir"]``, set per
    round), wait until both jobs reached it: the two commits then really collide there."""
    from ckptstore import _faults

    real = _faults.point
    lock = threading.Lock()

    def point(name: str) -> None:
        if name in points:
            with lock:
                d = state.get("dir")
                state["seen"][name] = state["seen"].get(name, 0) + 1
                hit = d is not None and state["seen"][name] == points[name]
            if hit:
                open(os.path.join(d, f"ready.{job}"), "w").close()
                deadline = time.monotonic() + 20
                while len([n for n in os.listdir(d) if n.startswith("ready.")]) < 2:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.002)
        real(name)

    _faults.point = point


def supersede_rounds(rank, world, root, remote, rounds, job, barrier_root, olds):
    """``rounds`` saves of ``r<i>``, each superseding attempt ``olds[i]``, each meeting the other job
    right before the replace: locally ``commit.manifest``; remotely, after both read the remote copy,
    ``remote.supersede`` (the conditional replace) or, in releases without it, the second pass of
    ``remote.manifest`` (the overwrite). Returns ``[(outcome, error type names, message)]`` per round."""
    state = {"dir": None, "seen": {}}
    points = {"remote.manifest": 2, "remote.supersede": 1} if remote else {"commit.manifest": 1}
    _install_round_barrier(state, f"job{job}", points)
    out = []
    for i in range(rounds):
        d = os.path.join(barrier_root, f"round{i}")
        os.makedirs(d, exist_ok=True)
        state["dir"], state["seen"] = d, {}
        v = f"r{i}"
        sd = crash_ranks.expected_state(round_seed(i, job), 1, False)
        w = ckptstore.StorageWriter(root, remote=remote, durability="remote" if remote else "local", step=i,
                                    frame_size=4096, upload_timeout=30)
        w.save_options(v, supersede={olds[i]: "split-brain test: both jobs believe they own the run"})
        try:
            dcp.save(sd, checkpoint_id=v, storage_writer=w)
            w.close()
            out.append(("ok", [], None))
        except BaseException as e:  # noqa: BLE001
            try:
                w.close()
            except BaseException:  # noqa: BLE001
                pass
            out.append(("error", [n for n, _ok, _m in crash_ranks._describe(e)], str(e)[:400]))
    return out


def blob_state(seed: int, nbytes: int) -> dict:
    """An incompressible state of ``nbytes`` (so what a killed save leaves is what it wrote)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g), "meta": {"seed": seed}}


def blob_save(rank, world, root, version, seed, nbytes):
    """Save :func:`blob_state` (killed mid-write when ``CKPTSTORE_FAULT`` is armed). Returns
    ``("ok", None)`` or ``("error", error type names)``."""
    w = ckptstore.StorageWriter(root, step=seed, frame_size=64 << 10, compression="none")
    try:
        dcp.save(blob_state(seed, nbytes), checkpoint_id=version, storage_writer=w)
        w.close()
        return ("ok", None)
    except BaseException as e:  # noqa: BLE001
        return ("error", [n for n, _ok, _m in crash_ranks._describe(e)])


def blob_loads(root: str, version: str, seed: int, nbytes: int) -> bool:
    import torch

    exp = blob_state(seed, nbytes)
    tgt = {"w": torch.zeros_like(exp["w"]), "meta": {"seed": -1}}
    dcp.load(tgt, checkpoint_id=version, storage_reader=ckptstore.StorageReader(root))
    return torch.equal(tgt["w"], exp["w"]) and tgt["meta"] == exp["meta"]
