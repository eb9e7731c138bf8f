"""Build a job: its layout (degrees, mesh, mixed precision), then its model, the one way.

The sequence is the same for the trainer (real tensors) and for fake traces at any world size
(``graph_trainer.fake_trace``: meta tensors on the fake process group), so both trace the same
model:

1. ``build_layout(cfg, world_size, device_type)``: the parallel degrees resolved against the
   world size, the device mesh (None for one process), the mixed-precision dtypes, the
   microbatches per step and the pipeline (schedule plan, stages' blocks, this rank's stages);
2. ``build_job_model(cfg, layout, device)``: construct on the meta device, swap the linears
   ``float8.recipe_name`` chooses for FP8 ones (``models.float8``), cut it to this rank's
   pipeline stages (``parallelism.pp`` > 1: ``models.common.keep_stage``; ``stage_modules`` gives
   each local stage its own module), apply the model's
   parallel plan (``models.<name>.parallelize``: TP, EP, SimpleFSDP), materialise on ``device``
   and initialise (not for ``meta``; not the parameters a Hugging Face folder fills), then let the
   listed passes prepare it for tracing
   (``PassSpec.prepare_model``, e.g. ``ep_overlap``'s chunking);
3. ``pass_context(cfg, layout, model)``: what the passes get beside the graph.

The trainer does other things between 1 and 2 (deciding which checkpoint to resume, opening the
data) so that a wrong checkpoint or dataset fails before the model is built.

Initial weights depend only on the seed and each parameter's FQN, never on how the parameter
is later sharded: every parameter's FULL tensor is drawn from its own generator (seeded from
``(seed, fqn)``) and each rank keeps its piece. So every parallel layout starts from the same
model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from graph_trainer.compiler.passes import PassContext, prepare_model_for_passes
from graph_trainer.config import JobConfig
from graph_trainer.distributed.parallel_dims import (
    ParallelDims,
    build_mesh,
    loss_scale,
    microbatches_per_step,
    pp_rank,
    resolve_parallel_degrees,
    weights_per_step,
)
from graph_trainer.distributed.simple_fsdp import MixedPrecision, clean_fqn
from graph_trainer.errors import ConfigError
from graph_trainer.pipelining.schedule import RankPipeline, plan_pipeline
from graph_trainer.pipelining.stages import stage_ranges
from models import float8
from models.common import block_costs, draw_parameter, keep_stage, stage_view
from models.registry import MODEL_SPECS, model_args
from models.sequence import SequenceLayout

logger = logging.getLogger("graph_trainer")


@torch.no_grad()
def init_parameters(model: nn.Module, rules: dict, seed: int) -> None:
    """Fill every parameter (plain or DTensor) from its init rule; identical across layouts."""
    for name, param in model.named_parameters():
        fqn = clean_fqn(name)
        if fqn not in rules:
            raise KeyError(f"parameter {fqn} has no init rule")
        device = param.device if not isinstance(param, DTensor) else param.to_local().device
        full = draw_parameter(rules[fqn], fqn, tuple(param.shape), seed, device)
        if isinstance(param, DTensor):
            # Every rank drew the same full tensor: keep the local piece without communicating.
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)


def build_model(
    build_fn, args, device: torch.device, seed: int, parallelize=None, check=None, init: bool = True
) -> nn.Module:
    """Construct on meta, apply ``parallelize(model)`` (may be None), materialise on ``device``, init.

    ``check(model)`` (may be None) sees the parallelised model still on the meta device, before
    anything is allocated (the trainer refuses a model state that cannot fit there). ``device``
    meta stops before materialising: the model is then only good for tracing on fake tensors
    (``graph_trainer.fake_trace``), at any size, with no memory. ``init`` False leaves the
    parameters' memory as allocated (uninitialised) for a caller that fills every one of them
    (``checkpoint.initial_load_hf``); buffers are initialised either way.
    """
    with torch.device("meta"):
        model = build_fn(args)
    rules = model.init_rules()
    if parallelize is not None:
        model = parallelize(model)
    if check is not None:
        check(model)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    if init:
        init_parameters(model, rules, seed)
    model.init_buffers(device)
    return model


@dataclass(frozen=True)
class JobLayout:
    """A job's facts, computed once (``build_layout``) and carried: the model's shapes, and where
    the model lives: degrees, mesh (None for one process), mixed precision, how many microbatches
    each data-parallel rank runs per optimizer step, the pipeline."""

    model_args: Any
    """The model's arguments: its flavor's, with ``model.n_layers`` applied (``models.registry.model_args``)."""
    dims: ParallelDims
    mesh: DeviceMesh | None
    mp: MixedPrecision
    microbatches: int = 1
    pipeline: RankPipeline | None = None
    """The pipeline (``parallelism.pp`` > 1): schedule, stages' blocks, this rank's stages."""
    weights_per_step: bool = False
    """SimpleFSDP's gathers and reductions run once per step (``parallel_dims.weights_per_step``)."""

    @property
    def loss_scale(self) -> float:
        """The factor each microbatch's loss gets before backward (``parallel.loss_scale``)."""
        return loss_scale(self.dims.dp_size, self.microbatches, self.dims.cp)


