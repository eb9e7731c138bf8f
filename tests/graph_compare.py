"""Compare FX graphs by their edges, not just by node names and counts.

Two graphs with the same node names, ops and targets can still be wired differently (a node
fed the wrong input after a pass moved or replaced nodes). ``node_signatures`` gives each node
as ``(name, op, target, args, kwargs)`` where every node inside ``args``/``kwargs`` (also
inside nested lists, tuples and dicts) is replaced by its name, so that comparing signatures
compares which node feeds which.

- ``node_signatures(graph)`` is ordered: compare two lists when the node order must match.
- ``node_multiset(graph)`` is a Counter of the same signatures: compare when only the order
  may differ (a scheduling pass that keeps every node once, with the same inputs).
"""

from __future__ import annotations

from collections import Counter

import torch.fx as fx


def _by_name(value):
    """``value`` with every fx.Node (recursively through lists, tuples, dicts) replaced by its name."""
    if isinstance(value, fx.Node):
        return ("node", value.name)  # tagged so a node never equals a str constant of the same text
    if isinstance(value, (list, tuple)):
        return ("tuple" if isinstance(value, tuple) else "list", tuple(_by_name(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _by_name(v)) for k, v in value.items()))
    return value


def node_signature(node: fx.Node) -> tuple:
    """``(name, op, target, args, kwargs)`` of ``node``, its input nodes given by name."""
    return (node.name, node.op, str(node.target), _by_name(node.args), _by_name(node.kwargs))


def node_signatures(graph: fx.Graph) -> list[tuple]:
    """Every node's signature, in graph order."""
    return [node_signature(n) for n in graph.nodes]


def node_multiset(graph: fx.Graph) -> Counter:
    """Every node's signature, order ignored."""
    return Counter(node_signatures(graph))
