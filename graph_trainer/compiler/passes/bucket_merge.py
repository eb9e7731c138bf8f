"""The merge behind transformer_block_bucketing: which FSDP collectives a bucket may hold
(``collective_kind``, from the ``fsdp_role`` tags and the op), and how one bucket's collectives
become one (``merge_all_gathers``, ``merge_reductions``), with gloo's ring alignment
(``ring_aligned_row``). Scheduling the merged collectives is the pass's
(``graph_trainer.compiler.passes.transformer_block_bucketing``, whose docstring states the layouts and
their numerics).

Contract: a merge replaces its members and their waits with new functional nodes (no ``out=``),
each with a fake ``meta["val"]`` computed in the trace's fake mode and the tags of what it
replaces; an all-gather merge also replaces the contiguous transposed copies of a 2-D member,
when they are all that reads it (``transposed_copies``), by that member's copy-out made in the
transposed layout (the same values in the same layout, one copy fewer). It returns a ``Merged``
saying which nodes to issue and which to wait. A collective whose only user is not its wait, or
a node without a fake value, raises ``PassError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from graph_trainer.compiler.passes.registry import PassError
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
    FORWARD,
    FSDP_BUCKET,
    FSDP_PARAM,
    FSDP_PARAMS,
    FSDP_ROLE,
    MODULE_FQN,
    REDUCE_GRAD,
    UNSHARD,
)
from graph_trainer.torch_compat import fake_mode_of_nodes

aten = torch.ops.aten

FORWARD_GATHER, BACKWARD_GATHER = "forward all_gather", "backward all_gather"
GRAD_REDUCE, GRAD_ALL_REDUCE = "reduce_scatter", "all_reduce"
AMAX_ALL_REDUCE = "amax all_reduce"
"""A float8 weight's amax all-reduce (max) in its gather chain (``graph_trainer.distributed.float8_gather``)."""
REDUCTIONS = (GRAD_REDUCE, GRAD_ALL_REDUCE)
FLAT_ALL_REDUCES = (GRAD_ALL_REDUCE, AMAX_ALL_REDUCE)
"""Kinds whose bucket is one all-reduce of the members' flattened concatenation."""

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


def collective_kind(node: fx.Node) -> str | None:
    """Which FSDP bucket kind a collective belongs to, from its tags; None for all others."""
    role = tags.get(node, FSDP_ROLE)
    if node.target is ALL_GATHER and role == UNSHARD:
        return FORWARD_GATHER if tags.phase(node) == FORWARD else BACKWARD_GATHER
    if node.target is REDUCE_SCATTER and role == REDUCE_GRAD:
        return GRAD_REDUCE
    if node.target is ALL_REDUCE and role == REDUCE_GRAD:
        return GRAD_ALL_REDUCE
    if node.target is ALL_REDUCE and role == UNSHARD:
        return AMAX_ALL_REDUCE
    return None


def only_wait(node: fx.Node) -> fx.Node:
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


def _cast_chain(members: list[fx.Node], name: str) -> list[fx.Node]:
    """The ``unshard`` nodes of the gathers' own parameters (or of their bucket ``name``) and
    phase that they depend on, inputs before users: the mixed-precision cast; for a float8
    weight also its amax, the amax's all-reduce (merged per bucket beforehand by
    ``merge_reductions``), the scale and the cast (``graph_trainer.distributed.float8_gather``). They move with the
    bucket's gather, so that it can be issued early."""
    owners = {tags.get(m, FSDP_PARAM) for m in members} | {name}
    phase = tags.phase(members[0])
    chain: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack: list[tuple[fx.Node, bool]] = [(i, False) for m in reversed(members) for i in reversed(m.all_input_nodes)]
    while stack:  # depth first, each node listed once all its inputs are
        node, inputs_listed = stack.pop()
        if inputs_listed:
            chain.append(node)
            continue
        if node in seen or tags.get(node, FSDP_ROLE) != UNSHARD or tags.phase(node) != phase:
            continue
        if tags.get(node, FSDP_PARAM) not in owners:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((i, False) for i in reversed(node.all_input_nodes))
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
        wait = only_wait(member)
        wait.replace_all_uses_with(out)
        graph.erase_node(wait)
        graph.erase_node(member)


def _unmerged(collective: fx.Node, bucket: int, kind: str, group: str, casts: list[fx.Node], name: str) -> Merged:
    """A bucket of one collective: nothing to merge, only tagged and scheduled."""
    wait = only_wait(collective)
    for node in (collective, wait):
        tags.update(node, {FSDP_BUCKET: name})
    return Merged(bucket, kind, group, casts + [collective], [wait], [wait])


