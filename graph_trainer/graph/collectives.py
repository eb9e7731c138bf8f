"""Collective facts: which nodes communicate, what kind, on which group, paired with which wait.

Collectives appear in traced graphs as ``torch.ops._c10d_functional.<name>`` nodes
(``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``, ``all_to_all_single``,
...): a *launch*, whose result is only valid after its ``wait_tensor``. The tracer guarantees
that every launch has exactly one user, its wait (``wait_of``); PyTorch's bucketers and our
passes rely on it. The process-group name is the last string argument of the launch.
"""

from __future__ import annotations

import operator
from collections import Counter

import torch
import torch.fx as fx

from graph_trainer.graph.ops import SIZE_READS, named_args
from graph_trainer.graph.sizes import SizeHints, value_of
from graph_trainer.torch_compat import is_op_overload, op_name

_C10D = torch.ops._c10d_functional
NAMESPACE = "_c10d_functional"
ALL_GATHER = _C10D.all_gather_into_tensor.default
REDUCE_SCATTER = _C10D.reduce_scatter_tensor.default
ALL_REDUCE = _C10D.all_reduce.default
ALL_TO_ALL = _C10D.all_to_all_single.default
WAIT = _C10D.wait_tensor.default
WAIT_NAME = "wait_tensor"
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")
"""Collective kinds (``kind``); any other launch is ``"other"``."""


class PairingError(ValueError):
    """A launch whose only user is not its wait (the contract every pass relies on)."""


def collective_name(node: fx.Node) -> str | None:
    """The functional-collective op name of a node (``"all_gather_into_tensor"``, ``"wait_tensor"``), else None."""
    if node.op != "call_function" or not is_op_overload(node.target) or node.target.namespace != NAMESPACE:
        return None
    return op_name(node.target)


def stays_outside(node: fx.Node) -> bool:
    """Whether ``node`` stays outside the compiled regions of the regional Inductor backend, and so
    ends one (``compiler.backend``): placeholders and the output, collectives and their waits,
    reads of data-dependent sizes, impure ops."""
    if node.op != "call_function":
        return True
    if collective_name(node) is not None or node.target in SIZE_READS:
        return True
    return node.is_impure()


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is WAIT


def is_collective(node: fx.Node) -> bool:
    """True for collective launches (not their waits)."""
    name = collective_name(node)
    return name is not None and name != WAIT_NAME


def kind(node: fx.Node) -> str | None:
    """``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``, ``broadcast``, ``other``;
    None for a wait or a node that is not a collective."""
    if not is_collective(node):
        return None
    name = collective_name(node)
    return next((k for k in KINDS if k in name), "other")


def group_name(node: fx.Node) -> str:
    """The process-group name a collective runs on (its last string argument), ``"?"`` if none."""
    for arg in reversed([*node.args, *node.kwargs.values()]):
        if isinstance(arg, str):
            return arg
    return "?"


def group_size_arg(node: fx.Node) -> int | None:
    """The ``group_size`` argument of a launch that has one (all-gather, reduce-scatter), else None."""
    return named_args(node).get("group_size") if is_op_overload(node.target) else None


def wait_of(launch: fx.Node) -> fx.Node:
    """The wait of ``launch``; raises ``PairingError`` unless it is the launch's only user."""
    users = list(launch.users)
    if len(users) != 1 or not is_wait(users[0]):
        raise PairingError(
            f"collective {launch.name} must have exactly one user, its wait_tensor; has {[u.name for u in users]}"
        )
    return users[0]


def waits_among_users(launch: fx.Node) -> list[fx.Node]:
    """The waits reading ``launch`` (one after tracing; more only in a graph being repaired)."""
    return [u for u in launch.users if is_wait(u)]


def launch_of(wait: fx.Node) -> fx.Node | None:
    """The launch a wait waits on, through ``getitem`` of a coalesced collective; None if not found."""
    source = wait.args[0] if wait.args else None
    while isinstance(source, fx.Node) and not is_collective(source) and source.target is operator.getitem:
        source = source.args[0]
    return source if isinstance(source, fx.Node) and is_collective(source) else None


def collective_bytes(node: fx.Node, hints: SizeHints | None = None) -> int:
    """Bytes of the full buffer a launch moves: the gathered output (all-gather), the unreduced
    input (reduce-scatter, all-reduce), the larger of input and output (all_to_all)."""
    hints = hints or SizeHints()
    k = kind(node)
    out = hints.nbytes(value_of(node))
    inp = hints.nbytes(value_of(node.args[0])) if node.args else 0
    if k in ("reduce_scatter", "all_reduce"):
        return inp
    if k == "all_to_all":
        return max(inp, out)
    return out


def collective_order(graph: fx.Graph) -> list[tuple]:
    """The launches and waits of ``graph`` in order, each as (op name, node name, its scalar
    arguments: sizes, group names): what a stage that must not move communication compares."""
    order = []
    for node in graph.nodes:
        name = collective_name(node)
        if name is None:
            continue
        scalars = tuple(a for a in node.args if not isinstance(a, (fx.Node, list, tuple)))
        order.append((name, node.name, scalars))
    return order


def max_in_flight(op_names: list[str]) -> int:
    """The most collectives issued and not yet waited for at once, along ``op_names`` in order."""
    in_flight = most = 0
    for name in op_names:
        in_flight += -1 if name == WAIT_NAME else 1
        most = max(most, in_flight)
    return most


def collective_counts(graph: fx.Graph) -> Counter[str]:
    """Number of nodes per functional-collective op name, waits included."""
    return Counter(name for n in graph.nodes if (name := collective_name(n)) is not None)


def format_counts(counts: Counter[str]) -> str:
    """``'all_gather_into_tensor=21 wait_tensor=42'`` or ``'none'``."""
    return " ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"


__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "ALL_TO_ALL",
    "KINDS",
    "REDUCE_SCATTER",
    "WAIT",
    "WAIT_NAME",
    "PairingError",
    "collective_bytes",
    "collective_counts",
    "collective_name",
    "collective_order",
    "format_counts",
    "group_name",
    "group_size_arg",
    "is_collective",
    "is_wait",
    "kind",
    "launch_of",
    "max_in_flight",
    "wait_of",
    "waits_among_users",
]
