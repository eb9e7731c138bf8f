"""How a training sequence reaches attention: which of its tokens a rank holds, at which rotary
positions, and which earlier tokens each query may see.

A model carries one ``SequenceLayout`` (``model.sequence_layout``, set by the build from the job's
config and mesh); each forward asks it for a ``SequencePlan`` of the batch at hand
(``SequenceLayout.plan``), which the blocks' attention and the loss head use.

Context parallel (``cp`` > 1). A sequence of ``S`` tokens is cut into ``2 cp`` chunks of
``c = S / (2 cp)``; cp rank ``r`` holds chunk ``r`` and chunk ``2 cp - 1 - r``, in that order. Under
a causal mask a query of chunk ``j`` reads ``(j + 1) c`` keys, so every rank's two chunks read
``(2 cp + 1) c`` keys together: the attention work is the same on every rank. The data loader gives
every cp rank of a data-parallel rank the same rows; the forward's first step takes the rank's
tokens (``SequencePlan.local``: an index along the sequence, visible in the graph), and the loss
head takes the same positions of the labels. Rotary positions are the tokens' positions in the
sequence. Attention all-gathers the keys and values over the cp ranks (tagged ``cp_role``
``kv_gather``; backward: their gradients reduce-scattered), puts the chunks back in sequence order
and computes each local chunk's queries against the keys up to its end, with an additive mask
(0 where a key is visible, -inf where not): one per chunk, built once per forward and shared by
every block. Why all-gather and not a ring: docs/parallelism.md.

Document masking (``block_causal``). A query sees only earlier tokens of its own document. The
documents are the loader's: a document starts at every BOS token when the tokenizer has one (the
loader puts one before each document), else after every EOS token (``document_start``). Rows of a
sequence start a document at their first token. With ``positions_per_document`` each document's
rotary positions start at 0. The mask is built from the whole sequence's tokens, which every cp
rank holds, so it needs no communication. ``causal`` without context parallel keeps SDPA's own
causal kernel (no mask tensor).

Numerics: a rank's attention computes each query's softmax over the same keys as one process
does, in another kernel blocking (a masked SDPA over a key prefix instead of the causal kernel over
the whole sequence), so it matches one process to float rounding, not bitwise; graph and eager run
the same ops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from graph_trainer.graph.tags import CP_ROLE, KV_GATHER, annotate

MASKS = ("causal", "block_causal")
"""The values of ``training.attention_mask``."""


@dataclass(frozen=True)
class QueryChunk:
    """A run of consecutive queries of the sequence that a rank holds: ``length`` of them, from
    ``start`` in the rank's tokens and ``position`` in the sequence. They read the sequence's first
    ``position + length`` keys."""

    start: int
    length: int
    position: int

    @property
    def keys(self) -> int:
        return self.position + self.length


def rank_chunks(seq: int, cp: int, cp_rank: int) -> tuple[QueryChunk, ...]:
    """The chunks of a ``seq``-token sequence that cp rank ``cp_rank`` of ``cp`` holds, in its order
    (module docstring): the whole sequence without context parallel."""
    if cp == 1:
        return (QueryChunk(0, seq, 0),)
    if seq % (2 * cp):
        raise ValueError(f"a sequence of {seq} tokens does not split into 2 x cp = {2 * cp} equal chunks")
    c = seq // (2 * cp)
    return (QueryChunk(0, c, cp_rank * c), QueryChunk(c, c, (2 * cp - 1 - cp_rank) * c))


def sequence_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """``gathered`` [B, S, ...], every cp rank's tokens in rank order (rank ``r``: chunks ``r`` and
    ``2 cp - 1 - r``), put back in sequence order: the first chunks in rank order, then the second
    ones in reverse rank order (views, a flip and a cat: the backward is a flip and slices).
    ``ValueError`` when ``S`` does not split into ``2 cp`` equal chunks."""
    b, s, *rest = gathered.shape
    if s % (2 * cp):
        raise ValueError(f"{s} gathered tokens do not split into 2 x cp = {2 * cp} equal chunks")
    pairs = gathered.view(b, cp, 2, s // (2 * cp), *rest)
    early = pairs[:, :, 0].flatten(1, 2)
    late = pairs[:, :, 1].flip(1).flatten(1, 2)
    return torch.cat([early, late], dim=1)


def gather_over_cp(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``x`` [B, S / cp, ...] of every cp rank, in sequence order [B, S, ...]: an all-gather over
    ``mesh`` (tagged ``cp_role`` kv_gather) whose backward reduce-scatters the gradient (each rank's
    queries read every rank's keys, so a key's gradient is the sum of the ranks' parts)."""
    with annotate({CP_ROLE: KV_GATHER}):
        piece = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        whole = piece.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    return sequence_order(whole, mesh.size())


