"""models.sequence: which tokens a cp rank holds (two chunks each, the same causal work on every
rank), putting gathered keys back in sequence order, documents and their positions, the masks;
context parallel's attention held against one process with no process group (every cp rank's plan
attends over what its all-gather would give it, and the ranks' outputs and the queries', keys' and
values' gradients together match one process's attention, causal and block_causal, with
grouped-query heads; a plan with one chunk's causal offset wrong must fail the same check); and
block_causal through the debug model: a packed row's per-token losses are its documents' own."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from graph_trainer.build import build_model
from graph_trainer.compiler.tracer import loss_head
from graph_trainer.data.tokenizer import ByteTokenizer, document_start
from models.registry import MODEL_SPECS
from models.sequence import (
    QueryChunk,
    SequenceLayout,
    chunk_bias,
    document_ids,
    positions_in_documents,
    rank_chunks,
    sequence_order,
)

# ------------------------------------------------------------------ chunks and their order


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_rank_chunks_cover_the_sequence_once_with_equal_causal_work(cp):
    seq = 2 * cp * 5
    c = seq // (2 * cp)
    held = []
    for rank in range(cp):
        early, late = rank_chunks(seq, cp, rank)
        assert (early.start, late.start) == (0, c) and early.length == late.length == c
        assert early.position == rank * c and late.position == (2 * cp - 1 - rank) * c
        # a query of chunk j reads (j + 1) c keys: every rank's two chunks read (2 cp + 1) c together
        assert early.keys + late.keys == (2 * cp + 1) * c
        held += [p for q in (early, late) for p in range(q.position, q.keys)]
    assert sorted(held) == list(range(seq))  # every position held by exactly one rank


def test_rank_chunks_without_context_parallel_is_the_whole_sequence():
    assert rank_chunks(10, 1, 0) == (QueryChunk(0, 10, 0),)


@pytest.mark.parametrize(("seq", "cp"), [(10, 2), (12, 4), (7, 3)])
def test_rank_chunks_of_a_sequence_that_does_not_split_raises(seq, cp):
    with pytest.raises(ValueError, match=f"a sequence of {seq} tokens does not split into 2 x cp = {2 * cp}"):
        rank_chunks(seq, cp, 0)


@pytest.mark.parametrize("cp", [2, 4])
def test_sequence_order_inverts_the_rank_order_concatenation(cp):
    seq = 2 * cp * 3
    whole = torch.randn(2, seq, 3, generator=torch.Generator().manual_seed(cp))
    plans = [SequenceLayout(cp=cp, cp_rank=r).plan(None, seq, "cpu") for r in range(cp)]
    gathered = torch.cat([plan.local(whole) for plan in plans], dim=1)  # what the all-gather gives
    assert not torch.equal(gathered, whole)
    assert torch.equal(sequence_order(gathered, cp), whole)
    # the plan's rank positions are its chunks' positions, which are also its rotary positions
    for rank, plan in enumerate(plans):
        expected = [p for q in rank_chunks(seq, cp, rank) for p in range(q.position, q.keys)]
        assert plan.keep.tolist() == expected and plan.positions.tolist() == expected
    with pytest.raises(ValueError, match=f"^{seq + 2} gathered tokens do not split into 2 x cp = {2 * cp} equal"):
        sequence_order(torch.zeros(2, seq + 2, 3), cp)


# ------------------------------------------------------------------ documents and masks

BOS, EOS = 1, 2


def test_document_ids_at_bos_tokens():
    # the row starts mid-document (no BOS first), then two BOS in a row: an empty-bodied document
    tokens = torch.tensor([[7, 8, BOS, 9, BOS, BOS, 5, 6], [BOS, 3, 4, 5, BOS, 6, 7, 8]])
    expected = [[0, 0, 1, 1, 2, 3, 3, 3], [0, 0, 0, 0, 1, 1, 1, 1]]
    assert document_ids(tokens, ("bos", BOS)).tolist() == expected


def test_document_ids_after_eos_tokens():
    # an eos-only tokenizer: a document starts after each EOS; the row starts mid-document, two EOS
    # in a row close an empty document, and a row ending in EOS starts nothing inside it
    tokens = torch.tensor([[7, EOS, 9, EOS, EOS, 5, 6, EOS], [EOS, 3, 4, 5, 6, 7, 8, 9]])
    expected = [[0, 0, 1, 1, 2, 3, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert document_ids(tokens, ("eos", EOS)).tolist() == expected


def test_positions_in_documents_restart_at_each_document():
    documents = torch.tensor([[0, 0, 1, 1, 2, 3, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]])
    expected = [[0, 1, 0, 1, 0, 0, 1, 2], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert positions_in_documents(documents).tolist() == expected


def _visible(query: int, key: int, documents: torch.Tensor | None, row: int) -> bool:
    """The mask's rule, one pair at a time: at or before the query, and in its document."""
    return key <= query and (documents is None or bool(documents[row, key] == documents[row, query]))


