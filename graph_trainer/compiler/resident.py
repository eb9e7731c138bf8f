"""A step on weights resident for the step, traced as three graphs (``parallelism.fsdp_collectives``).

``trace_resident(model, tokens, labels, ...)`` traces what ``graph_trainer.distributed.resident``
runs eagerly (its docstring has the rule and the numerics), as graphs:

- ``gather``: the gathered parameters' flat local shards -> the gathered local tensors (the cast
  and the all-gathers, tagged ``fsdp_role`` unshard with ``fsdp_param``, ``phase`` forward), and
  what the microbatch would compute from them alone (``compiler.hoist``: the float8 weight casts);
  run once per step;
- ``step``: a microbatch's joint graph (``tracer.trace_train_step``) whose inputs are the gathered
  tensors (those it still reads after ``compiler.hoist``, then the values moved to ``gather``),
  then the other parameters, buffers, tokens and labels, and whose gradient outputs are
  the gathered tensors' gradients in the reduce dtype, then the other parameters' (flat); it
  holds no data-parallel collective, so the memory policy's ``reshard_after_forward`` and the
  bucketing passes find nothing of SimpleFSDP's in it; the compile chain and the pipeline's cut
  take it as any traced step; its gathered-weight inputs are tagged ``fsdp_role`` gathered (the
  memory estimate counts them as resident for the step, not as parameters);
- ``reduce``: the summed gradients of the gathered tensors -> those parameters' gradients (flat
  DTensor inners; the collectives tagged ``fsdp_role`` reduce_grad, ``phase`` backward); run once
  per step, after the last microbatch.

``GraphResidentStep`` runs them: the gathered tensors are made at the step's first microbatch and
dropped once ``grads`` has reduced the step's sums.

Fails: a model with no gathered parameter (nothing to keep resident) raises ``ValueError``; the
configuration refuses such jobs first (``graph_trainer.validation``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from graph_trainer import torch_compat
from graph_trainer.compiler.flat_tensors import FlatTensorSpec, flatten_tensor, split_flat, unflatten_tensor
from graph_trainer.compiler.hoist import hoist_invariants
from graph_trainer.compiler.tracer import FlatState, GraphStep, TracedStep, batch_signature, fake_like, trace_train_step
from graph_trainer.distributed.resident import ResidentWeights
from graph_trainer.distributed.simple_fsdp import owner_fqn
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import collective_counts, format_counts
from graph_trainer.graph.tags import BACKWARD, FORWARD, FSDP_ROLE, GATHERED, INPUT, INPUT_FQN, MODULE_FQN, OUTPUT, PHASE

logger = logging.getLogger("graph_trainer")


@dataclass(frozen=True)
class ResidentState(FlatState):
    """The flat state of a step on gathered weights: the gathered tensors (plain, named as their
    parameters) first, then the other parameters, then the buffers."""

    weights: ResidentWeights | None = None

    @classmethod
    def on(cls, model: nn.Module, weights: ResidentWeights, gathered: list[torch.Tensor]) -> ResidentState:
        base = FlatState.of(model)
        n_params = len(base.param_names)
        groups = split_flat(base.flat, base.specs)
        _, direct_groups = weights.split(groups[:n_params])
        _, direct_specs = weights.split(base.specs[:n_params])
        _, direct_names = weights.split(base.param_names)
        plain = [flatten_tensor(g)[1] for g in gathered]
        flat = [*gathered, *(t for group in [*direct_groups, *groups[n_params:]] for t in group)]
        specs = [*plain, *direct_specs, *base.specs[n_params:]]
        return cls(weights.gathered_names + direct_names, base.buffer_names, specs, flat, weights)

    def rebuild(self, flat: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        params, tensors = super().rebuild(flat)
        for name in self.weights.gathered_names:  # (the module reads these through its parametrization)
            del tensors[name]
        return params, tensors

    def computing(self, params: list[torch.Tensor]):
        return self.weights.use(params[: len(self.weights.gathered_index)])

    def finish_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        n = len(self.weights.gathered_index)
        return [*self.weights.to_reduce_dtype(grads[:n]), *grads[n:]]


def _trace_plain(fn: Callable, inputs: list[torch.Tensor], names: list[str], phase: str, device) -> fx.GraphModule:
    """``fn`` traced on fake copies of ``inputs`` (meta ones made on ``device``); every node tagged
    ``phase``, placeholders ``input`` with ``input_fqn`` ``names``."""
    fake_mode = torch_compat.new_fake_mode(shape_env=ShapeEnv(), static_shapes=True, allow_non_fake_inputs=False)
    fake = [fake_like(t, fake_mode, device) for t in inputs]

    def tagged(*args):
        with tags.annotate({PHASE: phase}):
            return fn(*args)

    with torch.fx.traceback.preserve_node_meta(), fake_mode:
        gm = make_fx(tagged, record_stack_traces=False)(*fake)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names, strict=True):
        tags.replace(node, {PHASE: INPUT, MODULE_FQN: owner_fqn(name), INPUT_FQN: name})
    for node in gm.graph.nodes:
        if node.op == "output":
            tags.update(node, {PHASE: OUTPUT, MODULE_FQN: ""})
        tags.set_default(node, PHASE, phase)
        tags.set_default(node, MODULE_FQN, "")
    gm.graph.lint()
    gm.recompile()
    return gm


def _meta_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=dtype or t.dtype, device="meta")


@dataclass
class ResidentTrace:
    """The three graphs of a step on resident weights (module docstring)."""

    weights: ResidentWeights
    gather: fx.GraphModule
    step: TracedStep
    reduce: fx.GraphModule
    reduce_specs: list[FlatTensorSpec] = field(default_factory=list)
    """How ``reduce``'s flat outputs make the gathered parameters' gradients."""


def _gather_graph(weights: ResidentWeights, params: list[torch.Tensor], device) -> fx.GraphModule:
    flat_groups = [flatten_tensor(p) for p in params]
    names = weights.gathered_names

    def gather(*flat: torch.Tensor) -> list[torch.Tensor]:
        groups = split_flat(list(flat), [spec for _, spec in flat_groups])
        out = []
        for rc, group, (_, spec), name in zip(weights.parametrizations, groups, flat_groups, names, strict=True):
            with tags.annotate({MODULE_FQN: owner_fqn(name)}):
                out.append(rc.gather(unflatten_tensor(group, spec)))
        return out

    inputs = [t for inners, _ in flat_groups for t in inners]
    input_names = [name for (inners, _), name in zip(flat_groups, names, strict=True) for _ in inners]
    return _trace_plain(gather, inputs, input_names, FORWARD, device)


def _reduce_graph(weights: ResidentWeights, params: list[torch.Tensor], sums: list[torch.Tensor], device):
    specs: list[FlatTensorSpec] = []
    names = weights.gathered_names

    def reduce(*summed: torch.Tensor) -> list[torch.Tensor]:
        specs.clear()
        out = []
        for rc, param, s, name in zip(weights.parametrizations, params, summed, names, strict=True):
            with tags.annotate({MODULE_FQN: owner_fqn(name)}):
                inners, spec = flatten_tensor(rc.reduce(param, s))
            out.extend(inners)
            specs.append(spec)
        return out

    return _trace_plain(reduce, sums, names, BACKWARD, device), specs


def trace_resident(
    model: nn.Module,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    loss_chunks: int = 1,
    *,
    grad_scale: float = 1.0,
    fake_device: torch.device | None = None,
) -> ResidentTrace:
    """The three graphs of ``model``'s step on resident weights (module docstring); arguments as
    ``tracer.trace_train_step``'s."""
    weights = ResidentWeights(model)
    if not weights.gathered_index:
        raise ValueError("no parameter is gathered by data parallelism: there is nothing to keep resident")
    device = fake_device if fake_device is not None else tokens.device
    gathered_params, _ = weights.split([p for _, p in model.named_parameters()])
    gather = _gather_graph(weights, gathered_params, device)
    outputs = next(n for n in gather.graph.nodes if n.op == "output").args[0]
    templates = [_meta_like(node.meta["val"]) for node in outputs]
    state = ResidentState.on(model, weights, templates)
    step = trace_train_step(model, tokens, labels, loss_chunks, grad_scale=grad_scale, fake_device=device, state=state)
    placeholders = [n for n in step.gm.graph.nodes if n.op == "placeholder"]
    for node in placeholders[: len(templates)]:
        tags.update(node, {FSDP_ROLE: GATHERED})
    moved = hoist_invariants(gather, step.gm)
    if moved:
        logger.info("computed once per step from the gathered weights alone (compiler.hoist): %d values", moved)
    sums = [_meta_like(t, rc.mp.reduce_dtype) for t, rc in zip(templates, weights.parametrizations, strict=True)]
    reduce, specs = _reduce_graph(weights, gathered_params, sums, device)
    return ResidentTrace(weights, gather, step, reduce, specs)


