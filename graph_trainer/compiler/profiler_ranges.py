"""Named profiler ranges around the nodes of the graph that runs (``--profiling.enable_profiling``).

A torch.profiler trace of a traced step shows aten kernels with no hint of the module they belong
to. ``add_profiler_ranges`` wraps every ``call_function`` node of the final graph (after the
backend: an Inductor region is one node) in a range named ``"<module fqn>: <node name>"``
(``"<node name>"`` where the node has no module), e.g. ``layers.3.attention: mm_85`` or
``layers.3: inductor_region_12``, so the trace reads like the graph dumps
(``--compile.dump_graphs``).

Reads: the ``module_fqn`` tag (``graph.tags``). Changes: before each such node a call opening its
range, after it a call closing it (the profiler's own record-function ops); no tag is written
and nothing reads them: this is the last change to the graph. Guarantees: the same ops on the
same values in the same order (bitwise the graph without ranges); outside a profiler the ranges
cost a few microseconds per node, so the trainer adds them only when profiling.
"""

from __future__ import annotations

import torch.fx as fx

from graph_trainer.graph import tags
from graph_trainer.graph.tags import MODULE_FQN
from graph_trainer.torch_compat import record_function_ops


def range_name(node: fx.Node) -> str:
    """``"<module fqn>: <node name>"``, or the node's name where it has no module."""
    fqn = tags.get(node, MODULE_FQN, "")
    return f"{fqn}: {node.name}" if fqn else node.name


def add_profiler_ranges(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with every ``call_function`` node inside a named profiler range (module docstring)."""
    enter, leave = record_function_ops()
    graph = gm.graph
    for node in [n for n in graph.nodes if n.op == "call_function"]:
        with graph.inserting_before(node):
            handle = graph.call_function(enter, (range_name(node), None))
        with graph.inserting_after(node):
            graph.call_function(leave, (handle,))
    graph.lint()
    gm.recompile()
    return gm


__all__ = ["add_profiler_ranges", "range_name"]
