"""Activation checkpointing as two graph passes, decide then recompute.

Contract
--------
Reads: the tracer's tags on every node (``graph_trainer.graph.tags``): ``phase`` (forward /
backward / ...), ``module_fqn`` (transformer blocks are the modules ``layers.<i>``, ``block_of``;
a backward node carries the FQN of the forward op it differentiates), ``loss_chunk`` (``unit_of``),
``fsdp_role`` (SimpleFSDP's gather chains), ``tp_role`` (sequence parallel's gathers); and
``--activation_checkpoint.mode`` / ``selective_ops`` / ``selective_matmuls`` / ``full_blocks``.

``tag_activations`` (decides, changes no edge): within each transformer block (and each row
block of a chunked loss, ``graph_trainer.loss``, which is always recomputed in full; and the
graph's first ``activation_checkpoint.full_blocks`` blocks by index, a pipeline stage's first
ones, whatever the mode: ``region_modes``), every
forward value the region's backward reads is tagged ``custom["activation"] = "save"`` or
``"recompute"``, and so is every value a recomputation reads:

- ``full``: recompute everything the block computes; what is saved is what the block reads
  from outside (its input, the parameters) and what may never run twice (below).
- ``selective``: also save the outputs of the ops in ``selective_ops`` (by default matmuls,
  grouped matmuls and attention: the expensive ones); recompute the cheap ones (norms,
  activations, RoPE, views) from them. With ``selective_matmuls`` 'every_other' the region's
  matmuls among them (``MATMUL_OP_NAMES``) are counted in graph order, which is forward order,
  and the 2nd, 4th, ... are not saved for being matmuls (``every_other_matmul``): decided as any
  op, they are recomputed, and so are the cheap ops before them (torchtitan's op-level selective
  policy, which counts a block's ``aten.mm`` calls and recomputes the even ones).
- Never recomputed, whatever the mode: collectives and their waits (a tensor-parallel
  all-reduce or an expert-parallel all_to_all is issued once per step: token routing is
  computed once), ops with side effects (the MoE token counter's in-place add), random ops
  (a fused attention kernel with ``dropout_p`` 0 draws no random numbers: it is recomputed),
  reads of data-dependent sizes (``_local_scalar_dense``), non-tensor values, SimpleFSDP's
  gather chains (``reshard_after_forward``, which runs after this, re-gathers parameters for
  every backward reader, recomputations included: one gather per block for backward),
  values read outside their region (a block's output is the next block's saved input), and
  values of one number (0-d: a tensorwise float8 cast's amax and scale; a few bytes kept against,
  for the amax, one more pass over the whole input recomputed; torchtitan's selective policy
  keeps the amaxes too).
  One exception to the collectives: sequence parallel's all-gather of a region's input
  (``tp_role`` sequence_gather, with its wait) is recomputed like any op: its input is this
  rank's piece of the sequence, 1/tp of what it gathers, so a block keeps the piece and gathers
  it again for backward, as Megatron's recomputation does (one more all-gather per region).
- A view (or ``getitem``) of a saved value is saved too: it shares the saved storage.

``recompute_activations`` (acts only on the tags, never re-decides): each value tagged
``recompute`` is copied right before the first backward node that needs it (its own first
backward reader, or the first copy that reads it), in graph order, so a block's forward is
recomputed piece by piece as its backward proceeds; the block's backward reads the copies,
the forward values die after their last forward use. Copies are tagged ``phase = "backward"``,
``recomputed = True`` and ``recompute_of = <original node name>``, and keep every other tag
(``module_fqn``, chunk ids, ``ep_role``): later passes (bucketing, ``ep_overlap``) place them
like any backward node and must not recompute them again.

Numerics: a copy runs the same op on the same inputs (saved values, or re-gathered
parameters that are bitwise the forward's), so the backward sees bit-for-bit the values it
would have read from forward: losses and gradients are bitwise those without the policy
(on CUDA only with deterministic kernels, as for any rerun).
"""

from __future__ import annotations

import functools
import operator
from collections import defaultdict

import torch
import torch.fx as fx

