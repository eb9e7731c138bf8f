"""transformer_block_bucketing: one FSDP all-gather and one gradient reduction per transformer block.

Contract
--------
Reads: ``context.extras["bucket_plan"]``, the model's list of FQN-prefix groups
(``[["tok_embeddings"], ["layers.0"], ..., ["norm", "output"]]``); and the tags
(``graph_trainer.graph.tags``) written by ``graph_trainer.simple_fsdp``, the tracer and ``reshard_after_forward``:
``fsdp_role`` (``unshard`` / ``reduce_grad``), ``fsdp_param``, ``phase``, ``module_fqn``,
``recomputed``. A parameter belongs to the first group with a prefix matching its
``fsdp_param`` (``p == prefix`` or ``p`` starts with ``prefix + "."``).

Changes: the FSDP collectives, and only those, are merged per group (a *bucket*):

- the forward ``all_gather_into_tensor`` nodes tagged ``unshard`` (phase forward),
- the backward re-gathers tagged ``unshard`` (phase backward, ``recomputed``; made by the
  default ``reshard_after_forward`` pass, absent with ``fsdp_reshard_after_forward never``),
- the ``reduce_scatter_tensor`` nodes tagged ``reduce_grad`` (FSDP, HSDP's shard dim),
- the ``all_reduce`` nodes tagged ``reduce_grad`` (DDP, and HSDP's replicate dim, which sums
  the reduce-scattered shard: ``graph_trainer.simple_fsdp``),

each become ONE collective per bucket and process group (for the reductions also per dtype
and reduce op; a bucket whose parameters live on several groups, e.g. DeepSeek-V3 experts
sharded over ``efsdp`` beside dense weights over ``dp_shard``, gets one collective per group).
TP all_reduces (untagged) and EP all_to_alls are left as they are. The merge is
functional (no ``out=`` mutation): an all-gather bucket is ``cat`` of the flattened shards
(bytes when dtypes differ) -> one all_gather -> ``view(world, N)`` -> per parameter
``slice(dim 1) -> clone -> view``, rank-major exactly like the per-parameter gathers; a
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
last gradient is computed (under HSDP the all-reduce right after its reduce-scatter's wait),
and waited right before the next reduction of its group is issued (the last one before the
graph output), so it overlaps the next bucket's backward.
A stable topological sort then restores a valid order moving as few nodes as possible
(a node placed before an input goes right after it); every node stays exactly once.

Numerics: gathers and reductions see the same elements; the concatenation and split only move
data. Losses and gradients are bitwise those of the graph without this pass (for the
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
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from graph_trainer.errors import ConfigError
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    WAIT,
    PairingError,
    group_name,
    wait_of,
)
from graph_trainer.graph.tags import (
    BACKWARD,
    FORWARD,
    FSDP_BUCKET,
    FSDP_PARAM,
    FSDP_PARAMS,
    FSDP_ROLE,
    MODULE_FQN,
    RECOMPUTED,
    REDUCE_GRAD,
    UNSHARD,
)
from graph_trainer.passes.registry import PassContext, PassError, PassSpec
from graph_trainer.torch_compat import fake_mode_of, pass_needs_torch_2_13

aten = torch.ops.aten

FORWARD_GATHER, BACKWARD_GATHER = "forward all_gather", "backward all_gather"
GRAD_REDUCE, GRAD_ALL_REDUCE = "reduce_scatter", "all_reduce"
REDUCTIONS = (GRAD_REDUCE, GRAD_ALL_REDUCE)

GLOO_MAX_SEGMENT_BYTES = 1 << 20
"""gloo's ``AllreduceOptions::kMaxSegmentSize``: the largest piece its ring all-reduce sends at once."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def ring_aligned_row(row: int, world: int, itemsize: int) -> int:
    """The smallest row length >= ``row`` for which gloo's ring all-reduce of a ``(world, length)``
    buffer (how gloo reduce-scatters) puts its chunk boundaries exactly between the rank rows.

    gloo (``allreduce.cc``, ``ring``) splits ``B`` bytes into ``S`` segments, ``S`` the multiple of
    ``world`` at least ``max(ceil(B / 1 MiB), 2 * world)``, each ``ceil(B / S)`` bytes rounded up
    to the element size; chunk ``c`` is segments ``[c S / world, (c + 1) S / world)``. With 2
    ranks the order cannot matter (one addition per element), so nothing is padded."""
    if world <= 2:
        return row
    length = row
    while True:
        total = world * length * itemsize
        segments = _ceil_div(max(_ceil_div(total, GLOO_MAX_SEGMENT_BYTES), 2 * world), world) * world
        segment = _ceil_div(_ceil_div(total, segments), itemsize) * itemsize
        if segments // world * segment == length * itemsize:
            return length
        length += 1


