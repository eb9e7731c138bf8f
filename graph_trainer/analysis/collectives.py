"""Counting the communication in a graph.

Collectives appear in traced graphs as ``torch.ops._c10d_functional.<name>`` nodes
(``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``,
``all_to_all_single``, ...), each followed by a ``wait_tensor``. The process-group name
is the last positional string argument of the collective.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.fx as fx

from graph_trainer.torch_compat import is_op_overload, op_name

_C10D = torch.ops._c10d_functional


def collective_name(node: fx.Node) -> str | None:
    """The functional-collective op name of a node (e.g. 'all_gather_into_tensor'), else None."""
    if node.op != "call_function" or not is_op_overload(node.target):
        return None
    if node.target.namespace != "_c10d_functional":
        return None
    return op_name(node.target)


def is_collective(node: fx.Node) -> bool:
    """True for collective launches (not their waits)."""
    name = collective_name(node)
    return name is not None and name != "wait_tensor"


def process_group_of(node: fx.Node) -> str:
    """The group name a collective runs on (the last string argument)."""
    for arg in reversed(node.args):
        if isinstance(arg, str):
            return arg
    return "?"


def collective_counts(graph: fx.Graph) -> Counter[str]:
    """Number of nodes per functional-collective op name, waits included."""
    return Counter(name for n in graph.nodes if (name := collective_name(n)) is not None)


def collective_counts_by_group(graph: fx.Graph) -> Counter[tuple[str, str]]:
    """Number of collective launches per (op name, process group)."""
    return Counter(
        (collective_name(n), process_group_of(n)) for n in graph.nodes if is_collective(n)
    )


def format_counts(counts: Counter[str]) -> str:
    """'all_gather_into_tensor=21 wait_tensor=42' or 'none'."""
    return " ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"
