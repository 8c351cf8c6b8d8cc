"""Tensors without memory of their own: wrapper subclasses (quantized / Float8 weights).

A wrapper subclass (``torch.Tensor._make_wrapper_subclass``, e.g. an int8 payload and a scale with
``__tensor_flatten__``) presents a dtype and shape but has no storage: its ``data_ptr()`` is 0, and
``reshape``/``view``/``numpy`` either fail ("invalid python storage") or return a *temporary*
(its ``__torch_dispatch__`` dequantizes ops it does not know). ckptstore stores such a tensor by its
values, as DCP's metadata describes it (dtype, shape), converted by the subclass's own ``copy_`` into a
plain tensor — what ``async_save``'s staging does — so the format is unchanged and the item loads into
plain tensors and reshards (docs/FORMAT.md, "Index"). It loads back through the subclass's ``copy_``
from a plain tensor, and the result is read back and compared bit for bit: a load never writes into a
temporary and never leaves a target silently unchanged. A subclass that cannot take its values back
(its ``copy_`` refuses a plain tensor or does not change it) is refused with
:class:`UnsupportedStateError` naming the key and the class, before anything is written.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import UnsupportedStateError


def has_memory(t: torch.Tensor) -> bool:
    """True when ``t`` (numel > 0, on the CPU or not) has storage of its own that holds its bytes."""
    try:
        return t.data_ptr() != 0
    except RuntimeError:  # "invalid python storage", "has no storage"
        return False


def own_bytes(t: torch.Tensor) -> np.ndarray | None:
    """``t``'s own memory as a flat uint8 array, or None when that is not possible: not a contiguous
    CPU tensor, no storage of its own (wrapper subclass), a lazy conjugate/negative view, or a class
    whose ``reshape``/``view`` give a copy. The flat view is checked to start at ``t.data_ptr()`` and
    to span exactly ``t``'s bytes, so writing into the array writes ``t``."""
    if not t.is_cpu or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    try:
        ptr = t.data_ptr()
        flat = t.reshape(-1).view(torch.uint8)
        if ptr == 0 or flat.data_ptr() != ptr or flat.numel() != t.numel() * t.element_size():
            return None
        return flat.numpy()
    except (RuntimeError, TypeError):
        return None


def _class(t: torch.Tensor) -> str:
    c = type(t)
    return f"{c.__module__}.{c.__qualname__}"


def values(t: torch.Tensor, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """A plain tensor (``out``, else a new CPU one) holding ``t``'s values (dtype, shape) through the
    subclass's own ``copy_``.

    Raises :class:`UnsupportedStateError` naming ``key`` and the class when the subclass cannot give them.
    """
    if out is None:
        out = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")
    try:
        out.copy_(t)
    except Exception as e:  # noqa: BLE001 - any failure of the subclass's own dispatch
        raise UnsupportedStateError(
            f"state dict key {key!r} is a {_class(t)} (a tensor subclass without memory of its own) whose "
            f"copy_ into a plain {t.dtype} tensor failed ({type(e).__name__}: {e}); ckptstore stores such a "
            "tensor by its values. Implement copy_ from the subclass into a plain tensor, or save its inner "
            "tensors (__tensor_flatten__) under keys of their own"
        ) from e
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class Assembly:
    """One wrapper-subclass destination being loaded: its read items are delivered into a plain buffer
    of its dtype and shape (``part(ri)``); once every part is in, :meth:`finish` copies the buffer into
    the destination with its ``copy_`` and checks, bit for bit, that it reads back as the buffer
    (``exact=False``, the reader's ``allow_cast``: a subclass may re-encode the values, e.g. quantize
    plain float weights)."""

    def __init__(self, key: str, dest: torch.Tensor, exact: bool = True) -> None:
        self.key = key
        self.dest = dest
        self.exact = exact
        self.parts: list = []  # (read item, the tensor resolve_tensor returned)
        self.left = 0
        try:
            self.buf = values(dest, key)  # what no stored chunk covers keeps its value
        except UnsupportedStateError as e:
            raise self._refuse(f"it does not convert into a plain tensor ({e.__cause__!r})", e) from None
        self.check()

    def _refuse(self, why: str, cause: BaseException | None = None, before: bool = True) -> UnsupportedStateError:
        e = UnsupportedStateError(
            f"cannot load state dict key {self.key!r} into its {_class(self.dest)} (a tensor subclass without "
            f"memory of its own): {why}.{' Nothing was loaded.' if before else ''} Load into a plain "
            f"{self.dest.dtype} tensor of shape {tuple(self.dest.shape)} and convert it, or give the subclass a "
            "copy_ that takes a plain tensor"
        )
        e.__cause__ = cause
        return e

    def check(self) -> None:
        """Before anything is written: the subclass's ``copy_`` takes a plain tensor (zeros, or ones when
        the destination is all zeros) into a clone of the destination, and the clone then reads back
        changed — not a copy into a temporary."""
        orig = self.buf
        fill = torch.ones if orig.numel() and not bool(orig.ne(0).any()) else torch.zeros
        try:
            probe = self.dest.clone()
            probe.copy_(fill(tuple(self.dest.shape), dtype=self.dest.dtype))
            back = values(probe, self.key)
        except Exception as e:  # noqa: BLE001 - the subclass's own dispatch
            raise self._refuse(f"its copy_ from a plain {self.dest.dtype} tensor failed ({type(e).__name__}: {e})", e) from None
        if _same_bits(back, orig):
            raise self._refuse("its copy_ from a plain tensor does not change it (it writes into a temporary)")

    def part(self, ri) -> torch.Tensor:
        """The region of the buffer that read item ``ri`` fills (``dest_offsets``/``lengths``)."""
        self.left += 1
        t = self.buf
        for d, (o, n) in enumerate(zip(ri.dest_offsets, ri.lengths)):
            if n < t.shape[d]:
                t = t.narrow(d, o, n)
        return t

    def finish(self) -> None:
        """Copy the buffer into the destination and verify it (raises :class:`UnsupportedStateError`)."""
        try:
            self.dest.copy_(self.buf)
            back = values(self.dest, self.key)
        except UnsupportedStateError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._refuse(f"its copy_ failed ({type(e).__name__}: {e})", e, before=False) from None
        if self.exact and not _same_bits(back, self.buf):
            diff = (back.double() - self.buf.double()).abs().max().item() if self.buf.dtype.is_floating_point else None
            raise UnsupportedStateError(
                f"state dict key {self.key!r}: its {_class(self.dest)} does not hold the stored values after its copy_ "
                f"(it re-encodes them{'' if diff is None else f'; max difference {diff:g}'}); ckptstore loads a tensor "
                "subclass without memory of its own only when it takes the stored values back exactly. Load into a "
                f"plain {self.dest.dtype} tensor and convert it, or pass allow_cast=True to StorageReader to let it re-encode them"
            )
