"""Trace a job at any world size in one CPU process, on the fake process group.

``fake_world(world_size)`` starts PyTorch's fake process group (collectives are recorded,
never run) as rank 0 of ``world_size``; ``trace_job(cfg)`` then builds the job's model on the
meta device with its real parallel layout (TP, SimpleFSDP, ...), traces the training step on
fake tensors and runs the job's pass pipeline. Nothing is allocated at model size: this is
how real-size layouts (Llama3-8B at FSDP=8 ...) are inspected and simulated on a machine
without GPUs.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from graph_trainer.build import build_model
from graph_trainer.config import JobConfig, resolve_parallel_degrees
from graph_trainer.config import model_args as config_model_args
from graph_trainer.parallel import ParallelDims, build_mesh
from graph_trainer.passes import PassContext, prepare_model_for_passes, run_passes
from graph_trainer.simple_fsdp import MixedPrecision
from graph_trainer.torch_compat import fake_store
from graph_trainer.tracer import TracedStep, trace_train_step
from models.registry import MODEL_SPECS


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


def trace_without_passes(cfg: JobConfig, world_size: int, device_type: str = "cpu",
                         model_args=None) -> tuple[TracedStep, PassContext]:
    """The job's training step at ``world_size`` traced on fake tensors, and the pass context
    the trainer would give its passes. ``model_args`` overrides the flavor's (e.g. fewer layers)."""
    spec = MODEL_SPECS[cfg.model.name]
    args = model_args if model_args is not None else config_model_args(cfg)
    t = cfg.training
    dims = ParallelDims.from_degrees(resolve_parallel_degrees(cfg.parallelism, world_size))
    mesh = build_mesh(dims, device_type)
    mp = MixedPrecision(param_dtype=getattr(torch, t.mixed_precision_param),
                        reduce_dtype=getattr(torch, t.mixed_precision_reduce))
    model = build_model(spec.build, args, torch.device("meta"), t.seed,
                        parallelize=lambda m: spec.parallelize(m, mesh, dims, mp))
    prepare_model_for_passes(model, cfg)
    batch = torch.empty(t.local_batch_size, t.seq_len, dtype=torch.long, device="meta")
    traced = trace_train_step(model, batch, batch, grad_scale=1.0 / dims.dp_size,
                              fake_device=torch.device(device_type))
    context = PassContext(config=cfg, degrees=dims.as_dict(), extras={"bucket_plan": spec.bucket_plan(model)})
    return traced, context


def trace_job(cfg: JobConfig, world_size: int, device_type: str = "cpu", model_args=None) -> TracedStep:
    """The job's training step at ``world_size``, traced on fake tensors, after its passes.

    Must run inside ``fake_world(world_size)`` when ``world_size > 1``. ``device_type`` is
    the device the graph is made for (fake tensors never touch it).
    """
    traced, context = trace_without_passes(cfg, world_size, device_type, model_args)
    traced.gm = run_passes(traced.gm, context, cfg.compile.passes)
    return traced


__all__ = ["fake_world", "trace_job", "trace_without_passes"]
