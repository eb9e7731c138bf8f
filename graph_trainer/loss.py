"""The training loss: mean token cross-entropy, optionally over chunks of the sequence.

``token_cross_entropy(hidden, output, labels, chunks)`` is the loss head the models call on
their final (normed) hidden state: ``output`` (the output projection module) makes logits,
which are upcast to float32; the loss is the mean over all tokens of the per-token
cross-entropy.

With ``chunks = 1`` the whole batch's logits exist at once: for LLaMA-3 8B at 8192 tokens
that is 8192 x 128256 logits in bf16, their float32 copy, the log-softmax and its gradient,
several GiB (measured: docs/performance.md), the largest live set of the step once activations
are checkpointed. With ``chunks = K > 1`` (``training.loss_chunks``) the tokens are split into K
row blocks; each block's projection and cross-entropy are tagged ``loss_chunk = k``
(``graph.tags``), and the memory policy (``memory_policy/activation_checkpoint.py``) recomputes
each block's logits right before that block's backward, so about 1/K of that memory is alive at
a time, for one more output matmul per step.

Numerics: the per-token losses of all blocks are concatenated before the mean, so the loss is
the same reduction over the same per-token values as with one chunk, and those are bitwise the
unchunked ones where the matmul kernel computes a row block as it computes those rows of the
whole. The log-softmax is row-wise; MKL's matmul is, on the development CPU, except for blocks
of one or two rows, which take a vector kernel: the loss then moves by one ulp (measured:
docs/performance.md). ``tests/compiler/memory_policy/test_activation_checkpoint.py`` holds the loss to
2.5e-7. The output weight's gradient adds the blocks' contributions in another order than one
matmul over all tokens, so from the second step on the runs agree to float rounding, not bitwise.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from graph_trainer.graph.tags import LOSS, LOSS_CHUNK, LOSS_MODULE, MODULE_FQN, PHASE, annotate


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
    return F.cross_entropy(logits.float(), targets, reduction="none")


__all__ = ["token_cross_entropy"]
