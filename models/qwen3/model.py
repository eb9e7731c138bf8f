"""The Qwen3 transformer (dense and MoE), written to be traced into one aten graph.

Parameter names follow the other families' layout: ``tok_embeddings``,
``layers.{i}.attention.{wq, wk, wv, wo, q_norm, k_norm}``, ``layers.{i}.{attention_norm, ffn_norm}``,
then ``layers.{i}.feed_forward.{w1, w2, w3}`` (dense) or ``layers.{i}.moe.{router.gate,
experts.{w1, w2, w3}}`` (MoE), then ``norm`` and ``output`` (absent when tied to the embedding).

What Qwen3 adds to LLaMA-3's block, and how:

- QK-norm: an RMSNorm over each head's ``head_dim`` features of the queries and of the keys (one
  weight vector each, shared by the heads), after the projections and before RoPE.
- The head size is its own argument (``n_heads * head_dim`` need not be ``dim``).
- RoPE with base 1e6 and no scaling, on the pairs (2i, 2i+1) as the other families rotate them;
  Hugging Face's checkpoints hold the "rotate half" order, which ``models.qwen3.hf`` permutes (the
  rows of wq, wk and the features of q_norm, k_norm alike, so the norms see the same values).
- The MoE layer is ``models.moe``'s: softmax scores, top-k, the top-k weights renormalised
  (``route_norm``), no shared expert, and no load-balancing state: routing is Hugging Face's
  exactly. Qwen3 was trained with an auxiliary load-balancing loss; this model adds none to the
  loss and no bias balancing (docs/parallelism.md, "Qwen3").

Head counts are read from the activations at run time, so tensor parallel splits heads by
splitting the projections; the QK norms compute on the rank's heads with their weight replicated
(``models.qwen3.parallelize``).
"""

from __future__ import annotations

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
from models.moe import MoE
from models.qwen3.flavors import Qwen3Args
from models.sequence import SequencePlan
from models.stack import DecoderStack


def rope_table(args: Qwen3Args, device: torch.device | str | None = None) -> torch.Tensor:
    """``[max_seq_len, head_dim]`` float32 cos | sin table of the frequencies ``rope_theta ** (-2i / head_dim)``."""
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim
    return rotary_table(1.0 / (args.rope_theta**exponents), args.max_seq_len, device)


class Attention(nn.Module):
    """Grouped-query self-attention with QK-norm, then RoPE on queries and keys; which keys each query
    sees is the forward's plan's (``models.sequence.SequencePlan``)."""

    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, plan: SequencePlan) -> torch.Tensor:
        batch, seq, _ = x.shape
        # "-1" heads: under tensor parallel the projections hold only this rank's heads.
        q = self.q_norm(self.wq(x).view(batch, seq, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(batch, seq, -1, self.head_dim))
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = plan.attend(q, k, v)
        return self.wo(out.reshape(batch, seq, -1))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then a dense SwiGLU or the MoE, each on a normed input."""

    def __init__(self, layer_id: int, args: Qwen3Args):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if args.is_moe:
            self.moe = MoE(args, bias_balancing=False)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden)

    @property
    def is_moe(self) -> bool:
        return hasattr(self, "moe")

    def forward(self, x: torch.Tensor, rope: torch.Tensor, plan: SequencePlan) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, plan)
        ffn = self.moe if self.is_moe else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Qwen3(DecoderStack):
    """Qwen3: token embedding, ``n_layers`` blocks, final RMSNorm, output projection (its own weight,
    or the embedding's with ``args.tie_embeddings``), as ``models.stack.DecoderStack``; the rotary
    table [max_seq_len, head_dim] of base ``rope_theta``."""

    def __init__(self, args: Qwen3Args):
        super().__init__(args, TransformerBlock, rope_dim=args.head_dim)

    def rope_table(self, device: torch.device | str | None) -> torch.Tensor:
        return rope_table(self.args, device=device)

    def block_init_rules(self, block: nn.Module, deep: InitRule) -> dict[str, InitRule]:
        """As the other families: norms (the QK norms too) ones, projections reading the residual
        stream (wq, wk, wv, w1 of every FFN and expert) and the router gate at the base std,
        projections writing into it plus w3 depth-scaled; stacked expert weights drawn as one
        [E, ...] tensor."""
        return _block_init_rules(block, deep)


def _block_init_rules(block: nn.Module, deep: InitRule) -> dict[str, InitRule]:
    rules = {
        "attention.wq.weight": BASE,
        "attention.wk.weight": BASE,
        "attention.wv.weight": BASE,
        "attention.wo.weight": deep,
        "attention.q_norm.weight": ONES,
        "attention.k_norm.weight": ONES,
        "attention_norm.weight": ONES,
        "ffn_norm.weight": ONES,
    }
    if block.is_moe:
        rules.update(
            {"moe.router.gate.weight": BASE, "moe.experts.w1": BASE, "moe.experts.w2": deep, "moe.experts.w3": deep}
        )
    else:
        rules.update({"feed_forward.w1.weight": BASE, "feed_forward.w2.weight": deep, "feed_forward.w3.weight": deep})
    return rules


__all__ = ["Attention", "Qwen3", "TransformerBlock", "rope_table"]
