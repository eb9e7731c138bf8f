"""Common subexpressions computed once: identical computations of one phase and one unit of the
traced step become one node.

The step as traced repeats work its program writes twice. The float8 linears that share an
input (``wq``, ``wk``, ``wv``; ``w1``, ``w3``) each compute its amax, scale and cast it in the
forward, and cast it again transposed in the backward for their weight gradients; under tensor
parallel each also all-reduces that amax. ``torch.compile`` removes such repeats (AOTAutograd
eliminates common subexpressions in the joint graph before it partitions it); run op by op, or
costed as traced, the graph would do every one.

Reads: every node's target, arguments and tags. Two nodes compute the same value when

- their targets are equal and their arguments and keyword arguments are, an argument node
  standing for its value (a size read as an unbacked ``SymInt``, which cannot be compared,
  makes a node unique);
- their tags are equal except ``module_fqn`` (which of the modules the node computed for: the
  kept node's says one of them), and so are their units (``graph.tags.unit_of``: block or loss
  chunk): nothing is shared between blocks or loss chunks, nor between phases, where sharing
  would hold a value longer (more memory), unless the value is one number (a 0-d tensor: the
  backward holding the forward's costs nothing), nor between what the memory policy or a pass
  tells apart (recomputation, ``ep_overlap`` chunks, collective roles);
- a whole tensor's ``max`` (or ``min``) stands for the same value whenever it reads the same
  elements: of one tensor, of reshapes or transposes of it, or of ``abs`` of either. It depends
  on the set of elements alone and rounds nothing. A tensorwise float8 cast's amax is one: the
  forward casts a linear's input and weight, the backward casts them again (a 2-d view of the
  input for the weight gradient, the transposed weight for the input gradient), and would
  compute the same amaxes (one more pass over each, and under tensor parallel one more
  all-reduce) unless it reads the forward's.

Changes: a node whose value an earlier node computes is replaced by it and erased, and what only
it read is erased after it, unless sharing would cost more than computing again: a pointwise op
or a copy (cheap: a compiler computes it inside the kernel reading it, never writing it) is
shared only within one region of the regional backend (no collective or wait between the two,
``graph.collectives.stays_outside``), or when its value is written to memory anyway (a matmul,
attention, a collective or the output reads it). Across a region, sharing it would write it in
one compiled region and read it back in the other. The kept node keeps its own tags.

Never merged: placeholders and the output; a node the graph returns, or a view of one (two
outputs would be one tensor, which an in-place update of one, a gradient's, would change for
both); random ops; ``empty``-like allocations (their contents are no function of their inputs);
impure ops (but waits); ops that mutate an argument, and ops that read a tensor some op mutates.
Collectives and their waits are merged like any op (a collective only with its waits): a
functional collective over the same group of the same input returns the same value, and every
rank of the group holds the same graph, so all ranks drop the same collectives in the same order.

Numerics: bitwise. Each erased node computed exactly the value of the node that replaces it.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

from graph_trainer.graph import tags
from graph_trainer.graph.collectives import is_collective, is_wait, stays_outside
from graph_trainer.graph.ops import aliases_input, is_one_number, is_random, mutated_args, name_of

_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_COPIES = {"_to_copy", "clone", "copy", "_unsafe_view", "expand_copy", "permute_copy", "transpose_copy"}
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "var", "var_mean", "norm", "linalg_vector_norm"}
_ORDER_FREE = {torch.ops.aten.max.default, torch.ops.aten.min.default}
"""Reductions of a whole tensor to one value that depend only on its elements, not on their
order or shape, and round nothing."""
_SAME_ELEMENTS = {
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.t.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default,
}
"""Views holding every element of their input, in another shape or order."""


class _Incomparable(Exception):
    """An argument that cannot be compared by value (a symbolic size)."""


def eliminate_common_subexpressions(gm: fx.GraphModule) -> int:
    """Compute each value once where that saves work (module docstring); returns how many nodes
    were erased. Recompiles ``gm`` when any was."""
    graph = gm.graph
    mutated = {arg for node in graph.nodes for arg in mutated_args(node)}
    returned = _returned(graph)
    value: dict[fx.Node, fx.Node] = {}
    """Each node's value, named by the first node computing it."""
    first_of: dict[tuple, fx.Node] = {}
    holders: dict[fx.Node, list[fx.Node]] = {}
    """Per value, the nodes left computing it (the first, and pointwise copies kept apart)."""
    region_of: dict[fx.Node, int] = {}
    region, orphans, erased = 0, [], 0
    for node in list(graph.nodes):
        key = _value_key(node, value, mutated, returned)
        value[node] = first = node if key is None else first_of.setdefault(key, node)
        kept = _holder_to_share(node, holders.get(first, []), region_of, region)
        if kept is not None:
            orphans.extend(node.all_input_nodes)
            node.replace_all_uses_with(kept)
            graph.erase_node(node)
            erased += 1
            continue
        holders.setdefault(first, []).append(node)
        region_of[node] = region
        region += stays_outside(node)
    erased += _erase_unread(graph, orphans, mutated, returned)
    if erased:
        # A copy of the graph, whose names are only those of its nodes: the erased ones' are free
        # again, so a pass names what it adds here as it would in any copy of this graph.
        gm.graph = copy.deepcopy(graph)
        gm.graph.lint()
        gm.recompile()
    return erased


