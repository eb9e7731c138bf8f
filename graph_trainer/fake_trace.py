"""Trace a job at any world size in one CPU process, on the fake process group.

``fake_world(world_size)`` starts PyTorch's fake process group (collectives are recorded,
never run) as rank 0 of ``world_size`` (or another rank: ``fake_world(world_size, rank)``);
``trace_job(cfg)`` then builds the job's model on the meta device with its real parallel layout
(``graph_trainer.build``, as the trainer does), traces the training step on fake tensors and runs
its memory policy and passes
(``graph_trainer.compiler.chain.transform_graph``). Nothing is allocated at model size: this is
how real-size layouts (Llama3-8B at FSDP=8 ...) are inspected and simulated on a machine
without GPUs.

Two opt-in knobs make the CPU trace the graph a GPU run executes (both default off, which
traces exactly what the trainer traces on this machine):

- ``param_dtype``: cast the floating-point parameters to this dtype before tracing ("pure"
  low precision: parameters, and so gradients and optimizer state, in that dtype, no fp32
  master copy), as the one-GPU bf16 runs of ``docs/performance.md`` were.
- ``gpu_attention``: trace ``F.scaled_dot_product_attention`` as the fused kernel PyTorch
  picks on an H100 (cuDNN attention for bf16/fp16, memory-efficient attention for fp32, as
  the measured profiles in docs/h100_profiles/ show). A CPU build cannot select them itself: it traces the CPU flash
  kernel, or for unequal q/v head dims (DeepSeek MLA) an fp32 math decomposition whose cost
  has nothing to do with the GPU's. The fused ops only have fake/meta kernels here, so such a
  graph is for analysis, not for running on CPU.

  With an ``attn_mask`` (context parallel, document masking: ``models.sequence``) SDPA's flash
  kernel does not apply, and PyTorch's default order (flash, memory-efficient, math) runs the
  memory-efficient kernel: ``_scaled_dot_product_efficient_attention`` with the mask as its
  bias, as SDPA passes it: a boolean mask turned into 0 / -inf in the query's dtype, expanded to
  [B, H, Lq, Lk], copied into a row padded to a multiple of 16 where Lk is not one. That kernel
  computes every query x key pair of the bias (no tile is skipped), which is what
  ``cost_model``'s attention FLOPs count for a call without ``is_causal``. (Builds that put cuDNN
  first on an H100 may run cuDNN's kernel with the same bias: the same FLOPs, and the same rates
  in the device model, which gives both kernel classes the fused attention's rates.)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from graph_trainer.build import JobLayout, build_job_model, build_layout, pass_context, stage_modules
from graph_trainer.compiler.chain import transform_graph, transform_resident
from graph_trainer.compiler.passes import PassContext
from graph_trainer.compiler.resident import ResidentTrace, trace_resident
from graph_trainer.compiler.tracer import TracedStep, trace_train_step
from graph_trainer.config import JobConfig
from graph_trainer.errors import ConfigError
from graph_trainer.pipelining.schedule import RankPipeline
from graph_trainer.torch_compat import clear_dtensor_sharding_caches, fake_store


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks, this process being global rank ``rank``, while
    active: a job traced inside it is that rank's (its mesh coordinates: the context-parallel
    chunks it holds, the groups its collectives run on)."""
    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without a process group")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of the {world_size} ranks (0 to {world_size - 1})")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        # DTensor's caches would hand the next world this world's meshes (and group names)
        clear_dtensor_sharding_caches()


