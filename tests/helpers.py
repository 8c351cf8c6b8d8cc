"""Small helpers shared by the tests."""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptstore
from ckptstore.codec import xxh3
from ckptstore.codec.frame import FrameCodec
from ckptstore.manifest import catalogue, layout
from ckptstore.manifest.schema import ObjectEntry
from ckptstore.tiers import LocalTier


def failures(exc: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside a DCP CheckpointException (or the exception itself)."""
    if isinstance(exc, CheckpointException):
        return [e for e, _tb in exc.failures.values()]
    return [exc]


def save(sd, root, version, **kw):
    dcp.save(sd, checkpoint_id=version, storage_writer=ckptstore.StorageWriter(root, **kw))


def load(sd, root, version=None, **kw):
    reader = ckptstore.StorageReader(root, version=version, **kw)
    if version is None:
        dcp.load(sd, storage_reader=reader)
    else:
        dcp.load(sd, checkpoint_id=version, storage_reader=reader)
    return sd


def load_error(sd, root, version=None, **kw) -> BaseException:
    try:
        load(sd, root, version, **kw)
    except BaseException as e:  # noqa: BLE001 — CheckpointException is a BaseException
        return e
    raise AssertionError("load succeeded but was expected to fail")


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(b.contiguous().reshape(-1).view(torch.uint8).numpy())


@contextlib.contextmanager
def small_tmpfs(where, size: str = "2m", nr_inodes: int | None = None):
    """A real small file system (tmpfs) mounted at ``where``; skips unless the tests run as root."""
    os.makedirs(where, exist_ok=True)
    opts = f"size={size}" + (f",nr_inodes={nr_inodes}" if nr_inodes else "")
    try:
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {p.stderr.strip()}")
    try:
        yield str(where)
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def forge_metadata(root: str, version: str, blob: bytes) -> None:
    """Replace the DCP metadata object of unencrypted ``version`` by one frame holding ``blob``,
    with valid frame checksums, object digest and manifest seal: what someone with write access
    to an unencrypted store can do."""
    tier = LocalTier(root)
    m = catalogue.read_manifest(tier, version).manifest
    name = m.metadata_object.name
    head, payload, _h = FrameCodec(version, m.attempt, None, compress="none").encode(name, 0, blob, 0)
    data = head + bytes(payload)
    with open(tier.local_path(layout.object_key(version, name)), "wb") as f:
        f.write(data)
    m.metadata_object = ObjectEntry(name, len(data), f"{xxh3(head):016x}", 1, None, len(blob))
    with open(tier.local_path(layout.manifest_key(version)), "wb") as f:
        f.write(m.to_bytes(None))


def mutated(draw, blob: bytes, changes: tuple[int, int]) -> bytes:
    """``blob`` with a drawn number (``changes``: least, most) of its bytes set to drawn values, then
    cut at a drawn length or not: a decoder's hostile input for hypothesis (``draw``: ``data.draw``
    or a composite strategy's ``draw``)."""
    from hypothesis import strategies as st

    b = bytearray(blob)
    for _ in range(draw(st.integers(*changes))):
        if b:
            b[draw(st.integers(0, len(b) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        b = b[: draw(st.integers(0, len(b)))]
    return bytes(b)
