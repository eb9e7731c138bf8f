"""How a training step gets the loss and the gradients of its microbatches.

``build_gradients`` picks one of three from the job's config and layout:

- eager (``compile.mode = "eager"``): the model run directly, forward then ``autograd.grad``
  (``compiler.tracer.eager_step``): the numerics baseline;
- graph: the traced step (``compiler.tracer.GraphStep``), traced at the first batch of a shape and
  sent through the compile chain (memory policy, passes, backend: ``compiler.chain``);
- pipeline (``parallelism.pp`` > 1): the schedule over this rank's stages
  (``pipelining.step.PipelineStep``), each stage traced and sent through the same chain.

With weights resident per step (``JobLayout.weights_per_step``) graph jobs trace the step as three
graphs (``compiler.resident.ResidentGraphStep``), eager ones run the same parts
(``distributed.resident.EagerResidentStep``): the microbatches' sums are reduced once, by
``AccumulatedGradients``' ``finish``.

Each is a callable ``gradients(microbatches) -> (loss_sum, grads)``: the sum of the microbatches'
losses (each the mean over its tokens) and, in the parameters' order, their gradients of the
scaled losses summed over the microbatches, in microbatch order (graph and eager alike, so graph
== eager holds bitwise). A pipeline's last stage shares its loss sum with every pipeline rank.

Measured beside the step: ``AccumulatedGradients`` times each microbatch's forward, loss and
backward on the device (``loop.metrics.ForwardBackwardTimer``; not under a pipeline schedule,
whose stages overlap). Predicted for it: the memory estimate is logged and recorded as numbers,
and with ``metrics.simulate_device`` the step the analysis simulator predicts for the graph the
job will run (after the memory policy and passes, as the ``none`` backend runs it; clipping and
the optimizer step are not simulated).

Memory: before a step allocates what would not fit, the job's estimated peak per rank (the
largest over the ranks, so every rank decides alike) is checked against the device
(``loop.preflight.check_step_fits``): eager and pipeline jobs at once (parameters, gradients and
optimizer state), a pipeline again once its stages are traced (with the activations its schedule
keeps in flight; an eager pipeline traces its stages on fake tensors for it, before its first
step), a graph job after the memory policy and the passes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from graph_trainer import torch_compat
from graph_trainer.analysis.devices import DEVICES
from graph_trainer.analysis.fusion import fuses
from graph_trainer.analysis.memory import StepMemoryEstimate, estimate_step_memory
from graph_trainer.analysis.simulator import simulate
from graph_trainer.build import JobLayout, pass_context, stage_modules
from graph_trainer.compiler.backend import compile_key
from graph_trainer.compiler.chain import apply_memory_policy, apply_passes, compile_graph, transform_resident
from graph_trainer.compiler.passes.runner import PassRunner
from graph_trainer.compiler.profiler_ranges import add_profiler_ranges
from graph_trainer.compiler.resident import ResidentGraphStep, ResidentTrace, resident_collectives
from graph_trainer.compiler.tracer import GraphStep, TracedStep, eager_step
from graph_trainer.config import JobConfig
from graph_trainer.distributed.comm import first_per_node
from graph_trainer.distributed.parallel_dims import pp_group
from graph_trainer.distributed.resident import EagerResidentStep
from graph_trainer.loop.metrics import ForwardBackwardTimer, MetricsLogger
from graph_trainer.loop.preflight import check_step_fits
from graph_trainer.pipelining.split import split_stage
from graph_trainer.pipelining.step import PipelineStep
from graph_trainer.pipelining.timeline import rank_memory, stage_cost

logger = logging.getLogger("graph_trainer")

Microbatches = list[tuple[torch.Tensor, torch.Tensor]]
Gradients = Callable[[Microbatches], tuple[torch.Tensor, list[torch.Tensor]]]


def _memory_record(estimate: StepMemoryEstimate) -> dict:
    """``estimate`` as numbers for ``metrics.jsonl``: the peak (bytes, moment, parts) and each
    moment's total."""
    p = estimate.peak
    return {
        "peak_bytes": estimate.peak_bytes,
        "peak_moment": p.moment,
        "params_bytes": p.params,
        "grads_bytes": p.grads + p.accumulated_grads,
        "optimizer_bytes": p.optimizer,
        "transient_bytes": p.activations,
        "moment_bytes": {moment.moment: moment.total for moment in estimate.moments},
        "activations_estimated": estimate.activations_estimated,
    }


