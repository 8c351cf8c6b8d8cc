"""Training data for the demo: real text nobody on this team wrote, and a resumable sampler.

Corpus: the Python standard library's own ``*.py`` files found on this machine (top level of
``sysconfig.get_paths()["stdlib"]``, sorted by name, concatenated, capped at ``max_bytes``). If
that directory has no sources (some slim images ship only bytecode) it falls back to PyTorch's
own Python sources. A fingerprint (SHA-256) of the bytes is recorded in every run so the
reference and the crashed run are known to have trained on the same text.

Samples: sample ``i`` is the byte window ``corpus[i*T : i*T + T + 1]`` (``T`` = context); the
dataset returns ``(i, tokens)`` so every rank can log exactly which samples it trained on.

Sampler state is world-size independent. :class:`GlobalBatchSampler` walks one global,
seeded permutation per epoch (``torch.randperm`` with a generator seeded ``seed + epoch``) in
global batches of ``G`` samples. Its whole state is ``{seed, epoch, cursor, global_batch,
num_samples}`` where ``cursor`` counts samples consumed *globally* in the epoch; rank ``r`` of
``W`` takes positions ``[cursor + r*G//W, cursor + (r+1)*G//W)`` of the global batch. Nothing
in the state names a rank or a world size, so a checkpoint written by 2 ranks resumes on 1 or 3
ranks at exactly the same global sample position: the concatenation over ranks of each step's
samples is the same global batch whatever ``W`` is.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from typing import Any, Iterator

import torch
from torch.utils.data import Dataset, Sampler


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _source_files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "*.py")))


def load_corpus(directory: str | None = None, max_bytes: int = 4 << 20) -> tuple[bytes, dict]:
    """Concatenate ``*.py`` files of ``directory`` (default: the stdlib) in name order."""
    if directory is None:
        directory = stdlib_dir()
        files = _source_files(directory)
        if not files:  # bytecode-only stdlib: use torch's own sources instead
            directory = os.path.dirname(torch.__file__)
            files = _source_files(directory)
    else:
        files = _source_files(directory)
    if not files:
        raise FileNotFoundError(f"no *.py files under {directory!r} to train on; pass --corpus DIR")
    parts: list[bytes] = []
    total = 0
    used = 0
    for f in files:
        with open(f, "rb") as fh:
            b = fh.read()
        head = f"# ===== {os.path.basename(f)} =====\n".encode()
        parts.append(head + b)
        total += len(head) + len(b)
        used += 1
        if total >= max_bytes:
            break
    data = b"".join(parts)[:max_bytes]
    info = {
        "directory": directory,
        "files": used,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    return data, info


class ByteWindows(Dataset):
    """Map-style dataset of non-overlapping ``context + 1`` byte windows; items are ``(index, tokens)``."""

    def __init__(self, data: bytes, context: int) -> None:
        self.context = context
        self.buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.n = (len(data) - 1) // context

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        s = i * self.context
        return i, self.buf[s : s + self.context + 1].long()


class GlobalBatchSampler(Sampler[list[int]]):
    """Batch sampler: each ``next()`` is this rank's share of the next global batch.

    It is its own iterator and is ``Stateful`` (``state_dict``/``load_state_dict``), so
    ``torchdata``'s ``StatefulDataLoader`` saves and restores it exactly (no fast-forwarding).
    """

    def __init__(self, num_samples: int, global_batch: int, rank: int, world_size: int, seed: int) -> None:
        if not 1 <= world_size <= global_batch:
            raise ValueError(f"world size {world_size} must be between 1 and the global batch {global_batch}")
        if num_samples < global_batch:
            raise ValueError(f"corpus has {num_samples} samples, fewer than one global batch ({global_batch})")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = 0
        self.cursor = 0  # samples consumed globally in this epoch
        self._perm: tuple[int, torch.Tensor] | None = None

    def _permutation(self) -> torch.Tensor:
        if self._perm is None or self._perm[0] != self.epoch:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            self._perm = (self.epoch, torch.randperm(self.num_samples, generator=g))
        return self._perm[1]

    def shard(self, global_batch_positions: int) -> tuple[int, int]:
        g, w, r = self.global_batch, self.world_size, self.rank
        return global_batch_positions + r * g // w, global_batch_positions + (r + 1) * g // w

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        if self.cursor + self.global_batch > self.num_samples:  # drop the ragged tail, next epoch
            self.epoch += 1
            self.cursor = 0
        lo, hi = self.shard(self.cursor)
        ids = self._permutation()[lo:hi].tolist()
        self.cursor += self.global_batch
        return ids

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "global_batch": self.global_batch,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for k in ("seed", "global_batch", "num_samples"):
            if sd[k] != getattr(self, k):
                raise ValueError(
                    f"sampler state has {k}={sd[k]!r} but this run has {getattr(self, k)!r}: "
                    "the checkpoint was written by a run with different data settings"
                )
        self.epoch = int(sd["epoch"])
        self.cursor = int(sd["cursor"])


def collate(batch: list[tuple[int, torch.Tensor]]) -> tuple[list[int], torch.Tensor]:
    return [i for i, _ in batch], torch.stack([t for _, t in batch])