@pytest.mark.parametrize("with_documents", [False, True])
def test_chunk_bias_is_zero_exactly_where_the_key_is_visible(with_documents):
    tokens = torch.tensor([[BOS, 3, 4, BOS, 5, 6, 7, BOS, 8, 9, 10, 11], [3, 4, 5, 6, BOS, 7, BOS, 8, 9, 10, 11, 12]])
    documents = document_ids(tokens, ("bos", BOS)) if with_documents else None
    for chunk in rank_chunks(12, 2, 0) + rank_chunks(12, 2, 1):
        bias = chunk_bias(chunk, documents, torch.float32, "cpu")
        rows = 2 if with_documents else 1
        assert bias.shape == (rows, 1, chunk.length, chunk.keys) and bias.dtype == torch.float32
        for row in range(rows):
            for i in range(chunk.length):
                for key in range(chunk.keys):
                    value = bias[row, 0, i, key].item()
                    want = 0.0 if _visible(chunk.position + i, key, documents, row) else float("-inf")
                    assert value == want, (row, chunk, i, key)


# ------------------------------------------------------------------ context parallel's attention, no process group


def _sequences(seq: int, seed: int):
    """A batch of 2 rows of ``seq`` tokens with documents of several lengths (BOS first in each; the
    second row starts mid-document), and float32 queries [B, S, 4, 8], keys and values [B, S, 2, 8]
    that require gradients: grouped-query heads, two query heads a kv head."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 50, (2, seq), generator=g)
    tokens[0, [0, 5, 6, seq // 2 + 1]] = BOS
    tokens[1, [seq // 4, seq - 3]] = BOS
    q = torch.randn(2, seq, 4, 8, generator=g).requires_grad_()
    k = torch.randn(2, seq, 2, 8, generator=g).requires_grad_()
    v = torch.randn(2, seq, 2, 8, generator=g).requires_grad_()
    return tokens, q, k, v


def _layout(mask: str, **kwargs) -> SequenceLayout:
    return SequenceLayout(mask=mask, document_start=("bos", BOS) if mask == "block_causal" else None, **kwargs)


def _all_gather(rank: int, pieces: tuple[list[torch.Tensor], ...], cp: int):
    """The plan's ``gather`` for cp rank ``rank``: given its own keys (or values), every rank's
    (``pieces``: the keys' and the values' lists, rank ``r``'s at index ``r``) concatenated in rank
    order and put in sequence order, as the all-gather over cp gives them."""

    def gather(x: torch.Tensor) -> torch.Tensor:
        for ranks in pieces:
            if x is ranks[rank]:
                return sequence_order(torch.cat(ranks, dim=1), cp)
        raise AssertionError(f"rank {rank}'s attention gathered a tensor that is neither its keys nor its values")

    return gather


def _context_parallel_attention(mask: str, cp: int, tokens, q, k, v, broken_rank: int = -1, shift: int = 0):
    """The output [B, S, H, D] of ``cp`` ranks' attention, each rank's plan gathering every rank's
    keys and values, put back at the ranks' positions. ``broken_rank``'s late chunk reads with its
    causal offset ``shift`` tokens early (a planted bug)."""
    seq = q.shape[1]
    plans = [_layout(mask, cp=cp, cp_rank=r).plan(tokens, seq, "cpu") for r in range(cp)]
    pieces = ([p.local(k) for p in plans], [p.local(v) for p in plans])
    outs = []
    for rank, plan in enumerate(plans):
        plan = dataclasses.replace(plan, gather=_all_gather(rank, pieces, cp))
        if rank == broken_rank:
            early, late = plan.chunks
            plan = dataclasses.replace(plan, chunks=(early, dataclasses.replace(late, position=late.position - shift)))
        plan = plan.with_masks(torch.float32)
        outs.append(plan.attend(plan.local(q), pieces[0][rank], pieces[1][rank]))
    where = torch.cat([plan.keep for plan in plans])
    return torch.cat(outs, dim=1).index_select(1, torch.argsort(where))


def _one_process_attention(mask: str, tokens, q, k, v):
    plan = _layout(mask).plan(tokens, q.shape[1], "cpu").with_masks(torch.float32)
    assert plan.masked == (mask == "block_causal")  # causal: SDPA's causal kernel, no mask tensor
    return plan.attend(q, k, v)


def _values_and_gradients(out, q, k, v, grad) -> list[torch.Tensor]:
    """``out`` and the gradients of ``q``, ``k`` and ``v`` under ``out``'s gradient ``grad``."""
    return [out.detach(), *torch.autograd.grad(out, [q, k, v], grad)]


def _deviation(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest absolute difference of the outputs and of the gradients."""
    return max((a - b).abs().nan_to_num(nan=float("inf")).max().item() for a, b in zip(got, want, strict=True))


ATTENTION_ATOL = 1e-5
"""Bound on the absolute difference of context parallel's attention (outputs, and the gradients of
queries, keys and values) from one process's, for inputs and output gradients of unit scale in
float32: each query's softmax over the same keys, in another blocking (a masked SDPA over a key
prefix instead of the causal kernel over the whole sequence), so they differ by a few float32 ulps
of values of order 1. A mask one token off changes outputs by a sizeable fraction of their scale."""


def _reference_attention(mask: str, tokens, q, k, v):
    """One process's attention written without models.sequence: every kv head repeated for its two
    query heads, and SDPA's causal kernel over the row (causal) or over each document alone."""
    k, v = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if mask == "causal":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    rows = []
    for row in range(tokens.shape[0]):
        starts = [0] + [i for i in range(1, tokens.shape[1]) if tokens[row, i] == BOS] + [tokens.shape[1]]
        q_row, k_row, v_row = q[row : row + 1], k[row : row + 1], v[row : row + 1]
        pieces = [
            F.scaled_dot_product_attention(q_row[:, :, a:b], k_row[:, :, a:b], v_row[:, :, a:b], is_causal=True)
            for a, b in zip(starts, starts[1:], strict=False)
        ]
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows).transpose(1, 2)


