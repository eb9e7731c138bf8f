"""Peak memory of one training step on one rank: parameters, gradients, optimizer state and
the traced graph's own transient memory, reported apart.

Reads: a graph traced by ``graph_trainer.compiler.tracer.trace_train_step`` (inputs: the parameters'
local tensors first, then buffers, tokens and labels; outputs: the loss, then one gradient
tensor per parameter tensor), optionally the parameters themselves (plain tensors or
DTensors: their local shard on this rank counts) and the optimizer (a torch optimizer, the
job's ``Training`` section, or an ``OptimizerMemory``). Sizes come from ``node.meta["val"]``
(fake or real tensors recorded while tracing) and the tensors' metadata, so real-size
models traced on the fake process group are estimated without allocating anything.

Reports (``StepMemoryEstimate``): per moment of the step, the bytes of

- **params**: the parameters as stored (the local shard of each DTensor parameter, in its
  own dtype: the fp32 master weights under mixed precision);
- **grads**: the gradients alive at that moment's peak (the local reduced shard of each, as
  the graph outputs them; the parameters' layout and dtype when no graph is given);
- **optimizer**: the state the optimizer keeps between steps (AdamW: ``exp_avg`` and
  ``exp_avg_sq``, each of the parameter's shape and dtype; its ``step`` scalars are
  negligible and not counted);
- **activations**: the moment's transient memory. In the graph: everything the graph
  allocates besides gradients (activations saved for backward, gathered parameters,
  collectives' buffers, the loss region) plus the non-parameter inputs (buffers, tokens,
  labels), which ``estimate_peak_memory`` below replays node by node. In the optimizer step:
  the temporaries of clipping and of the update of one parameter;
- **resident weights** (``parallelism.fsdp_collectives`` per_step): the graph's inputs tagged
  ``fsdp_role`` gathered, the weights gathered once and kept for the step; the graph's
  gradients are then their sums (**accumulated grads**, in the reduce dtype), and a
  "gradient reduction" moment holds those sums, the reduced gradients and the weights together;

and the peak: the moment with the largest sum of its parts.

Model of time (one steady-state step, i.e. from the second step on, per rank):

1. Before the graph: parameters and optimizer state are resident; the previous step's
   gradients are gone (the trainer sets ``p.grad`` to None after ``optimizer.step()`` and
   drops its list of gradients when the step returns).
2. **Graph** (forward, loss, backward): the replay below. Parameters and optimizer state
   stay resident throughout. Each gradient is allocated by the node that produces it
   (the reduce-scatter's result, or its cast) and, being a graph output, lives to the end:
   gradients accumulate during backward, so at the graph's peak only those produced so far
   count. Every other allocation is made when its node runs and freed after its last reader.
3. **Optimizer step** (clip, AdamW, then ``zero_grad``): parameters, all gradients,
   optimizer state, plus the temporaries of the parameter being worked on: clipping squares
   one gradient at a time (``g.float().pow(2)``: one fp32 copy, two if the gradient is not
   fp32); single-tensor AdamW (``foreach=False``, as ``graph_trainer.loop.optim.build_optimizer``
   makes it on CPU) builds ``exp_avg_sq.sqrt() / c`` for one parameter at a time (two temporaries
   of its size at once); a ``foreach`` AdamW (``build_optimizer`` on CUDA: ``adamw_memory``)
   builds that for all parameters of a group at once (counted as all parameters); a ``fused``
   one none.

With gradient accumulation (``microbatches`` M > 1, ``graph_trainer.trainer``) the graph runs M
times per step; from the second microbatch on, the sum of the earlier microbatches' gradients
(all gradient outputs' bytes: the accumulation buffer) is resident beside the graph's own, so
moment 2 counts it as ``accumulated_grads``. Moment 3 is unchanged: each microbatch's gradients
are added into the buffer and dropped, and the optimizer sees the buffer.

The peak is the larger of moments 2 and 3. The first step is lower: the optimizer state is
created lazily inside its first ``step()``. In eager mode (no graph) the activations are not
known: the estimate is moment 3 only, a lower bound (``activations_estimated`` is False).

Assumptions and what is ignored: allocations are counted, not nodes (a view, a
``wait_tensor`` share their source's memory; each output of a multi-output kernel, taken by
its ``getitem``, is an allocation of its own, freed after its own last reader, as the caching
allocator frees it: attention's small logsumexp saved for backward does not keep its large
output alive); the caching allocator's
fragmentation and rounding, kernels' workspaces (cuBLAS, attention), the CUDA context and
the memory a collective library keeps for itself are not counted: the estimate compares with
``torch.cuda.max_memory_allocated``, and the device needs somewhat more. The graph's
activations are those of the kernels it was traced for: a graph traced on a (fake) CPU
device counts what CPU kernels allocate, e.g. the S x S attention matrix of the math SDPA
fallback that DeepSeek-V3's MLA (query/key head dim != value head dim) takes on CPU and no
CUDA attention kernel allocates, so such graphs are over-estimated. Data-dependent sizes
(expert-parallel all_to_all) are made concrete by balanced routing (``SizeHints.from_graph``).
``memory_warning`` compares the peak with a device memory the caller gives (this module
never asks CUDA).

Checked against one H100 (``torch.cuda.max_memory_allocated``, one process): the LLaMA-3
8B-shaped cases (fp32 and pure bf16, a few layers) agree closely; the DeepSeek-V3 16B-shaped
case traced on CPU is over-estimated by the CPU attention fallback above (measured:
docs/performance.md).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from graph_trainer.distributed.parallel_dims import local_tensor
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import is_wait
from graph_trainer.graph.ops import aliases_input, mutated_args
from graph_trainer.graph.sizes import SizeHints
from graph_trainer.graph.tags import FSDP_ROLE, GATHERED, INPUT_FQN

GIB = float(1 << 30)

DEVICE_MEMORY_BYTES: dict[str, int] = {"h100": round(79.1 * (1 << 30))}
"""Usable memory by device model name (``devices.DEVICES``): an H100 SXM "80 GB" shows
about 79.1 GiB to PyTorch. Devices without an entry (``cpu``) are not checked."""


# --------------------------------------------------------------------------------------
# The graph: replay the node order


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak of one traced graph's live allocations, inputs and produced outputs included."""

    peak_bytes: int
    """Largest sum of live allocations at any point of the step (inputs included)."""
    input_bytes: int
    """Bytes of the graph inputs, live throughout."""
    peak_node: str
    """Name of the node at which the peak is reached."""
    param_bytes: int = 0
    """Bytes of the parameter inputs (the first placeholders, one per gradient output)."""
    grad_bytes: int = 0
    """Bytes of the gradient outputs already produced at the peak."""
    total_grad_bytes: int = 0
    """Bytes of all gradient outputs (alive once the graph has run)."""
    resident_bytes: int = 0
    """Bytes of the inputs that are gathered weights resident for the step (``fsdp_role``
    gathered; counted in ``param_bytes`` too, as the graph's parameter inputs)."""

    @property
    def peak_activation_bytes(self) -> int:
        """The peak minus the inputs: what the step itself allocates at its worst point."""
        return self.peak_bytes - self.input_bytes

    @property
    def transient_bytes(self) -> int:
        """The peak minus parameters and gradients: activations, gathered parameters,
        collective buffers, and the non-parameter inputs."""
        return self.peak_bytes - self.param_bytes - self.grad_bytes