class AccumulatedGradients:
    """Forward and backward of each microbatch in turn through ``step_fn``. The first microbatch's
    gradients are the accumulation buffer: each later one is added into it in place and dropped,
    so at most one more set is alive at a time. ``timer`` times each forward and backward.
    ``finish`` (weights resident per step) makes the step's gradients from the sums."""

    def __init__(
        self,
        step_fn: Callable,
        device: torch.device,
        timer: ForwardBackwardTimer,
        finish: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
    ):
        self.step_fn, self.device, self.timer, self.finish = step_fn, device, timer, finish

    def __call__(self, microbatches: Microbatches) -> tuple[torch.Tensor, list[torch.Tensor]]:
        loss_sum, accumulated = None, None
        for tokens, labels in microbatches:
            tokens = tokens.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            with self.timer:
                loss, grads = self.step_fn(tokens, labels)
            if accumulated is None:
                loss_sum, accumulated = loss, list(grads)
                continue
            loss_sum = loss_sum + loss
            for acc, g in zip(accumulated, grads, strict=True):
                acc.add_(g)
            del grads
        return loss_sum, self.finish(accumulated) if self.finish is not None else accumulated


class PipelineGradients:
    """The microbatches through the pipeline schedule; the last stage's loss sum is shared with
    every pipeline rank (the others add 0), so every rank logs and checks it."""

    def __init__(self, pipeline_step: PipelineStep, group, device: torch.device):
        self.pipeline_step, self.group, self.device = pipeline_step, group, device

    def __call__(self, microbatches: Microbatches) -> tuple[torch.Tensor, list[torch.Tensor]]:
        moved = [
            (t.to(self.device, non_blocking=True), la.to(self.device, non_blocking=True)) for t, la in microbatches
        ]
        loss_sum, grads = self.pipeline_step(moved)
        if loss_sum is None:
            loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        loss_sum = loss_sum.detach().clone()
        dist.all_reduce(loss_sum, group=self.group)
        return loss_sum, grads


