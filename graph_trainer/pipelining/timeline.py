"""Estimates of one pipeline step from its stage graphs: every rank's memory with the microbatches
its schedule keeps in flight, and the schedule's timeline (step time, bubble fraction).

``stage_cost(graphs, traced, device)`` reads one stage's pieces (``split.split_stage``): the
simulated time of each piece on a device model (``analysis.simulator.simulate``: compute and the
stage's own collectives, e.g. FSDP's per-microbatch all-gathers and reduce-scatters), what a
microbatch holds between its pieces, and what each piece allocates above its inputs
(``analysis.memory.estimate_peak_memory``).

With weights resident per step (``compiler.resident``) a stage's cost also holds its gather and
reduce graphs' seconds (``once_seconds``), the gathered weights (``resident_bytes``, held all
step) and its parameters' shards from the gather graph's inputs.

``replay_pipeline(plan, costs, p2p_seconds)`` runs the plan's actions on a clock per rank: each
rank runs its actions in the plan's order, an action starts when its rank is free and its input
has arrived (a forward: the previous stage's forward of that microbatch plus one point-to-point
transfer, none between two stages of one rank; a backward or dI: the next stage's; dW: its own
dI). A rank's once-per-step gathers (every local stage's) run at the step's start, before its first
action, as the trainer's pipeline step runs them: a later stage gathers while it waits for its
first input. The reductions run after the rank's last action. The step ends when the last rank
does; a rank's bubble is the time it is not computing.

``rank_memory(plan, rank, costs, optimizer)`` walks one rank's actions in order (memory depends on
the order, not on the clock) as the runners hold tensors (``graph_trainer.pipelining.runners``):
a forward's saved values from it until the microbatch's backward (or dW), and from dI until dW
what dI keeps for dW and the output gradient. The peak is the largest (held + the running piece's
own allocations) on top of the rank's parameters, gradient accumulation buffer and AdamW state (and
resident weights); the optimizer step is the other moment, as ``analysis.memory.estimate_step_memory``
has it, and with resident weights the gradient reduction a third.

The optimizer step ends the step (``analysis.optimizer_step``): each pipeline rank clips and
updates its own stages' parameter shards (``StageCost.optimizer_params``) after its last action
and reductions; the gradient norm's all-reduce over the pipeline waits for the last rank's
squared norm, then every rank scales and updates (``replay_pipeline``'s ``optimizer``).
``traced_optimizer_step`` costs the same step after a traced step without a pipeline.

Reads: ``input_fqn`` on the stage graphs' placeholders (``tracer.BATCH_INPUTS``: what is held per
microbatch rather than once), ``fsdp_role`` gathered (resident weights, not parameters). Nothing
is written. Fails: a plan whose actions can never all run (a dependency no rank produces) raises
``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from graph_trainer.analysis.cost_model import CollectiveTraffic, traffic_time
from graph_trainer.analysis.devices import DeviceModel
from graph_trainer.analysis.memory import (
    MemoryParts,
    StepMemoryEstimate,
    allocation_owners,
    estimate_peak_memory,
    estimate_step_memory,
    optimizer_memory,
    parameter_tensors,
    reduction_moment,
)
from graph_trainer.analysis.optimizer_step import (
    OptimizerSettings,
    OptimizerStepCost,
    norm_reduce_groups,
    optimizer_step_cost,
)
from graph_trainer.analysis.simulator import simulate
from graph_trainer.compiler.flat_tensors import split_flat, unflatten_tensor
from graph_trainer.compiler.resident import ResidentTrace
from graph_trainer.compiler.tracer import BATCH_INPUTS, TracedStep
from graph_trainer.graph import tags
from graph_trainer.graph.sizes import SizeHints
from graph_trainer.graph.tags import FSDP_ROLE, GATHERED, INPUT_FQN
from graph_trainer.pipelining.schedule import Action, PipelinePlan
from graph_trainer.pipelining.split import StageGraphs, split_stage


@dataclass(frozen=True)
class StageCost:
    """One stage's pieces on a device model: seconds per microbatch, and bytes."""

    seconds: dict[str, float]
    """Simulated seconds of one microbatch's F, B, I and W (``split.StageGraphs``' pieces)."""
    peak_bytes: dict[str, int]
    """Per piece kind, the most it allocates above its inputs (outputs included)."""
    saved_bytes: int
    """Held per microbatch from its forward to its backward (or dW): the forward's saved values
    that are not parameters or buffers."""
    kept_bytes: int
    """Held per microbatch from dI to dW: what dI computes for dW, and the output gradient."""
    params: list[torch.Tensor] = field(repr=False)
    """The stage's parameter and buffer inputs (this rank's shards), resident all step."""
    grad_bytes: int = 0
    """Bytes of the stage's parameter gradients (the accumulation buffer)."""
    output_bytes: int = 0
    """Bytes of the tensor the stage sends on (0 for the last stage: its loss)."""
    resident_bytes: int = 0
    """Weights resident per step (``compiler.resident``): the gathered weights, held all step."""
    reduced_grad_bytes: int = 0
    """Bytes of the gradients the optimizer steps with (``grad_bytes`` unless weights are resident:
    then those are the gathered weights' sums, reduced once per step into these)."""
    once_seconds: dict[str, float] = field(default_factory=dict)
    """Weights resident per step: the simulated seconds of the stage's ``gather`` (at its first
    action of the step) and ``reduce`` (after the rank's last action)."""
    optimizer_params: list[torch.Tensor] = field(default_factory=list, repr=False)
    """The parameters the optimizer steps for this stage (``step_parameters``; with weights resident
    per step, the reduced gradients' layout stands for the gathered ones)."""


