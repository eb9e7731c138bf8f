"""How DeepSeek-V3 is laid out over the mesh: tensor parallel, expert parallel, then SimpleFSDP.

Tensor parallel (``tp > 1``, the ``tp`` mesh dim), Megatron style:

- attention (MLA), split over heads: ``wq`` (or, with ``q_lora_rank > 0``, ``wq_b``) and
  ``wkv_b`` column-parallel (each rank computes n_heads/tp heads; the model reads head counts
  from shapes), ``wo`` row-parallel (an all_reduce of the output). The down-projections
  ``wq_a`` and ``wkv_a`` and the norms ``q_norm`` and ``kv_norm`` stay replicated: every tp rank
  computes them whole, and the gradient of their outputs that comes back from the
  column-parallel up-projections is all-reduced by ``ColwiseParallel``'s input handling.
  The rotary key ``k_rope`` is split off ``wkv_a``'s output and broadcast to every head, so
  each rank's heads give only part of its gradient: ``Attention.k_rope_grad_reduce`` (the
  identity in one process) becomes ``SumGradOverTP``, the identity forward whose backward
  sums the gradient over tp (an all_reduce; Megatron's "copy to tensor-parallel region");
- dense feed-forward layers (the first ``n_dense_layers``) and each MoE layer's shared
  experts: ``w1``, ``w3`` column-parallel, ``w2`` row-parallel, as llama3's feed-forward;
- routed experts and the router gate are NOT split over tp (no expert tensor parallel: skinny
  expert matmuls). Without sequence parallel, or with ep = 1, every tp rank of a data-parallel
  rank routes the same tokens and runs its experts (all of them, or its ``ep`` slice) on them,
  so their gradients are identical on every tp rank and need no tp reduction; the cost is that
  this work (and, with ep, the all_to_all traffic) is repeated on each tp rank. Under sequence
  parallel with ep > 1 each tp rank routes only its own piece of the sequence, and the tp ranks
  are expert-parallel ranks too (``ep = ep_dp x tp``, ``ParallelDims.experts_span_tp``): no work
  is repeated and every expert lives on one rank of its ep group;
- ``tok_embeddings`` row-parallel over the vocabulary, ``output`` column-parallel over the
  vocabulary with its logits left split, the cross-entropy computed from each rank's slice (loss
  parallel: ``graph_trainer.loss``), as llama3.

Sequence parallel (``ParallelDims.sequence_parallel``), as llama3's: the residual stream between
the regions is split over tp along the sequence, the block norms and the final norm compute on the
rank's piece (the final norm's output all-gathered for the output projection), and ``wo`` and the
dense feed-forward's ``w2`` reduce-scatter their outputs. Attention gathers its
normed input as a plain tensor (the replicated down-projections compute on it too; its gradient
comes back whole from the column-parallel up-projections' all-reduces and the rotary key's sum, and
each rank keeps its slice). A MoE layer with ep > 1 computes on the rank's piece: its router on
those rows (the gate's weight replicated over tp, its gradient summed there), its shared experts
on the rows of every tp rank (gathered along the row dim, the output reduce-scattered back), its
routed experts through the all_to_all over the ep group that includes the tp ranks. With ep = 1
it gathers its input as attention does and runs as without sequence parallel (every tp rank
routes every token), then keeps its piece of the output (backward: the output gradient
all-gathered).

Expert parallel (``ep > 1``, see ``graph_trainer.distributed.parallel_dims`` for the mesh): the stacked expert
weights ``moe.experts.w1/w2/w3`` [E, ...] are split on the expert dim over ``ep`` (rank r holds
experts r*E/ep ... (r+1)*E/ep - 1), and each MoE layer's ``token_dispatcher`` becomes a
``graph_trainer.distributed.expert_parallel.ExpertParallelDispatcher`` (all_to_all dispatch and combine,
tagged ``ep_role`` / ``moe_fqn`` for the passes). SimpleFSDP then shards each rank's experts
over the data-parallel ranks ep does not use (``dp_replicate`` x ``efsdp``) and hands the
module its local experts as plain tensors: expert weights live on the mesh dims
(expert data-parallel dims..., ``ep``), where ``ep`` includes the tp ranks under sequence parallel.

Data parallel for everything else (FSDP / HSDP / DDP over ``dp_replicate`` x ``dp_shard``) is
exactly llama3's: a parameter tensor parallel split lives on (data-parallel dims..., ``tp``),
a replicated one on the data-parallel dims. Buffers (``rope_cache``, ``expert_bias``,
``tokens_per_expert``) stay plain tensors on every rank; the trainer keeps ``expert_bias``
identical on all ranks by summing the token counts over the ranks that routed different tokens
before each bias update (``graph_trainer.distributed.parallel_dims.sum_of_routing_counts``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from graph_trainer.distributed.parallel_dims import ParallelDims
from graph_trainer.distributed.simple_fsdp import MixedPrecision, cast_for_compute, data_parallel_for_job
from graph_trainer.errors import ConfigError
from models.common import (
    feed_forward_plan,
    gather_sequence,
    region_output,
    sequence_parallel_norms,
    split_vocabulary,
)
from models.deepseek_v3.flavors import DeepSeekV3Args
from models.moe_parallel import apply_expert_parallel, moe_block_plan


def tp_split_sizes(args: DeepSeekV3Args) -> list[tuple[str, int]]:
    """(model field, size) of every shape tensor parallel splits over ``tp``."""
    sizes = [("n_heads", args.n_heads), ("vocab_size", args.vocab_size)]
    if args.n_dense_layers > 0:
        sizes.append(("inter_dim", args.inter_dim))
    if args.n_moe_layers > 0 and args.n_shared_experts > 0:
        sizes.append(("n_shared_experts * moe_inter_dim", args.n_shared_experts * args.moe_inter_dim))
    return sizes


def validate_parallelism(args: DeepSeekV3Args, degrees: dict[str, int]) -> None:
    """Reject degrees the model's shapes cannot be split by (one ``ConfigError`` line each)."""
    tp, ep = degrees["tp"], degrees["ep"]
    if degrees.get("cp", 1) > 1:
        raise ConfigError(
            f"parallelism.cp = {degrees['cp']}: context parallel is built for llama3's attention; deepseek_v3's "
            "MLA does not split its sequences yet (use cp = 1)"
        )
    for field, size in tp_split_sizes(args):
        if size % tp != 0:
            raise ConfigError(f"parallelism.tp = {tp} does not divide the model's {field} ({size})")
    if ep > 1 and args.n_moe_layers == 0:
        raise ConfigError("parallelism.ep > 1 needs MoE layers; this deepseek_v3 flavor has none")
    if args.n_routed_experts % ep != 0:
        raise ConfigError(
            f"parallelism.ep = {ep} does not divide the model's n_routed_experts ({args.n_routed_experts})"
        )


