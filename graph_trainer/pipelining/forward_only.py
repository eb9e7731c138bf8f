"""Forward passes alone through the pipeline: the loss of held-out batches (``loop.held_out``).

``forward_only_plan(plan, microbatches)``: every rank runs the forward (F) of each of its stages
for every microbatch, its stages in stage order and, within a stage, the microbatches in order
(GPipe's forward half, whatever the training schedule is). A stage's forward of microbatch m
reads only the previous stage's forward of m, which its own rank ran earlier in this order or
another rank sends (``executor.run_pipeline``: sends are asynchronous), so every action can run:
nothing waits for an action that waits for it.

``ForwardOnlyRunner`` runs a stage module op by op without autograd: the stage's output, or on
the last stage the loss (the models' ``head``: ``compiler.tracer.loss_head``). Its forward is the
eager runner's forward on the same inputs, without the graph autograd would keep for a backward;
it has no backward.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from graph_trainer.compiler.tracer import loss_head
from graph_trainer.pipelining.schedule import PipelinePlan


def forward_only_plan(plan: PipelinePlan, microbatches: int) -> PipelinePlan:
    """``plan``'s stages and ranks, with ``microbatches`` forwards per stage and nothing else
    (module docstring)."""
    if microbatches < 1:
        raise ValueError(f"a forward-only pipeline needs at least one microbatch, got {microbatches}")
    actions = {
        rank: [("F", stage, mb) for stage in plan.local_stages(rank) for mb in range(microbatches)]
        for rank in range(plan.pp)
    }
    return PipelinePlan(f"{plan.schedule}, forward only", plan.pp, microbatches, dict(plan.stage_to_rank), actions)


class ForwardOnlyRunner:
    """One stage's forwards without autograd (module docstring)."""

    def __init__(self, module: nn.Module, last: bool, loss_chunks: int):
        self.module, self.last, self.loss_chunks = module, last, loss_chunks

    def forward(self, microbatch: int, stage_input: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        with torch.no_grad():
            if self.last:
                return self.module(stage_input, head=loss_head(labels, self.loss_chunks))
            return self.module(stage_input)

    def backward(self, microbatch: int, output_grad: torch.Tensor | None) -> torch.Tensor | None:
        raise RuntimeError("a forward-only pipeline runs no backward")

    backward_input = backward

    def backward_weight(self, microbatch: int) -> None:
        raise RuntimeError("a forward-only pipeline runs no backward")


__all__ = ["ForwardOnlyRunner", "forward_only_plan"]