def bucket_index(plan: list[list[str]], fqn: str) -> int | None:
    """Index of the first plan group with a prefix matching ``fqn`` (a parameter or module FQN)."""
    for index, prefixes in enumerate(plan):
        if any(fqn == p or fqn.startswith(p + ".") for p in prefixes):
            return index
    return None


def collective_kind(node: fx.Node) -> str | None:
    """Which FSDP bucket kind a collective belongs to, from its tags; None for all others."""
    role = tags.get(node, FSDP_ROLE)
    if node.target is ALL_GATHER and role == UNSHARD:
        return FORWARD_GATHER if tags.phase(node) == FORWARD else BACKWARD_GATHER
    if node.target is REDUCE_SCATTER and role == REDUCE_GRAD:
        return GRAD_REDUCE
    if node.target is ALL_REDUCE and role == REDUCE_GRAD:
        return GRAD_ALL_REDUCE
    return None


def _only_wait(node: fx.Node) -> fx.Node:
    try:
        return wait_of(node)
    except PairingError as e:
        raise PassError(f"transformer_block_bucketing: {e}") from None


@dataclass
class Merged:
    """One bucketed collective after merging: what to issue, what to wait, what replaces the old waits."""

    bucket: int
    kind: str
    group: str
    issue: list[fx.Node]
    """Copy-in nodes (casts, flattening, cat) and the collective last, in order."""
    wait: list[fx.Node]
    """The wait and the copy-out nodes, in order."""
    outputs: list[fx.Node]
    """Per member, the node now holding its result (what its old wait held)."""

    @property
    def collective(self) -> fx.Node:
        return self.issue[-1]


class _Emitter:
    """Adds call_function nodes before ``anchor``, each with a fake ``val`` and its tags."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, fake_mode: Any):
        self.graph, self.anchor, self.fake_mode = graph, anchor, fake_mode
        self.created: list[fx.Node] = []

    def __call__(self, target, args: tuple, node_tags: dict, kwargs: dict | None = None) -> fx.Node:
        kwargs = kwargs or {}
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        vals = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*vals[0], **vals[1])
        tags.replace(node, node_tags)
        self.created.append(node)
        return node

    def flat_rows(self, x: fx.Node, rows: int, node_tags: dict) -> fx.Node:
        """``x`` viewed as ``(rows, -1)`` (``(-1,)`` when rows is 0), made contiguous first if needed."""
        if not x.meta["val"].is_contiguous():
            x = self(aten.clone.default, (x,), node_tags, {"memory_format": torch.contiguous_format})
        return self(aten.view.default, (x, [rows, -1] if rows else [-1]), node_tags)

    def take(self) -> list[fx.Node]:
        created, self.created = self.created, []
        return created


def _cast_chain(collective: fx.Node) -> list[fx.Node]:
    """The single-user ``unshard`` nodes feeding a gather (the mixed-precision cast), in order."""
    chain: list[fx.Node] = []
    node = collective.args[0]
    while (
        isinstance(node, fx.Node)
        and tags.get(node, FSDP_ROLE) == UNSHARD
        and len(node.users) == 1
        and len(node.all_input_nodes) == 1
    ):
        chain.insert(0, node)
        node = node.all_input_nodes[0]
    return chain


def _common_module(members: list[fx.Node]) -> str:
    """The innermost module FQN containing every member's module ("" for the root)."""
    parts = [tags.module_fqn(m).split(".") for m in members]
    common = []
    for names in zip(*parts, strict=False):
        if len(set(names)) != 1:
            break
        common.append(names[0])
    return ".".join(common)


