"""transformer_block_bucketing: one FSDP all-gather and one gradient reduction per transformer block.

Contract
--------
Reads: ``context.extras["bucket_plan"]``, the model's list of FQN-prefix groups
(``[["tok_embeddings"], ["layers.0"], ..., ["norm", "output"]]``); and the tags
(``graph_trainer.graph.tags``) written by ``graph_trainer.distributed.simple_fsdp``, the tracer and
``reshard_after_forward``: ``fsdp_role`` (``unshard`` / ``reduce_grad``), ``fsdp_param``, ``phase``, ``module_fqn``,
``recomputed``. A collective belongs to the first group with a prefix matching the module it is
made for, its ``module_fqn`` (``m == prefix`` or ``m`` starts with ``prefix + "."``): the module
owning its ``fsdp_param``, or, for a parameter two modules compute with (an embedding tied to
the output projection), the one whose forward gathered it.

Changes: the FSDP collectives, and only those, are merged per group (a *bucket*; the merge itself
is ``graph_trainer.compiler.passes.bucket_merge``):

- the forward ``all_gather_into_tensor`` nodes tagged ``unshard`` (phase forward),
- the backward re-gathers tagged ``unshard`` (phase backward, ``recomputed``; made by the
  default ``reshard_after_forward`` pass, absent with ``fsdp_reshard_after_forward never``),
- the ``reduce_scatter_tensor`` nodes tagged ``reduce_grad`` (FSDP, HSDP's shard dim),
- the ``all_reduce`` nodes tagged ``reduce_grad`` (DDP, and HSDP's replicate dim, which sums
  the reduce-scattered shard: ``graph_trainer.distributed.simple_fsdp``),
- the ``all_reduce`` (max) nodes tagged ``unshard``: a float8 weight's amax, before its
  gather (``graph_trainer.distributed.float8_gather``); the bucket's one all-reduce moves with
  its gather's casts, ahead of the gather,

each become ONE collective per bucket and process group (for the all-reduces and reductions
also per dtype and reduce op; a bucket whose parameters live on several groups, e.g. DeepSeek-V3 experts
sharded over ``efsdp`` beside dense weights over ``dp_shard``, gets one collective per group).
TP all_reduces (untagged) and EP all_to_alls are left as they are. The merge is
functional (no ``out=`` mutation): an all-gather bucket is ``cat`` of the flattened shards
(bytes when dtypes differ) -> one all_gather -> ``view(world, N)`` -> per parameter
``slice(dim 1) -> clone -> view``, rank-major exactly like the per-parameter gathers (a 2-D
gathered weight read only through contiguous copies of its transpose, a float8 weight's backward
gather, is copied out transposed instead, ``view -> permute -> clone``, and those copies' readers
read it: ``bucket_merge.transposed_copies``); a
reduce-scatter bucket is ``cat`` of each gradient ``view(world, -1)`` along dim 1 (and of zero
padding, see Numerics) -> one reduce_scatter -> per parameter ``slice -> view``; an all-reduce
bucket is ``cat`` of the flattened gradients -> one all_reduce -> per parameter
``slice -> view``. PyTorch's ``merge_all_reduce_bucket`` builds the same all-reduce bucket, but
by re-tracing a merge function whose nodes carry none of our tags and whose placement we would
have to undo; this pass writes the bucket the way it writes the other two. New nodes get
``meta["val"]`` (run on the trace's fake mode) and the tags of what they replace; nodes shared
by a bucket carry ``fsdp_param = fsdp_bucket = `` the bucket name (``"layers.3"``,
``"norm+output"``) and ``fsdp_params``, the tuple of its parameters.

Schedule (per phase, buckets in the order their compute starts; *compute* of a bucket = the
``call_function`` nodes of that phase whose ``module_fqn`` is in the bucket, FSDP nodes
excluded): a gather bucket is issued before the first compute node of the bucket before it
(prefetch one bucket ahead: forward in plan order, backward in reverse), and waited right
before the first node that reads its parameters; a reduction bucket is issued right after its
last gradient is computed (under HSDP the all-reduce right after its reduce-scatter's wait;
the views tagged ``reduce_grad`` that only feed it, DTensor's identity views, move with it),
and waited right before the next reduction of its group is issued (the last one before the
graph output), so it overlaps the next bucket's backward.
A stable topological sort then restores a valid order moving as few nodes as possible
(a node placed before an input goes right after it); every node stays exactly once.

Numerics: gathers and reductions see the same elements; the concatenation and split only move
data; a max is the same in any grouping. Losses and gradients are bitwise those of the graph without this pass (for the
reduce-scatter, provided the backend sums each element's contributions in the same order in
a larger buffer: always true for 2 ranks, and for ring reduce-scatters). Gloo's reduce-scatter
is not one: it all-reduces the whole buffer with a ring that cuts it into ``world`` chunks of
``k`` equal segments (``k`` from the buffer's bytes and gloo's 1 MiB segment limit) and sums each
chunk in its own rotation of the ranks. When ``world * row`` does not split into such chunks
exactly, chunk ``r`` starts a few elements after rank ``r``'s row, and the first elements of
that row (the first bucket member's) are summed in chunk ``r - 1``'s order: a last-bit
difference. Each rank's row of a reduce-scatter bucket is therefore padded with zeros to the
next length gloo cuts exactly (``ring_aligned_row``: fewer than ``k`` elements, none for
2 ranks), which makes every member bitwise its own reduce-scatter whenever that one is cut
exactly too: its shard's element count is a multiple of ``max(ceil(shard bytes / 1 MiB), 2)``
(any even count up to 2 MiB, any multiple of 1 MiB). An all-reduce bucket is bitwise its
members' all-reduces over 2 ranks (one addition per element). Over more ranks it is not, and
no padding can make it so: a ring all-reduce (gloo's, NCCL's) sums each element in the rank
order of the chunk it falls in, and a member's elements fall in other chunks of the bucket than
of its own buffer (DDP's own buckets have the same property). Each sum is then the same terms
in another order: a last-bit difference per element, as between any two bucket sizes.

Errors: config validation rejects the pass without data parallelism (``dp_shard`` and
``dp_replicate`` both 1);
at run time a missing bucket plan, an FSDP parameter in no bucket, a collective whose only
user is not its wait, or a graph without FSDP collectives raise ``PassError``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch.fx as fx

from graph_trainer.compiler.passes.bucket_merge import (
    AMAX_ALL_REDUCE,
    BACKWARD_GATHER,
    FLAT_ALL_REDUCES,
    FORWARD_GATHER,
    GRAD_ALL_REDUCE,
    GRAD_REDUCE,
    REDUCTIONS,
    Merged,
    collective_kind,
    merge_all_gathers,
    merge_reductions,
    only_wait,
)
from graph_trainer.compiler.passes.registry import PassContext, PassError, PassSpec
from graph_trainer.errors import ConfigError
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import group_name
from graph_trainer.graph.ops import is_view
from graph_trainer.graph.tags import BACKWARD, FORWARD, FSDP_PARAM, FSDP_ROLE, RECOMPUTED, REDUCE_GRAD, UNSHARD


def bucket_index(plan: list[list[str]], fqn: str) -> int | None:
    """Index of the first plan group with a prefix matching ``fqn`` (a parameter or module FQN)."""
    for index, prefixes in enumerate(plan):
        if tags.within(fqn, prefixes):
            return index
    return None


def fsdp_buckets(graph: fx.Graph, plan: list[list[str]]) -> dict[tuple, list[fx.Node]]:
    """The FSDP collectives to merge, keyed by (kind, bucket index, group, dtype, reduce op), in graph order."""
    buckets: dict[tuple, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        module = tags.module_fqn(node)
        index = bucket_index(plan, module)
        if index is None:
            raise PassError(
                f"transformer_block_bucketing: {node.name} (parameter {tags.get(node, FSDP_PARAM, '')!r}, "
                f"module {module!r}) is in no group of the bucket plan {plan}"
            )
        only_wait(node)
        if kind in FLAT_ALL_REDUCES or kind == GRAD_REDUCE:
            key = (kind, index, group_name(node), node.meta["val"].dtype, node.args[1])
        else:
            key = (kind, index, group_name(node), None, None)
        buckets[key].append(node)
    return buckets


def compute_starts(graph: fx.Graph, plan: list[list[str]]) -> dict[str, dict[int, fx.Node]]:
    """First compute node of each bucket in the forward and in the backward (FSDP nodes excluded)."""
    starts: dict[str, dict[int, fx.Node]] = {FORWARD: {}, BACKWARD: {}}
    for node in graph.nodes:
        phase = tags.phase(node)
        if node.op != "call_function" or phase not in starts:
            continue
        if tags.get(node, FSDP_ROLE) or tags.get(node, RECOMPUTED):
            continue
        index = bucket_index(plan, tags.module_fqn(node))
        if index is not None:
            starts[phase].setdefault(index, node)
    return starts


def _first_reader(outputs: list[fx.Node], position: dict[fx.Node, int]) -> fx.Node:
    """The earliest node reading the gathered parameters past their ``unshard`` view chains."""
    readers, frontier, seen = [], list(outputs), set()
    while frontier:
        for user in frontier.pop().users:
            if user in seen:
                continue
            seen.add(user)
            (frontier if tags.get(user, FSDP_ROLE) == UNSHARD else readers).append(user)
    return min(readers, key=position.__getitem__)


def _move_before(anchor: fx.Node, nodes: list[fx.Node]) -> None:
    for node in nodes:
        if node is not anchor:
            anchor.prepend(node)


def schedule_gathers(merged: list[Merged], starts: dict[int, fx.Node], position: dict[fx.Node, int]) -> None:
    """Issue each gather bucket before the previous bucket's compute; wait right before its first reader."""
    order = sorted(starts, key=lambda b: position[starts[b]])
    previous = dict(zip(order[1:], order, strict=False))
    rank = {b: i for i, b in enumerate(order)}
    merged = sorted(merged, key=lambda m: (rank.get(m.bucket, len(rank)), position[m.collective]))
    readers = [_first_reader(m.outputs, position) for m in merged]
    for m, reader in zip(merged, readers, strict=True):  # all issues first: a prefetch goes before an earlier wait
        candidates = [reader] + [starts[b] for b in (m.bucket, previous.get(m.bucket)) if b in starts]
        _move_before(min(candidates, key=position.__getitem__), m.issue)
    for m, reader in zip(merged, readers, strict=True):
        _move_before(reader, m.wait)


