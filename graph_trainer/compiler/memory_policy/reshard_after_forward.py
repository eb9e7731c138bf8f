"""reshard_after_forward: backward re-gathers parameters instead of keeping them from forward.

Contract
--------
Reads: tags (``graph_trainer.graph.tags``) written by ``graph_trainer.distributed.simple_fsdp`` and the tracer:
``fsdp_role == "unshard"`` marks the forward nodes that cast and all-gather one parameter
(``fsdp_param`` names it, ``module_fqn`` the module it is gathered for), ``phase`` says which
nodes belong to the backward; ``parallelism.fsdp_reshard_after_forward`` of the config and, for
``default``, ``context.extras["head_modules"]`` (the modules the backward starts with: the final
norm and the output projection). ``always`` (or no config) re-gathers every parameter;
``default`` keeps the gathers made for the head modules: the backward reads them first, so
a re-gather would be waited for at once, with no compute to hide behind (torchtitan's default
does not reshard them either; the forward's copy lives only from the loss to the backward's
start, where the re-gathered copy would have been alive anyway).

Changes: for every parameter whose gathered value is read by backward nodes (and, with
``default``, that is not gathered for a head module), the whole
gather chain (cast, ``all_gather_into_tensor``, ``wait_tensor``, views), extended by the
forward view ops of the gathered tensor (e.g. the ``t`` of a linear layer, which autograd
saves for the backward matmul; found by ``OpOverload.is_view``), is copied once, right
before the first backward node that reads it, and the backward readers are pointed at the
copy. Scalars of a chain (a float8 weight's amax, its all-reduce and scale:
``graph_trainer.distributed.float8_gather``) are not copied: four bytes kept from forward
instead of a collective run again. The forward copy is then dead after its last forward use,
so the unsharded parameter is freed after forward instead of living until backward: this is
what makes SimpleFSDP save memory like FSDP. The copies are tagged ``phase = "backward"``, keep ``fsdp_role``
and ``fsdp_param``, and get ``recomputed = True``. Graphs without tagged chains (one
process, or DDP where nothing is gathered) are left as they are.

Numerics: an all-gather concatenates the same shards in the same rank order every time and
the cast is deterministic, so the backward sees bit-for-bit the tensor the forward saw.
Losses and gradients are bitwise those of the graph without this pass.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.fx as fx

from graph_trainer.compiler.passes.registry import PassContext, PassError
from graph_trainer.graph import tags
from graph_trainer.graph.ops import is_view
from graph_trainer.graph.tags import BACKWARD, FORWARD, FSDP_PARAM, FSDP_ROLE, PHASE, RECOMPUTED, UNSHARD


def unshard_chains(graph: fx.Graph) -> dict[tuple[str, str], list[fx.Node]]:
    """The forward gather-chain nodes of each parameter, in graph order, by (``fsdp_param``, the
    ``module_fqn`` it is gathered for): a parameter two modules compute with (an embedding tied to
    the output projection) has a chain for each, which are resharded each on their own."""
    chains: dict[tuple[str, str], list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if tags.get(node, FSDP_ROLE) == UNSHARD and tags.phase(node) == FORWARD:
            if not tags.has(node, FSDP_PARAM):
                raise PassError(f"reshard_after_forward: gather node {node.name} has no fsdp_param tag")
            chains[(tags.get(node, FSDP_PARAM), tags.module_fqn(node))].append(node)
    return chains


def with_forward_views(chain: list[fx.Node], position: dict[fx.Node, int]) -> list[fx.Node]:
    """``chain`` plus forward view ops of its values (transitively), in graph order.

    A view shares the gathered storage: if the backward read the forward's view, the
    unsharded parameter would stay alive anyway.
    """
    members = set(chain)
    frontier = list(chain)
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user not in members and is_view(user) and tags.phase(user) == FORWARD and user.args[0] is node:
                members.add(user)
                frontier.append(user)
    return sorted(members, key=position.__getitem__)


def _backward_readers(chain: list[fx.Node]) -> list[fx.Node]:
    members = set(chain)
    readers = {user for node in chain for user in node.users if user not in members and tags.phase(user) == BACKWARD}
    return list(readers)


def _recompute_for_backward(
    graph: fx.Graph, chain: list[fx.Node], readers: list[fx.Node], position: dict[fx.Node, int]
) -> None:
    """Copy ``chain`` before the earliest of ``readers`` and point the readers at the copy; its
    scalars (a float8 weight's amax and scale) are not copied: the copies and readers use the
    forward's."""
    first = min(readers, key=position.__getitem__)
    readers_set = set(readers)
    copies: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(first):
        for node in chain:
            if _scalar(node):
                continue
            copy = graph.node_copy(node, lambda arg: copies.get(arg, arg))
            copy.meta = dict(node.meta)
            tags.replace(copy, {**tags.tags(node), PHASE: BACKWARD, RECOMPUTED: True})
            copies[node] = copy
    for node, copy in copies.items():
        node.replace_all_uses_with(copy, delete_user_cb=lambda user: user in readers_set)


def _scalar(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.numel() <= 1


def kept_modules(context: PassContext) -> list[str]:
    """FQN prefixes of the modules whose forward gathers the backward keeps: the head modules under
    ``fsdp_reshard_after_forward = 'default'``, none under 'always' or without a config."""
    config = context.config
    if config is None or config.parallelism.fsdp_reshard_after_forward == "always":
        return []
    if "head_modules" not in context.extras:
        raise PassError("reshard_after_forward 'default' needs context.extras['head_modules'] (the model's head)")
    return list(context.extras["head_modules"])


def reshard_after_forward(gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
    graph = gm.graph
    position = {node: i for i, node in enumerate(graph.nodes)}
    kept = kept_modules(context)
    for (_, module), chain in unshard_chains(graph).items():
        if tags.within(module, kept):
            continue
        chain = with_forward_views(chain, position)
        readers = _backward_readers(chain)
        if readers:
            _recompute_for_backward(graph, chain, readers, position)
    # Copies whose value no backward reader needed (e.g. a view only the forward used) are pure
    # and go; the copied collectives are all needed by construction.
    graph.eliminate_dead_code()
    gm.recompile()
    return gm


__all__ = ["kept_modules", "reshard_after_forward", "unshard_chains", "with_forward_views"]