def document_ids(tokens: torch.Tensor, document_start: tuple[str, int]) -> torch.Tensor:
    """[B, S] int64: which document of its row each token is in, counted from 0 at the row's first
    token. ``document_start`` ("bos", id): a document starts at each such token; ("eos", id): after
    each."""
    kind, token = document_start
    marks = tokens == token
    if kind == "bos":
        starts = marks.clone()
        starts[:, 0] = False
    else:
        starts = torch.cat([torch.zeros_like(marks[:, :1]), marks[:, :-1]], dim=1)
    return starts.long().cumsum(dim=1)


def positions_in_documents(documents: torch.Tensor) -> torch.Tensor:
    """[B, S] int64: each token's index in its document (``document_ids``' output)."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    first = torch.cat([torch.ones_like(documents[:, :1]), documents[:, 1:] != documents[:, :-1]], dim=1)
    starts = torch.where(first.bool(), index, torch.zeros_like(index)).cummax(dim=1).values
    return index - starts


@dataclass(frozen=True)
class SequenceLayout:
    """A model's fixed facts about its sequences (module docstring); the default is one rank, causal."""

    mask: str = "causal"
    """``causal`` or ``block_causal`` (``training.attention_mask``)."""
    cp: int = 1
    cp_rank: int = 0
    cp_mesh: DeviceMesh | None = None
    """The context-parallel ranks (``cp`` > 1), over which attention gathers keys and values."""
    document_start: tuple[str, int] | None = None
    """("bos", id) or ("eos", id): where documents start (``document_ids``); block_causal needs it."""
    positions_per_document: bool = False

    def __post_init__(self) -> None:
        if self.mask not in MASKS:
            raise ValueError(f"attention mask {self.mask!r}: choose one of {', '.join(MASKS)}")
        if self.mask == "block_causal" and self.document_start is None:
            raise ValueError("block_causal needs to know where documents start (a BOS or an EOS token)")
        if self.cp > 1 and self.cp_mesh is not None and self.cp_mesh.size() != self.cp:
            raise ValueError(f"cp = {self.cp} but the cp mesh has {self.cp_mesh.size()} ranks")

    def plan(self, tokens: torch.Tensor | None, seq: int, device) -> SequencePlan:
        """The plan of one forward over sequences of ``seq`` tokens: ``tokens`` [B, seq] (the whole
        sequences, every cp rank's) where the caller has them (a pipeline stage after the first has
        not: causal only). Its masks come with ``SequencePlan.with_masks``."""
        chunks = rank_chunks(seq, self.cp, self.cp_rank)
        keep = None
        if self.cp > 1:
            keep = torch.cat([torch.arange(q.position, q.keys, device=device) for q in chunks])
        documents, positions = None, keep  # (the tokens' positions in the sequence; None: 0..seq-1)
        if self.mask == "block_causal":
            if tokens is None:
                raise ValueError("block_causal attention needs the whole sequences' tokens")
            documents = document_ids(tokens, self.document_start)
            if self.positions_per_document:
                in_documents = positions_in_documents(documents)
                positions = in_documents if keep is None else in_documents[:, keep]
        masked = self.mask == "block_causal" or self.cp > 1
        gather = None if self.cp == 1 else self._gather
        return SequencePlan(seq, chunks, keep, positions, masked, documents, None, gather, device)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.cp_mesh is None:
            raise ValueError("context parallel needs the cp mesh to gather keys and values")
        return gather_over_cp(x, self.cp_mesh)