def _carried_views(issue: list[fx.Node], position: dict[fx.Node, int]) -> list[fx.Node]:
    """The reduction's own views (``reduce_grad``) that feed ``issue`` and nothing else, in graph
    order: DTensor's identity views, between each gradient and its reduce-scatter under torch 2.13
    (none under 2.11), and before each HSDP all-reduce (``from_local`` in the replicas' sum). They
    move with the bucket, so that it is issued right after its last gradient even where an earlier
    pass (``ep_overlap``) moved the gradients and left the views."""
    members, carried = set(issue), set()
    frontier = [i for n in issue for i in n.all_input_nodes if i not in members]
    while frontier:
        node = frontier.pop()
        if node in carried or not is_view(node) or tags.get(node, FSDP_ROLE) != REDUCE_GRAD:
            continue
        if any(u not in members and u not in carried for u in node.users):
            continue
        carried.add(node)
        frontier.extend(node.all_input_nodes)
    return sorted(carried, key=position.__getitem__)


def schedule_reductions(graph: fx.Graph, merged: list[Merged], position: dict[fx.Node, int]) -> None:
    """Issue each reduction bucket after its last input (its gradients, or under HSDP the
    all-reduce's reduce-scattered shards, once their waits have moved; its own views move with
    it); wait before its group's next one."""
    last_input = {}
    for m in merged:
        issue = _carried_views(m.issue, position) + m.issue
        members = set(issue)
        inputs = [i for n in issue for i in n.all_input_nodes if i not in members]
        last_input[id(m)] = max(inputs, key=position.__getitem__)
        cursor = last_input[id(m)]
        for node in issue:
            cursor.append(node)
            cursor = node
    by_group: dict[str, list[Merged]] = defaultdict(list)
    for m in sorted(merged, key=lambda m: position[last_input[id(m)]]):
        by_group[m.group].append(m)
    output = next(iter(reversed(graph.nodes)))
    for chain in by_group.values():
        for m, following in zip(chain, chain[1:] + [None], strict=True):
            _move_before(following.collective if following else output, m.wait)


