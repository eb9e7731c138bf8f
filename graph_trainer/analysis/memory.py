"""Peak memory of a traced graph, estimated by replaying its node order.

The estimate counts allocations, not nodes: a view (or a ``wait_tensor``, which returns its
collective's buffer, or a ``getitem`` of a multi-output op) shares its input's memory and
costs nothing more. An allocation is made when its node runs and freed after the last node
reading it or any of its aliases, in the graph's order, the way the FX interpreter drops
values. Graph inputs
(parameters, optimizer-independent buffers, the batch) are held by the caller for the whole
step; graph outputs (loss and gradients) live until the end.

Sizes come from ``node.meta["val"]`` (fake or real tensors recorded while tracing), so this
works on graphs traced at real-model sizes on the fake process group without allocating
anything. It ignores allocator fragmentation, workspace of kernels and the memory a
collective library keeps for itself: compare two graphs of one model with it, rather than
reading it as the exact number a device will report.
"""

from __future__ import annotations

from dataclasses import dataclass

import operator

import torch
import torch.fx as fx

from graph_trainer.analysis.cost_model import SizeHints
from graph_trainer.torch_compat import is_view_op


@dataclass(frozen=True)
class MemoryEstimate:
    peak_bytes: int
    """Largest sum of live allocations at any point of the step (inputs included)."""
    input_bytes: int
    """Bytes of the graph inputs, live throughout."""
    peak_node: str
    """Name of the node at which the peak is reached."""

    @property
    def peak_activation_bytes(self) -> int:
        """The peak minus the inputs: what the step itself allocates at its worst point."""
        return self.peak_bytes - self.input_bytes


def _aliases_input(node: fx.Node) -> bool:
    """Nodes whose result is (a view of) their first input's memory, not a new allocation."""
    if node.target in (torch.ops._c10d_functional.wait_tensor.default, operator.getitem):
        return True  # the wait hands back the collective's buffer; getitem picks a result
    return is_view_op(node)


def estimate_peak_memory(graph: fx.Graph, sizes: SizeHints | None = None) -> MemoryEstimate:
    """Replay ``graph`` in node order and return its peak of live allocation bytes.

    Allocations are identified by the node that made them (views, waits and getitems
    resolve to their source node), not by the tensors recorded in ``meta["val"]``: a pass
    that copies nodes may share those records between the original and the copy.
    Data-dependent sizes (expert-parallel all_to_all) are made concrete by ``sizes``
    (default ``SizeHints.from_graph``: balanced routing).
    """
    sizes = sizes or SizeHints.from_graph(graph)
    nodes = list(graph.nodes)
    owner: dict[fx.Node, fx.Node] = {}
    size: dict[fx.Node, int] = {}
    for node in nodes:
        if node.op == "output":
            continue
        source = node.args[0] if node.args else None
        if _aliases_input(node) and isinstance(source, fx.Node) and source in owner:
            owner[node] = owner[source]
        else:
            owner[node] = node
            size[node] = sizes.nbytes(node.meta.get("val"))

    last_use: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        if node in owner:
            last_use[owner[node]] = max(last_use.get(owner[node], i), i)
        for arg in node.all_input_nodes:
            if arg in owner:
                last_use[owner[arg]] = i
    pinned = {owner[n] for n in nodes if n.op == "placeholder"}
    pinned |= {owner[a] for a in nodes[-1].all_input_nodes if a in owner}
    frees_at: dict[int, list[fx.Node]] = {}
    for alloc, i in last_use.items():
        if alloc not in pinned:
            frees_at.setdefault(i, []).append(alloc)

    input_bytes = sum(size[n] for n in nodes if n.op == "placeholder")
    peak, peak_node, current = 0, "", 0
    for i, node in enumerate(nodes):
        current += size.get(node, 0)
        if current > peak:
            peak, peak_node = current, node.name
        for alloc in frees_at.get(i, []):
            current -= size[alloc]
    return MemoryEstimate(peak_bytes=peak, input_bytes=input_bytes, peak_node=peak_node)


__all__ = ["MemoryEstimate", "estimate_peak_memory"]