def _value_key(node: fx.Node, value: dict, mutated: set[fx.Node], returned: set[fx.Node]) -> tuple | None:
    """What makes ``node``'s value: its target, its arguments' values and its tags (module
    docstring); None for a node never merged or with an argument that cannot be compared."""
    if not _may_merge(node, mutated, returned):
        return None
    try:
        if node.target in _ORDER_FREE and not node.kwargs:
            args = _elements_key(node.args[0], value)
        else:
            args = _key(node.args, value)
        kwargs = _key(tuple(sorted(node.kwargs.items())), value)
    except _Incomparable:
        return None
    return (node.target, args, kwargs, _tag_key(node, phase=not is_one_number(node)))


def _elements_key(arg, value: dict) -> tuple:
    """A stand-in for the elements of ``arg`` whatever their shape and order: a reshape or
    transpose of a tensor has its elements, and ``abs`` of one the elements of ``abs`` of the tensor."""
    if isinstance(arg, fx.Node) and arg.target in _SAME_ELEMENTS:
        return _elements_key(arg.args[0], value)
    if isinstance(arg, fx.Node) and arg.target is torch.ops.aten.abs.default:
        return ("abs", _elements_key(arg.args[0], value))
    return _key(arg, value)


def _holder_to_share(node: fx.Node, holders: list[fx.Node], region_of: dict, region: int) -> fx.Node | None:
    """The node that ``node`` should read its value from instead of computing it, if any: the
    latest holder of the value in this region, or for what is not cheap to recompute (or is
    written to memory anyway, ``_written``) the first holder wherever it is."""
    if not holders:
        return None
    if region_of[holders[-1]] == region:
        return holders[-1]
    if not _cheap(node) or _written(holders[0]) or _written(node):
        return holders[0]
    return None


def _erase_unread(graph: fx.Graph, candidates: list[fx.Node], mutated: set, returned: set) -> int:
    """Erase the nodes among ``candidates`` (and then their inputs) that nothing reads any more and
    that could have been merged (pure): what the erased nodes alone read."""
    gone: set[fx.Node] = set()
    while candidates:
        node = candidates.pop()
        if node in gone or node.users or not _may_merge(node, mutated, returned):
            continue
        candidates.extend(node.all_input_nodes)
        graph.erase_node(node)
        gone.add(node)
    return len(gone)


def _cheap(node: fx.Node) -> bool:
    """Pointwise ops and copies: computed inside the kernel that reads them when compiled."""
    return torch.Tag.pointwise in getattr(node.target, "tags", ()) or name_of(node) in _COPIES


def _written(node: fx.Node) -> bool:
    """Whether ``node``'s value is written to memory whatever the compiler fuses: something other
    than a pointwise op, a copy or a reduction reads it (a matmul, attention, a collective, the output)."""
    for user in node.users:
        if aliases_input(user):
            if _written(user):
                return True
        elif user.op != "call_function" or not (_cheap(user) or name_of(user) in _REDUCTIONS):
            return True
    return False


def _returned(graph: fx.Graph) -> set[fx.Node]:
    """The graph's outputs and what they are views of: merging two would return one tensor as
    two outputs (two gradients, say), which an in-place update of one would change both of."""
    found: set[fx.Node] = set()
    for node in graph.output_node().all_input_nodes:
        while node not in found:
            found.add(node)
            if not (aliases_input(node) and node.args and isinstance(node.args[0], fx.Node)):
                break
            node = node.args[0]
    return found


def _may_merge(node: fx.Node, mutated: set[fx.Node], returned: set[fx.Node]) -> bool:
    """Whether ``node`` may be merged: not what the module docstring excludes, nor a graph output
    or a view of one (``returned``). A wait counts as pure (torch marks it side-effectful so that
    no pass drops it; two waits on one collective return the same tensor); a collective, only
    when its waits may be merged too (one collective, one wait)."""
    if node.op != "call_function" or mutated_args(node) or node in returned:
        return False
    if node.is_impure() and not is_wait(node):
        return False
    if is_collective(node) and any(not is_wait(u) or u in returned for u in node.users):
        return False
    if is_random(node) or name_of(node) in _ALLOCATIONS:
        return False
    return not any(arg in mutated for arg in node.all_input_nodes)


def _key(arg, value: dict):
    """A hashable stand-in for an argument, equal for arguments of equal value (a node by the first
    node computing its value)."""
    if isinstance(arg, fx.Node):
        return ("node", id(value.get(arg, arg)))
    if isinstance(arg, (list, tuple)):
        return (type(arg).__name__, tuple(_key(v, value) for v in arg))
    if isinstance(arg, (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor)):
        raise _Incomparable
    try:
        hash(arg)
    except TypeError:
        raise _Incomparable from None
    return (type(arg).__name__, arg)


def _tag_key(node: fx.Node, phase: bool = True) -> tuple:
    ignored = {tags.MODULE_FQN} if phase else {tags.MODULE_FQN, tags.PHASE}
    kept = sorted((k, repr(v)) for k, v in tags.tags(node).items() if k not in ignored)
    return tags.unit_of(node), tuple(kept)


__all__ = ["eliminate_common_subexpressions"]