def stable_topological_sort(graph: fx.Graph) -> None:
    """Reorder so every node follows its inputs; a node found before an input moves right after it."""
    placed: set[fx.Node] = set()
    parked: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    order: list[fx.Node] = []
    todo = list(reversed(graph.nodes))
    while todo:
        node = todo.pop()
        missing = next((i for i in node.all_input_nodes if i not in placed), None)
        if missing is not None:
            parked[missing].append(node)
            continue
        placed.add(node)
        order.append(node)
        todo.extend(reversed(parked.pop(node, [])))
    if len(order) != len(graph.nodes):
        raise PassError("transformer_block_bucketing: the rescheduled graph has a cycle")
    for before, node in zip(order, order[1:], strict=False):
        if before.next is not node:
            before.append(node)


def transformer_block_bucketing(gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
    plan = context.extras.get("bucket_plan")
    if not plan:
        raise PassError("transformer_block_bucketing needs context.extras['bucket_plan'] (the model's FQN groups)")
    graph = gm.graph
    buckets = fsdp_buckets(graph, plan)
    if not buckets:
        raise PassError(
            "transformer_block_bucketing: the graph has no FSDP all_gather/reduce_scatter and no "
            "gradient all_reduce (fsdp_role tags); it needs data parallelism (parallelism.dp_shard "
            "or dp_replicate > 1)"
        )
    starts = compute_starts(graph, plan)
    merged: dict[str, list[Merged]] = defaultdict(list)
    # float8 amax all-reduces first: each gather bucket then moves its merged one with its casts
    for (kind, index, *_), members in sorted(buckets.items(), key=lambda item: item[0][0] != AMAX_ALL_REDUCE):
        merge = merge_reductions if kind in (*REDUCTIONS, AMAX_ALL_REDUCE) else merge_all_gathers
        merged[kind].append(merge(graph, members, index, "+".join(plan[index])))
    position = {node: i for i, node in enumerate(graph.nodes)}
    schedule_gathers(merged[FORWARD_GATHER], starts[FORWARD], position)
    schedule_gathers(merged[BACKWARD_GATHER], starts[BACKWARD], position)
    schedule_reductions(graph, merged[GRAD_REDUCE], position)
    if merged[GRAD_REDUCE] and merged[GRAD_ALL_REDUCE]:
        # HSDP's all-reduces read the reduce-scatters' outputs (through casts): settle those after
        # the waits that just moved, so each all-reduce is issued, and the previous one waited,
        # only once its own reduce-scatter is done, not where the casts were first traced
        stable_topological_sort(graph)
        position = {node: i for i, node in enumerate(graph.nodes)}
    schedule_reductions(graph, merged[GRAD_ALL_REDUCE], position)
    stable_topological_sort(graph)
    graph.lint()
    gm.recompile()
    return gm


def check_config(cfg: Any, degrees: dict[str, int]) -> None:
    # SimpleFSDP shards over dp_shard x cp: context-parallel ranks gather and reduce like data-parallel ones
    shard, cp, replicate = (degrees.get(k, 1) for k in ("dp_shard", "cp", "dp_replicate"))
    if shard * cp <= 1 and replicate <= 1:
        raise ConfigError(
            "compile.passes: transformer_block_bucketing buckets FSDP all-gathers and gradient "
            "reductions and needs data parallelism: parallelism.dp_shard, cp or dp_replicate > 1 "
            f"(got dp_shard = {shard}, cp = {cp}, dp_replicate = {replicate})"
        )


TRANSFORMER_BLOCK_BUCKETING = PassSpec(
    "transformer_block_bucketing",
    transformer_block_bucketing,
    "one FSDP all-gather / gradient reduction per transformer block, prefetched and deferred for overlap",
    check_config,
    on_fsdp_collectives=True,
)

__all__ = [
    "TRANSFORMER_BLOCK_BUCKETING",
    "bucket_index",
    "compute_starts",
    "fsdp_buckets",
    "stable_topological_sort",
    "transformer_block_bucketing",
]
