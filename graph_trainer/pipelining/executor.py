"""Run one step of a pipeline plan on this rank: the stages' actions, and the tensors between them.

``run_pipeline`` walks this rank's actions (``PipelinePlan.actions[rank]``) in order. A forward
takes its input (the microbatch's tokens on stage 0, else the previous stage's output) and hands
its output to the next stage; a backward (B, or its dI half I) takes the next stage's gradient of
that output and hands the gradient of its input back; W takes nothing from outside. Between
stages on one rank the tensor is handed over in memory; between ranks it is sent point to point
over the pipeline group (``dist.isend`` / ``dist.irecv``), each message tagged with its direction,
stage and microbatch so that messages between two ranks match whatever order they are posted in.
Sends are asynchronous; a receive is waited for just before the action that reads it, so a rank
blocks only where the schedule makes it wait. Every send is waited for before the step returns.

Why not PyTorch's pipeline runtime: its ``_PipelineScheduleRuntime`` accepts custom functions for
the compute actions, but its sends and receives read buffers and caches that its
``PipelineStage`` fills when it runs a module itself; our stages run traced graphs whose inputs
and outputs are plain tensors the executor already holds. The schedules' orders are PyTorch's
(``graph_trainer.pipelining.schedule``).

The stage work is the runners' (``graph_trainer.pipelining.runners``): graph and eager runners
take the same calls in the same order, so a graph pipeline equals its eager twin bit for bit when
each stage's graph equals its eager stage.

Fails: a runner's error propagates; a peer that stops answering ends in the pipeline group's
timeout (``graph_trainer.distributed.comm``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from graph_trainer.pipelining.schedule import PipelinePlan

FORWARD_MESSAGE, BACKWARD_MESSAGE = 0, 1


class StageRunner(Protocol):
    """One stage's work on one microbatch at a time (``graph_trainer.pipelining.runners``)."""

    def forward(self, microbatch: int, stage_input: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor: ...

    def backward(self, microbatch: int, output_grad: torch.Tensor | None) -> torch.Tensor | None: ...

    def backward_input(self, microbatch: int, output_grad: torch.Tensor | None) -> torch.Tensor | None: ...

    def backward_weight(self, microbatch: int) -> None: ...


def message_tag(direction: int, stage: int, microbatch: int, microbatches: int) -> int:
    """A tag no other message of the step has: (stage, microbatch) pairs are unique per direction."""
    return 2 * (stage * microbatches + microbatch) + direction


class _Channel:
    """Point-to-point transfers of one step over the pipeline group, and hand-overs on this rank."""

    def __init__(self, plan: PipelinePlan, rank: int, group, make_buffer: Callable[[], torch.Tensor]):
        self.plan, self.rank, self.group, self.make_buffer = plan, rank, group, make_buffer
        self.local: dict[tuple[int, int, int], torch.Tensor] = {}
        self.sends: list = []
        spec = make_buffer()
        self.spec = (tuple(spec.shape), spec.dtype)

    def _check(self, tensor: torch.Tensor, to_stage: int) -> None:
        if (tuple(tensor.shape), tensor.dtype) != self.spec:
            raise RuntimeError(
                f"pipeline stage {to_stage} is handed a {tuple(tensor.shape)} {tensor.dtype} tensor; the stages "
                f"pass {self.spec[0]} {self.spec[1]} (the hidden state in the compute dtype)"
            )

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, self.plan.stage_to_rank[stage])

    def send(self, direction: int, to_stage: int, microbatch: int, tensor: torch.Tensor) -> None:
        self._check(tensor, to_stage)
        if self.plan.stage_to_rank[to_stage] == self.rank:
            self.local[(direction, to_stage, microbatch)] = tensor
            return
        tag = message_tag(direction, to_stage, microbatch, self.plan.microbatches)
        self.sends.append(dist.isend(tensor.contiguous(), self._peer(to_stage), group=self.group, tag=tag))

    def receive(self, direction: int, stage: int, microbatch: int) -> torch.Tensor:
        key = (direction, stage, microbatch)
        if key in self.local:
            return self.local.pop(key)
        from_stage = stage - 1 if direction == FORWARD_MESSAGE else stage + 1
        buffer = self.make_buffer()
        tag = message_tag(direction, stage, microbatch, self.plan.microbatches)
        dist.irecv(buffer, self._peer(from_stage), group=self.group, tag=tag).wait()
        return buffer

    def finish(self) -> None:
        for work in self.sends:
            work.wait()
        if self.local:
            raise RuntimeError(f"pipeline step ended with undelivered hand-overs {sorted(self.local)}")


def run_pipeline(
    plan: PipelinePlan,
    rank: int,
    runners: dict[int, StageRunner],
    tokens: list[torch.Tensor],
    labels: list[torch.Tensor],
    group,
    make_hidden: Callable[[], torch.Tensor],
) -> list[torch.Tensor]:
    """Run this rank's actions of one step (module docstring). ``runners``: this rank's stages;
    ``tokens`` / ``labels``: the step's microbatches (read by the first / last stage);
    ``make_hidden()``: an empty tensor of the shape and dtype passed between stages. Returns the
    last stage's losses in microbatch order if this rank holds it, else an empty list."""
    last = plan.num_stages - 1
    channel = _Channel(plan, rank, group, make_hidden)
    losses: dict[int, torch.Tensor] = {}
    for kind, stage, mb in plan.actions[rank]:
        runner = runners[stage]
        if kind == "F":
            stage_input = tokens[mb] if stage == 0 else channel.receive(FORWARD_MESSAGE, stage, mb)
            out = runner.forward(mb, stage_input, labels[mb] if stage == last else None)
            if stage == last:
                losses[mb] = out
            else:
                channel.send(FORWARD_MESSAGE, stage + 1, mb, out)
        elif kind in ("B", "I"):
            output_grad = None if stage == last else channel.receive(BACKWARD_MESSAGE, stage, mb)
            run = runner.backward if kind == "B" else runner.backward_input
            input_grad = run(mb, output_grad)
            if stage > 0:
                channel.send(BACKWARD_MESSAGE, stage - 1, mb, input_grad)
        elif kind == "W":
            runner.backward_weight(mb)
        else:
            raise ValueError(f"unknown pipeline action kind {kind!r}")
    channel.finish()
    return [losses[mb] for mb in sorted(losses)]


__all__ = ["StageRunner", "message_tag", "run_pipeline"]