class StepPreparation:
    """What a job does to a traced graph before it runs (the compile chain, logged), and the memory
    checks of its steps (module docstring)."""

    def __init__(
        self,
        cfg: JobConfig,
        layout: JobLayout,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        metrics: MetricsLogger,
        device: torch.device,
    ):
        self.cfg, self.layout, self.model, self.optimizer = cfg, layout, model, optimizer
        self.metrics, self.device = metrics, device
        self.params = list(model.parameters())

    def check_memory(self, graph: fx.Graph | None, estimate: StepMemoryEstimate | None = None) -> None:
        """Log the estimated per-rank peak with its parts; refuse the job when the largest over the
        ranks exceeds the device. ``graph`` None: no traced graph (a lower bound), unless ``estimate``."""
        if estimate is None:
            micro = self.layout.microbatches
            estimate = estimate_step_memory(graph, self.params, self.optimizer, microbatches=micro)
        logger.info("estimated memory per rank: %s", estimate.summary())
        self.metrics.record_event("memory estimate", **_memory_record(estimate))
        peak = torch.tensor([float(estimate.peak_bytes)], dtype=torch.float64, device=self.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # uneven shards differ a little
        check_step_fits(self.cfg, estimate, int(peak.item()), self.device.type)

    def compile(
        self, traced: TracedStep | ResidentTrace, context=None, dumps: str | None = None, pipeline_stage: bool = False
    ) -> TracedStep | ResidentTrace:
        """The compile chain after tracing: memory policy, passes (then the memory check, which for a
        ``pipeline_stage`` waits for every local stage), backend. A ``ResidentTrace`` (weights
        resident per step) goes through ``chain.transform_resident``; its step graph to the backend."""
        step = traced.step if isinstance(traced, ResidentTrace) else traced
        self.metrics.log_event("trace", trace_seconds=step.trace_seconds, graph_nodes=len(step.gm.graph.nodes))
        dumps = self.cfg.compile.dump_graphs if dumps is None else dumps
        context = context or pass_context(self.cfg, self.layout, self.model)
        if isinstance(traced, ResidentTrace):
            transform_resident(traced, context, dumps)
            gm = step.gm
            logger.info("once per step: %s", resident_collectives(traced))
        else:
            runner = PassRunner(context, dumps)
            gm = apply_passes(apply_memory_policy(step.gm, runner), runner)
        if not pipeline_stage:
            self.check_memory(gm.graph)
            self.simulate(gm.graph)
        deterministic = self.device.type == "cpu" or self.cfg.debug.deterministic
        step.gm, report = self._compile_once_per_node(gm, deterministic, pipeline_stage)
        if self.cfg.profiling.enable_profiling and not pipeline_stage:  # (a stage's pieces get theirs)
            step.gm = add_profiler_ranges(step.gm)
        if report.backend != "none":
            self.metrics.log_event(
                "compile",
                backend=report.backend,
                scope=report.scope,
                compile_seconds=report.seconds,
                regions=report.regions,
            )
        return traced

    def _compile_once_per_node(self, gm: fx.GraphModule, deterministic: bool, pipeline_stage: bool):
        """``compile_graph``; with ``compile.once_per_node`` the ranks of a host holding the same graph
        take turns (``distributed.comm.first_per_node``): the first compiles, the others should
        find its result in Inductor's FX graph cache (logged: how many of their lookups missed).
        Not for a pipeline stage: it compiles inside the schedule, where ranks wait for each
        other's activations, not in a barrier."""
        settings = self.cfg.compile

        def compile_it():
            before = dict(torch_compat.inductor_counters())
            compiled = compile_graph(gm, settings, deterministic)
            after = torch_compat.inductor_counters()
            return compiled, after["fxgraph_cache_miss"] - before.get("fxgraph_cache_miss", 0)

        if pipeline_stage or settings.backend != "inductor" or not settings.once_per_node:
            return compile_graph(gm, settings, deterministic)
        if not torch_compat.fx_graph_cache_enabled():
            return compile_graph(gm, settings, deterministic)
        key = compile_key(gm, settings.backend, settings.inductor_scope, deterministic)
        (compiled, misses), first = first_per_node(key, compile_it)
        _log_followers_misses(first, misses)
        return compiled

    def simulate(self, graph: fx.Graph) -> None:
        """Log the step ``metrics.simulate_device``'s model predicts for ``graph``, ranks placed on
        nodes of this node's size (module docstring)."""
        name = self.cfg.metrics.simulate_device
        if name == "none":
            return
        start = time.perf_counter()
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        fused = fuses(self.cfg.compile.backend)
        result = simulate(graph, DEVICES[name], ranks_per_node=ranks_per_node, record_events=False, fused=fused)
        self.metrics.log_event(
            "simulated step",
            device=result.device,
            kernels="fused as Inductor (model)" if fused else "op by op",
            step_ms=result.step_time * 1e3,
            compute_ms=result.compute_time * 1e3,
            exposed_comm_ms=result.exposed_comm_time * 1e3,
            simulate_seconds=time.perf_counter() - start,
        )

    def compile_stage(self, traced: TracedStep, stage: int, module: nn.Module) -> TracedStep:
        """``compile`` for one pipeline stage's graph: the passes see that stage's modules; the memory
        check waits for every local stage (``check_pipeline_memory``)."""
        dumps = self.cfg.compile.dump_graphs and os.path.join(self.cfg.compile.dump_graphs, f"stage{stage}")
        return self.compile(traced, pass_context(self.cfg, self.layout, module), dumps, pipeline_stage=True)

    def check_eager_pipeline_memory(self, step: PipelineStep) -> None:
        """``check_pipeline_memory`` for an eager pipeline rank, whose stages are not traced to run:
        each traced on fake tensors of a microbatch's shape (nothing runs or allocates) and costed
        as a graph job's, so the activations its schedule keeps in flight are counted too."""
        t = self.cfg.training
        tokens = torch.empty(t.local_batch_size, t.seq_len, dtype=torch.long, device="meta")
        costs = {}
        for stage in step.modules:
            traced = step.trace_stage(stage, tokens, tokens.clone(), fake_device=self.device)
            resident = traced if isinstance(traced, ResidentTrace) else None
            joint = resident.step if resident is not None else traced
            graphs = split_stage(joint.gm, joint.num_flat_param_grads)
            costs[stage] = stage_cost(graphs, joint, resident=resident)
        pipeline = self.layout.pipeline
        self.check_memory(None, rank_memory(pipeline.plan, pipeline.rank, costs, self.optimizer))

    def check_pipeline_memory(self, step: PipelineStep) -> None:
        """The memory check of a pipeline rank once its stages are traced: parameters, gradient
        buffer, optimizer state and the activations its schedule keeps in flight
        (``pipelining.timeline.rank_memory``), before the first microbatch allocates them."""
        costs = {
            s: stage_cost(runner.graphs, step.traced[s], resident=step.resident.get(s))
            for s, runner in step.runners.items()
        }
        pipeline = self.layout.pipeline
        self.check_memory(None, rank_memory(pipeline.plan, pipeline.rank, costs, self.optimizer))


def once_per_node_report(first: list[bool], misses: list[int]) -> tuple[int, str]:
    """The log level and line after ``compile.once_per_node``, from each rank's turn (``first``) and
    its FX graph cache misses: a rank that compiled second and missed means the ranks of a host do
    not share the cache folder, so it compiled again (a warning)."""
    waited = [m for m, led in zip(misses, first, strict=True) if not led]
    line = f"compile.once_per_node: {sum(first)} of {len(first)} ranks compiled (the first of each host and graph)"
    if not any(waited):
        loaded = f"; the other {len(waited)} loaded the result from Inductor's FX graph cache" if waited else ""
        return logging.INFO, line + loaded
    return logging.WARNING, (
        f"{line}; the others missed Inductor's FX graph cache {sum(waited)} time(s) and compiled again: is "
        "its folder (compile.cache_dir, $TORCHINDUCTOR_CACHE_DIR) shared by the ranks of a host?"
    )


def _log_followers_misses(first: list[bool], misses: int) -> None:
    every = [misses]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        every = [0] * dist.get_world_size()
        dist.all_gather_object(every, misses)
    logger.log(*once_per_node_report(first, every))


def build_gradients(prep: StepPreparation, hidden_dim: int, timer: ForwardBackwardTimer) -> Gradients:
    """The job's gradients (module docstring): pipeline, graph or eager; ``timer`` times the
    forward and backward of eager and graph jobs."""
    cfg, layout, model = prep.cfg, prep.layout, prep.model
    loss_chunks, grad_scale = cfg.training.loss_chunks, layout.loss_scale
    if layout.pipeline is not None:
        prep.check_memory(None)  # (parameters, gradients, optimizer state; no stage graph yet)
        modules, group = stage_modules(model, layout.pipeline), pp_group(layout.mesh, layout.dims)
        pipeline_step = PipelineStep(
            layout.pipeline,
            model,
            modules,
            group,
            graph=cfg.compile.mode == "graph",
            hidden_dim=hidden_dim,
            hidden_dtype=layout.mp.param_dtype,
            loss_chunks=loss_chunks,
            grad_scale=grad_scale,
            post_trace=lambda traced, stage: prep.compile_stage(traced, stage, modules[stage]),
            on_traced=prep.check_pipeline_memory,
            profiler_ranges=cfg.profiling.enable_profiling,
            weights_per_step=layout.weights_per_step,
        )
        if cfg.compile.mode == "eager":
            prep.check_eager_pipeline_memory(pipeline_step)
        return PipelineGradients(pipeline_step, group, prep.device)
    if cfg.compile.mode == "graph" and layout.weights_per_step:
        graph_step = ResidentGraphStep(model, loss_chunks, grad_scale, post_trace=prep.compile)
        return AccumulatedGradients(graph_step, prep.device, timer, finish=graph_step.grads)
    if cfg.compile.mode == "graph":
        return AccumulatedGradients(
            GraphStep(model, loss_chunks, grad_scale, post_trace=prep.compile), prep.device, timer
        )
    prep.check_memory(None)
    if layout.weights_per_step:
        resident = EagerResidentStep(model)

        def resident_step_fn(tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
            wrt, computing = resident.differentiated()
            with computing:
                loss, grads = eager_step(model, tokens, labels, loss_chunks, grad_scale, wrt=wrt)
            return loss, resident.accumulands(grads)

        return AccumulatedGradients(resident_step_fn, prep.device, timer, finish=resident.grads)

    def step_fn(tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return eager_step(model, tokens, labels, loss_chunks, grad_scale)

    return AccumulatedGradients(step_fn, prep.device, timer)


__all__ = [
    "AccumulatedGradients",
    "Gradients",
    "PipelineGradients",
    "StepPreparation",
    "build_gradients",
    "once_per_node_report",
]
