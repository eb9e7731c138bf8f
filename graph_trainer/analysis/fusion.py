"""Kernels as Inductor fuses them: which compute nodes of a traced graph run as one kernel under
``--compile.backend inductor``, so that the simulator can cost a compiled step.

A model of Inductor's scheduler, not Inductor itself (compiling a real-size graph takes minutes
on the CPU and would fuse for the CPU's C++ backend, not for Triton). What it keeps:

- **Kernels of their own.** Matmuls, attention, accumulating scatters, collectives and their
  waits, and the ops this model does not fuse (``_NOT_FUSED``: gathers such as ``embedding``,
  the loss's ``nll_loss``, sorts and scans, random numbers; in-place updates, complex tensors,
  reads of data-dependent values, impure ops) run alone and cost what they cost op by op.
- **Regions and segments.** The regional backend compiles each run of one phase and unit
  (``graph.tags.unit_of``) between collectives, waits and other nodes that stay outside
  (``graph.collectives.stays_outside``) as one graph: a value crossing a region's end is written
  to memory. Kernels are formed inside *segments*, the runs of fusible nodes between two nodes
  of their own, so collectives and waits keep their places and nothing fuses across a matmul
  (Inductor's ``full`` scope may fuse more: this bounds its fusion from below).
- **Inlining.** A pointwise node whose readers are all fusible nodes of its region, each of whose
  iteration it fits (below), runs in no kernel of its own: every reader recomputes it, as
  Inductor inlines pointwise ops into their readers (when there is one reader, or when it reads
  one input of its own size, so recomputing reads no more than reading it would). A reader in
  a later segment of the region recomputes it too; a reader beyond the region makes it a
  kernel's node after all (written, then read).
- **Vertical fusion.** Inside a segment, a fusible node joins the kernel of a node whose output
  it reads (directly or through inlined nodes) when their iteration spaces fit, as Triton
  kernels iterate: a kernel runs over ``x`` elements (pointwise) or ``x`` rows of ``r`` reduced
  elements (it holds a reduction; softmax counts as one over its ``dim``), and
    - pointwise nodes fuse when their element counts are equal;
    - a pointwise producer of ``x * r`` elements (a prologue) or of ``x`` fuses into a reduction;
    - a pointwise consumer of a reduction fuses when it runs over ``x * r`` elements (the rows
      again, as RMSNorm's scaling) or ``x`` (the reduced values), unless ``x == 1``: Inductor
      splits a reduction to one value over two kernels, and only scalar ops follow it;
    - two reductions fuse only over the same ``(x, r)``.
  A merge that would make a kernel both feed and read one node outside it (a cycle through
  anything but views and inlined nodes) is refused. Siblings that read none of each other's
  outputs are not fused (no horizontal fusion), nor pointwise ops into matmuls (ATen's GEMMs,
  Inductor's default).

Cost (``FusedKernel.time``): the bytes a kernel moves are the tensors its nodes and the nodes they inline
read from outside it (each input node once; an expanded dim once) and the outputs read outside
it (by a node of another kernel, through views and inlined nodes, or by the graph's output); the
intermediates stay in registers. They move at the HBM bandwidth times the efficiency of the kernel's class on the
device (``softmax_forward`` / ``softmax_backward`` if it holds a softmax, ``reduction`` if a
reduction, ``elementwise`` otherwise; ``cost_model``'s classes, calibrated op by op), plus one
launch per kernel (two for a split reduction). How this predicts Inductor's measured steps:
docs/performance.md, "Inductor's fusion, simulated".

Reads the nodes' ``meta["val"]`` and the tags ``phase`` and the unit's; writes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from graph_trainer.analysis.cost_model import FILLS, is_free, kernel_class, read_bytes
from graph_trainer.analysis.devices import DeviceModel
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import collective_name, is_wait, stays_outside
from graph_trainer.graph.ops import SIZE_READS, aliases_input, is_random, mutated_args, name_of, named_args
from graph_trainer.graph.sizes import SizeHints, tensors_in, value_of

aten = torch.ops.aten

_FUSIBLE_CLASSES = {"elementwise", "strided", "dtype_cast", "reduction", "softmax_forward", "softmax_backward"}
_NOT_FUSED = {
    "embedding",
    "embedding_dense_backward",
    "index_select",
    "gather",
    "index",
    "nll_loss_forward",
    "nll_loss_backward",
    "topk",
    "sort",
    "histc",
    "cumsum",
    "cumprod",
}
"""Ops this model leaves to kernels of their own although their class is a memory class (random
ops too, by their ``nondeterministic_seeded`` tag)."""


def fuses(backend: str) -> bool:
    """Whether a job of this ``compile.backend`` runs Inductor's fused kernels (costed by this
    model); 'none' runs op by op."""
    return backend == "inductor"


@dataclass(frozen=True)
class Iteration:
    """A kernel's iteration space: ``x`` rows of ``r`` reduced elements (``r == 1``: pointwise)."""

    x: int
    r: int = 1

    @property
    def reduces(self) -> bool:
        return self.r > 1


