"""The LLaMA-3 transformer, written to be traced into one aten graph.

Parameter names follow torchtitan's classic llama3 layout (``tok_embeddings``,
``layers.{i}.attention.wq`` ..., ``layers.{i}.feed_forward.w1`` ..., ``norm``, ``output``),
so tensor-parallel plans and checkpoints keyed by those names apply unchanged.

Choices made for tracing and sharding:

- RoPE uses real cos/sin tables, not complex tensors (complex dtypes trace badly); the pair
  rotation is exactly the one Meta's complex implementation performs on (x[2i], x[2i+1]).
- Head counts in attention come from the activations' shapes at run time, so the module
  works unchanged when wq/wk/wv/wo are sharded over heads by tensor parallel.
- Initialisation is described per parameter (``init_rules``) and replayed from a generator
  seeded by (seed, fqn), so it does not depend on how parameters are later sharded.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from models.common import (
    BASE,
    ONES,
    FeedForward,
    InitRule,
    RMSNorm,
    apply_rope,
    rotary_table,
)
from models.llama3.flavors import Llama3Args, RopeScaling
from models.sequence import SequencePlan
from models.stack import DecoderStack

# --------------------------------------------------------------------------------------
# Rotary position embedding


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The ``head_dim // 2`` rotation frequencies (radians per position), float64.

    With ``scaling`` (LLaMA-3.1's, e.g. factor 8, low_freq_factor 1, high_freq_factor 4, original
    context 8192), long wavelengths (beyond original context / low_freq_factor) are slowed down
    ``factor`` times, short ones (below original context / high_freq_factor) are kept, and the band
    in between is interpolated smoothly between the two.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    freqs = 1.0 / (theta**exponents)
    if scaling is None:
        return freqs
    s = scaling
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = s.original_context / s.low_freq_factor
    high_freq_wavelen = s.original_context / s.high_freq_factor
    smooth = (s.original_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * freqs / s.factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / s.factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def rope_table(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: RopeScaling | None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``[max_seq_len, head_dim]`` float32 cos | sin table of the LLaMA-3 frequencies (``rotary_table``)."""
    return rotary_table(rope_frequencies(head_dim, theta, scaling), max_seq_len, device)


# --------------------------------------------------------------------------------------
# Blocks


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE on queries and keys; which keys each query sees (causal,
    within its document, other context-parallel ranks' tokens) is the forward's plan's
    (``models.sequence.SequencePlan``)."""

    def __init__(self, args: Llama3Args):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, plan: SequencePlan) -> torch.Tensor:
        batch, seq, _ = x.shape
        # "-1" heads: under tensor parallel wq/wk/wv are column-sharded and their outputs
        # hold only this rank's heads, so the head counts are read from the shapes here.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        # Grouped-query heads, the mask, and under context parallel the keys and values of the
        # other ranks' tokens: ``models.sequence``.
        out = plan.attend(q, k, v)
        return self.wo(out.reshape(batch, seq, -1))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then the feed-forward, each on a normed input."""

    def __init__(self, layer_id: int, args: Llama3Args):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, plan: SequencePlan) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, plan)
        return h + self.feed_forward(self.ffn_norm(h))


# --------------------------------------------------------------------------------------
# The model


class Transformer(DecoderStack):
    """LLaMA-3: token embedding, ``n_layers`` blocks, final RMSNorm, output projection (its own
    weight, or the embedding's with ``args.tie_embeddings``), as ``models.stack.DecoderStack``; the
    rotary table [max_seq_len, head_dim] of LLaMA-3's (scaled) frequencies. Its initialisation:
    wq/wk/wv/w1 at the base std and wo/w2/w3 depth-scaled, norms ones."""

    def __init__(self, args: Llama3Args):
        super().__init__(args, TransformerBlock, rope_dim=args.head_dim)

    def rope_table(self, device: torch.device | str | None) -> torch.Tensor:
        a = self.args
        return rope_table(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling, device=device)

    def block_init_rules(self, block: nn.Module, deep: InitRule) -> dict[str, InitRule]:
        return _block_init_rules(block, deep)


def _block_init_rules(block: nn.Module, deep: InitRule) -> dict[str, InitRule]:
    return {
        "attention.wq.weight": BASE,
        "attention.wk.weight": BASE,
        "attention.wv.weight": BASE,
        "attention.wo.weight": deep,
        "feed_forward.w1.weight": BASE,
        "feed_forward.w2.weight": deep,
        "feed_forward.w3.weight": deep,
        "attention_norm.weight": ONES,
        "ffn_norm.weight": ONES,
    }


__all__ = ["Attention", "Transformer", "TransformerBlock", "rope_frequencies", "rope_table"]