_PIECES = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}


def _is_per_microbatch_input(node: fx.Node) -> bool:
    return node.op == "placeholder" and tags.get(node, INPUT_FQN) in BATCH_INPUTS


def _held_output_bytes(gm: fx.GraphModule, skip: int, hints: SizeHints) -> int:
    """Bytes of the distinct allocations behind ``gm``'s outputs after the first ``skip``, less
    the parameter and buffer inputs (resident anyway): what a runner keeps from this piece."""
    nodes = list(gm.graph.nodes)
    owner, size = allocation_owners(nodes, hints)
    outputs = [o for o in nodes[-1].args[0][skip:] if isinstance(o, fx.Node)]
    held = {owner[o] for o in outputs if o in owner}
    return sum(size[a] for a in held if a.op != "placeholder" or _is_per_microbatch_input(a))


def _seconds(
    graph: fx.Graph,
    device: DeviceModel | None,
    ranks_per_node: int,
    fused: bool = False,
    hints: SizeHints | None = None,
) -> float:
    if device is None:
        return 0.0
    return simulate(graph, device, ranks_per_node, record_events=False, fused=fused, hints=hints).step_time


def _bytes(vals: list[torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in vals)


def stage_cost(
    graphs: StageGraphs,
    traced: TracedStep,
    device: DeviceModel | None = None,
    ranks_per_node: int = 8,
    resident: ResidentTrace | None = None,
    fused: bool = False,
) -> StageCost:
    """The costs of one stage (module docstring) from its pieces and its traced joint graph;
    without a ``device`` only the bytes (the seconds are 0: the trainer's memory check).
    ``resident``: the stage's step on weights resident per step (``traced`` is its step graph).
    ``fused``: the pieces' compute costed as Inductor fuses it (``analysis.fusion``); the gather and
    reduce graphs run op by op whatever the backend (only the step graph is compiled)."""
    hints = SizeHints.from_graph(traced.gm.graph)  # (the pieces' data-dependent sizes are made in the forward)
    seconds = {
        kind: _seconds(getattr(graphs, attr).graph, device, ranks_per_node, fused, hints)
        for kind, attr in _PIECES.items()
    }
    peaks = {
        kind: estimate_peak_memory(getattr(graphs, attr).graph, hints).peak_activation_bytes
        for kind, attr in _PIECES.items()
    }
    saved = _held_output_bytes(graphs.forward, 1, hints)
    kept = _held_output_bytes(graphs.backward_input, 1 if graphs.has_input_grad else 0, hints)
    joint = list(traced.gm.graph.nodes)
    placeholders = [n for n in joint if n.op == "placeholder"]
    stage_out = joint[-1].args[0][0].meta["val"]
    boundary = stage_out.numel() * stage_out.element_size() if graphs.takes_output_grad else 0
    grads = [g.meta["val"] for g in joint[-1].args[0][1 : 1 + traced.num_flat_param_grads]]
    gathered = [n for n in placeholders if tags.get(n, FSDP_ROLE) == GATHERED]
    params = [n.meta["val"] for n in placeholders if not _is_per_microbatch_input(n) and n not in gathered]
    once, reduced = {}, _bytes(grads)
    if resident is None:
        stepped = step_parameters(traced)
    else:
        shards = [n.meta["val"] for n in resident.gather.graph.nodes if n.op == "placeholder"]
        params = shards + params
        once = {"gather": _seconds(resident.gather.graph, device, ranks_per_node)}
        once["reduce"] = _seconds(resident.reduce.graph, device, ranks_per_node)
        reduced = _bytes(grads[len(resident.weights.gathered_index) :]) + _bytes(shards)  # (the sums come first)
        stepped = _reduced_parameters(resident) + parameter_tensors(traced.gm.graph, None)[len(gathered) :]
    return StageCost(
        seconds=seconds,
        peak_bytes=peaks,
        saved_bytes=saved,
        kept_bytes=kept + boundary,  # (the runner keeps the output gradient for dW)
        params=params,
        grad_bytes=_bytes(grads),
        output_bytes=boundary,
        resident_bytes=_bytes([n.meta["val"] for n in gathered]),
        reduced_grad_bytes=reduced,
        once_seconds=once,
        optimizer_params=stepped,
    )


def step_parameters(traced: TracedStep) -> list[torch.Tensor]:
    """The parameters a traced step takes, rebuilt from its graph's inputs and their flat specs
    (DTensors where they are one: their local shard is what this rank's optimizer steps)."""
    specs = traced.input_specs[: len(traced.param_names)]
    inputs = [n.meta["val"] for n in traced.gm.graph.nodes if n.op == "placeholder"]
    flat = split_flat(inputs[: sum(spec.num_inner for spec in specs)], specs)
    return [unflatten_tensor(inners, spec) for inners, spec in zip(flat, specs, strict=True)]


def _reduced_parameters(resident: ResidentTrace) -> list[torch.Tensor]:
    """The gathered parameters' gradients the reduce graph makes, rebuilt (their parameters'
    shards and layout)."""
    outputs = [o.meta["val"] for o in list(resident.reduce.graph.nodes)[-1].args[0]]
    flat = split_flat(outputs, resident.reduce_specs)
    return [unflatten_tensor(inners, spec) for inners, spec in zip(flat, resident.reduce_specs, strict=True)]


def traced_optimizer_step(
    traced: TracedStep, device: DeviceModel, training=None, foreach: bool = True, ranks_per_node: int = 8
) -> OptimizerStepCost:
    """The optimizer step after ``traced`` run without a pipeline (``analysis.optimizer_step``):
    its parameters' shards, ``training``'s clipping and weight decay (None: the defaults)."""
    params = step_parameters(traced)
    settings = OptimizerSettings.of(training, foreach)
    return optimizer_step_cost(params, device, settings, norm_reduce_groups(params), ranks_per_node)


def p2p_seconds(nbytes: int, device: DeviceModel, inter_node: bool) -> float:
    """One point-to-point transfer of ``nbytes`` between neighbouring stages' ranks."""
    return traffic_time(CollectiveTraffic("send", 2, float(nbytes), float(nbytes) if inter_node else 0.0), device)


@dataclass(frozen=True)
class PipelineTimeline:
    """The replayed step: when every action ran, on which rank."""

    step_seconds: float
    busy_seconds: dict[int, float]
    """Per rank, the seconds its actions ran."""
    events: list[tuple[int, Action, float, float]]
    """(rank, action, start, end) in the order they were placed."""

    @property
    def bubble_fraction(self) -> float:
        """The share of the ranks' step time spent not computing (waiting on other stages)."""
        if self.step_seconds == 0:
            return 0.0
        return 1.0 - sum(self.busy_seconds.values()) / (len(self.busy_seconds) * self.step_seconds)


def _ready_key(action: Action, last_stage: int) -> tuple[str, int, int] | None:
    """What an action waits for from another stage: the key another action's end sets."""
    kind, stage, mb = action
    if kind == "F":
        return ("F", stage - 1, mb) if stage > 0 else None
    if kind in ("B", "I"):
        return ("G", stage + 1, mb) if stage < last_stage else ("F", stage, mb)
    return ("G", stage, mb)  # W after its own dI


def replay_pipeline(
    plan: PipelinePlan,
    costs: dict[int, StageCost],
    p2p: dict[int, float] | float = 0.0,
    optimizer: dict[int, OptimizerStepCost] | None = None,
) -> PipelineTimeline:
    """Replay ``plan`` with ``costs`` per stage (module docstring). ``p2p``: seconds of one transfer
    across the boundary between stages s and s + 1 (either way), a dict keyed by s or one figure for
    all; none between two stages of one rank. ``optimizer``: each rank's optimizer step, run last
    (``_optimizer_step``)."""
    last = plan.num_stages - 1
    transfer = p2p if isinstance(p2p, dict) else {s: p2p for s in range(plan.num_stages)}
    done: dict[tuple[str, int, int], tuple[float, int]] = {}  # key -> (end, rank)
    # the once-per-step gathers first, on every rank
    clock = {r: sum(costs[s].once_seconds.get("gather", 0.0) for s in plan.local_stages(r)) for r in plan.actions}
    busy = dict(clock)
    position = {r: 0 for r in plan.actions}
    events = []
    remaining = sum(len(a) for a in plan.actions.values())
    while remaining:
        progressed = False
        for rank, actions in plan.actions.items():
            while position[rank] < len(actions):
                action = actions[position[rank]]
                kind, stage, mb = action
                key = _ready_key(action, last)
                arrival = 0.0
                if key is not None:
                    if key not in done:
                        break
                    end, source_rank = done[key]
                    boundary = min(stage, key[1])
                    arrival = end + (transfer[boundary] if source_rank != rank else 0.0)
                start = max(clock[rank], arrival)
                seconds = costs[stage].seconds[kind]
                clock[rank] = start + seconds
                busy[rank] += seconds
                events.append((rank, action, start, clock[rank]))
                done[("F" if kind == "F" else "G" if kind in ("B", "I") else "W", stage, mb)] = (clock[rank], rank)
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: a[position[r]] for r, a in plan.actions.items() if position[r] < len(a)}
            raise ValueError(f"the {plan.schedule} plan cannot proceed: every rank waits ({stuck})")
    for rank in clock:  # reductions once per step, after the rank's last action
        seconds = sum(costs[s].once_seconds.get("reduce", 0.0) for s in plan.local_stages(rank))
        clock[rank] += seconds
        busy[rank] += seconds
    if optimizer:
        _optimizer_step(clock, busy, optimizer)
    return PipelineTimeline(max(clock.values()), busy, events)