class _GpuAttention(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to the fused op an H100 runs (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            fused = _gpu_attention(*args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)


def _gpu_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The output of the fused GPU attention op for these inputs, or None where PyTorch would
    not pick one (GQA inside the op): the caller then traces the original call. A mask runs the
    memory-efficient kernel with it as its bias (module docstring)."""
    if enable_gqa:
        return None
    aten = torch.ops.aten
    # compute_log_sumexp=True: training keeps the logsumexp for the backward kernel.
    if attn_mask is not None:
        bias = _attention_bias(attn_mask, query, key)
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, dropout_p, is_causal, scale=scale
        )[0]
    if query.dtype in (torch.bfloat16, torch.float16):
        return aten._scaled_dot_product_cudnn_attention(
            query, key, value, None, True, dropout_p, is_causal, False, scale=scale
        )[0]
    return aten._scaled_dot_product_efficient_attention(
        query, key, value, None, True, dropout_p, is_causal, scale=scale
    )[0]


BIAS_ALIGNMENT = 16
"""Elements a bias row of the memory-efficient kernel must start on (SDPA pads the rows to it)."""


def _attention_bias(attn_mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``attn_mask`` as SDPA hands it to the memory-efficient kernel: additive in the query's dtype
    (a boolean mask: 0 where True, -inf where False), expanded to [B, H, Lq, Lk] (a view), and
    copied into rows padded to ``BIAS_ALIGNMENT`` elements where Lk is not a multiple of it."""
    if attn_mask.dtype == torch.bool:
        zeros = torch.zeros(attn_mask.shape, dtype=query.dtype, device=attn_mask.device)
        attn_mask = zeros.masked_fill(attn_mask.logical_not(), float("-inf"))
    keys = key.shape[-2]
    bias = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], keys)
    if keys % BIAS_ALIGNMENT:
        padded = F.pad(bias, (0, BIAS_ALIGNMENT - keys % BIAS_ALIGNMENT))
        bias = padded[..., :keys]
    return bias


def trace_without_passes(
    cfg: JobConfig,
    world_size: int,
    device_type: str = "cpu",
    model_args=None,
    param_dtype: torch.dtype | None = None,
    gpu_attention: bool = False,
) -> tuple[TracedStep, PassContext]:
    """The job's training step at ``world_size`` traced on fake tensors, and the pass context
    the trainer would give its passes. ``model_args`` overrides the flavor's (e.g. fewer layers);
    ``param_dtype`` and ``gpu_attention`` are described in the module docstring."""
    if cfg.parallelism.pp > 1:
        raise ConfigError(
            f"parallelism.pp = {cfg.parallelism.pp}: a pipeline is traced stage by stage (trace_pipeline)"
        )
    layout = build_layout(cfg, world_size, device_type, model_args)
    if layout.weights_per_step:
        raise ConfigError(
            "parallelism.fsdp_collectives = per_step without pipeline parallel is not traced on the fake process "
            "group (analyze, dry run): fake traces of weights resident per step are made for pp > 1; "
            "the trainer runs it"
        )
    model = build_job_model(cfg, layout, torch.device("meta"), param_dtype)
    batch = _meta_tokens(cfg)
    traced = _fake_trace(model, cfg, layout, batch, batch, device_type, gpu_attention)
    return traced, pass_context(cfg, layout, model)


def _meta_tokens(cfg: JobConfig) -> torch.Tensor:
    t = cfg.training
    return torch.empty(t.local_batch_size, t.seq_len, dtype=torch.long, device="meta")


def _fake_trace(model, cfg: JobConfig, layout: JobLayout, stage_in, target, device_type: str, gpu_attention: bool):
    """``trace_train_step`` of ``model`` (the job or one stage) on meta inputs, for ``device_type``;
    with weights resident per step, ``compiler.resident.trace_resident`` (a ``ResidentTrace``)."""
    trace = trace_resident if layout.weights_per_step else trace_train_step
    with _GpuAttention() if gpu_attention else contextlib.nullcontext():
        return trace(
            model,
            stage_in,
            target,
            cfg.training.loss_chunks,
            grad_scale=layout.loss_scale,
            fake_device=torch.device(device_type),
        )


def trace_job(
    cfg: JobConfig,
    world_size: int,
    device_type: str = "cpu",
    model_args=None,
    param_dtype: torch.dtype | None = None,
    gpu_attention: bool = False,
) -> TracedStep:
    """The job's training step at ``world_size``, traced on fake tensors, after its memory policy
    and passes.

    Must run inside ``fake_world(world_size)`` when ``world_size > 1``. ``device_type`` is
    the device the graph is made for (fake tensors never touch it).
    """
    traced, context = trace_without_passes(
        cfg, world_size, device_type, model_args, param_dtype=param_dtype, gpu_attention=gpu_attention
    )
    traced.gm = transform_graph(traced.gm, context)
    return traced


def _stage_signatures(pipeline: RankPipeline) -> dict[int, tuple]:
    """Per stage, what its graph depends on: whether it is first or last, and its blocks' costs
    (equal costs: equal blocks, e.g. DeepSeek's dense and MoE blocks differ). Stages of one
    signature trace to the same graph up to parameter names."""
    costs = pipeline.block_costs
    return {
        s: (s == 0, s == pipeline.last_stage, tuple(costs[b] for b in blocks))
        for s, blocks in enumerate(pipeline.stage_blocks)
    }


