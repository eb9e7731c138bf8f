"""What a microbatch computes from the resident weights alone, computed once per step.

With weights resident per step (``graph_trainer.compiler.resident``) one step graph runs per
microbatch on the same gathered tensors. What it computes from those tensors alone is the same at
every microbatch: the float8 weight casts above all (each weight's amax, its all-reduce over the
tensor-parallel group, the scale, the cast, and in the backward the same cast again in the
transposed layout its matmul reads). ``hoist_invariants`` moves that work into the gather graph,
which runs once per step: loop-invariant code motion over the microbatches, as Transformer
Engine's ``is_first_microbatch`` caches the float8 weights of the first microbatch for the others.

Reads: the step graph's leading placeholders tagged ``fsdp_role`` gathered (the gathered weights,
in the gather graph's output order); op schemas (mutation, aliasing) and torch's
``nondeterministic_seeded`` op tag.

Which nodes move (a weight's *derived values*, the nodes computed from it alone):

- a node is invariant when it is a call of a pure op (no argument mutated, not random; a
  collective and its wait count as pure: every rank of the group holds the same graph and moves
  the same ones) whose inputs are gathered weights, invariant nodes or nodes computed from
  nothing (constants), at least one of them not a constant;
- the values handed to the step graph are the invariant nodes it reads; a view among them stays
  in the step graph, reading its input instead (a view costs nothing to recompute and its base
  would be held anyway);
- a weight's derived values move only if, once they have, the step graph no longer reads the
  weight itself, none of them also derives from another weight, and together they hold at most
  ``MAX_GROWTH`` more bytes than the weight: the step then holds them in its place, not beside it.
  (float8's casts: one float8 copy per layout, half a bf16 weight each, and their scales.) A
  weight whose values would hold more (a bf16 transposed copy beside the weight it is read with)
  keeps its computation per microbatch.

Writes: the step graph loses the moved nodes and the placeholders of the weights it no longer
reads, and gains one placeholder per moved value after the gathered weights it still reads (tags
``phase`` input, ``fsdp_role`` gathered: resident for the step, ``input_fqn`` the weight's name,
``module_fqn`` the value's module); the gather graph computes the moved nodes after the gathers
(tags ``phase`` forward and ``module_fqn`` kept, the rest dropped; copies of one computation on
the same values are one node: a forward cast and its backward recast are cast once) and returns the weights the step
still reads, then the moved values, in the step graph's placeholder order.

Numerics: bitwise. Each moved node computes what it computed in the step graph, on the same
values; the step graph reads the result instead of computing it.
"""

from __future__ import annotations

import copy
import operator
from fractions import Fraction

import torch
import torch.fx as fx

from graph_trainer.graph import tags
from graph_trainer.graph.collectives import is_wait
from graph_trainer.graph.ops import is_random, is_view, mutated_args
from graph_trainer.graph.tags import FORWARD, FSDP_ROLE, GATHERED, INPUT, INPUT_FQN, MODULE_FQN, PHASE
from graph_trainer.torch_compat import is_op_overload

MAX_GROWTH = Fraction(1, 16)
"""How many more bytes than its weight a weight's moved values may hold (float8 scales: one fp32
per tensor, or per row and per column, under 1/16 of a bf16 weight whose sides are 64 or more)."""


def _pure(node: fx.Node) -> bool:
    """An aten op (or a ``getitem`` of one's results) that mutates nothing and is not random; a
    collective's wait counts as pure (torch marks it side-effectful so that no pass drops it)."""
    if node.op != "call_function" or not (node.target is operator.getitem or is_op_overload(node.target)):
        return False
    if mutated_args(node) or (node.is_impure() and not is_wait(node)):
        return False
    return not is_random(node)


def _bytes(node: fx.Node) -> int:
    val = node.meta["val"]
    return val.numel() * val.element_size()


def _invariant(graph: fx.Graph, weights: list[fx.Node]) -> tuple[set[fx.Node], dict[fx.Node, frozenset]]:
    """The invariant nodes (module docstring) and, per node, the weights it is computed from."""
    sources: dict[fx.Node, frozenset] = {w: frozenset([w]) for w in weights}
    invariant: set[fx.Node] = set()
    for node in graph.nodes:
        if not _pure(node) or any(i not in sources for i in node.all_input_nodes):
            continue
        sources[node] = frozenset().union(*(sources[i] for i in node.all_input_nodes))
        if sources[node]:
            invariant.add(node)
    return invariant, sources


def _handed_over(invariant: set[fx.Node]) -> list[fx.Node]:
    """The invariant nodes read outside ``invariant``, its views excluded from it first (in place)."""
    while True:
        views = [n for n in invariant if is_view(n) and any(u not in invariant for u in n.users)]
        if not views:
            return [n for n in invariant if any(u not in invariant for u in n.users)]
        invariant.difference_update(views)