def _aliases_input(node: fx.Node) -> bool:
    """Nodes whose result is (a view of) their first input's memory, not a new allocation: views,
    ``getitem`` (picks a result), waits (hand back the collective's buffer) and in-place ops on
    their first input (``add_``: a pipeline stage adding its gradients into the step's sums)."""
    return is_wait(node) or aliases_input(node) or (bool(node.args) and node.args[0] in mutated_args(node))


def _graph_outputs(nodes: list[fx.Node]) -> list:
    """The output node's values, flat: [loss, *gradients] for a traced step."""
    if not nodes or nodes[-1].op != "output":
        return []
    out = nodes[-1].args[0]
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _allocations(nodes: list[fx.Node], sizes: SizeHints) -> tuple[dict[fx.Node, fx.Node], dict[fx.Node, int]]:
    """(owner of every value: the node that allocated its memory, bytes of every owner)."""
    owner: dict[fx.Node, fx.Node] = {}
    size: dict[fx.Node, int] = {}
    picked: dict[tuple[fx.Node, object], fx.Node] = {}
    for node in nodes:
        if node.op == "output":
            continue
        source = node.args[0] if node.args else None
        if _picks_kernel_output(node, owner):  # (each output of a kernel is an allocation of its own)
            first = picked.setdefault((source, node.args[1]), node)
            owner[node] = first
            if first is not node:
                continue
            size[node] = sizes.nbytes(node.meta.get("val"))
            size[source] -= size[node]
        elif _aliases_input(node) and isinstance(source, fx.Node) and source in owner:
            owner[node] = owner[source]
        else:
            owner[node] = node
            size[node] = sizes.nbytes(node.meta.get("val"))
    return owner, size