def _shared_tags(members: list[fx.Node], name: str) -> dict:
    return {
        **tags.tags(members[0]),
        MODULE_FQN: _common_module(members),
        FSDP_PARAM: name,
        FSDP_BUCKET: name,
        FSDP_PARAMS: tuple(tags.get(m, FSDP_PARAM) for m in members),
    }


def _member_tags(member: fx.Node, bucket: str) -> dict:
    return {**tags.tags(member), FSDP_BUCKET: bucket}


def _replace(graph: fx.Graph, members: list[fx.Node], outputs: list[fx.Node]) -> None:
    for member, out in zip(members, outputs, strict=True):
        wait = _only_wait(member)
        wait.replace_all_uses_with(out)
        graph.erase_node(wait)
        graph.erase_node(member)


def _unmerged(collective: fx.Node, bucket: int, kind: str, group: str, casts: list[fx.Node], name: str) -> Merged:
    """A bucket of one collective: nothing to merge, only tagged and scheduled."""
    wait = _only_wait(collective)
    for node in (collective, wait):
        tags.update(node, {FSDP_BUCKET: name})
    return Merged(bucket, kind, group, casts + [collective], [wait], [wait])


def merge_all_gathers(graph: fx.Graph, members: list[fx.Node], bucket: int, name: str) -> Merged:
    """Replace the gathers of one bucket (one group) with one gather of their concatenation."""
    first, kind = members[0], collective_kind(members[0])
    group_size, group = first.args[1], first.args[2]
    casts = [n for m in members for n in _cast_chain(m)]
    if len(members) == 1:
        return _unmerged(first, bucket, kind, group, casts, name)
    emit = _Emitter(graph, first, _fake_mode(first))
    shared = _shared_tags(members, name)
    as_bytes = len({m.args[0].meta["val"].dtype for m in members}) > 1
    flats = []
    for m in members:
        flat = emit.flat_rows(m.args[0], 0, _member_tags(m, name))
        flats.append(emit(aten.view.dtype, (flat, torch.uint8), _member_tags(m, name)) if as_bytes else flat)
    sizes = [f.meta["val"].numel() for f in flats]
    gathered = emit(ALL_GATHER, (emit(aten.cat.default, (flats,), shared), group_size, group), shared)
    issue = casts + emit.take()
    rows = emit(aten.view.default, (emit(WAIT, (gathered,), shared), [group_size, sum(sizes)]), shared)
    outputs, offset = [], 0
    for m, size in zip(members, sizes, strict=True):
        member = _member_tags(m, name)
        piece = emit(aten.slice.Tensor, (rows, 1, offset, offset + size), member)
        piece = emit(aten.clone.default, (piece,), member, {"memory_format": torch.contiguous_format})
        if as_bytes:
            piece = emit(aten.view.dtype, (piece, m.meta["val"].dtype), member)
        outputs.append(emit(aten.view.default, (piece, list(m.meta["val"].shape)), member))
        offset += size
    wait = emit.take()
    _replace(graph, members, outputs)
    return Merged(bucket, kind, group, issue, wait, outputs)