@dataclasses.dataclass(frozen=True)
class TracedPipeline:
    """A pipeline job traced stage by stage (``trace_pipeline``)."""

    layout: JobLayout
    """The layout of pipeline rank 0 (its ``pipeline`` holds the plan and every stage's blocks)."""
    stages: dict[int, TracedStep]
    """Every stage's joint graph; stages of one signature share one ``TracedStep``."""
    traced_blocks: dict[int, range]
    """Per stage, the blocks its graph was traced with: its own, or those of the stage of equal
    signature it shares the trace with (its parameter and module names are that stage's)."""
    resident: dict[int, ResidentTrace] = dataclasses.field(default_factory=dict)
    """Per stage, with weights resident per step: its gather, step and reduce graphs (``stages``
    holds the step graph)."""


def trace_pipeline(
    cfg: JobConfig,
    world_size: int,
    device_type: str = "cpu",
    param_dtype: torch.dtype | None = None,
    gpu_attention: bool = False,
    passes: bool = True,
    traces: dict | None = None,
) -> TracedPipeline:
    """A pipeline job (``parallelism.pp`` > 1) at ``world_size``, traced stage by stage on fake
    tensors as its ranks trace them (``pipelining.step.PipelineStep``): every stage's joint graph
    after its memory policy and passes (unless ``passes`` is False). Stages of one signature
    (``_stage_signatures``) share one trace; ``traces`` (a dict the caller keeps) shares them
    between calls for jobs that differ only in how the model is staged (``pp_schedule``,
    ``pp_stage_blocks``): a stage's graph depends on its blocks and ends, which its signature
    holds. A stage of pipeline rank r is built with rank r's blocks on this process's mesh (rank
    0's): its collectives have the sizes and node layout of rank r's groups, not their names.
    Must run inside ``fake_world(world_size)``."""
    layout = build_layout(cfg, world_size, device_type)
    pipeline = layout.pipeline
    if pipeline is None:
        raise ConfigError("trace_pipeline needs parallelism.pp > 1")
    tokens = _meta_tokens(cfg)
    hidden_dtype = param_dtype or layout.mp.param_dtype
    batch, seq = tokens.shape  # (a piece of the sequence under sequence parallel: run_stack)
    hidden_shape = (batch, seq // layout.dims.sequence_shards, layout.model_args.dim)
    hidden = torch.empty(hidden_shape, dtype=hidden_dtype, device="meta")
    traced_by_signature: dict[tuple, tuple[TracedStep | ResidentTrace, range]] = traces if traces is not None else {}
    stages: dict[int, TracedStep] = {}
    resident: dict[int, ResidentTrace] = {}
    traced_blocks: dict[int, range] = {}
    modules_of_rank: dict[int, dict[int, nn.Module]] = {}
    for stage, signature in _stage_signatures(pipeline).items():
        if signature not in traced_by_signature:
            rank = pipeline.plan.stage_to_rank[stage]
            rank_layout = dataclasses.replace(layout, pipeline=dataclasses.replace(pipeline, rank=rank))
            if rank not in modules_of_rank:
                model = build_job_model(cfg, rank_layout, torch.device("meta"), param_dtype)
                modules_of_rank[rank] = stage_modules(model, rank_layout.pipeline)
            module = modules_of_rank[rank][stage]
            stage_in, target = (
                tokens if stage == 0 else hidden,
                tokens if stage == pipeline.last_stage else hidden.clone(),
            )
            traced = _fake_trace(module, cfg, layout, stage_in, target, device_type, gpu_attention)
            if passes and isinstance(traced, ResidentTrace):
                transform_resident(traced, pass_context(cfg, rank_layout, module))
            elif passes:
                traced.gm = transform_graph(traced.gm, pass_context(cfg, rank_layout, module))
            traced_by_signature[signature] = (traced, pipeline.stage_blocks[stage])
        traced, traced_blocks[stage] = traced_by_signature[signature]
        if isinstance(traced, ResidentTrace):
            resident[stage], traced = traced, traced.step
        stages[stage] = traced
    return TracedPipeline(layout, stages, traced_blocks, resident)


__all__ = ["TracedPipeline", "fake_world", "trace_job", "trace_pipeline", "trace_without_passes"]
