"""How DeepSeek-V3 is laid out over the mesh: expert parallel, then SimpleFSDP.

Expert parallel (``ep > 1``, see ``graph_trainer.parallel`` for the mesh): the stacked expert
weights ``moe.experts.w1/w2/w3`` [E, ...] are split on the expert dim over ``ep`` (rank r holds
experts r*E/ep ... (r+1)*E/ep - 1), and each MoE layer's ``token_dispatcher`` becomes a
``graph_trainer.expert_parallel.ExpertParallelDispatcher`` (all_to_all dispatch and combine,
tagged ``ep_role`` / ``moe_fqn`` for the passes). SimpleFSDP then shards each rank's experts
over the data-parallel ranks ep does not use (``dp_replicate`` x ``efsdp``) and hands the
module its local experts as plain tensors.

Data parallel for everything else (FSDP / HSDP / DDP over ``dp_replicate`` x ``dp_shard``) is
exactly llama3's. Buffers (``rope_cache``, ``expert_bias``, ``tokens_per_expert``) stay plain
tensors on every rank; the trainer keeps ``expert_bias`` identical on all ranks by summing
the token counts over data-parallel ranks before each bias update.

Not wired yet (rejected by ``validate_parallelism``):

- tensor parallel (``tp > 1``): wq / wq_b / wkv_b column-wise and wo row-wise over heads
  would work in the model as written (head counts are read from shapes), BUT the rotary key
  part ``k_rope`` comes from the replicated ``wkv_a`` and is shared by all heads: each tp
  rank only sees the gradient from its own heads, so it needs an explicit all_reduce of its
  gradient over tp (Megatron's "copy to tensor-parallel region") before wkv_a. Until that is
  written and tested, tp > 1 is rejected.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from graph_trainer.errors import ConfigError
from graph_trainer.expert_parallel import ExpertParallelDispatcher
from graph_trainer.parallel import ParallelDims, dp_mesh_dims, expert_dp_mesh_dims
from graph_trainer.simple_fsdp import MixedPrecision, cast_for_compute, data_parallel
from models.deepseek_v3.flavors import DeepSeekV3Args

_TP_NOT_WIRED = "tensor parallelism for deepseek_v3 is not wired yet (use parallelism.tp = 1)"


def validate_parallelism(args: DeepSeekV3Args, degrees: dict[str, int]) -> None:
    """Reject degrees the model's shapes cannot be split by (and tp > 1, not supported yet)."""
    tp, ep = degrees["tp"], degrees["ep"]
    if args.n_heads % tp != 0:
        raise ConfigError(f"parallelism.tp = {tp} does not divide the model's n_heads ({args.n_heads})")
    if ep > 1 and args.n_moe_layers == 0:
        raise ConfigError("parallelism.ep > 1 needs MoE layers; this deepseek_v3 flavor has none")
    if args.n_routed_experts % ep != 0:
        raise ConfigError(
            f"parallelism.ep = {ep} does not divide the model's n_routed_experts ({args.n_routed_experts})"
        )
    if tp > 1:
        raise ConfigError(_TP_NOT_WIRED)


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, dims: ParallelDims, mp: MixedPrecision) -> None:
    """Split every MoE layer's experts over ``ep``, install the all_to_all dispatcher, and
    shard each rank's experts with SimpleFSDP over the remaining data-parallel dims."""
    ep_mesh = mesh["ep"]
    expert_dims = expert_dp_mesh_dims(dims)
    expert_dp_mesh = mesh[expert_dims] if expert_dims else None
    full_mesh = mesh[(*expert_dims, "ep")]
    for name, block in model.layers.items():
        if not block.is_moe:
            continue
        experts = block.moe.experts
        for param_name, param in list(experts.named_parameters(recurse=False)):
            split = distribute_tensor(
                torch.empty(param.shape, dtype=param.dtype, device="meta"), ep_mesh, [Shard(0)], src_data_rank=None
            )
            experts.register_parameter(param_name, nn.Parameter(split, requires_grad=param.requires_grad))
        block.moe.token_dispatcher = ExpertParallelDispatcher(ep_mesh, block.moe.num_experts, f"layers.{name}.moe")
        data_parallel(
            experts,
            expert_dp_mesh,
            dims.expert_fsdp_mode,
            mp,
            full_mesh=full_mesh,
            hand_local=True,
            fqn_prefix=f"layers.{name}.moe.experts",
        )


def parallelize_deepseek_v3(
    model: nn.Module, mesh: DeviceMesh | None, dims: ParallelDims, mp: MixedPrecision
) -> nn.Module:
    """Apply expert parallel (if ep > 1), then SimpleFSDP (if any data parallelism; otherwise
    the plain mixed-precision cast), on meta."""
    if dims.tp > 1:
        raise ConfigError(_TP_NOT_WIRED)
    if mesh is None:
        return cast_for_compute(model, mp)
    if dims.ep > 1:
        apply_expert_parallel(model, mesh, dims, mp)
    dp_dims = dp_mesh_dims(dims)
    if dp_dims:  # experts already have their parametrization: data_parallel leaves them alone
        data_parallel(model, mesh[dp_dims], dims.fsdp_mode, mp)
    return model


__all__ = ["apply_expert_parallel", "parallelize_deepseek_v3", "validate_parallelism"]
