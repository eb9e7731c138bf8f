"""How LLaMA-3 is laid out over the mesh: tensor parallel first, then SimpleFSDP.

Tensor parallel (``tp`` mesh dim), Megatron style:

- attention: ``wq``, ``wk``, ``wv`` column-parallel (each rank holds n_heads/tp query heads and
  n_kv_heads/tp kv heads), ``wo`` row-parallel (an all_reduce of the output);
- feed-forward: ``w1``, ``w3`` column-parallel, ``w2`` row-parallel;
- ``tok_embeddings`` row-parallel over the vocabulary, ``output`` column-parallel over the
  vocabulary with its logits left split: each rank holds [tokens, vocab / tp] of them, and the
  cross-entropy is computed from the slices (loss parallel: ``graph_trainer.loss``, two small
  all-reduces per row block forward, none backward); the full-vocabulary logits never exist;
- without sequence parallel the norms are replicated: every tp rank holds the whole residual
  stream and computes them on every token.

Sequence parallel (``ParallelDims.sequence_parallel``, Megatron's): between the regions above, the
residual stream is split over tp along the sequence ([B, S/tp, dim] per rank). The block norms
compute on the rank's piece (``SequenceParallel``: their weights are replicated DTensors, whose
gradients are summed over tp); attention and the feed-forward all-gather their normed input along
the sequence (backward: a reduce-scatter of its gradient), and ``wo`` and ``w2`` reduce-scatter
their outputs along the sequence instead of all-reducing them; the embedding reduce-scatters its
lookup; the final norm computes on the rank's piece too and its output is all-gathered along the
sequence for the output projection (backward: a reduce-scatter of its gradient). A pipeline stage
sends and receives its piece of the hidden state. Same values as without it (row-wise norms on the same
rows; the sums over tp are the all-reduce's, split), the norm weights' gradients summed in another
order (per piece, then over tp).

Context parallel (``dims.cp`` > 1) needs no plan here: each rank computes on its chunks of every
sequence with whole weights (``models.sequence``: the forward takes the rank's tokens, attention
gathers keys and values over ``cp``), and SimpleFSDP shards the parameters over ``dp_shard x cp``,
so the gradients are summed over the cp ranks too. A pipeline stage sends and receives the hidden
state of the rank's chunks.

Then every parameter goes to SimpleFSDP over the data-parallel dims
(``graph_trainer.distributed.simple_fsdp``). The tracer tags every node with its module FQN, which is
what the passes use to find blocks; ``models.common.block_bucket_plan`` lists the groups of FQNs
that form one transformer-block bucket.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
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
from models.llama3.flavors import Llama3Args


def validate_parallelism(args: Llama3Args, degrees: dict[str, int]) -> None:
    """Reject degrees the model's shapes cannot be split by."""
    if degrees["ep"] > 1:
        raise ConfigError("parallelism.ep > 1 needs a model with experts; llama3 is dense")
    if args.tie_embeddings and degrees["pp"] > 1:
        raise ConfigError(
            f"parallelism.pp = {degrees['pp']}: this model's output projection is tied to its embedding, "
            "and pipeline stages would hold the two apart (the first and the last stage); use pp = 1"
        )
    tp = degrees["tp"]
    n_kv = args.n_kv_heads or args.n_heads
    for what, size in (
        ("n_heads", args.n_heads),
        ("n_kv_heads", n_kv),
        ("vocab_size", args.vocab_size),
        ("ffn hidden dim", args.ffn_hidden_dim),
    ):
        if size % tp != 0:
            raise ConfigError(f"parallelism.tp = {tp} does not divide the model's {what} ({size})")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Split attention heads, feed-forwards, embedding and output over ``tp_mesh`` (module
    docstring), with the residual stream split along the sequence under ``sequence_parallel``."""
    split_vocabulary(model, tp_mesh, sequence_parallel)
    for block in model.layers.values():
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": region_output(sequence_parallel),
            **feed_forward_plan("feed_forward", sequence_parallel),
        }
        if sequence_parallel:
            plan.update(sequence_parallel_norms(["attention_norm", "ffn_norm"]))
            gather_sequence(block.attention, tp_mesh)  # (x, rope): the rope table passes as it is
            gather_sequence(block.feed_forward, tp_mesh)
        parallelize_module(block, tp_mesh, plan)


def parallelize_llama3(model: nn.Module, mesh: DeviceMesh | None, dims: ParallelDims, mp: MixedPrecision) -> nn.Module:
    """Apply TP (if tp > 1), then SimpleFSDP (if any data parallelism; otherwise the plain
    mixed-precision cast). Model is on meta."""
    if mesh is None:
        return cast_for_compute(model, mp)
    model.sequence_shards = dims.sequence_shards  # (context parallel's chunks, sequence parallel's pieces)
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], dims.sequence_parallel)
    return data_parallel_for_job(model, mesh, dims, mp)


__all__ = ["apply_tensor_parallel", "parallelize_llama3", "validate_parallelism"]
