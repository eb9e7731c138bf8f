"""The flat boundary of a traced graph: tensor subclasses (DTensor) as their plain inner tensors.

The tracer (``graph_trainer.compiler.tracer``) gives a graph plain tensors only: each parameter, buffer and
gradient is unwrapped with ``__tensor_flatten__`` into its inner tensors, and rebuilt from them
with ``__tensor_unflatten__`` (one level of subclass). ``FlatTensorSpec`` records how.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn


@dataclass(frozen=True)
class FlatTensorSpec:
    """How a user-level tensor maps onto its flat graph tensors.

    Plain tensors have ``subclass=None`` and one inner tensor. Traceable wrapper subclasses
    (DTensor) record their class, flatten context and outer size/stride, enough to rebuild
    the wrapper around new inner tensors. Inner attributes that are not tensors (DTensor
    flattens its ``device_mesh`` this way) are not graph inputs: they are kept here, in
    ``opaque_inners``, and handed back unchanged when the wrapper is rebuilt.
    """

    subclass: type | None
    inner_names: tuple[str, ...]
    context: Any
    outer_size: torch.Size
    outer_stride: tuple[int, ...]
    opaque_inners: tuple[tuple[str, Any], ...] = ()

    @property
    def num_inner(self) -> int:
        return len(self.inner_names)


def flatten_tensor(t: torch.Tensor) -> tuple[list[torch.Tensor], FlatTensorSpec]:
    """Inner plain tensors of ``t`` and the spec to rebuild it (one level of subclass)."""
    if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        plain = t.data if isinstance(t, nn.Parameter) else t
        return [plain], FlatTensorSpec(None, ("",), None, t.shape, t.stride())
    names, context = t.__tensor_flatten__()
    tensor_names = tuple(n for n in names if isinstance(getattr(t, n), torch.Tensor))
    opaque = tuple((n, getattr(t, n)) for n in names if n not in tensor_names)
    inners = [getattr(t, name) for name in tensor_names]
    if any(hasattr(i, "__tensor_flatten__") and type(i) is not torch.Tensor for i in inners):
        raise NotImplementedError(f"nested tensor subclasses are not supported: {type(t).__name__}")
    return inners, FlatTensorSpec(type(t), tensor_names, context, t.shape, t.stride(), opaque)


def unflatten_tensor(inners: list[torch.Tensor], spec: FlatTensorSpec) -> torch.Tensor:
    """Rebuild a tensor from its inner tensors (the inverse of ``flatten_tensor``)."""
    if spec.subclass is None:
        return inners[0]
    return spec.subclass.__tensor_unflatten__(
        {**dict(zip(spec.inner_names, inners, strict=True)), **dict(spec.opaque_inners)},
        spec.context,
        spec.outer_size,
        spec.outer_stride,
    )


def split_flat(flat: list[Any], specs: list[FlatTensorSpec]) -> list[list[Any]]:
    """Group a flat list by ``specs``: each tensor's inner tensors (or values) together."""
    out, i = [], 0
    for spec in specs:
        out.append(flat[i : i + spec.num_inner])
        i += spec.num_inner
    return out


__all__ = ["FlatTensorSpec", "flatten_tensor", "split_flat", "unflatten_tensor"]