def _optimizer_step(clock: dict[int, float], busy: dict[int, float], optimizer: dict[int, OptimizerStepCost]) -> None:
    """Every rank's optimizer step after its clock: its squared gradient norm, the norm's
    all-reduces (over the pipeline too: they start once the last rank's norm is ready), then its
    clip and update. Moves the clocks and counts the ranks' kernels as busy."""
    ready = max(clock[r] + optimizer[r].norm_seconds for r in clock)
    summed = ready + max(optimizer[r].reduce_seconds for r in clock)
    for rank in clock:
        clock[rank] = summed + optimizer[rank].update_seconds
        busy[rank] += optimizer[rank].norm_seconds + optimizer[rank].update_seconds


def _activation_peak(actions: list[Action], costs: dict[int, StageCost]) -> tuple[int, str]:
    """The most one rank holds in activations over its actions, and where (module docstring)."""
    held, peak, where = 0, 0, ""
    for kind, stage, mb in actions:
        cost = costs[stage]
        now = held + cost.peak_bytes[kind]
        if now > peak:
            peak, where = now, f"{kind} of stage {stage}, microbatch {mb}"
        if kind == "F":
            held += cost.saved_bytes
        elif kind == "B":
            held -= cost.saved_bytes
        elif kind == "I":
            held += cost.kept_bytes
        else:
            held -= cost.saved_bytes + cost.kept_bytes
    return peak, where