def iteration(node: fx.Node, hints: SizeHints) -> Iteration | None:
    """The iteration space of a fusible ``node``; None when ``node`` is not fusible."""
    if not _fusible(node, hints):
        return None
    out = tensors_in(value_of(node))
    cls = kernel_class(node, hints)
    if cls in ("softmax_forward", "softmax_backward"):
        args = named_args(node)
        inp = value_of(node.args[0])
        rows = hints.concrete(inp.shape[args["dim"]])
        return Iteration(hints.numel(inp) // max(1, rows), rows)
    x = max(hints.numel(t) for t in out)
    if cls == "reduction":
        inputs = [t for a in node.all_input_nodes for t in tensors_in(value_of(a))]
        reduced = max((hints.numel(t) for t in inputs), default=x)
        x = hints.numel(out[0])
        if x and reduced > x:
            return Iteration(x, reduced // x)
    return Iteration(x)


def _fusible(node: fx.Node, hints: SizeHints) -> bool:
    if node.op != "call_function" or is_free(node) or collective_name(node) is not None or is_wait(node):
        return False
    if node.target in SIZE_READS or name_of(node) in _NOT_FUSED or node.is_impure() or mutated_args(node):
        return False
    if is_random(node):
        return False
    if kernel_class(node, hints) not in _FUSIBLE_CLASSES:
        return False
    values = tensors_in(value_of(node)) + [t for a in node.all_input_nodes for t in tensors_in(value_of(a))]
    return bool(tensors_in(value_of(node))) and not any(t.is_complex() for t in values)


def fits(producer: Iteration, consumer: Iteration) -> Iteration | None:
    """The iteration space of a kernel joining ``producer``'s and ``consumer``'s (the module
    docstring's rules), or None when they do not fuse."""
    p, c = producer, consumer
    if not p.reduces and not c.reduces:
        return p if p.x == c.x else None
    if not p.reduces:  # a pointwise prologue into a reduction
        return c if p.x in (c.x * c.r, c.x) else None
    if not c.reduces:  # a pointwise epilogue after a reduction
        if p.x == 1:
            return p if c.x == 1 else None
        return p if c.x in (p.x * p.r, p.x) else None
    return p if p == c and p.x > 1 else None


@dataclass
class FusedKernel:
    """One kernel: its nodes in graph order and what it moves."""

    nodes: list[fx.Node]
    space: Iteration
    bytes: int = 0
    """Bytes read from outside the kernel plus bytes written for readers outside it."""
    kernel_class: str = "elementwise"
    launches: int = 1

    def time(self, device: DeviceModel) -> float:
        """Seconds on ``device``: its bytes at the class's share of the HBM bandwidth, plus its launches."""
        eff = device.kernel_efficiency
        share = device.bandwidth_efficiency if eff is None else getattr(eff, self.kernel_class)
        return self.bytes / (device.hbm_bandwidth * share) + self.launches * device.launch_overhead


@dataclass
class FusionPlan:
    """The fused kernels of a graph, and the pointwise nodes inlined into the kernels reading them."""

    kernels: list[FusedKernel]
    inlined: set[fx.Node] = field(default_factory=set)
    """Recomputed inside every kernel that reads them (as Inductor inlines a pointwise op into
    its readers): they run in no kernel of their own and write nothing."""
    kernel_of: dict[fx.Node, FusedKernel] = field(default_factory=dict)

    def __post_init__(self):
        for kernel in self.kernels:
            for node in kernel.nodes:
                self.kernel_of[node] = kernel

    def cost(self, node: fx.Node, device: DeviceModel) -> tuple[float, str] | None:
        """(seconds, class) of ``node`` on ``device``: a kernel's whole cost at its last node, 0 at
        its others and at inlined nodes; None for a node this plan leaves to a kernel of its own."""
        if node in self.inlined:
            return 0.0, "fused elementwise"
        kernel = self.kernel_of.get(node)
        if kernel is None:
            return None
        return (kernel.time(device) if node is kernel.nodes[-1] else 0.0), f"fused {kernel.kernel_class}"


def fuse_kernels(graph: fx.Graph, hints: SizeHints | None = None) -> FusionPlan:
    """Group ``graph``'s fusible nodes into kernels (the module docstring's model)."""
    hints = hints or SizeHints.from_graph(graph)
    fuser = _Fuser(hints)
    for node in graph.nodes:
        fuser.visit(node)
    order = {n: i for i, n in enumerate(graph.nodes)}
    inlined = set(fuser.inlined)
    kernels = []
    for members, space in fuser.groups():
        members.sort(key=order.__getitem__)
        kernels.append(_kernel(members, space, inlined, hints))
    return FusionPlan(kernels, inlined)


def _transparent(node: fx.Node) -> bool:
    """Views and ``getitem``: they belong to the tensor they alias, inside a kernel or out."""
    return node.op == "call_function" and (aliases_input(node) or node.target is aten._unsafe_view.default)


def _base(node: fx.Node) -> fx.Node:
    """The node whose output ``node`` aliases (``node`` itself when it is no view)."""
    while _transparent(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _readers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read ``node``'s output, directly or through views."""
    found = []
    for user in node.users:
        found.extend(_readers(user) if _transparent(user) else [user])
    return found


class _Fuser:
    """The kernels being formed, node by node in graph order (union-find over kernel ids)."""

    def __init__(self, hints: SizeHints):
        self.hints = hints
        self.parent: dict[int, int] = {}
        self.members: dict[int, list[fx.Node]] = {}
        self.space: dict[int, Iteration] = {}
        self.kernel_id: dict[fx.Node, int] = {}
        self.inlined: dict[fx.Node, Iteration] = {}
        """Pointwise nodes recomputed by each kernel that reads them (``_inlinable``)."""
        self.segment: set[fx.Node] = set()
        """The fusible nodes and views of the current segment, seen so far."""
        self.region: set[fx.Node] = set()
        """The fusible nodes of the current region (a phase and unit, between collectives)."""
        self.region_inlined: list[fx.Node] = []
        self.key: tuple | None = None

    def visit(self, node: fx.Node) -> None:
        if _transparent(node):
            self.segment.add(node)
            return
        space = iteration(node, self.hints) if node.op == "call_function" else None
        if space is None:
            if stays_outside(node) and node.op != "placeholder":
                self._end_region()
            elif node.op == "call_function" and not is_free(node):
                self._end_segment()  # a kernel of its own (a matmul): nothing fuses across it
            return
        key = (tags.phase(node), tags.unit_of(node))
        if key != self.key:
            self._end_region()
            self.key = key
        self.segment.add(node)
        self.region.add(node)
        if self._inlinable(node, space):
            self.inlined[node] = space
            self.region_inlined.append(node)
            return
        self._new(node, space)
        self._join_producers(node)

    def groups(self) -> Iterable[tuple[list[fx.Node], Iteration]]:
        return ((members, self.space[root]) for root, members in self.members.items())

    def _inlinable(self, node: fx.Node, space: Iteration) -> bool:
        """Whether pointwise ``node`` is left to its readers, as Inductor inlines it: every reader
        is a node this segment may fuse (same phase and unit) whose iteration it fits, and there
        is one reader, or recomputing it reads no more than reading it (one input of its size)."""
        readers = _readers(node)
        if space.reduces or not readers:
            return False
        for reader in readers:
            if reader.op != "call_function" or (tags.phase(reader), tags.unit_of(reader)) != self.key:
                return False
            reads = iteration(reader, self.hints)
            if reads is None or fits(space, reads) is None:
                return False
        own_size = [a for a in node.all_input_nodes if _numel(a, self.hints) == space.x]
        return len(readers) == 1 or len(own_size) <= 1

    def _end_segment(self) -> None:
        self.segment = set()

    def _end_region(self) -> None:
        """End the region (where the regional backend's compiled graph ends): an inlined node with
        a reader beyond it is computed and written by a kernel after all."""
        for node in self.region_inlined:
            if not all(r in self.region for r in _readers(node)):
                self._new(node, self.inlined.pop(node))
                self._join_producers(node)
        self.region, self.region_inlined = set(), []
        self._end_segment()
        self.key = None

    def _new(self, node: fx.Node, space: Iteration) -> int:
        k = len(self.parent)
        self.parent[k], self.members[k], self.space[k] = k, [node], space
        self.kernel_id[node] = k
        return k

    def _find(self, k: int) -> int:
        while self.parent[k] != k:
            self.parent[k] = self.parent[self.parent[k]]
            k = self.parent[k]
        return k

    def _join_producers(self, node: fx.Node) -> None:
        """Join ``node``'s kernel with each producer kernel it fits, when no cycle comes of it."""
        kernel = self._find(self.kernel_id[node])
        for producer in self._producer_kernels(node):
            if producer == kernel:
                continue
            joined = fits(self.space[producer], self.space[kernel])
            if joined is not None and not self._cycle(producer, kernel):
                kernel = self._union(producer, kernel, joined)

    def _union(self, keep: int, other: int, space: Iteration) -> int:
        self.parent[other] = keep
        self.members[keep].extend(self.members.pop(other))
        self.space[keep] = space
        return keep

    def _producer_kernels(self, node: fx.Node) -> list[int]:
        """The kernels of this segment whose outputs ``node`` reads, in argument order (through
        the nodes it inlines)."""
        found: dict[int, None] = {}
        for arg in node.all_input_nodes:
            base = _base(arg)
            if base not in self.segment:
                continue
            if base in self.inlined:
                found.update(dict.fromkeys(self._producer_kernels(base)))
            elif base in self.kernel_id:
                found[self._find(self.kernel_id[base])] = None
        return list(found)

    def _cycle(self, a: int, b: int) -> bool:
        """Whether joining kernels ``a`` and ``b`` would make the kernel read, through a node
        outside it other than views and inlined nodes, an output of its own."""
        union = set(self.members[a]) | set(self.members[b])
        stack = [(user, False) for m in union for user in m.users]
        seen: set[tuple[fx.Node, bool]] = set()
        while stack:
            node, left = stack.pop()
            if node in union:
                if left:
                    return True
                continue
            if node not in self.segment or (node, left) in seen:
                continue
            seen.add((node, left))
            left = left or not (_transparent(node) or node in self.inlined)
            stack.extend((user, left) for user in node.users)
        return False


def _numel(node: fx.Node, hints: SizeHints) -> int:
    return sum(hints.numel(t) for t in tensors_in(value_of(node)))


def _kernel(members: list[fx.Node], space: Iteration, inlined: set[fx.Node], hints: SizeHints) -> FusedKernel:
    """A kernel of ``members`` (graph order) with its bytes, class and launches."""
    inside = set(members)
    read: dict[fx.Node, None] = {}

    def add_reads(node: fx.Node) -> None:
        for arg in node.all_input_nodes:
            base = _base(arg)
            if base in inlined:
                add_reads(base)  # recomputed here: what it reads is read here
            elif base not in inside:
                read[arg] = None

    for m in members:
        if m.target not in FILLS:  # (a fill writes its output without reading its tensor argument)
            add_reads(m)
    moved = sum(read_bytes(t, hints) for arg in read for t in tensors_in(value_of(arg)))
    moved += sum(hints.nbytes(value_of(m)) for m in members if _read_outside(m, inside, inlined))
    classes = {kernel_class(m, hints) for m in members}
    softmax = [c for c in ("softmax_forward", "softmax_backward") if c in classes]
    cls = softmax[0] if softmax else "reduction" if "reduction" in classes else "elementwise"
    launches = 2 if space.reduces and space.x == 1 else 1
    return FusedKernel(members, space, moved, cls, launches)


def _read_outside(node: fx.Node, inside: set[fx.Node], inlined: set[fx.Node]) -> bool:
    """Whether ``node``'s output is read outside the kernel ``inside`` (through views and inlined nodes too)."""
    for user in node.users:
        if user.op == "output":
            return True
        if _transparent(user) or user in inlined:
            if _read_outside(user, inside, inlined):
                return True
        elif user not in inside:
            return True
    return False


__all__ = ["FusedKernel", "FusionPlan", "Iteration", "fits", "fuse_kernels", "fuses", "iteration"]