from graph_trainer.compiler.passes.registry import PassContext
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import collective_name
from graph_trainer.graph.ops import (
    MATMUL_OP_NAMES,
    SCALAR_READ,
    aliases_input,
    is_attention,
    is_matmul,
    is_one_number,
    is_random,
    name_of,
    named_args,
)
from graph_trainer.graph.tags import (
    ACTIVATION,
    BACKWARD,
    CP_ROLE,
    FORWARD,
    FSDP_ROLE,
    KV_GATHER,
    LOSS,
    LOSS_CHUNK,
    PHASE,
    RECOMPUTE,
    RECOMPUTE_OF,
    RECOMPUTED,
    SAVE,
    SEQUENCE_GATHER,
    TP_ROLE,
    unit_of,
)
from graph_trainer.torch_compat import has_side_effects, is_op_overload, op_schema


def _is_tensor(node: fx.Node) -> bool:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return any(isinstance(v, torch.Tensor) for v in val)
    return isinstance(val, torch.Tensor)


def _may_run_twice(node: fx.Node) -> bool:
    """Whether copying ``node`` is safe: a pure, deterministic tensor op that is not a collective."""
    if node.op != "call_function" or not _is_tensor(node):
        return False
    if tags.get(node, TP_ROLE) == SEQUENCE_GATHER or tags.get(node, CP_ROLE) == KV_GATHER:
        return True  # (the gather, its wait and the reshuffle into the sequence dim: deterministic)
    if collective_name(node) is not None or node.target is SCALAR_READ or has_side_effects(node):
        return False
    if tags.get(node, FSDP_ROLE):
        return False  # parameter gathers: reshard_after_forward re-gathers them for backward
    if is_op_overload(node.target):
        if op_schema(node.target).is_mutable:
            return False
        if is_random(node) and not _draws_no_random_numbers(node):
            return False
    return node.target is operator.getitem or is_op_overload(node.target)


def _draws_no_random_numbers(node: fx.Node) -> bool:
    """A fused attention kernel without dropout: its schema is tagged random (it can drop out),
    but with ``dropout_p`` 0 it computes the same values every time it runs."""
    return is_attention(node) and named_args(node).get("dropout_p", 0.0) == 0.0


def every_other_matmul(forward_nodes: list[fx.Node], saved_ops: set[str]) -> set[fx.Node]:
    """The 2nd, 4th, ... of the matmuls among ``saved_ops`` in ``forward_nodes`` (graph order)."""
    matmuls = [n for n in forward_nodes if name_of(n) in saved_ops and name_of(n) in MATMUL_OP_NAMES]
    return set(matmuls[1::2])


def decide_region(
    forward_nodes: list[fx.Node], region: str, mode: str, saved_ops: set[str], selective_matmuls: str = "all"
) -> dict[fx.Node, str]:
    """The decision for each forward node of ``region`` that its backward (or a recomputation) reads;
    ``forward_nodes``: the region's forward and loss nodes in graph order (``forward_nodes_by_region``);
    ``selective_matmuls``: 'all' or 'every_other' (module docstring)."""
    forward = set(forward_nodes)
    unsaved = every_other_matmul(forward_nodes, saved_ops) if selective_matmuls == "every_other" else set()

    def backward_readers(node: fx.Node) -> list[fx.Node]:
        return [u for u in node.users if tags.phase(u) == BACKWARD]

    def pinned(node: fx.Node) -> bool:
        if not _may_run_twice(node):
            return True
        if mode == "selective" and name_of(node) in saved_ops and node not in unsaved:
            return True
        if is_one_number(node):
            return True  # (kept: a few bytes; recomputed: a launch, and for an amax a pass over its input)
        # Read outside its region (another block, the loss): the region's boundary is saved.
        return any(unit_of(u) != region for u in node.users)

    needed = [n for n in forward_nodes if backward_readers(n)]
    decision: dict[fx.Node, str] = {}
    stack = list(needed)
    while stack:
        node = stack.pop()
        if node in decision:
            continue
        if pinned(node):
            decision[node] = SAVE
            continue
        decision[node] = RECOMPUTE
        stack.extend(a for a in node.all_input_nodes if a in forward and a not in decision)
    # A view of a saved value costs nothing to keep (same storage): save it rather than copy it.
    for node in forward_nodes:  # graph order: a view's source is decided before the view
        if decision.get(node) == RECOMPUTE and aliases_input(node):
            sources = [a for a in node.all_input_nodes if a in forward]
            if sources and all(decision.get(a, SAVE) == SAVE for a in sources):
                decision[node] = SAVE
    return decision