def resident_collectives(trace: ResidentTrace) -> str:
    """The gather and reduce graphs' collectives, for the log."""
    gather, reduce = (format_counts(collective_counts(gm.graph)) for gm in (trace.gather, trace.reduce))
    return f"gather graph {gather}; reduce graph {reduce}"


class GraphResidentStep:
    """Runs a ``ResidentTrace``'s gather and reduce around the microbatches (module docstring)."""

    def __init__(self, trace: ResidentTrace):
        self.trace = trace
        self.gathered: list[torch.Tensor] | None = None

    def _split_params(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        weights = self.trace.weights
        return weights.split([p for _, p in weights.module.named_parameters()])

    def gather(self) -> None:
        """Gather the step's weights, unless this step has gathered them already."""
        if self.gathered is None:
            flat = [t for p in self._split_params()[0] for t in flatten_tensor(p)[0]]
            with torch.no_grad():
                self.gathered = list(self.trace.gather(*flat))

    def step_params(self) -> list[torch.Tensor]:
        """The step graph's parameters: the gathered tensors (``gather``, at the step's first call
        when not before), then the other parameters."""
        self.gather()
        return [*self.gathered, *self._split_params()[1]]

    def grads(self, sums: list[torch.Tensor]) -> list[torch.Tensor]:
        """The step's gradients in ``named_parameters`` order from its sums (one per step-graph
        parameter, ``step_params`` order); the gathered tensors are dropped."""
        n = len(self.trace.weights.gathered_index)
        with torch.no_grad():
            flat = list(self.trace.reduce(*sums[:n]))
        specs = self.trace.reduce_specs
        reduced = [unflatten_tensor(g, s) for g, s in zip(split_flat(flat, specs), specs, strict=True)]
        self.gathered = None
        return self.trace.weights.merge(reduced, sums[n:])


class ResidentGraphStep(GraphStep):
    """``GraphStep`` on resident weights (no pipeline): each call runs a microbatch's step graph on
    the step's gathered weights and returns its loss and ``accumulands`` (the gathered weights'
    gradients in the reduce dtype, then the other parameters'); ``grads(sums)`` reduces the step's
    sums. A batch shape's first call traces (``trace_resident``); ``post_trace`` sees the step graph."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.traces: dict[tuple, ResidentTrace] = {}
        self.runs: dict[tuple, GraphResidentStep] = {}
        self.current: GraphResidentStep | None = None

    def get(self, tokens: torch.Tensor, labels: torch.Tensor) -> TracedStep:
        sig = batch_signature(tokens, labels)
        if sig not in self.traces:
            logger.info("tracing the training step on weights resident per step (gather, microbatch, reduce) ...")
            trace = trace_resident(self.model, tokens, labels, self.loss_chunks, grad_scale=self.grad_scale)
            graph = trace.step.gm.graph
            logger.info(
                "traced in %.2fs: microbatch graph %d nodes, collectives: %s",
                trace.step.trace_seconds,
                len(graph.nodes),
                format_counts(collective_counts(graph)),
            )
            self.traces[sig] = self.post_trace(trace) if self.post_trace is not None else trace
        return self.traces[sig].step

    def __call__(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        traced = self.get(tokens, labels)
        sig = batch_signature(tokens, labels)
        if sig not in self.runs:
            self.runs[sig] = GraphResidentStep(self.traces[sig])
        self.current = self.runs[sig]
        buffers = [b for _, b in self.model.named_buffers()]
        return traced(self.current.step_params(), buffers, tokens, labels)

    def grads(self, sums: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.current is None:
            raise RuntimeError("no microbatch ran in this step")
        grads, self.current = self.current.grads(sums), None
        return grads


__all__ = [
    "GraphResidentStep",
    "ResidentGraphStep",
    "ResidentState",
    "ResidentTrace",
    "resident_collectives",
    "trace_resident",
]