def merge_all_gathers(graph: fx.Graph, members: list[fx.Node], bucket: int, name: str) -> Merged:
    """Replace the gathers of one bucket (one group) with one gather of their concatenation."""
    first, kind = members[0], collective_kind(members[0])
    group_size, group = first.args[1], first.args[2]
    casts = _cast_chain(members, name)
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
    outputs, offset, read_instead = [], 0, {}
    for m, size in zip(members, sizes, strict=True):
        member = _member_tags(m, name)
        piece = emit(aten.slice.Tensor, (rows, 1, offset, offset + size), member)
        copies = transposed_copies(only_wait(m)) if not as_bytes or m.meta["val"].element_size() == 1 else []
        if copies:
            outputs.append(_copy_out_transposed(emit, piece, m, group_size, member))
            for copy in copies:  # (the copy's own dtype: a uint8 gather of float8 bytes is viewed after it)
                dtype = copy.meta["val"].dtype
                same = outputs[-1].meta["val"].dtype == dtype
                read_instead[copy] = outputs[-1] if same else emit(aten.view.dtype, (outputs[-1], dtype), member)
        else:
            piece = emit(aten.clone.default, (piece,), member, {"memory_format": torch.contiguous_format})
            if as_bytes:
                piece = emit(aten.view.dtype, (piece, m.meta["val"].dtype), member)
            outputs.append(emit(aten.view.default, (piece, list(m.meta["val"].shape)), member))
        offset += size
    wait = emit.take()
    _read_instead(graph, read_instead)
    _replace(graph, members, outputs)
    return Merged(bucket, kind, group, issue, wait, outputs)


def _keeps_every_place(node: fx.Node) -> bool:
    """A view whose elements sit where its input's do: ``detach``, ``alias``; a ``view``, ``slice``
    or dtype ``view`` whose result has its input's shape, strides and offset (a dtype of the same
    element size)."""
    if node.target in (aten.detach.default, aten.alias.default):
        return True
    if node.target not in (aten.view.default, aten.slice.Tensor, aten.view.dtype):
        return False
    val, source = node.meta["val"], node.args[0].meta["val"]
    layout = (val.shape, val.stride(), val.storage_offset(), val.element_size())
    return layout == (source.shape, source.stride(), source.storage_offset(), source.element_size())


def transposed_copies(result: fx.Node) -> list[fx.Node]:
    """The contiguous copies of the transpose of ``result`` (a 2-D gathered weight) when they are
    all that reads it, through ``t`` and views that keep every element's place
    (``_keeps_every_place``); otherwise none. A float8 weight's input-gradient matmul reads its
    weight that way (``_scaled_mm`` takes its second operand column-major): its backward gather
    can write the transposed layout at once."""
    if result.meta["val"].dim() != 2:
        return []
    copies, frontier = [], [(result, False)]
    while frontier:
        node, transposed = frontier.pop()
        for user in node.users:
            if user.target is aten.t.default or _keeps_every_place(user):
                frontier.append((user, transposed != (user.target is aten.t.default)))
            elif transposed and user.target is aten.clone.default and user.meta["val"].is_contiguous():
                copies.append(user)
            else:
                return []
    return copies


def _copy_out_transposed(emit: _Emitter, piece: fx.Node, member: fx.Node, world: int, node_tags: dict) -> fx.Node:
    """The member's rows of the gathered buffer, ``(world, shard elements)``, copied out as the
    contiguous transpose of the gathered ``(rows, cols)`` weight: one copy where the row-major
    copy-out and the transposed copy were two."""
    rows, cols = member.meta["val"].shape
    if piece.meta["val"].dtype != member.meta["val"].dtype:  # a byte bucket: one-byte elements only
        piece = emit(aten.view.dtype, (piece, member.meta["val"].dtype), node_tags)
    blocks = emit(aten.view.default, (piece, [world, rows // world, cols]), node_tags)
    moved = emit(aten.permute.default, (blocks, [2, 0, 1]), node_tags)
    copy = emit(aten.clone.default, (moved,), node_tags, {"memory_format": torch.contiguous_format})
    return emit(aten.view.default, (copy, [cols, rows]), node_tags)


def _read_instead(graph: fx.Graph, replacements: dict[fx.Node, fx.Node]) -> None:
    """Readers of each copy read its replacement (the same values in the same layout); the copies
    and the views that only fed them are erased."""
    for copy, replacement in replacements.items():
        copy.replace_all_uses_with(replacement)
        dead = [copy]
        while dead:
            node = dead.pop()
            inputs = node.all_input_nodes
            graph.erase_node(node)
            dead.extend(i for i in inputs if not i.users and (i.target is aten.t.default or _keeps_every_place(i)))


def merge_reductions(graph: fx.Graph, members: list[fx.Node], bucket: int, name: str) -> Merged:
    """Replace the reductions of one bucket (one kind, group, dtype, op) with one reduction of their
    concatenation: rank rows side by side for reduce-scatters, flat for all-reduces (gradients',
    and float8 weights' amaxes: a max, exact in any grouping)."""
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
    mode = fake_mode_of_nodes([node])
    if mode is None:
        raise PassError(
            f"transformer_block_bucketing: {node.name} has no fake meta['val']; trace with "
            "graph_trainer.compiler.tracer (fake mode) before running this pass"
        )
    return mode


__all__ = [
    "AMAX_ALL_REDUCE",
    "BACKWARD_GATHER",
    "FLAT_ALL_REDUCES",
    "FORWARD_GATHER",
    "GRAD_ALL_REDUCE",
    "GRAD_REDUCE",
    "REDUCTIONS",
    "Merged",
    "collective_kind",
    "merge_all_gathers",
    "merge_reductions",
    "only_wait",
    "ring_aligned_row",
    "transposed_copies",
]