def build_layout(cfg: JobConfig, world_size: int, device_type: str, args=None) -> JobLayout:
    """The job's layout at ``world_size`` (the process group, real or fake, must exist when > 1).
    ``args`` overrides the model's arguments (e.g. analyses of smaller shapes)."""
    args = args if args is not None else model_args(cfg)
    p = cfg.parallelism
    dims = ParallelDims.from_degrees(resolve_parallel_degrees(p, world_size), p.sequence_parallel)
    t = cfg.training
    mp = MixedPrecision(
        param_dtype=getattr(torch, t.mixed_precision_param),
        reduce_dtype=getattr(torch, t.mixed_precision_reduce),
        float8_all_gather=cfg.float8.enable_fsdp_float8_all_gather,
        float8_dispatch=cfg.float8.dispatch_in_float8,
    )
    microbatches = microbatches_per_step(
        t.global_batch_size, t.local_batch_size, dims.dp_size, cfg.parallelism.pp_microbatches
    )
    mesh = build_mesh(dims, device_type)
    pipeline = rank_pipeline(cfg, args, dims.pp, microbatches, pp_rank(mesh, dims)) if dims.pp > 1 else None
    per_step = weights_per_step(cfg.parallelism, dims.dp_size)
    return JobLayout(args, dims, mesh, mp, microbatches, pipeline, per_step)


def rank_pipeline(cfg: JobConfig, args, pp: int, microbatches: int, rank: int) -> RankPipeline:
    """The job's pipeline seen from pipeline rank ``rank``: the schedule's plan and every stage's
    blocks (``parallelism.pp_stage_blocks``, or balanced by the blocks' costs on the meta model of
    ``args``)."""
    p = cfg.parallelism
    plan = plan_pipeline(p.pp_schedule, pp, microbatches)
    with torch.device("meta"):
        model = MODEL_SPECS[cfg.model.name].build(args)
    costs, output_cost = block_costs(model)
    stages = stage_ranges(p.pp_stage_blocks, plan.num_stages, costs, output_cost)
    return RankPipeline(plan, stages, rank, tuple(costs))


def stage_modules(model: nn.Module, pipeline: RankPipeline) -> dict[int, nn.Module]:
    """This rank's stages as modules sharing ``model``'s parameters (``models.common.stage_view``)."""
    return {
        s: stage_view(model, pipeline.stage_blocks[s], s == 0, s == pipeline.last_stage) for s in pipeline.local_stages
    }


def build_job_model(
    cfg: JobConfig,
    layout: JobLayout,
    device: torch.device,
    param_dtype: torch.dtype | None = None,
    check=None,
    init: bool = True,
    document_start: tuple[str, int] | None = None,
) -> nn.Module:
    """The job's model of ``layout.model_args`` on ``layout``, ready to trace (module docstring,
    step 2). ``param_dtype`` casts the floating-point parameters after building
    (``cast_parameters``: analyses of pure low-precision runs); ``check``, ``init``: see
    ``build_model``; ``document_start``: where the tokenizer's documents start (``sequence_layout``)."""
    spec, args = MODEL_SPECS[cfg.model.name], layout.model_args
    pipeline = layout.pipeline

    def parallelize(m: nn.Module) -> nn.Module:
        if cfg.float8.recipe_name != "none":  # the whole model's linears: every filter must match one
            choices = float8.convert_linears(m, cfg.float8, layout.dims.tp)
            logger.info("float8 (%s): %s", cfg.float8.recipe_name, float8.summary(choices))
        if cfg.float8.convert_routed_experts:
            logger.info("float8: the routed experts of %d MoE layers too", float8.convert_routed_experts(m))
        if pipeline is not None:  # this rank's stages only, before anything is sharded or allocated
            m = keep_stage(m, pipeline.rank_blocks(), pipeline.holds_first(), pipeline.holds_last())
        return spec.parallelize(m, layout.mesh, layout.dims, layout.mp)

    model = build_model(spec.build, args, device, cfg.training.seed, parallelize=parallelize, check=check, init=init)
    if param_dtype is not None:
        cast_parameters(model, param_dtype)
    model.sequence_layout = sequence_layout(cfg, layout, document_start)
    prepare_model_for_passes(model, cfg)
    return model


def sequence_layout(cfg: JobConfig, layout: JobLayout, document_start: tuple[str, int] | None) -> SequenceLayout:
    """What the model's attention sees (``models.sequence``): ``training.attention_mask`` (block_causal
    needs ``document_start``, ``data.tokenizer.document_start`` of the job's tokenizer) and this
    rank's place among the context-parallel ranks."""
    t, dims = cfg.training, layout.dims
    if t.attention_mask == "block_causal" and document_start is None:
        raise ConfigError("training.attention_mask block_causal: the model needs where the tokenizer's documents start")
    cp_mesh = layout.mesh["cp"] if dims.cp > 1 else None
    return SequenceLayout(
        mask=t.attention_mask,
        cp=dims.cp,
        cp_rank=cp_mesh.get_local_rank() if cp_mesh is not None else 0,
        cp_mesh=cp_mesh,
        document_start=document_start if t.attention_mask == "block_causal" else None,
        positions_per_document=t.positions_per_document,
    )


def pass_context(cfg: JobConfig, layout: JobLayout, model: nn.Module) -> PassContext:
    """What the passes read besides the graph: the config, the degrees, the model's bucket plan and
    head modules."""
    spec = MODEL_SPECS[cfg.model.name]
    extras = {"bucket_plan": spec.bucket_plan(model), "head_modules": spec.head_modules(model)}
    return PassContext(config=cfg, degrees=layout.dims.as_dict(), extras=extras)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast every floating-point parameter of ``model`` to ``dtype`` in place (buffers keep
    theirs); a parameter shared by several modules stays shared."""
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None or not param.is_floating_point() or param.dtype == dtype:
                continue
            if id(param) not in cast:
                cast[id(param)] = nn.Parameter(param.detach().to(dtype), param.requires_grad)
            module._parameters[name] = cast[id(param)]


__all__ = [
    "JobLayout",
    "build_job_model",
    "build_layout",
    "build_model",
    "cast_parameters",
    "init_parameters",
    "pass_context",
    "rank_pipeline",
    "sequence_layout",
    "stage_modules",
]