class SumGradOverTP(nn.Module):
    """The identity forward; backward, the gradient summed over the ``tp`` ranks (an all_reduce).

    For an activation every tp rank holds whole but feeds into work split over tp (MLA's rotary
    key, shared by the heads each rank holds a slice of): each rank's backward then holds only
    its part of the gradient. Written with DTensor so the tracer sees a functional all_reduce:
    the output claims a ``Partial`` gradient, whose conversion back to the input's
    ``Replicate`` placement is the sum.
    """

    def __init__(self, tp_mesh: DeviceMesh):
        super().__init__()
        if tp_mesh.ndim != 1:
            raise ValueError("the tensor-parallel mesh must be 1-D")
        self.tp_mesh = tp_mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False)
        return shared.to_local(grad_placements=[Partial("sum")])


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False, local_routing: bool = False
) -> None:
    """Split attention heads, dense and shared-expert feed-forwards, the embedding and the
    output over ``tp_mesh`` (module docstring); routed experts and router stay whole. Under
    ``sequence_parallel`` the residual stream is split along the sequence between the regions;
    with ``local_routing`` too (the experts split over ep ranks that include the tp ranks), each tp
    rank's MoE layers route only its own tokens."""
    split_vocabulary(model, tp_mesh, sequence_parallel)
    for block in model.layers.values():
        attention = block.attention
        q_up = "attention.wq" if attention.q_lora_rank == 0 else "attention.wq_b"
        plan = {
            q_up: ColwiseParallel(),
            "attention.wkv_b": ColwiseParallel(),
            "attention.wo": region_output(sequence_parallel),
        }
        if not block.is_moe:
            plan.update(feed_forward_plan("feed_forward", sequence_parallel))
        if sequence_parallel:
            plan.update(sequence_parallel_norms(["attention_norm", "ffn_norm"]))
            gather_sequence(attention, tp_mesh, local=True)
            if not block.is_moe:
                gather_sequence(block.feed_forward, tp_mesh)
        if block.is_moe:
            plan.update(moe_block_plan(block.moe, tp_mesh, sequence_parallel, local_routing))
        parallelize_module(block, tp_mesh, plan)
        attention.k_rope_grad_reduce = SumGradOverTP(tp_mesh)
    if sequence_parallel:
        model.sequence_shards = tp_mesh.size()


def parallelize_deepseek_v3(
    model: nn.Module, mesh: DeviceMesh | None, dims: ParallelDims, mp: MixedPrecision
) -> nn.Module:
    """Apply tensor parallel (if tp > 1), expert parallel (if ep > 1), then SimpleFSDP (if any
    data parallelism; otherwise the plain mixed-precision cast). Model is on meta."""
    if mesh is None:
        return cast_for_compute(model, mp)
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], dims.sequence_parallel, dims.experts_span_tp)
    if dims.ep > 1:  # the experts get their own data-parallel layout here, on (expert dp dims, "ep")
        apply_expert_parallel(model, mesh, dims, mp)
    # (experts already have their parametrization: data parallel leaves them alone)
    return data_parallel_for_job(model, mesh, dims, mp)


__all__ = [
    "SumGradOverTP",
    "apply_tensor_parallel",
    "parallelize_deepseek_v3",
    "tp_split_sizes",
    "validate_parallelism",
]