def region_modes(regions: set[str], mode: str, full_blocks: int) -> dict[str, str]:
    """The mode each region of one graph is decided with: a loss row block ``full``; the first
    ``full_blocks`` transformer blocks by block index ``full``, the others ``mode``."""
    blocks = sorted((r for r in regions if not r.startswith(LOSS_CHUNK)), key=lambda r: int(r.rpartition(".")[2]))
    modes = {r: "full" for r in regions if r.startswith(LOSS_CHUNK)}
    modes.update({r: "full" if i < full_blocks else mode for i, r in enumerate(blocks)})
    return modes


def tag_activations(gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
    """Tag save / recompute on the activations of every block (by ``activation_checkpoint.mode``,
    the graph's first ``full_blocks`` blocks ``full``) and of every loss row block (always
    ``full``: their logits are what chunking frees)."""
    ac = context.config.activation_checkpoint
    forward = forward_nodes_by_region(gm.graph)
    saved_ops = set(ac.selective_ops)
    modes = region_modes(set(forward), ac.mode, ac.full_blocks)
    for region in sorted(forward):
        mode = modes[region]
        if mode == "none":
            continue
        for node, choice in decide_region(forward[region], region, mode, saved_ops, ac.selective_matmuls).items():
            tags.update(node, {ACTIVATION: choice})
    return gm


def forward_nodes_by_region(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    """Every region (unit) of ``graph`` -> its forward and loss nodes in graph order, from one pass
    over the graph (a pass per region would make tagging quadratic in the blocks)."""
    forward: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        region = unit_of(node)
        if region is not None:
            members = forward.setdefault(region, [])
            if tags.phase(node) in (FORWARD, LOSS):
                members.append(node)
    return forward


def recompute_activations(gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
    """Copy every value tagged ``recompute`` before its first backward use (module docstring)."""
    graph = gm.graph
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    recompute = [n for n in nodes if tags.get(n, ACTIVATION) == RECOMPUTE]
    if not recompute:
        return gm
    chosen = set(recompute)
    # Where each copy must exist: before its first backward reader and before the copies that read it.
    target: dict[fx.Node, fx.Node] = {}
    for node in reversed(recompute):
        candidates = [u for u in node.users if tags.phase(u) == BACKWARD]
        candidates += [target[u] for u in node.users if u in chosen]
        if not candidates:
            raise RuntimeError(f"activation {node.name} is tagged recompute but nothing in backward reads it")
        target[node] = min(candidates, key=position.__getitem__)
    copies: dict[fx.Node, fx.Node] = {}
    for node in recompute:  # graph order: a copy's inputs are copied (or saved) before it
        with graph.inserting_before(target[node]):
            copy = graph.node_copy(node, lambda arg: copies.get(arg, arg))
        copy.meta = dict(node.meta)
        tags.replace(copy, {**tags.tags(node), PHASE: BACKWARD, RECOMPUTED: True, RECOMPUTE_OF: node.name})
        tags.remove(copy, ACTIVATION)
        copies[node] = copy
    for node, copy in copies.items():
        node.replace_all_uses_with(copy, delete_user_cb=functools.partial(_backward_reader_of, copy))
    graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _backward_reader_of(copy: fx.Node, user: fx.Node) -> bool:
    """Whether ``user`` should read ``copy`` instead of the forward value: a backward node other than the copy."""
    return tags.phase(user) == BACKWARD and user is not copy


def recompute_counts(graph: fx.Graph) -> dict[str, dict[str, int]]:
    """Per block: how many nodes were recomputed, of which matmuls, and collectives (must be 0)."""
    counts: dict[str, dict[str, int]] = defaultdict(lambda: {"nodes": 0, "matmuls": 0, "collectives": 0})
    for node in graph.nodes:
        if tags.get(node, RECOMPUTED) and tags.has(node, RECOMPUTE_OF):
            row = counts[unit_of(node) or "?"]
            row["nodes"] += 1
            row["matmuls"] += is_matmul(node)
            row["collectives"] += collective_name(node) is not None
    return dict(counts)


__all__ = [
    "decide_region",
    "every_other_matmul",
    "forward_nodes_by_region",
    "recompute_activations",
    "recompute_counts",
    "region_modes",
    "tag_activations",
]
