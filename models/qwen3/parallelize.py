"""How Qwen3 is laid out over the mesh: tensor parallel, expert parallel, then SimpleFSDP.

Tensor parallel (``tp`` mesh dim), as LLaMA-3's: ``wq``, ``wk``, ``wv`` column-parallel (each rank
holds n_heads/tp query heads and n_kv_heads/tp kv heads), ``wo`` row-parallel; a dense block's
feed-forward ``w1``, ``w3`` column-parallel and ``w2`` row-parallel; the embedding and the output
split over the vocabulary with the logits left split (loss parallel: ``models.common.split_vocabulary``).
The QK norms compute on the rank's heads: their weights are replicated over tp as DTensors and their
inputs are taken as split on the head dim (``SequenceParallel`` on dim 2, the head dim of
[B, S, heads, head_dim]), so each weight's gradient, partial over tp (each rank saw only its heads),
is summed there. A MoE block's router and experts stay whole (``models.moe_parallel.moe_block_plan``).

Sequence parallel, as LLaMA-3's: the residual stream between the regions is split over tp along the
sequence, the block norms and the final norm compute on the rank's piece, attention and a dense
feed-forward gather their normed input, ``wo`` and ``w2`` reduce-scatter their outputs; a MoE layer
routes the rank's own tokens when the experts are split over ep ranks that include the tp ranks,
else gathers the sequence (``models.moe_parallel``).

Context parallel (``dims.cp`` > 1, dense models) needs no plan here, as LLaMA-3's: each rank computes
on its chunks of every sequence with whole weights and attention gathers keys and values over ``cp``
(``models.sequence``).

Expert parallel (``ep > 1``): ``models.moe_parallel.apply_expert_parallel``. Then every other
parameter goes to SimpleFSDP over the data-parallel dims.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

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
from models.moe_parallel import apply_expert_parallel, moe_block_plan
from models.qwen3.flavors import Qwen3Args

HEAD_DIM = 2
"""The head dim of attention's [B, S, heads, head_dim] activations, which tensor parallel splits."""


def validate_parallelism(args: Qwen3Args, degrees: dict[str, int]) -> None:
    """Reject degrees the model's shapes or layout cannot take (one ``ConfigError`` line each)."""
    tp, ep, cp = degrees["tp"], degrees["ep"], degrees.get("cp", 1)
    if ep > 1 and not args.is_moe:
        raise ConfigError("parallelism.ep > 1 needs a model with experts; this qwen3 flavor is dense")
    if ep > 1 and args.n_routed_experts % ep != 0:
        raise ConfigError(
            f"parallelism.ep = {ep} does not divide the model's n_routed_experts ({args.n_routed_experts})"
        )
    if cp > 1 and args.is_moe:
        raise ConfigError(
            f"parallelism.cp = {cp}: context parallel is built for the dense models' layouts; a qwen3 MoE "
            "does not split its sequences over cp yet (use cp = 1)"
        )
    if args.tie_embeddings and degrees["pp"] > 1:
        raise ConfigError(
            f"parallelism.pp = {degrees['pp']}: this model's output projection is tied to its embedding, "
            "and pipeline stages would hold the two apart (the first and the last stage); use pp = 1"
        )
    sizes = [("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads), ("vocab_size", args.vocab_size)]
    if not args.is_moe:
        sizes.append(("ffn_hidden", args.ffn_hidden))
    for what, size in sizes:
        if size % tp != 0:
            raise ConfigError(f"parallelism.tp = {tp} does not divide the model's {what} ({size})")


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False, local_routing: bool = False
) -> None:
    """Split attention heads, dense feed-forwards, the embedding and the output over ``tp_mesh``
    (module docstring); a MoE layer's router and experts stay whole."""
    split_vocabulary(model, tp_mesh, sequence_parallel)
    for block in model.layers.values():
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": region_output(sequence_parallel),
            "attention.q_norm": SequenceParallel(sequence_dim=HEAD_DIM, use_local_output=True),
            "attention.k_norm": SequenceParallel(sequence_dim=HEAD_DIM, use_local_output=True),
        }
        if not block.is_moe:
            plan.update(feed_forward_plan("feed_forward", sequence_parallel))
        if sequence_parallel:
            plan.update(sequence_parallel_norms(["attention_norm", "ffn_norm"]))
            gather_sequence(block.attention, tp_mesh)  # (x, rope, plan): the rest pass as they are
            if not block.is_moe:
                gather_sequence(block.feed_forward, tp_mesh)
        if block.is_moe:
            plan.update(moe_block_plan(block.moe, tp_mesh, sequence_parallel, local_routing))
        parallelize_module(block, tp_mesh, plan)


def parallelize_qwen3(model: nn.Module, mesh: DeviceMesh | None, dims: ParallelDims, mp: MixedPrecision) -> nn.Module:
    """Apply tensor parallel (if tp > 1), expert parallel (if ep > 1), then SimpleFSDP (if any data
    parallelism; otherwise the plain mixed-precision cast). Model is on meta."""
    if mesh is None:
        return cast_for_compute(model, mp)
    model.sequence_shards = dims.sequence_shards  # (context parallel's chunks, sequence parallel's pieces)
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], dims.sequence_parallel, dims.experts_span_tp)
    if dims.ep > 1:  # the experts get their own data-parallel layout here, on (expert dp dims, "ep")
        apply_expert_parallel(model, mesh, dims, mp)
    # (experts already have their parametrization: data parallel leaves them alone)
    return data_parallel_for_job(model, mesh, dims, mp)


__all__ = ["apply_tensor_parallel", "parallelize_qwen3", "validate_parallelism"]