def merge_reductions(graph: fx.Graph, members: list[fx.Node], bucket: int, name: str) -> Merged:
    """Replace the gradient reductions of one bucket (one kind, group, dtype, op) with one reduction
    of their concatenation: rank rows side by side for reduce-scatters, flat for all-reduces."""
    first, kind = members[0], collective_kind(members[0])
    reduce_op, group = first.args[1], group_name(first)
    if len(members) == 1:
        return _unmerged(first, bucket, kind, group, [], name)
    emit = _Emitter(graph, first, _fake_mode(first))
    shared = _shared_tags(members, name)
    if kind == GRAD_REDUCE:
        group_size = first.args[2]
        rows = [emit.flat_rows(m.args[0], group_size, _member_tags(m, name)) for m in members]
        sizes = [r.meta["val"].shape[1] for r in rows]
        pad = ring_aligned_row(sum(sizes), group_size, rows[0].meta["val"].element_size()) - sum(sizes)
        if pad:  # zeros at the end of each rank's row: see Numerics in the module docstring
            rows.append(emit(aten.new_zeros.default, (rows[0], [group_size, pad]), shared))
        flat = emit(aten.view.default, (emit(aten.cat.default, (rows, 1), shared), [-1]), shared)
        reduced = emit(REDUCE_SCATTER, (flat, reduce_op, group_size, group), shared)
    else:
        flats = [emit.flat_rows(m.args[0], 0, _member_tags(m, name)) for m in members]
        sizes = [f.meta["val"].numel() for f in flats]
        reduced = emit(ALL_REDUCE, (emit(aten.cat.default, (flats,), shared), reduce_op, group), shared)
    issue = emit.take()
    result = emit(WAIT, (reduced,), shared)
    outputs, offset = [], 0
    for m, size in zip(members, sizes, strict=True):
        member = _member_tags(m, name)
        piece = emit(aten.slice.Tensor, (result, 0, offset, offset + size), member)
        outputs.append(emit(aten.view.default, (piece, list(m.meta["val"].shape)), member))
        offset += size
    wait = emit.take()
    _replace(graph, members, outputs)
    return Merged(bucket, kind, group, issue, wait, outputs)


def _fake_mode(node: fx.Node):
    mode = fake_mode_of(node.meta.get("val"))
    if mode is None:
        raise PassError(
            f"transformer_block_bucketing: {node.name} has no fake meta['val']; trace with "
            "graph_trainer.tracer (fake mode) before running this pass"
        )
    return mode


def fsdp_buckets(graph: fx.Graph, plan: list[list[str]]) -> dict[tuple, list[fx.Node]]:
    """The FSDP collectives to merge, keyed by (kind, bucket index, group, dtype, reduce op), in graph order."""
    buckets: dict[tuple, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        param = tags.get(node, FSDP_PARAM, "")
        index = bucket_index(plan, param)
        if index is None:
            raise PassError(
                f"transformer_block_bucketing: parameter {param!r} ({node.name}) is in no group "
                f"of the bucket plan {plan}"
            )
        _only_wait(node)
        if kind in REDUCTIONS:
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


def schedule_reductions(graph: fx.Graph, merged: list[Merged], position: dict[fx.Node, int]) -> None:
    """Issue each reduction bucket after its last input (its gradients, or under HSDP the
    all-reduce's reduce-scattered shards, once their waits have moved); wait before its group's
    next one."""
    last_input = {}
    for m in merged:
        members = set(m.issue)
        inputs = [i for n in m.issue for i in n.all_input_nodes if i not in members]
        last_input[id(m)] = max(inputs, key=position.__getitem__)
        cursor = last_input[id(m)]
        for node in m.issue:
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
    for (kind, index, *_), members in buckets.items():
        merge = merge_reductions if kind in REDUCTIONS else merge_all_gathers
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
    problem = pass_needs_torch_2_13("transformer_block_bucketing")
    if problem:
        raise ConfigError(f"compile.passes: {problem}")
    if degrees.get("dp_shard", 1) <= 1 and degrees.get("dp_replicate", 1) <= 1:
        raise ConfigError(
            "compile.passes: transformer_block_bucketing buckets FSDP all-gathers and gradient "
            "reductions and needs data parallelism: parallelism.dp_shard or dp_replicate > 1 "
            f"(got dp_shard = {degrees.get('dp_shard', 1)}, dp_replicate = {degrees.get('dp_replicate', 1)})"
        )


TRANSFORMER_BLOCK_BUCKETING = PassSpec(
    "transformer_block_bucketing",
    transformer_block_bucketing,
    "one FSDP all-gather / gradient reduction per transformer block, prefetched and deferred for overlap",
    check_config,
)

__all__ = [
    "TRANSFORMER_BLOCK_BUCKETING",
    "bucket_index",
    "collective_kind",
    "compute_starts",
    "fsdp_buckets",
    "merge_all_gathers",
    "merge_reductions",
    "ring_aligned_row",
    "transformer_block_bucketing",
]