def _picks_kernel_output(node: fx.Node, owner: dict[fx.Node, fx.Node]) -> bool:
    """A ``getitem`` taking one output of a multi-output kernel that allocated its outputs (not of
    a view op such as ``split``, whose outputs share their input's memory)."""
    source = node.args[0] if node.args else None
    return (
        node.target is operator.getitem
        and isinstance(source, fx.Node)
        and owner.get(source) is source
        and isinstance(source.meta.get("val"), (tuple, list))
        and isinstance(node.meta.get("val"), torch.Tensor)
    )


def allocation_owners(
    nodes: list[fx.Node], sizes: SizeHints | None = None
) -> tuple[dict[fx.Node, fx.Node], dict[fx.Node, int]]:
    """The node that allocated every value's memory (views, getitems and waits resolve to their
    source), and the bytes of every such allocation; ``sizes`` as ``estimate_peak_memory``'s."""
    return _allocations(nodes, sizes or SizeHints.from_graph(nodes[0].graph))


def _frees(nodes: list[fx.Node], owner: dict[fx.Node, fx.Node], pinned: set[fx.Node]) -> dict[int, list[fx.Node]]:
    """Index of the node after which each unpinned allocation is freed (its last reader)."""
    last_use: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        if node in owner:
            last_use[owner[node]] = max(last_use.get(owner[node], i), i)
        for arg in node.all_input_nodes:
            if arg in owner:
                last_use[owner[arg]] = i
    frees_at: dict[int, list[fx.Node]] = {}
    for alloc, i in last_use.items():
        if alloc not in pinned:
            frees_at.setdefault(i, []).append(alloc)
    return frees_at


def estimate_peak_memory(graph: fx.Graph, sizes: SizeHints | None = None) -> MemoryEstimate:
    """Replay ``graph`` in node order and return its peak of live allocation bytes.

    Allocations are identified by the node that made them (views, waits and getitems
    resolve to their source node), not by the tensors recorded in ``meta["val"]``: a pass
    that copies nodes may share those records between the original and the copy. Inputs are
    held by the caller for the whole step; outputs live from their node to the end.
    Data-dependent sizes (expert-parallel all_to_all) are made concrete by ``sizes``
    (default ``SizeHints.from_graph``: balanced routing).
    """
    sizes = sizes or SizeHints.from_graph(graph)
    nodes = list(graph.nodes)
    owner, size = _allocations(nodes, sizes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    returned = _graph_outputs(nodes)
    params = _parameter_inputs(placeholders, len(returned) - 1)
    grads = {owner[a] for a in returned[1:] if isinstance(a, fx.Node) and a in owner} - set(placeholders)
    pinned = {owner[n] for n in placeholders} | {owner[a] for a in returned if isinstance(a, fx.Node) and a in owner}
    frees_at = _frees(nodes, owner, pinned)

    peak, peak_node, peak_grads, current, current_grads = 0, "", 0, 0, 0
    for i, node in enumerate(nodes):
        current += size.get(node, 0)
        if node in grads:
            current_grads += size[node]
        if current > peak:
            peak, peak_node, peak_grads = current, node.name, current_grads
        for alloc in frees_at.get(i, []):
            current -= size[alloc]
    return MemoryEstimate(
        peak_bytes=peak,
        input_bytes=sum(size[n] for n in placeholders),
        peak_node=peak_node,
        param_bytes=sum(size[n] for n in params),
        grad_bytes=peak_grads,
        total_grad_bytes=sum(size[n] for n in grads),
        resident_bytes=sum(size[n] for n in placeholders if tags.get(n, FSDP_ROLE) == GATHERED),
    )


# --------------------------------------------------------------------------------------
# The optimizer


@dataclass(frozen=True)
class OptimizerMemory:
    """What an optimizer keeps and allocates, in units of one parameter's own bytes."""

    name: str
    state_tensors: int
    """Tensors of each parameter's shape and dtype kept between steps (AdamW: 2)."""
    temporaries: int
    """Parameter-sized temporaries alive at once while one parameter is updated."""
    all_at_once: bool = False
    """The update works on all parameters at once (``foreach``): temporaries of all of them."""


ADAMW = OptimizerMemory("AdamW", state_tensors=2, temporaries=2)
"""``torch.optim.AdamW(..., foreach=False)``: ``graph_trainer.loop.optim.build_optimizer`` on CPU."""
ADAMW_FOREACH = OptimizerMemory("AdamW", state_tensors=2, temporaries=1, all_at_once=True)
"""``torch.optim.AdamW(..., foreach=True)``: ``graph_trainer.loop.optim.build_optimizer`` on CUDA."""


def adamw_memory(device_type: str) -> OptimizerMemory:
    """The memory model of the project's AdamW on a device of this type ("cpu" or "cuda")."""
    return ADAMW_FOREACH if device_type == "cuda" else ADAMW


def optimizer_memory(optimizer) -> OptimizerMemory:
    """The memory model of ``optimizer``: an ``OptimizerMemory``; the job's ``Training``
    section (or None): the project's AdamW on CPU (``adamw_memory`` for a device); or a torch
    optimizer, read from its class and ``defaults`` (Adam / AdamW, with ``amsgrad``, ``foreach`` and ``fused``)."""
    if isinstance(optimizer, OptimizerMemory):
        return optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        from graph_trainer.config import Training

        if optimizer is None or isinstance(optimizer, Training):
            return ADAMW
        raise TypeError(f"optimizer_memory: expected an optimizer or a Training config, got {type(optimizer).__name__}")
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(f"no memory model for {type(optimizer).__name__}: give an OptimizerMemory")
    d = optimizer.defaults
    states = 3 if d.get("amsgrad") else 2
    if d.get("fused"):
        return OptimizerMemory(type(optimizer).__name__, states, temporaries=0)
    return OptimizerMemory(
        type(optimizer).__name__, states, temporaries=1 if d.get("foreach") else 2, all_at_once=bool(d.get("foreach"))
    )


# --------------------------------------------------------------------------------------
# The step


@dataclass(frozen=True)
class MemoryParts:
    """Bytes resident at one moment's peak, by kind (see the module docstring)."""

    moment: str
    """"graph", "pipeline" (a pipeline rank's stage graphs over its schedule:
    ``graph_trainer.pipelining.timeline``) or "optimizer step"."""
    params: int
    grads: int
    optimizer: int
    activations: int
    """The moment's transient memory: the graph's activations, gathered parameters, collective
    buffers and non-parameter inputs; or the optimizer step's temporaries."""
    peak_node: str = ""
    """The graph node at which the graph's peak is reached."""
    accumulated_grads: int = 0
    """The gradient accumulation buffer resident during a later microbatch's graph (0 without
    accumulation, and in the optimizer step, where the buffer is ``grads``); with weights resident
    per step, the summed gradients of the gathered weights (``parallelism.fsdp_collectives``)."""
    resident_weights: int = 0
    """Gathered weights kept for the whole step (``parallelism.fsdp_collectives`` per_step)."""

    @property
    def total(self) -> int:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.activations
            + self.accumulated_grads
            + self.resident_weights
        )