def rank_memory(plan: PipelinePlan, rank: int, costs: dict[int, StageCost], optimizer=None) -> StepMemoryEstimate:
    """One rank's step memory (module docstring) as ``estimate_step_memory`` reports a step's:
    the pipeline moment (activations: the in-flight microbatches and the running piece) and the
    optimizer step."""
    stages = plan.local_stages(rank)
    params = [p for s in stages for p in costs[s].params]
    opt = optimizer_memory(optimizer)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grads = sum(costs[s].grad_bytes for s in stages)
    resident = sum(costs[s].resident_bytes for s in stages)
    reduced = sum(costs[s].reduced_grad_bytes for s in stages)
    activations, where = _activation_peak(plan.actions[rank], costs)
    state = opt.state_tensors * param_bytes
    pipeline = MemoryParts(
        "pipeline", param_bytes, 0, state, activations, where, accumulated_grads=grads, resident_weights=resident
    )
    (step,) = estimate_step_memory(None, params, optimizer).moments
    step = MemoryParts(step.moment, step.params, reduced, step.optimizer, step.activations)
    moments = (pipeline, step)
    if resident:
        moments += (reduction_moment(param_bytes, reduced, state, grads, resident),)
    return StepMemoryEstimate(moments, activations_estimated=True)


def _boundary_crosses_nodes(rank_a: int, rank_b: int, stage_size: int, ranks_per_node: int) -> bool:
    """Whether a transfer between pipeline ranks ``rank_a`` and ``rank_b`` (each of ``stage_size``
    global ranks, pipeline outermost) crosses nodes for any pair of matching ranks."""
    return any(
        (rank_a * stage_size + i) // ranks_per_node != (rank_b * stage_size + i) // ranks_per_node
        for i in range(stage_size)
    )


