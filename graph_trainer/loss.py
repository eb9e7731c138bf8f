"""The training loss: mean token cross-entropy, optionally over chunks of the sequence.

``token_cross_entropy(hidden, output, labels, chunks)`` is the loss head the models call on
their final (normed) hidden state: ``output`` (the output projection module) makes logits,
which are upcast to float32; the loss is the mean over all tokens of the per-token
cross-entropy.

Under tensor parallel the output projection is split over the vocabulary and returns its logits
as a DTensor sharded on the vocabulary dim of the tp mesh (``models.common.split_vocabulary``):
each tp rank holds only its [tokens, vocab / tp] slice, and the per-token cross-entropy is
computed from the slices (loss parallel, ``vocab_parallel_cross_entropy``), never from gathered
logits. Per row: the largest logit (a functional all_reduce max over tp; a stabiliser only, no
gradient flows through it), then each rank's sum of exp(logit - max) and, from the rank whose
vocabulary range holds the target, the target's shifted logit (0 elsewhere), both summed over tp
in ONE all_reduce (stacked); the loss is log(sum) - shifted target logit, the same on every tp
rank. Backward needs no collective: each rank's logits get (softmax - one-hot) times the loss's
gradient on its own columns, the softmax recomputed from the saved logits, row maxima and sums
(so the backward keeps the projection's logits in their dtype, not a float32 log-softmax). These
collectives carry the loss's tags (phase ``loss``, module ``loss``, the row block's
``loss_chunk``): the memory policy never recomputes a collective, so a chunked loss keeps the
reduced maxima and sums (a few numbers per row) and recomputes the block's logits from them.

With ``chunks = 1`` the whole batch's logits exist at once: for LLaMA-3 8B at 8192 tokens
that is 8192 x 128256 logits in bf16, their float32 copy, the log-softmax and its gradient,
several GiB (measured: docs/performance.md), the largest live set of the step once activations
are checkpointed. With ``chunks = K > 1`` (``training.loss_chunks``) the tokens are split into K
row blocks; each block's projection and cross-entropy are tagged ``loss_chunk = k``
(``graph.tags``), and the memory policy (``memory_policy/activation_checkpoint.py``) recomputes
each block's logits right before that block's backward, so about 1/K of that memory is alive at
a time, for one more output matmul per step.

A label of ``IGNORE_INDEX`` is no token: its loss is 0 and it sends no gradient (it still counts
in the mean's denominator), on both paths.

Numerics: the per-token losses of all blocks are concatenated before the mean, so the loss is
the same reduction over the same per-token values as with one chunk, and those are bitwise the
unchunked ones where the matmul kernel computes a row block as it computes those rows of the
whole. The log-softmax is row-wise; MKL's matmul is, on the development CPU, except for blocks
of one or two rows, which take a vector kernel: the loss then moves by one ulp (measured:
docs/performance.md). ``tests/compiler/memory_policy/test_activation_checkpoint.py`` holds the loss to
2.5e-7. The output weight's gradient adds the blocks' contributions in another order than one
matmul over all tokens, so from the second step on the runs agree to float rounding, not bitwise.
The vocabulary-parallel loss adds each row's exponentials per slice, then the slices over tp, in
another order than one process's log-softmax: within float rounding of it, not bitwise
(docs/numerics.md); graph and eager run the same ops and stay bitwise equal.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.utils import parametrize

from graph_trainer.graph.tags import LOSS, LOSS_CHUNK, LOSS_MODULE, MODULE_FQN, PHASE, annotate
from graph_trainer.torch_compat import all_reduce

IGNORE_INDEX = -100
"""The label of no token (``F.cross_entropy``'s default ``ignore_index``)."""


def token_cross_entropy(hidden: torch.Tensor, output: nn.Module, labels: torch.Tensor, chunks: int = 1) -> torch.Tensor:
    """Mean cross-entropy of ``output(hidden)`` [B, S, vocab] against ``labels`` [B, S]."""
    rows = hidden.flatten(0, 1)
    if chunks == 1:  # the forward ends with the logits; everything after is the loss
        logits = output(rows)
        with annotate(_LOSS):
            return _per_token(logits, labels.flatten(0, 1)).mean()
    per_token = []
    # One gather of a SimpleFSDP-sharded output weight for all blocks, not one per block.
    with parametrize.cached():
        for k, block in enumerate(rows.tensor_split(chunks)):
            with annotate({LOSS_CHUNK: k}):
                logits = output(block)  # forward (the projection), then the block's loss
                with annotate(_LOSS):
                    per_token.append(_per_token(logits, labels.flatten(0, 1).tensor_split(chunks)[k]))
    with annotate(_LOSS):
        return torch.cat(per_token).mean()


_LOSS = {PHASE: LOSS, MODULE_FQN: LOSS_MODULE}


def _per_token(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if isinstance(logits, DTensor):  # split over the vocabulary (tensor parallel)
        return vocab_parallel_cross_entropy(vocabulary_slice(logits), targets, logits.device_mesh)
    return F.cross_entropy(logits.float(), targets, reduction="none", ignore_index=IGNORE_INDEX)


def vocabulary_slice(logits: DTensor) -> torch.Tensor:
    """This rank's [rows, vocab / tp] slice of ``logits``, a DTensor sharded on its last dim over a
    1-D mesh (its gradient comes back the same way: no collective); any other layout raises."""
    placements, last = logits.placements, logits.ndim - 1
    if logits.device_mesh.ndim != 1 or not (placements[0].is_shard() and placements[0].dim % logits.ndim == last):
        raise ValueError(
            f"the loss takes logits whole or split over the vocabulary (their last dim) on one mesh dim, "
            f"got a DTensor {tuple(placements)} on a {logits.device_mesh.ndim}-D mesh"
        )
    return logits.to_local()


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Per-token cross-entropy [rows] (float32, the same on every rank of ``mesh``) from this rank's
    slice ``local_logits`` [rows, vocab / n] of logits split evenly over the vocabulary across the n
    ranks of the 1-D ``mesh`` (rank r holds columns r * vocab / n onwards); ``targets`` [rows] are
    whole vocabulary ids, the same on every rank (module docstring)."""
    vocab_start = mesh.get_local_rank() * local_logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(local_logits, targets, vocab_start, mesh.get_group())


def _local_targets(targets: torch.Tensor, vocab_start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each target's column in this slice, 0 where the slice does not hold it; whether it does)."""
    here = (targets >= vocab_start) & (targets < vocab_start + width)
    return torch.where(here, targets - vocab_start, 0), here


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: the per-token loss from the slices (three row-wise reductions over the group, in two
    all_reduces); backward: (softmax - one-hot) x the loss's gradient on this slice, no collective."""

    @staticmethod
    def forward(ctx, local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
        logits = local_logits.float()
        row_max = all_reduce(logits.amax(dim=-1), "max", group)
        shifted = logits - row_max.unsqueeze(-1)
        column, here = _local_targets(targets, vocab_start, logits.shape[-1])
        target_shifted = torch.where(here, shifted.gather(-1, column.unsqueeze(-1)).squeeze(-1), 0.0)
        sum_exp, target_shifted = all_reduce(torch.stack([shifted.exp().sum(dim=-1), target_shifted]), "sum", group)
        ctx.save_for_backward(local_logits, targets, row_max, sum_exp)
        ctx.vocab_start = vocab_start
        return torch.where(targets == IGNORE_INDEX, 0.0, sum_exp.log() - target_shifted)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        local_logits, targets, row_max, sum_exp = ctx.saved_tensors
        grad = torch.where(targets == IGNORE_INDEX, 0.0, grad_loss)
        softmax = (local_logits.float() - row_max.unsqueeze(-1)).exp() / sum_exp.unsqueeze(-1)
        column, here = _local_targets(targets, ctx.vocab_start, local_logits.shape[-1])
        one_hot = torch.where(here, grad, 0.0).unsqueeze(-1)
        grad_logits = (softmax * grad.unsqueeze(-1)).scatter_add(-1, column.unsqueeze(-1), -one_hot)
        return grad_logits.to(local_logits.dtype), None, None, None


__all__ = ["IGNORE_INDEX", "token_cross_entropy", "vocab_parallel_cross_entropy", "vocabulary_slice"]