@pytest.mark.parametrize("mask", ["causal", "block_causal"])
def test_one_process_attention_is_causal_attention_within_each_document(mask):
    tokens, q, k, v = _sequences(24, seed=3)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    got = _values_and_gradients(_one_process_attention(mask, tokens, q, k, v), q, k, v, grad)
    want = _values_and_gradients(_reference_attention(mask, tokens, q, k, v), q, k, v, grad)
    assert _deviation(got, want) < ATTENTION_ATOL


@pytest.mark.parametrize("mask", ["causal", "block_causal"])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_matches_one_process_and_a_wrong_offset_does_not(mask, cp):
    seq = 2 * cp * 6
    tokens, q, k, v = _sequences(seq, seed=cp)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    reference = _values_and_gradients(_one_process_attention(mask, tokens, q, k, v), q, k, v, grad)
    got = _values_and_gradients(_context_parallel_attention(mask, cp, tokens, q, k, v), q, k, v, grad)
    assert _deviation(got, reference) < ATTENTION_ATOL
    # The planted bug: one rank's late chunk reads with its causal offset a token, or a chunk, early.
    # The check above must catch it, on whichever rank it is.
    for rank in range(cp):
        for shift in (1, seq // (2 * cp)):
            broken = _context_parallel_attention(mask, cp, tokens, q, k, v, broken_rank=rank, shift=shift)
            wrong = _deviation(_values_and_gradients(broken, q, k, v, grad), reference)
            assert wrong > 100 * ATTENTION_ATOL, (rank, shift, wrong)


# ------------------------------------------------------------------ block_causal: a packed row is its documents alone

DOCUMENT_RTOL = 1e-6
"""Bound on the relative difference of a packed row's per-token losses (block_causal) from its
documents' own, run alone, float32 on CPU: the same queries over the same keys at the same rotary
positions, through a masked SDPA over the row instead of the causal kernel over the document, so
they differ by float32 rounding of losses of order ln(vocab). Attention leaking across documents
(causal) moves the losses of the documents after the first by orders of magnitude more."""


def _debug_model(family: str):
    """A 2-block debug model of ``family`` (every family's attention reads the sequence layout)."""
    spec = MODEL_SPECS[family]
    args = dataclasses.replace(spec.flavors["debugmodel"], n_layers=2)
    return build_model(spec.build, args, torch.device("cpu"), seed=11)


def _packed_row(lengths: list[int], bos: int, seed: int):
    """One loader window of documents of ``lengths`` tokens, each starting with ``bos``: tokens and
    labels [1, sum(lengths)], and the documents' [start, end) in the row."""
    window = torch.randint(0, bos, (1, sum(lengths) + 1), generator=torch.Generator().manual_seed(seed))
    ends = torch.tensor(lengths).cumsum(0).tolist()
    spans = list(zip([0, *ends[:-1]], ends, strict=True))
    for start, _ in spans:
        window[0, start] = bos
    return window[:, :-1], window[:, 1:], spans


def _per_token_losses(model, layout: SequenceLayout, tokens, labels) -> torch.Tensor:
    model.sequence_layout = layout
    with torch.no_grad():
        logits = model(tokens)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("positions_per_document", [True, False])
def test_block_causal_packed_losses_are_the_documents_losses_alone(positions_per_document, family):
    """Every token of a packed row, block_causal, has the loss it has in its document run alone
    (its own row, causal, positions from 0): all of them, a document's last token too, whose label
    is the next document's BOS in both runs (the same labels; its logits see only its own
    document). So the packed loss (the trainer's head) is the token-weighted mean of the documents'
    losses. With each document's rotary positions from 0 the two runs rotate by the same angles;
    with the row's positions they agree too, to rounding, RoPE being relative. Causal attention
    across the row does not: the documents after the first read the ones before. Qwen3's QK norms
    act per token and its experts route each token alone: neither reads across documents."""
    model, start = _debug_model(family), document_start(ByteTokenizer())
    tokens, labels, spans = _packed_row([23, 17, 24], start[1], seed=2)
    alone = [_per_token_losses(model, SequenceLayout(), tokens[:, a:b], labels[:, a:b]) for a, b in spans]
    layout = SequenceLayout(mask="block_causal", document_start=start, positions_per_document=positions_per_document)
    if positions_per_document:
        rotary = layout.plan(tokens, tokens.shape[1], "cpu").positions[0].tolist()
        assert rotary == [i for a, b in spans for i in range(b - a)]
    packed = _per_token_losses(model, layout, tokens, labels)
    torch.testing.assert_close(packed, torch.cat(alone), rtol=DOCUMENT_RTOL, atol=0)
    model.sequence_layout = layout
    with torch.no_grad():
        loss = model(tokens, head=loss_head(labels, chunks=1))
    weighted = sum((b - a) * own.mean() for (a, b), own in zip(spans, alone, strict=True)) / tokens.shape[1]
    torch.testing.assert_close(loss, weighted, rtol=DOCUMENT_RTOL, atol=0)

    leaking = _per_token_losses(model, SequenceLayout(), tokens, labels)
    first = spans[0][1]
    torch.testing.assert_close(leaking[:first], alone[0], rtol=DOCUMENT_RTOL, atol=0)  # nothing before it to read
    later = ((leaking[first:] - torch.cat(alone[1:])).abs() / torch.cat(alone[1:])).max().item()
    assert later > 100 * DOCUMENT_RTOL, later