@dataclass(frozen=True)
class PipelineEstimate:
    """A pipeline step on a device model: per-stage costs, the replayed timeline, every rank's memory."""

    plan: PipelinePlan
    costs: dict[int, StageCost]
    timeline: PipelineTimeline
    memory: dict[int, StepMemoryEstimate]
    """Per pipeline rank."""
    optimizer: dict[int, OptimizerStepCost] = field(default_factory=dict)
    """Per pipeline rank, its optimizer step (part of ``timeline``'s step)."""

    def worst_memory(self) -> tuple[int, StepMemoryEstimate]:
        """(pipeline rank, estimate) of the rank with the highest peak."""
        return max(self.memory.items(), key=lambda item: item[1].peak_bytes)


def estimate_pipeline(
    plan: PipelinePlan,
    stages: dict[int, TracedStep],
    device: DeviceModel,
    world_size: int,
    ranks_per_node: int = 8,
    optimizer=None,
    resident: dict[int, ResidentTrace] | None = None,
    fused: bool = False,
    training=None,
) -> PipelineEstimate:
    """Cut every stage's graph (``split.split_stage``; stages sharing one trace are costed once),
    cost it, replay ``plan`` and estimate every rank's memory (module docstring). ``world_size``
    and ``ranks_per_node`` place the pipeline ranks on nodes (pipeline outermost), which decides
    whether a point-to-point transfer crosses nodes. ``resident``: per stage, its step on weights
    resident per step (``stages`` holds its step graph). ``fused``: the pieces' compute costed as
    Inductor fuses it (``analysis.fusion``), for ``compile.backend`` inductor. Each rank's optimizer
    step ends the step: ``optimizer``'s AdamW (foreach when it updates all parameters at once) with
    ``training``'s clipping and weight decay (None: the defaults)."""
    by_trace: dict[int, StageCost] = {}
    costs = {}
    for stage, traced in stages.items():
        if id(traced) not in by_trace:
            graphs = split_stage(traced.gm, traced.num_flat_param_grads, grads_into_sums=True)  # (as the runner)
            once = (resident or {}).get(stage)
            by_trace[id(traced)] = stage_cost(graphs, traced, device, ranks_per_node, once, fused)
        costs[stage] = by_trace[id(traced)]
    stage_size = world_size // plan.pp
    p2p = {}
    for stage in range(plan.num_stages):
        if stage == plan.num_stages - 1:
            p2p[stage] = 0.0
            continue
        here, there = plan.stage_to_rank[stage], plan.stage_to_rank[stage + 1]
        crosses = _boundary_crosses_nodes(here, there, stage_size, ranks_per_node)
        p2p[stage] = p2p_seconds(costs[stage].output_bytes, device, crosses)
    settings = OptimizerSettings.of(training, foreach=optimizer_memory(optimizer).all_at_once)
    steps = {}
    for rank in range(plan.pp):
        params = [p for s in plan.local_stages(rank) for p in costs[s].optimizer_params]
        steps[rank] = optimizer_step_cost(params, device, settings, norm_reduce_groups(params, plan.pp), ranks_per_node)
    timeline = replay_pipeline(plan, costs, p2p, steps)  # (the gradient back has the forward output's size)
    memory = {rank: rank_memory(plan, rank, costs, optimizer) for rank in range(plan.pp)}
    return PipelineEstimate(plan, costs, timeline, memory, steps)


__all__ = [
    "PipelineEstimate",
    "PipelineTimeline",
    "estimate_pipeline",
    "StageCost",
    "p2p_seconds",
    "rank_memory",
    "replay_pipeline",
    "stage_cost",
    "step_parameters",
    "traced_optimizer_step",
]