def _refused(weights: list[fx.Node], invariant: set[fx.Node], handed: list[fx.Node], sources: dict) -> set[fx.Node]:
    """The weights whose derived values may not move (module docstring)."""
    refused = set()
    for weight in weights:
        values = [n for n in handed if weight in sources[n]]
        still_read = any(u not in invariant for u in weight.users)
        shared = any(len(sources[n]) > 1 for n in values)
        tensors = all(isinstance(n.meta.get("val"), torch.Tensor) for n in values)
        if (
            not values
            or still_read
            or shared
            or not tensors
            or sum(map(_bytes, values)) > (1 + MAX_GROWTH) * _bytes(weight)
        ):
            refused.add(weight)
    return refused


def _to_move(graph: fx.Graph, weights: list[fx.Node]) -> tuple[set[fx.Node], list[fx.Node], dict]:
    """(the nodes that move, the values the step graph reads of them in graph order, each node's
    weights)."""
    invariant, sources = _invariant(graph, weights)
    while True:
        handed = _handed_over(invariant)
        refused = _refused(weights, invariant, handed, sources)
        kept = {n for n in invariant if not sources[n] & refused}
        if kept == invariant:
            order = {n: i for i, n in enumerate(graph.nodes)}
            return invariant, sorted(handed, key=order.__getitem__), sources
        invariant = kept


def _copy_into_gather(gather: fx.Graph, step: fx.Graph, moving: set[fx.Node], env: dict[fx.Node, fx.Node]) -> None:
    """The moved nodes (and the constants they read) copied before ``gather``'s output, ``env``
    mapping each step node to its copy (given: the weights to the gather graph's values). Copies
    computing one value are one node (a forward cast and its backward recast)."""
    computed: dict[tuple, fx.Node] = {}
    output = gather.output_node()
    for node in step.nodes:
        constant = _pure(node) and not node.all_input_nodes and any(u in moving for u in node.users)
        if node not in moving and not constant:
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
        key = (node.target, repr(args), repr(kwargs))
        if key not in computed:
            with gather.inserting_before(output):
                computed[key] = gather.node_copy(node, env.__getitem__)
            tags.replace(computed[key], {PHASE: FORWARD, MODULE_FQN: tags.module_fqn(node)})
        env[node] = computed[key]


def _read_only_by(node: fx.Node, nodes: set[fx.Node]) -> bool:
    return bool(node.users) and all(u in nodes for u in node.users)


def _per_step_input(step: fx.Graph, value: fx.Node, weight: fx.Node, before: fx.Node | None) -> fx.Node:
    """A step-graph placeholder for ``value`` (derived from ``weight``), before ``before``."""
    where = step.inserting_before(before) if before is not None else step.inserting_after(weight)
    with where:
        node = step.placeholder(f"{value.name}_per_step")
    node.meta["val"] = value.meta["val"]
    fqn = tags.get(weight, INPUT_FQN)
    tags.replace(node, {PHASE: INPUT, FSDP_ROLE: GATHERED, INPUT_FQN: fqn, MODULE_FQN: tags.module_fqn(value)})
    return node


def hoist_invariants(gather: fx.GraphModule, step: fx.GraphModule) -> int:
    """Move what ``step`` computes from the gathered weights alone into ``gather`` (module
    docstring), in place; returns how many step-graph inputs it added. ``gather`` returns one
    tensor per gathered placeholder of ``step`` (the leading ones), in order."""
    graph = step.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    weights = [n for n in placeholders if tags.get(n, FSDP_ROLE) == GATHERED]
    moving, handed, sources = _to_move(graph, weights)
    if not handed:
        return 0
    env = dict(zip(weights, gather.graph.output_node().args[0], strict=True))
    _copy_into_gather(gather.graph, graph, moving, env)
    before = placeholders[len(weights)] if len(placeholders) > len(weights) else None
    inputs: dict[fx.Node, fx.Node] = {}
    """Per value the gather graph returns anew, the step graph's input holding it."""
    for value in handed:
        (weight,) = sources[value]
        if env[value] not in inputs:
            inputs[env[value]] = _per_step_input(graph, value, weight, before)
        value.replace_all_uses_with(inputs[env[value]])
    constants = [n for n in graph.nodes if _pure(n) and not n.all_input_nodes and _read_only_by(n, moving)]
    for node in reversed(list(graph.nodes)):
        if node in moving:
            graph.erase_node(node)
    for node in constants:
        graph.erase_node(node)
    moved_from = frozenset().union(*(sources[v] for v in handed))
    for weight in moved_from:
        if not weight.users:
            graph.erase_node(weight)
    kept = [w for w in weights if w not in moved_from or w.users]
    gather.graph.output_node().args = ([env[w] for w in kept] + list(inputs),)
    step.graph = copy.deepcopy(graph)  # (the erased nodes' names are free again, as in cse)
    for gm in (gather, step):
        gm.graph.lint()
        gm.recompile()
    return len(inputs)
