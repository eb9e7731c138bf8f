"""How LLaMA-3 is laid out over the mesh: tensor parallel first, then SimpleFSDP.

Tensor parallel (``tp`` mesh dim), Megatron style:

- attention: ``wq``, ``wk``, ``wv`` column-parallel (each rank holds n_heads/tp query heads and
  n_kv_heads/tp kv heads), ``wo`` row-parallel (an all_reduce of the output);
- feed-forward: ``w1``, ``w3`` column-parallel, ``w2`` row-parallel;
- ``tok_embeddings`` row-parallel over the vocabulary, ``output`` column-parallel over the
  vocabulary with the logits gathered (Replicate) for the loss;
- norms stay replicated (no sequence parallel in this version).

Then every parameter goes to SimpleFSDP over the data-parallel dims
(``graph_trainer.distributed.simple_fsdp``). The tracer tags every node with its module FQN, which is
what the passes use to find blocks; ``models.common.block_bucket_plan`` lists the groups of FQNs
that form one transformer-block bucket.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from graph_trainer.distributed.parallel_dims import ParallelDims, dp_mesh_dims
from graph_trainer.distributed.simple_fsdp import MixedPrecision, cast_for_compute, data_parallel
from graph_trainer.errors import ConfigError
from models.common import feed_forward_plan, split_vocabulary
from models.llama3.flavors import Llama3Args


def validate_parallelism(args: Llama3Args, degrees: dict[str, int]) -> None:
    """Reject degrees the model's shapes cannot be split by."""
    if degrees["ep"] > 1:
        raise ConfigError("parallelism.ep > 1 needs a model with experts; llama3 is dense")
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


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    split_vocabulary(model, tp_mesh)
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(),
                **feed_forward_plan("feed_forward"),
            },
        )


def parallelize_llama3(model: nn.Module, mesh: DeviceMesh | None, dims: ParallelDims, mp: MixedPrecision) -> nn.Module:
    """Apply TP (if tp > 1), then SimpleFSDP (if any data parallelism; otherwise the plain
    mixed-precision cast). Model is on meta."""
    if mesh is None:
        return cast_for_compute(model, mp)
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    dp_dims = dp_mesh_dims(dims)
    if dp_dims:
        full = mesh[(*dp_dims, "tp")] if dims.tp > 1 else None
        data_parallel(model, mesh[dp_dims], dims.fsdp_mode, mp, full_mesh=full)
    else:
        cast_for_compute(model, mp)
    return model


__all__ = ["apply_tensor_parallel", "parallelize_llama3", "validate_parallelism"]
