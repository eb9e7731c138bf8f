"""FP8 weight all-gather: a float8 linear's weight shard cast to float8 before SimpleFSDP gathers it.

Under the tensorwise recipe a float8 linear (torchao's ``Float8Linear``) casts its gathered weight
to e4m3 with one scale, ``e4m3 max / amax(|weight|)``, before every matmul that reads it. The
cast is elementwise and the amax is a max, which no summation order changes, so it can run on
each rank's shard before the all-gather instead of on the gathered weight after it, provided
every shard is cast with the whole weight's amax: one all-reduce (max) of each shard's amax over
the mesh dims the weight is split on. The gather then moves one byte per element instead of the
parameter dtype's two (bf16), and the linear receives the gathered float8 data with its scale as
torchao's ``Float8TrainingTensor``, which it uses as it is (no second cast).

``WeightCast`` says how a module's weight is cast (``weight_cast``: None for a module that is not
a tensorwise float8 linear); ``cast_shard`` casts a shard as the linear would cast the gathered
weight (the same torchao functions: ``amax_to_scale``, ``hp_tensor_and_scale_to_float8``);
``float8_weight`` wraps the gathered data. ``graph_trainer.distributed.simple_fsdp`` runs them in
its gather (``ReplicateComputation.float8``) and owns the gradient's reduction, which is that of
any gathered parameter.

Numerics: the gathered float8 data and its scale are bitwise those the linear computes from the
gathered parameter-dtype weight (same shard cast to the parameter dtype, same amax, same scale,
same elementwise cast); losses and gradients are bitwise those of the same float8 run gathering
in the parameter dtype.

Fails: torchao missing is the caller's (``models.float8`` refuses the config first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement


@dataclass(frozen=True)
class WeightCast:
    """How a float8 linear casts its weight: the float8 dtype, whether scales are rounded down to
    powers of 2, and torchao's matmul settings the wrapped weight carries."""

    float8_dtype: torch.dtype
    round_scales_to_power_of_2: bool
    linear_mm_config: Any


def weight_cast(module: nn.Module) -> WeightCast | None:
    """The cast of ``module``'s weight when it is a float8 linear whose weight is cast dynamically
    with one scale per tensor, for its forward and its input gradient alike; None otherwise."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_linear import Float8Linear

    if not isinstance(module, Float8Linear):
        return None
    c = module.config
    casts = (c.cast_config_weight, c.cast_config_weight_for_grad_input)
    if any(k.scaling_type is not ScalingType.DYNAMIC for k in casts):
        return None
    if any(k.scaling_granularity is not ScalingGranularity.TENSORWISE for k in casts):
        return None
    if casts[0].target_dtype != casts[1].target_dtype:
        return None
    return WeightCast(casts[0].target_dtype, c.round_scales_to_power_of_2, module.linear_mm_config)


def global_amax(local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> torch.Tensor:
    """The largest ``|element|`` of the whole tensor whose local shard is ``local`` (float32): the
    shard's amax, all-reduced (max) over each mesh dim the tensor is split on (none over a dim it is
    replicated on: every rank there holds the same shard)."""
    amax = torch.max(torch.abs(local)).to(torch.float32)
    for dim, placement in enumerate(placements):
        if not isinstance(placement, Replicate):
            one_dim = mesh[mesh.mesh_dim_names[dim]]
            amax = DTensor.from_local(amax, one_dim, [Partial("max")], run_check=False).full_tensor()
    return amax


def cast_shard(
    local: torch.Tensor, cast: WeightCast, mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 data, scale) of the shard ``local`` (already in the parameter dtype), scaled by the
    whole tensor's amax as the linear scales the gathered tensor."""
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale

    amax = global_amax(local, mesh, placements)
    scale = amax_to_scale(amax, cast.float8_dtype, cast.round_scales_to_power_of_2)
    cast_local = hp_tensor_and_scale_to_float8(
        local, scale, cast.float8_dtype, cast.linear_mm_config, GemmInputRole.WEIGHT
    )
    return cast_local._data, scale


def float8_weight(data: torch.Tensor, scale: torch.Tensor, cast: WeightCast, orig_dtype: torch.dtype) -> torch.Tensor:
    """The gathered float8 ``data`` and its ``scale`` as the weight torchao's linear takes as cast."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    return Float8TrainingTensor(data, scale, orig_dtype, cast.linear_mm_config, gemm_input_role=GemmInputRole.WEIGHT)


__all__ = ["WeightCast", "cast_shard", "float8_weight", "global_amax", "weight_cast"]
