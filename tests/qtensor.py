"""A wrapper tensor subclass in the shape of quantized / Float8 training weights (torchao-style).

``QInt8Tensor`` is built with ``torch.Tensor._make_wrapper_subclass``: it has no storage of its own;
it holds an int8 payload ``qdata`` and an fp32 per-row ``scale`` (inner tensors, through
``__tensor_flatten__``/``__tensor_unflatten__``) and presents itself as a float32 tensor of
``qdata``'s shape. Its ``__torch_dispatch__`` handles the ops torchao's subclasses handle (detach,
alias, clone, ``_to_copy``, ``copy_`` in both directions, same-shape views, size queries) and
dequantizes for any other functional op; an in-place op it does not know raises, as torchao's do.

Module-level so spawned ranks can import it (and ``torch.load(weights_only=True)`` can be told
about it through ``torch.serialization.add_safe_globals``).
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmax int8: ``(qdata int8, scale float32 of shape (rows, 1))``."""
    x = x.detach().to(torch.float32)
    rows = x.reshape(x.shape[0], -1) if x.dim() else x.reshape(1, 1)
    scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    q = torch.round(rows / scale).clamp(-127, 127).to(torch.int8)
    return q.reshape(x.shape), scale


class QInt8Tensor(torch.Tensor):
    """int8 ``qdata`` × fp32 per-row ``scale``, seen as a float32 tensor of ``qdata.shape``."""

    copy_from_plain = "quantize"  # what ``q.copy_(plain)`` does: "quantize" | "refuse" | "temporary"
    copy_to_plain = "dequantize"  # what ``plain.copy_(q)`` does: "dequantize" | "refuse"

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls, qdata.shape, strides=qdata.stride(), dtype=torch.float32, device=qdata.device,
            requires_grad=requires_grad,
        )

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, requires_grad: bool = False):
        self.qdata = qdata
        self.scale = scale

    def __repr__(self) -> str:
        return f"QInt8Tensor(shape={tuple(self.shape)}, qdata={self.qdata!r}, scale={self.scale!r})"

    @classmethod
    def from_float(cls, x: torch.Tensor) -> "QInt8Tensor":
        q, s = quantize(x)
        return cls(q, s)

    def dequantize(self) -> torch.Tensor:
        rows = self.qdata.reshape(self.scale.shape[0], -1).to(torch.float32) * self.scale
        return rows.reshape(self.qdata.shape)

    def __tensor_flatten__(self):
        return ["qdata", "scale"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["qdata"], inner["scale"])

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cls = type(args[0]) if isinstance(args[0], QInt8Tensor) else cls
        if func in (aten.detach.default, aten.alias.default):
            return cls(func(args[0].qdata), func(args[0].scale))
        if func is aten.clone.default:
            return cls(args[0].qdata.clone(), args[0].scale.clone())
        if func is aten._to_copy.default:
            src = args[0]
            dtype = kwargs.get("dtype")
            if dtype is not None and dtype != torch.float32:  # a cast: the values, in that dtype
                return src.dequantize().to(**kwargs)
            dev = {"device": kwargs["device"]} if kwargs.get("device") is not None else {}
            return cls(src.qdata.to(**dev), src.scale.to(**dev))
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, QInt8Tensor):
                if isinstance(src, QInt8Tensor):
                    dst.qdata.copy_(src.qdata)
                    dst.scale.copy_(src.scale)
                elif type(dst).copy_from_plain == "refuse":
                    raise ValueError(f"{type(dst).__name__}.copy_: not supported from a plain tensor")
                elif type(dst).copy_from_plain == "temporary":  # the bug this shape of subclass can have
                    dst.dequantize().copy_(src)
                else:  # a plain tensor: quantize it into the payload
                    q, s = quantize(src)
                    dst.qdata.copy_(q)
                    dst.scale.copy_(s)
                return dst
            if type(src).copy_to_plain == "refuse":
                raise NotImplementedError(f"{type(src).__name__}: copy_ into a plain tensor is not implemented")
            dst.copy_(src.dequantize())  # plain destination: the values
            return dst
        if func in (aten.view.default, aten._unsafe_view.default, aten.reshape.default) and \
                tuple(args[1]) == tuple(args[0].shape):
            return cls(args[0].qdata.view(args[0].shape), args[0].scale)
        if func is aten.is_pinned.default:
            return args[0].qdata.is_pinned()
        if func._schema.is_mutable:
            raise NotImplementedError(f"QInt8Tensor: in-place {func} is not implemented")

        def unwrap(a):
            return a.dequantize() if isinstance(a, QInt8Tensor) else a

        return func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs))


class RefusingQInt8Tensor(QInt8Tensor):
    """Takes no plain tensor in ``copy_`` (torchao's AffineQuantizedTensor copies only from its own kind)."""

    copy_from_plain = "refuse"


class TemporaryQInt8Tensor(QInt8Tensor):
    """``copy_`` from a plain tensor writes into a dequantized temporary: a silent no-op."""

    copy_from_plain = "temporary"


class OpaqueQInt8Tensor(QInt8Tensor):
    """Cannot be converted into a plain tensor by ``copy_``."""

    copy_to_plain = "refuse"


torch.serialization.add_safe_globals([QInt8Tensor, RefusingQInt8Tensor, TemporaryQInt8Tensor, OpaqueQInt8Tensor])
