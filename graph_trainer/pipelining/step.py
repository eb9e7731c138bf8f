"""One optimizer step's forwards and backwards through the pipeline, on this rank.

``PipelineStep(pipeline, modules, ...)`` is the pipeline's counterpart of the trainer's
microbatch loop (``loop.gradients.AccumulatedGradients``): called with the step's microbatches, it runs
this rank's actions of the schedule (``executor.run_pipeline``) with one runner per local stage
and returns (the sum of the last stage's microbatch losses, or None on a rank without it; the
step's gradients, one per parameter of the rank's model, in ``named_parameters`` order).

Graph mode traces each local stage on the first step (``tracer.trace_train_step`` on the stage
module: a joint forward + backward graph with the stage's own ends), hands it to ``post_trace``
(the trainer's memory policy, passes and backend, so the user's passes run per stage graph),
then cuts it into the pieces the schedule runs (``split.split_stage``); ``on_traced`` then sees
every local stage's runner before the first microbatch runs (the trainer's memory check). With
``weights_per_step`` (``parallelism.fsdp_collectives``) a stage is traced as a gather, microbatch
and reduce graph (``compiler.resident.trace_resident``: ``post_trace`` gets that ``ResidentTrace``,
``resident`` keeps it) and its runner keeps the gathered weights for the step, gathered before the
schedule starts (every local stage's, in stage order: the ranks of a stage's FSDP group hold the
same stages), so that a rank gathers while it waits for its first input. Eager mode runs the same
schedule with ``EagerStageRunner``: the numerics baseline.

The tensor passed between stages is the hidden state [local batch, seq / sequence shards, dim]
in the compute dtype (under sequence parallel each tp rank sends and receives its piece of the
sequence: ``models.common.run_stack``); a stage output of another shape or dtype raises ``RuntimeError`` naming both
(``executor``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn as nn

from graph_trainer.compiler.resident import GraphResidentStep, ResidentTrace, trace_resident
from graph_trainer.compiler.tracer import TracedStep, trace_train_step
from graph_trainer.distributed.resident import EagerResidentStep
from graph_trainer.graph.collectives import collective_counts, format_counts
from graph_trainer.pipelining.executor import run_pipeline
from graph_trainer.pipelining.runners import EagerStageRunner, GraphStageRunner
from graph_trainer.pipelining.schedule import RankPipeline

logger = logging.getLogger("graph_trainer")


class PipelineStep:
    def __init__(
        self,
        pipeline: RankPipeline,
        model: nn.Module,
        modules: dict[int, nn.Module],
        group,
        *,
        graph: bool,
        hidden_dim: int,
        hidden_dtype: torch.dtype,
        loss_chunks: int,
        grad_scale: float,
        post_trace: Callable[[TracedStep | ResidentTrace, int], TracedStep | ResidentTrace] | None = None,
        on_traced: Callable[[PipelineStep], None] | None = None,
        profiler_ranges: bool = False,
        weights_per_step: bool = False,
    ):
        self.pipeline, self.model, self.modules, self.group = pipeline, model, modules, group
        self.graph, self.hidden_dim, self.hidden_dtype = graph, hidden_dim, hidden_dtype
        self.loss_chunks, self.grad_scale, self.post_trace = loss_chunks, grad_scale, post_trace
        self.on_traced, self.profiler_ranges = on_traced, profiler_ranges
        self.weights_per_step = weights_per_step
        self.runners: dict[int, GraphStageRunner | EagerStageRunner] = {}
        self.traced: dict[int, TracedStep] = {}
        self.resident: dict[int, ResidentTrace] = {}
        """Per local stage with ``weights_per_step``: its gather, microbatch and reduce graphs."""
        if not graph:
            last = pipeline.last_stage
            self.runners = {
                s: EagerStageRunner(
                    m, s == 0, s == last, loss_chunks, grad_scale, EagerResidentStep(m) if weights_per_step else None
                )
                for s, m in modules.items()
            }

    def _hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, seq = tokens.shape  # (a piece of the sequence under sequence parallel: run_stack)
        shape = (batch, seq // self.model.sequence_shards, self.hidden_dim)
        return torch.empty(shape, dtype=self.hidden_dtype, device=tokens.device)

    def trace_stage(
        self, stage: int, tokens: torch.Tensor, labels: torch.Tensor, fake_device: torch.device | None = None
    ) -> TracedStep | ResidentTrace:
        """Local stage ``stage`` traced for a microbatch of ``tokens``' shape (``trace_train_step``, or
        ``trace_resident`` with ``weights_per_step``); meta ``tokens`` need ``fake_device``."""
        trace = trace_resident if self.weights_per_step else trace_train_step
        return trace(
            self.modules[stage],
            tokens if stage == 0 else self._hidden(tokens),
            labels if stage == self.pipeline.last_stage else self._hidden(tokens),  # (another tensor)
            self.loss_chunks,
            grad_scale=self.grad_scale,
            fake_device=fake_device,
        )

    def _trace(self, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        """Trace, transform and cut every local stage (the first step)."""
        for stage, module in self.modules.items():
            logger.info("tracing pipeline stage %d (blocks %s) ...", stage, _blocks(self.pipeline.stage_blocks[stage]))
            traced = self.trace_stage(stage, tokens, labels)
            step = traced.step if isinstance(traced, ResidentTrace) else traced
            logger.info(
                "stage %d traced in %.2fs: %d nodes, collectives: %s",
                stage,
                step.trace_seconds,
                len(step.gm.graph.nodes),
                format_counts(collective_counts(step.gm.graph)),
            )
            if self.post_trace is not None:
                traced = self.post_trace(traced, stage)
            if isinstance(traced, ResidentTrace):
                self.resident[stage], traced = traced, traced.step
            self.traced[stage] = traced
            resident = GraphResidentStep(self.resident[stage]) if stage in self.resident else None
            self.runners[stage] = GraphStageRunner(traced, module, self.profiler_ranges, resident)
        if self.on_traced is not None:
            self.on_traced(self)

    def __call__(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor | None, list]:
        tokens = [t for t, _ in microbatches]
        labels = [lab for _, lab in microbatches]
        if self.graph and not self.runners:
            self._trace(tokens[0], labels[0])
        for runner in self.runners.values():  # (before the schedule: a later stage gathers while it waits)
            runner.gather_resident()
        losses = run_pipeline(
            self.pipeline.plan,
            self.pipeline.rank,
            self.runners,
            tokens,
            labels,
            self.group,
            lambda: self._hidden(tokens[0]),
        )
        grads: dict[str, torch.Tensor] = {}
        for stage, runner in self.runners.items():
            names = [n for n, _ in self.modules[stage].named_parameters()]
            grads.update(zip(names, runner.take_grads(), strict=True))
        ordered = [grads[name] for name, _ in self.model.named_parameters()]
        loss_sum = None
        for loss in losses:  # (in microbatch order, as the loop without a pipeline sums them)
            loss_sum = loss if loss_sum is None else loss_sum + loss
        return loss_sum, ordered


def _blocks(blocks: range) -> str:
    return f"{blocks.start}..{blocks.stop - 1}"


__all__ = ["PipelineStep"]
