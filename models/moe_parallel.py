"""How a MoE layer (``models.moe``) is laid out over the mesh: its tensor-parallel plan, and expert
parallel, both families' alike.

Tensor parallel does not split the routed experts or the router gate (no expert tensor parallel:
skinny expert matmuls); shared experts, when a layer has them, are split as a feed-forward (``w1``,
``w3`` column-parallel, ``w2`` row-parallel). Under sequence parallel a MoE layer either computes
on the rank's piece of the sequence (``local_routing``: the experts are split over ep ranks that
include the tp ranks, so each tp rank routes only its own tokens: its router on those rows with the
gate's weight replicated over tp, its shared experts on the rows of every tp rank, gathered along
the row dim and reduce-scattered back) or gathers the whole sequence, routes every token on every tp
rank, and keeps its piece of the output (backward: the output gradient all-gathered).

Expert parallel (``ep > 1``, see ``graph_trainer.distributed.parallel_dims`` for the mesh): the
stacked expert weights ``moe.experts.w1/w2/w3`` [E, ...] are split on the expert dim over ``ep``
(rank r holds experts r*E/ep ... (r+1)*E/ep - 1), and each MoE layer's ``token_dispatcher`` becomes
a ``graph_trainer.distributed.expert_parallel.ExpertParallelDispatcher`` (all_to_all dispatch and
combine, tagged ``ep_role`` / ``moe_fqn`` for the passes). SimpleFSDP then shards each rank's experts
over the data-parallel ranks ep does not use (``dp_replicate`` x ``efsdp``) and hands the module
its local experts as plain tensors.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import SequenceParallel

from graph_trainer.distributed.expert_parallel import ExpertParallelDispatcher
from graph_trainer.distributed.parallel_dims import ParallelDims, expert_dp_mesh_dims
from graph_trainer.distributed.simple_fsdp import MixedPrecision, data_parallel
from models.common import feed_forward_plan, gather_sequence, keep_sequence_piece
from models.float8 import EXPERTS_FLOAT8_DTYPE


def moe_block_plan(moe: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, local_routing: bool) -> dict:
    """The tensor-parallel plan entries of a block's MoE layer (FQNs relative to the block:
    ``moe.*``, and ``ffn_norm`` under local routing, which overrides a sequence-parallel norm entry:
    merge it last), with its sequence-parallel hooks installed (module docstring)."""
    plan = {}
    if moe.shared_experts is not None:
        plan.update(feed_forward_plan("moe.shared_experts", local_routing, sequence_dim=0))
    if not sequence_parallel:
        return plan
    if local_routing:
        plan.update(_local_routing_plan(moe, tp_mesh))
    else:  # (the whole sequence in, this rank's piece out)
        gather_sequence(moe, tp_mesh, local=True)
        keep_sequence_piece(moe, tp_mesh)
    return plan


def _local_routing_plan(moe: nn.Module, tp_mesh: DeviceMesh) -> dict:
    """A MoE layer on this tp rank's piece of the sequence: it gets the piece as a plain tensor
    (its tokens flattened to rows [T / tp, dim]), the router gate computes on those rows with its
    weight replicated over tp (the weight's gradient, partial over tp, summed there), the shared
    experts gather the rows of every tp rank (dim 0) and reduce-scatter their output back, and the
    routed experts get the rows through the expert-parallel dispatcher, whose ranks include the
    tp ranks."""
    if moe.shared_experts is not None:
        gather_sequence(moe.shared_experts, tp_mesh, sequence_dim=0)
    return {
        "ffn_norm": SequenceParallel(use_local_output=True),
        "moe.router.gate": SequenceParallel(sequence_dim=0, use_local_output=True),
    }


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, dims: ParallelDims, mp: MixedPrecision) -> None:
    """Split every MoE layer's experts over ``ep``, install the all_to_all dispatcher, and
    shard each rank's experts with SimpleFSDP over the remaining data-parallel dims."""
    ep_mesh = mesh["ep"]
    expert_dims = expert_dp_mesh_dims(dims)
    expert_dp_mesh = mesh[expert_dims] if expert_dims else None
    full_mesh = mesh[(*expert_dims, "ep")]
    float8_dtype = EXPERTS_FLOAT8_DTYPE if mp.float8_dispatch else None
    for name, block in model.layers.items():
        if not block.is_moe:
            continue
        experts = block.moe.experts
        for param_name, param in list(experts.named_parameters(recurse=False)):
            split = distribute_tensor(
                torch.empty(param.shape, dtype=param.dtype, device="meta"), ep_mesh, [Shard(0)], src_data_rank=None
            )
            experts.register_parameter(param_name, nn.Parameter(split, requires_grad=param.requires_grad))
        block.moe.token_dispatcher = ExpertParallelDispatcher(
            ep_mesh, block.moe.num_experts, f"layers.{name}.moe", float8_dtype
        )
        data_parallel(
            experts,
            expert_dp_mesh,
            dims.expert_fsdp_mode,
            mp,
            full_mesh=full_mesh,
            hand_local=True,
            fqn_prefix=f"layers.{name}.moe.experts",
        )


__all__ = ["apply_expert_parallel", "moe_block_plan"]
