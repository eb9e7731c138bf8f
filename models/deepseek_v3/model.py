"""The DeepSeek-V3 transformer, written to be traced into one aten graph.

Parameter names follow the classic DeepSeek / torchtitan layout: ``tok_embeddings``,
``layers.{i}.attention.{wq | wq_a, q_norm, wq_b}``, ``...attention.{wkv_a, kv_norm, wkv_b, wo}``,
``layers.{i}.{attention_norm, ffn_norm}``, then either ``layers.{i}.feed_forward.{w1,w2,w3}``
(the first ``n_dense_layers`` blocks) or ``layers.{i}.moe.{router.gate, experts.{w1,w2,w3},
shared_experts.{w1,w2,w3}}``, then ``norm`` and the untied ``output``.

Choices made for tracing and sharding (as in models/llama3/model.py; ``RMSNorm``, the SwiGLU
``FeedForward`` and ``apply_rope`` are the shared ones of ``models/common.py``):

- Multi-head latent attention (MLA) applies RoPE to ``qk_rope_head_dim`` dims of each query
  head and to ONE key part shared by all heads (decoupled RoPE), from real cos/sin tables
  (no complex tensors). YaRN corrects the frequencies and the softmax scale when
  ``rope_factor > 1``. Head counts are read from the activations at run time: tensor parallel
  on heads needs only the shared key's gradient hook (``Attention.k_rope_grad_reduce``).
- The MoE layer is the shared one (``models.moe``: top-k routing, expert-sorted rows, the
  token-dispatcher contract expert parallelism plugs into), here with routed and shared
  experts and aux-loss-free load balancing: a persistent ``expert_bias`` steers only the top-k
  choice, the forward counts tokens per expert, and ``DeepSeekV3.update_expert_bias`` turns
  the counts into a bias update between steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

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
from models.deepseek_v3.flavors import DeepSeekV3Args
from models.moe import MoE, update_expert_bias
from models.sequence import SequencePlan
from models.stack import DecoderStack

# --------------------------------------------------------------------------------------
# Rotary position embedding with YaRN


def yarn_frequencies(args: DeepSeekV3Args) -> torch.Tensor:
    """The ``qk_rope_head_dim // 2`` rotation frequencies (radians per position), float64.

    Without YaRN (``rope_factor == 1``): ``theta ** (-2i / d)``. With YaRN ("NTK-by-parts"):
    dim pair i completes ``original_seq_len * freq_i / (2 pi)`` rotations over the original
    context. Pairs rotating more than ``beta_fast`` times keep their frequency, pairs rotating
    fewer than ``beta_slow`` times are slowed down by ``rope_factor``, and in between the two
    are blended with a linear ramp over the pair index. The ramp ends are the pair indices at
    which the rotation counts equal beta_fast / beta_slow, rounded outwards (floor / ceil) and
    clipped to [0, d - 1], as DeepSeek's reference does.
    """
    d, theta = args.qk_rope_head_dim, args.rope_theta
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    if args.rope_factor <= 1.0:
        return freqs

    def pair_index_for(rotations: float) -> float:
        # Solve original_seq_len * theta**(-2i/d) / (2 pi) == rotations for i.
        return d * math.log(args.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(pair_index_for(args.beta_fast)), 0)
    high = min(math.ceil(pair_index_for(args.beta_slow)), d - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero; the ramp becomes a step
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return freqs * (1 - ramp) + freqs / args.rope_factor * ramp


def rope_table(args: DeepSeekV3Args, device: torch.device | str | None = None) -> torch.Tensor:
    """``[max_seq_len, qk_rope_head_dim]`` float32 cos | sin table of the YaRN frequencies (``rotary_table``)."""
    return rotary_table(yarn_frequencies(args), args.max_seq_len, device)


# --------------------------------------------------------------------------------------
# Multi-head latent attention


class Attention(nn.Module):
    """Multi-head latent attention (MLA), causal.

    q = wq(x) (or wq_b(q_norm(wq_a(x))) with a low-rank query), per head [nope | rope] dims.
    wkv_a(x) = [kv latent (kv_lora_rank) | k_rope (qk_rope_head_dim, shared by all heads)];
    wkv_b(kv_norm(latent)) = per head [k_nope | v]. RoPE rotates q's rope part and k_rope;
    k = [k_nope | k_rope broadcast to every head]. SDPA with the (YaRN-corrected) scale.
    ``k_rope_grad_reduce`` (identity here) wraps k_rope before the broadcast; tensor parallel
    replaces it with a sum of its gradient over tp, each rank holding only some heads.
    """

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.qk_head_dim = args.qk_head_dim
        self.v_head_dim = args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.softmax_scale = args.softmax_scale
        self.q_lora_rank = args.q_lora_rank
        q_out = args.n_heads * args.qk_head_dim
        if args.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, q_out, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, args.norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.k_rope_grad_reduce: nn.Module = nn.Identity()

    def forward(self, x: torch.Tensor, rope: torch.Tensor, plan: SequencePlan) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        # "-1" heads: under tensor parallel wq(_b)/wkv_b are column-sharded over heads and
        # their outputs hold only this rank's heads.
        q = q.view(batch, seq, -1, self.qk_head_dim)
        q_nope, q_rope = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rope = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_rope = apply_rope(q_rope, rope)
        k_rope = apply_rope(k_rope.unsqueeze(2), rope)  # [B, S, 1, rope]: one key part for all heads
        k_rope = self.k_rope_grad_reduce(k_rope)

        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        n_heads = kv.shape[2]
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(batch, seq, n_heads, self.qk_rope_head_dim)], dim=-1)

        # v's head dim may differ from q/k's; the mask: ``models.sequence``.
        out = plan.attend(q, k, v, scale=self.softmax_scale)
        return self.wo(out.reshape(batch, seq, -1))


# --------------------------------------------------------------------------------------
# Blocks and the model


class TransformerBlock(nn.Module):
    """Pre-norm residual block: MLA, then a dense SwiGLU (first n_dense_layers) or the MoE."""

    def __init__(self, layer_id: int, args: DeepSeekV3Args):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if layer_id < args.n_dense_layers:
            self.feed_forward = FeedForward(args.dim, args.inter_dim)
        else:
            self.moe = MoE(args)

    @property
    def is_moe(self) -> bool:
        return hasattr(self, "moe")

    def forward(self, x: torch.Tensor, rope: torch.Tensor, plan: SequencePlan) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, plan)
        ffn = self.moe if self.is_moe else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class DeepSeekV3(DecoderStack):
    """DeepSeek-V3: token embedding, ``n_layers`` blocks, final RMSNorm, untied output projection.

    Buffers: ``rope_cache`` [max_seq_len, qk_rope_head_dim] float32, non-persistent (a pure
    function of the args; cos | sin halves as in llama3), and per MoE block ``expert_bias``
    (persistent) and ``tokens_per_expert`` (non-persistent). After building on the meta device
    and ``to_empty``, call ``init_buffers(device)``. Cast parameters, not the whole module, to
    lower precision (the RoPE table and the balancing buffers stay float32).
    """

    def __init__(self, args: DeepSeekV3Args):
        super().__init__(args, TransformerBlock, rope_dim=args.qk_rope_head_dim)

    def rope_table(self, device: torch.device | str | None) -> torch.Tensor:
        return rope_table(self.args, device=device)

    def moe_layers(self) -> list[MoE]:
        return [block.moe for block in self.layers.values() if block.is_moe]

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute ``rope_cache`` and reset the MoE balancing buffers, on ``device``
        (default: where ``rope_cache`` lives now)."""
        super().init_buffers(device)
        for moe in self.moe_layers():
            moe.init_buffers(self.rope_cache.device)

    @torch.no_grad()
    def update_expert_bias(self, all_reduce_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Aux-loss-free load balancing step with ``args.load_balance_coeff``; call it after the
        optimizer step, outside the graph (``models.moe.update_expert_bias``: ``all_reduce_fn`` must
        return the sum of the routing counts over the ranks whose batches differ)."""
        update_expert_bias(self.moe_layers(), self.args.load_balance_coeff, all_reduce_fn)

    def block_init_rules(self, block: nn.Module, deep: InitRule) -> dict[str, InitRule]:
        """A block's initialisation, as in llama3 (``models.stack.DecoderStack.init_rules``). Norms
        (incl. q_norm, kv_norm) ones; projections reading the residual stream or a latent (wq, wq_a,
        wq_b, wkv_a, wkv_b, the w1 of every FFN/expert) at the base std; projections writing into
        the residual stream plus w3 (wo, w2, w3 of dense FFN, shared and routed experts)
        depth-scaled. The router gate uses the flat base std: it produces routing logits, not a
        residual update, so depth scaling would only make early routing more uniform in deep layers.
        Stacked expert weights are drawn as one [E, ...] tensor, so the draw does not depend on
        expert sharding."""
        return _block_init_rules(block, deep)


def _block_init_rules(block: nn.Module, deep: InitRule) -> dict[str, InitRule]:
    rules = {
        "attention_norm.weight": ONES,
        "ffn_norm.weight": ONES,
        "attention.wkv_a.weight": BASE,
        "attention.kv_norm.weight": ONES,
        "attention.wkv_b.weight": BASE,
        "attention.wo.weight": deep,
    }
    if block.attention.q_lora_rank == 0:
        rules["attention.wq.weight"] = BASE
    else:
        rules.update({"attention.wq_a.weight": BASE, "attention.q_norm.weight": ONES, "attention.wq_b.weight": BASE})
    ffns = ["feed_forward"]
    if block.is_moe:
        rules.update(
            {"moe.router.gate.weight": BASE, "moe.experts.w1": BASE, "moe.experts.w2": deep, "moe.experts.w3": deep}
        )
        ffns = ["moe.shared_experts"] if block.moe.shared_experts is not None else []
    for ffn in ffns:
        rules.update({f"{ffn}.w1.weight": BASE, f"{ffn}.w2.weight": deep, f"{ffn}.w3.weight": deep})
    return rules


__all__ = [
    "Attention",
    "DeepSeekV3",
    "TransformerBlock",
    "rope_table",
    "yarn_frequencies",
]
