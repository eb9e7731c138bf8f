"""Trace a job at any world size in one CPU process, on the fake process group.

``fake_world(world_size)`` starts PyTorch's fake process group (collectives are recorded,
never run) as rank 0 of ``world_size``; ``trace_job(cfg)`` then builds the job's model on the
meta device with its real parallel layout (``graph_trainer.build``, as the trainer does),
traces the training step on fake tensors and runs its memory policy and passes
(``graph_trainer.pipeline.transform_graph``). Nothing is allocated at model size: this is
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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from graph_trainer.build import build_job_model, build_layout, pass_context
from graph_trainer.config import JobConfig
from graph_trainer.errors import ConfigError
from graph_trainer.passes import PassContext
from graph_trainer.pipeline import transform_graph
from graph_trainer.torch_compat import clear_dtensor_sharding_caches, fake_store
from graph_trainer.tracer import TracedStep, trace_train_step


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks (this process is rank 0) while active."""
    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without a process group")
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)
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
    not pick one (masks, GQA inside the op): the caller then traces the original call."""
    if attn_mask is not None or enable_gqa:
        return None
    aten = torch.ops.aten
    # compute_log_sumexp=True: training keeps the logsumexp for the backward kernel.
    if query.dtype in (torch.bfloat16, torch.float16):
        return aten._scaled_dot_product_cudnn_attention(
            query, key, value, None, True, dropout_p, is_causal, False, scale=scale
        )[0]
    return aten._scaled_dot_product_efficient_attention(
        query, key, value, None, True, dropout_p, is_causal, scale=scale
    )[0]


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
            f"parallelism.pp = {cfg.parallelism.pp}: fake traces (the dry run, analyze) trace a job as one graph "
            f"and do not trace pipeline stages yet; run the job itself, or analyse it with parallelism.pp = 1"
        )
    layout = build_layout(cfg, world_size, device_type)
    model = build_job_model(cfg, layout, torch.device("meta"), model_args, param_dtype)
    t = cfg.training
    batch = torch.empty(t.local_batch_size, t.seq_len, dtype=torch.long, device="meta")
    with _GpuAttention() if gpu_attention else contextlib.nullcontext():
        traced = trace_train_step(
            model,
            batch,
            batch,
            t.loss_chunks,
            grad_scale=layout.loss_scale,
            fake_device=torch.device(device_type),
        )
    return traced, pass_context(cfg, layout, model)


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


__all__ = ["fake_world", "trace_job", "trace_without_passes"]