@dataclass(frozen=True)
class StepMemoryEstimate:
    """Per-rank memory of one steady-state training step, by moment."""

    moments: tuple[MemoryParts, ...]
    """The graph (when one was given), then the optimizer step."""
    activations_estimated: bool
    """False without a graph (eager): the peak is then a lower bound."""

    @property
    def peak(self) -> MemoryParts:
        return max(self.moments, key=lambda p: p.total)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total

    def summary(self) -> str:
        """One line: the peak, its parts and where it happens."""
        p = self.peak
        at = "during" if p.moment == "pipeline" else "at node"  # (a pipeline's peak is an action)
        where = p.moment + (f", {at} {p.peak_node}" if p.peak_node else "")
        transient = "step temporaries" if p.moment == "optimizer step" else "activations"
        bound = "" if self.activations_estimated else "at least "
        note = "" if self.activations_estimated else "; activations not estimated (no graph)"
        accumulated = f" + accumulated grads {_gib(p.accumulated_grads)}" if p.accumulated_grads else ""
        resident = f" + resident weights {_gib(p.resident_weights)}" if p.resident_weights else ""
        return (
            f"peak {bound}{_gib(p.total)} = params {_gib(p.params)}{resident} + grads {_gib(p.grads)}{accumulated} + "
            f"optimizer {_gib(p.optimizer)} + {transient} {_gib(p.activations)} ({where}{note})"
        )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def parameter_tensors(graph: fx.Graph | None, params: Iterable[torch.Tensor] | None) -> list[torch.Tensor]:
    """Local parameter tensors: ``params``' local shards, or the graph's parameter inputs."""
    if params is not None:
        return [local_tensor(p) for p in params]
    if graph is None:
        raise ValueError("estimate_step_memory needs a graph or the parameters")
    nodes = list(graph.nodes)
    inputs = _parameter_inputs([n for n in nodes if n.op == "placeholder"], len(_graph_outputs(nodes)) - 1)
    return [n.meta["val"] for n in inputs]


