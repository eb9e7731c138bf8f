"""A pipeline stage's work per microbatch: from its traced graphs, or eagerly (the numerics baseline).

Both runners keep what a microbatch's backward needs from its forward until that backward (the
graph runner: the forward graph's saved values; the eager runner: the autograd graph), and
accumulate the stage's parameter gradients over the step's microbatches in the order the
schedule runs their backwards (the eager runner: the first one's gradients are the buffer, later
ones are added in place, as ``loop.gradients.AccumulatedGradients`` does without a pipeline; the
graph runner: its backward pieces add each gradient into the step's sums in place as soon as it
is computed, ``split.split_stage``'s ``grads_into_sums``, bitwise the same sums). ``take_grads()`` hands
the sums over and starts the next step. With weights resident per step (``resident``: a
``compiler.resident.GraphResidentStep`` or ``distributed.resident.EagerResidentStep``) a stage's
weights are gathered once a step (``gather_resident()``, which the pipeline step calls before its
schedule, or else the stage's first forward), every microbatch differentiates them, the sums are
of their gradients in the reduce dtype, and ``take_grads()`` reduces them once.

The last stage's loss is scaled by ``grad_scale`` (``JobLayout.loss_scale``: 1 / (dp x
microbatches)) before its backward; earlier stages differentiate with the gradient they receive,
which carries the scale. ``forward`` returns the unscaled loss on the last stage.

Numerics: the graph runner's pieces are the stage's joint graph cut in two (or three), bitwise
the joint graph (``graph_trainer.pipelining.split``); the eager runner's dI and dW are two
``torch.autograd.grad`` calls on one autograd graph (the first keeps it), which compute each
gradient with the same ops on the same values as one call.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from graph_trainer.compiler.flat_tensors import split_flat, unflatten_tensor
from graph_trainer.compiler.profiler_ranges import add_profiler_ranges
from graph_trainer.compiler.resident import GraphResidentStep
from graph_trainer.compiler.tracer import TracedStep, loss_head
from graph_trainer.distributed.resident import EagerResidentStep
from graph_trainer.pipelining.split import StageGraphs, split_stage


class _Accumulator:
    def __init__(self) -> None:
        self.sums: list[torch.Tensor] | None = None

    def add(self, grads: list[torch.Tensor]) -> None:
        if self.sums is None:
            self.sums = list(grads)
            return
        for acc, g in zip(self.sums, grads, strict=True):
            acc.add_(g)

    def take(self) -> list[torch.Tensor]:
        if self.sums is None:
            raise RuntimeError("no backward ran on this stage in this step")
        sums, self.sums = self.sums, None
        return sums


class _GraphSums(_Accumulator):
    """A graph stage's gradient sums for one step: made at its first backward of the step
    (``StageGraphs.empty_sums``: -0.0, the additive identity of every value, signed zeros
    included), then added into in place by each backward piece (``take`` as ``_Accumulator``'s)."""

    def __init__(self, graphs: StageGraphs) -> None:
        super().__init__()
        self.graphs = graphs

    def buffers(self, device: torch.device) -> list[torch.Tensor]:
        if self.sums is None:
            self.sums = self.graphs.empty_sums(device)
        return self.sums


class GraphStageRunner:
    """Runs a stage's traced joint graph, cut by ``split.split_stage``, on live tensors.
    ``profiler_ranges``: each piece's nodes as named profiler ranges (``compiler.profiler_ranges``;
    added to the pieces, since a range node has no phase to split it by)."""

    def __init__(
        self,
        traced: TracedStep,
        module: nn.Module,
        profiler_ranges: bool = False,
        resident: GraphResidentStep | None = None,
    ):
        self.traced, self.module, self.resident = traced, module, resident
        self.num_flat_grads = traced.num_flat_param_grads
        self.graphs: StageGraphs = split_stage(traced.gm, self.num_flat_grads, grads_into_sums=True)
        if profiler_ranges:
            graphs = self.graphs
            for piece in (graphs.forward, graphs.backward, graphs.backward_input, graphs.backward_weight):
                add_profiler_ranges(piece)
        self.saved: dict[int, list[torch.Tensor]] = {}
        self.for_weight: dict[int, list[torch.Tensor]] = {}
        self.grads = _GraphSums(self.graphs)
        self.device: torch.device | None = None

    def gather_resident(self) -> None:
        """With weights resident per step: gather this step's now (else at its first forward)."""
        if self.resident is not None:
            self.resident.gather()

    def _inputs(self, stage_input: torch.Tensor, labels: torch.Tensor | None) -> list[torch.Tensor]:
        if self.resident is not None:
            params = self.resident.step_params()
        else:
            params = [p for _, p in self.module.named_parameters()]
        buffers = [b for _, b in self.module.named_buffers()]
        flat = self.traced.flat_inputs(params, buffers, stage_input, labels)
        return flat[:-1] if self.graphs.takes_output_grad else flat  # (output_grad is the backward's)

    def forward(self, microbatch: int, stage_input: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        with torch.no_grad():
            out, *saved = self.graphs.forward(*self._inputs(stage_input, labels))
        self.saved[microbatch] = saved
        self.device = stage_input.device
        return out

    def _output_grad(self, output_grad: torch.Tensor | None) -> list[torch.Tensor]:
        return [output_grad] if self.graphs.takes_output_grad else []

    def backward(self, microbatch: int, output_grad: torch.Tensor | None) -> torch.Tensor | None:
        sums = self.grads.buffers(self.device)
        with torch.no_grad():
            outs = self.graphs.backward(*self.saved.pop(microbatch), *self._output_grad(output_grad), *sums)
        return outs[0] if self.graphs.has_input_grad else None

    def backward_input(self, microbatch: int, output_grad: torch.Tensor | None) -> torch.Tensor | None:
        with torch.no_grad():
            outs = self.graphs.backward_input(*self.saved[microbatch], *self._output_grad(output_grad))
        input_grad, kept = (outs[0], outs[1:]) if self.graphs.has_input_grad else (None, outs)
        self.for_weight[microbatch] = [*self._output_grad(output_grad), *kept]
        return input_grad

    def backward_weight(self, microbatch: int) -> None:
        sums = self.grads.buffers(self.device)
        with torch.no_grad():
            self.graphs.backward_weight(*self.saved.pop(microbatch), *self.for_weight.pop(microbatch), *sums)

    def take_grads(self) -> list[torch.Tensor]:
        """The step's summed gradients, one per parameter (DTensors rewrapped)."""
        specs = self.traced.grad_specs[: len(self.traced.param_names)]
        flat = self.grads.take()
        groups = split_flat(flat, specs)
        grads = [unflatten_tensor(inner, spec) for inner, spec in zip(groups, specs, strict=True)]
        return self.resident.grads(grads) if self.resident is not None else grads


class EagerStageRunner:
    """Runs a stage module op by op with autograd (``compile.mode eager``); with ``resident``, on the
    step's gathered weights (``distributed.resident``)."""

    def __init__(
        self,
        module: nn.Module,
        first: bool,
        last: bool,
        loss_chunks: int,
        grad_scale: float,
        resident: EagerResidentStep | None = None,
    ):
        self.module, self.first, self.last = module, first, last
        self.loss_chunks, self.grad_scale, self.resident = loss_chunks, grad_scale, resident
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]] = {}
        self.output_grads: dict[int, torch.Tensor | None] = {}
        self.grads = _Accumulator()

    def gather_resident(self) -> None:
        """With weights resident per step: gather this step's now (else at its first forward)."""
        if self.resident is not None:
            self.resident.gather()

    def _differentiated(self) -> tuple[list[torch.Tensor], contextlib.AbstractContextManager]:
        if self.resident is None:
            return [p for _, p in self.module.named_parameters()], contextlib.nullcontext()
        return self.resident.differentiated()

    def _add_grads(self, grads: list[torch.Tensor]) -> None:
        self.grads.add(self.resident.accumulands(grads) if self.resident is not None else list(grads))

    def forward(self, microbatch: int, stage_input: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        x = stage_input if self.first else stage_input.detach().requires_grad_(True)
        wrt, computing = self._differentiated()
        with computing:
            if self.last:
                loss = self.module(x, head=loss_head(labels, self.loss_chunks))
                seed = loss * self.grad_scale if self.grad_scale != 1.0 else loss
                self.pending[microbatch] = (seed, None if self.first else x, wrt)
                return loss.detach()
            out = self.module(x)
        self.pending[microbatch] = (out, None if self.first else x, wrt)
        return out.detach()

    def backward(self, microbatch: int, output_grad: torch.Tensor | None) -> torch.Tensor | None:
        seed, x, params = self.pending.pop(microbatch)
        wrt = params + ([x] if x is not None else [])
        grads = torch.autograd.grad(seed, wrt, grad_outputs=output_grad)
        self._add_grads(list(grads[: len(params)]))
        return grads[len(params)] if x is not None else None

    def backward_input(self, microbatch: int, output_grad: torch.Tensor | None) -> torch.Tensor | None:
        seed, x, _ = self.pending[microbatch]
        self.output_grads[microbatch] = output_grad
        if x is None:
            return None
        (input_grad,) = torch.autograd.grad(seed, [x], grad_outputs=output_grad, retain_graph=True)
        return input_grad

    def backward_weight(self, microbatch: int) -> None:
        seed, _, params = self.pending.pop(microbatch)
        grads = torch.autograd.grad(seed, params, grad_outputs=self.output_grads.pop(microbatch))
        self._add_grads(list(grads))

    def take_grads(self) -> list[torch.Tensor]:
        sums = self.grads.take()
        return self.resident.grads(sums) if self.resident is not None else sums


__all__ = ["EagerStageRunner", "GraphStageRunner"]