def chunk_bias(chunk: QueryChunk, documents: torch.Tensor | None, dtype: torch.dtype, device) -> torch.Tensor:
    """The additive mask of ``chunk``'s queries over the sequence's first ``chunk.keys`` keys:
    [1, 1, length, keys] (causal) or [B, 1, length, keys] (with ``documents``, block_causal), 0
    where the key is at or before the query (and in its document), -inf elsewhere."""
    query = torch.arange(chunk.position, chunk.keys, device=device)
    key = torch.arange(chunk.keys, device=device)
    visible = (key[None, :] <= query[:, None])[None]
    if documents is not None:
        own = documents[:, chunk.position : chunk.keys]
        visible = visible & (documents[:, None, : chunk.keys] == own[:, :, None])
    zeros = torch.zeros(visible.shape, dtype=dtype, device=device)
    return zeros.masked_fill(~visible, float("-inf")).unsqueeze(1)


@dataclass(frozen=True)
class SequencePlan:
    """One forward's sequence facts (``SequenceLayout.plan``)."""

    seq: int
    """Tokens of a whole sequence (every cp rank's)."""
    chunks: tuple[QueryChunk, ...]
    keep: torch.Tensor | None
    """The sequence positions of this rank's tokens, in its order; None: every token, in order."""
    positions: torch.Tensor | None
    """Rotary positions of this rank's tokens: [S_local] or [B, S_local]; None: 0..S-1."""
    masked: bool
    """Attention computes with a mask per chunk; False: SDPA's causal kernel over the sequence."""
    documents: torch.Tensor | None
    """[B, S] document ids of the whole sequences (block_causal), else None."""
    biases: tuple[torch.Tensor, ...] | None
    """Each chunk's additive mask (``chunk_bias``, once ``with_masks`` made them)."""
    gather: Callable[[torch.Tensor], torch.Tensor] | None
    """[B, S_local, ...] -> [B, S, ...] in sequence order, over the cp ranks (None without cp)."""
    device: torch.device | str | None = None
    """Where the forward computes (the masks' device)."""

    def with_masks(self, dtype: torch.dtype) -> SequencePlan:
        """This plan with its chunks' masks in ``dtype`` (the attention's compute dtype), made once
        for every block; itself where no mask is needed."""
        if not self.masked or self.biases is not None:
            return self
        biases = tuple(chunk_bias(q, self.documents, dtype, self.device) for q in self.chunks)
        return dataclasses.replace(self, biases=biases)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a [B, S, ...] per-token tensor (tokens, labels), in its order."""
        return t if self.keep is None else t.index_select(1, self.keep)

    def rope(self, table: torch.Tensor) -> torch.Tensor:
        """The rows of the rotary ``table`` [max_seq_len, head_dim] at this rank's positions:
        [S_local, head_dim] or [B, S_local, head_dim]."""
        return table[: self.seq] if self.positions is None else table[self.positions]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Attention of this rank's queries ``q`` [B, S_local, H, Dqk] over the keys ``k`` and values
        ``v`` [B, S_local, H_kv, D] of the whole sequence (gathered over cp here; ``H`` a multiple of
        ``H_kv``: grouped-query heads read kv head ``h // (H / H_kv)``) -> [B, S_local, H, Dv]."""
        if self.masked and self.biases is None:
            raise ValueError("a masked plan attends with its masks: SequencePlan.with_masks first")
        if self.gather is not None:
            k, v = self.gather(k), self.gather(v)
        k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # SDPA wants [B, H, S, D]
        if not self.masked:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            outs = [
                F.scaled_dot_product_attention(
                    q[:, :, c.start : c.start + c.length], k[:, :, : c.keys], v[:, :, : c.keys], bias, scale=scale
                )
                for c, bias in zip(self.chunks, self.biases, strict=True)
            ]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out.transpose(1, 2)


def repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``x`` [B, S, H_kv, D] with each kv head repeated ``n_heads / H_kv`` times in a row (head
    ``h`` reads kv head ``h // n_rep``), so SDPA sees ``n_heads`` heads."""
    batch, seq, n_kv, dim = x.shape
    if n_kv == n_heads:
        return x
    n_rep = n_heads // n_kv
    return x.unsqueeze(3).expand(batch, seq, n_kv, n_rep, dim).reshape(batch, seq, n_heads, dim)


__all__ = [
    "MASKS",
    "QueryChunk",
    "SequenceLayout",
    "SequencePlan",
    "chunk_bias",
    "document_ids",
    "gather_over_cp",
    "positions_in_documents",
    "rank_chunks",
    "repeat_kv",
    "sequence_order",
]