def _parameter_inputs(placeholders: list[fx.Node], n_grads: int) -> list[fx.Node]:
    """The graph's parameter inputs, one parameter per gradient output: the first placeholders, where
    the gathered inputs (weights resident per step, or values computed once per step from one:
    ``compiler.hoist``) count for as many parameters as their ``input_fqn`` name."""
    gathered = [n for n in placeholders if tags.get(n, FSDP_ROLE) == GATHERED]
    others = [n for n in placeholders if n not in gathered]
    return gathered + others[: max(n_grads - len({tags.get(n, INPUT_FQN) for n in gathered}), 0)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _clip_temporary_bytes(grad_numel: int, grad_itemsize: int) -> int:
    """``g.float().pow(2)`` of one gradient: one fp32 copy, two when the gradient is not fp32."""
    return grad_numel * 4 * (1 if grad_itemsize == 4 else 2)


def _step_temporary_bytes(params: Sequence[torch.Tensor], opt: OptimizerMemory) -> int:
    """Largest transient allocation of the optimizer step (clip, then the update)."""
    if not params:
        return 0
    clip = max(_clip_temporary_bytes(p.numel(), p.element_size()) for p in params)
    update = (sum if opt.all_at_once else max)(_nbytes(p) for p in params) * opt.temporaries
    return max(clip, update)


def reduction_moment(params: int, reduced: int, state: int, sums: int, resident: int) -> MemoryParts:
    """Weights resident per step, after the last microbatch: the gradient sums, the ``reduced``
    gradients and the gathered weights alive together."""
    return MemoryParts("gradient reduction", params, reduced, state, 0, "", sums, resident)


def estimate_step_memory(
    graph: fx.Graph | None,
    params: Iterable[torch.Tensor] | None = None,
    optimizer=None,
    sizes: SizeHints | None = None,
    microbatches: int = 1,
) -> StepMemoryEstimate:
    """Per-rank peak memory of a training step, with its parts (module docstring).

    ``graph``: the traced step (after its passes), or None in eager mode (activations are
    then unknown). ``params``: the model's parameters (DTensors count their local shard);
    None takes them from the graph's parameter inputs. ``optimizer``: see
    ``optimizer_memory`` (default: the project's AdamW). ``sizes``: concrete values for
    data-dependent sizes (default: balanced routing). ``microbatches``: graph runs per
    optimizer step (gradient accumulation when > 1).
    """
    if microbatches < 1:
        raise ValueError(f"estimate_step_memory: microbatches = {microbatches} must be >= 1")
    local = parameter_tensors(graph, params)
    opt = optimizer_memory(optimizer)
    param_bytes = sum(_nbytes(p) for p in local)
    state_bytes = opt.state_tensors * param_bytes
    moments = []
    other_inputs = 0
    grad_bytes = param_bytes  # the parameters' layout and dtype, without a graph
    if graph is not None:
        g = estimate_peak_memory(graph, sizes)
        other_inputs = g.input_bytes - g.param_bytes
        grad_bytes = g.total_grad_bytes
        transient, accumulated = g.peak_bytes - g.param_bytes - g.grad_bytes, g.total_grad_bytes * (microbatches > 1)
        parts = (param_bytes, g.grad_bytes, state_bytes, transient, g.peak_node, accumulated, g.resident_bytes)
        moments.append(MemoryParts("graph", *parts))
        if g.resident_bytes:  # the graph's gradients are the gathered weights' sums, reduced after it
            grad_bytes = param_bytes
            moments.append(
                reduction_moment(param_bytes, param_bytes, state_bytes, g.total_grad_bytes, g.resident_bytes)
            )
    moments.append(
        MemoryParts(
            "optimizer step", param_bytes, grad_bytes, state_bytes, other_inputs + _step_temporary_bytes(local, opt)
        )
    )
    return StepMemoryEstimate(tuple(moments), activations_estimated=graph is not None)


def memory_warning(
    estimate: StepMemoryEstimate, device_memory_bytes: int | None, device: str = "the device"
) -> str | None:
    """One line if ``estimate``'s peak exceeds ``device_memory_bytes`` (None: no limit), else None."""
    if device_memory_bytes is None or estimate.peak_bytes <= device_memory_bytes:
        return None
    over = estimate.peak_bytes - device_memory_bytes
    return (
        f"estimated memory per rank exceeds {device}'s {_gib(device_memory_bytes)} "
        f"by {_gib(over)}: {estimate.summary()}"
    )


__all__ = [
    "ADAMW",
    "DEVICE_MEMORY_BYTES",
    "MemoryEstimate",
    "MemoryParts",
    "allocation_owners",
    "OptimizerMemory",
    "StepMemoryEstimate",
    "estimate_peak_memory",
    "estimate_step_memory",
    "memory_warning",
    "optimizer_memory",
    "reduction_moment",
]
