"""DeepSeek-V3 model arguments, the standard flavors, and analytic size / FLOP counts.

Shapes follow DeepSeek's published models (DeepSeek-V2-Lite-sized "16B", DeepSeek-V3 "671B")
and torchtitan's deepseek_v3 flavors. Everything here is plain arithmetic on the arguments,
so it can be checked against a model built on the meta device without allocating memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DeepSeekV3Args:
    """The hyper-parameters that fully determine a DeepSeek-V3 model."""

    dim: int
    """Model (residual stream) width."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Number of attention heads (queries, keys and values all have this many heads)."""
    vocab_size: int
    """Rows of the token embedding and of the output projection."""
    n_dense_layers: int = 1
    """The first this many blocks use a dense SwiGLU FFN (``feed_forward``); the rest a MoE (``moe``)."""
    # --- Multi-head latent attention (MLA)
    q_lora_rank: int = 0
    """Rank of the low-rank query projection (``wq_a`` -> ``q_norm`` -> ``wq_b``); 0 = one plain ``wq``."""
    kv_lora_rank: int = 512
    """Width of the compressed key/value latent (``wkv_a`` output, before ``kv_norm`` and ``wkv_b``)."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dims WITHOUT rotary embedding (produced from the latents)."""
    qk_rope_head_dim: int = 64
    """Per-head query/key dims WITH rotary embedding (decoupled RoPE; the key part is shared by all heads)."""
    v_head_dim: int = 128
    """Per-head value dims."""
    # --- Feed-forward sizes
    inter_dim: int = 1024
    """Hidden size of the dense SwiGLU FFN of the first ``n_dense_layers`` blocks."""
    moe_inter_dim: int = 256
    """Hidden size of ONE expert (routed or shared)."""
    # --- Mixture of experts
    n_routed_experts: int = 8
    """Routed experts per MoE layer (E)."""
    n_shared_experts: int = 2
    """Shared experts per MoE layer, fused into one SwiGLU of width ``moe_inter_dim * n_shared_experts``
    that every token goes through (0 = none)."""
    n_activated_experts: int = 3
    """Routed experts per token (top-k)."""
    score_func: str = "softmax"
    """Router score function on the gate logits: ``"softmax"`` (over experts) or ``"sigmoid"`` (per expert)."""
    n_expert_groups: int = 1
    """Experts are split into this many equal groups for group-limited routing (1 = no grouping)."""
    n_limited_groups: int = 1
    """Each token picks its top-k experts only among its best this-many groups (see ``Router``)."""
    route_scale: float = 1.0
    """Routing weights are multiplied by this (after the optional normalisation)."""
    route_norm: bool = False
    """Normalise each token's top-k weights to sum to 1 before ``route_scale`` (DeepSeek-V3 does this
    with sigmoid scores)."""
    load_balance_coeff: float | None = 1e-3
    """Step size of the auxiliary-loss-free balancing: after each optimizer step
    ``expert_bias += coeff * sign(mean(counts) - counts)``. ``None`` or 0 disables it."""
    # --- Rotary position embedding (on the ``qk_rope_head_dim`` dims only)
    rope_theta: float = 10000.0
    """RoPE base: frequencies are ``rope_theta ** (-2i / qk_rope_head_dim)``."""
    rope_factor: float = 40.0
    """YaRN context-extension factor; > 1 enables the YaRN frequency correction and mscale."""
    original_seq_len: int = 4096
    """Context length the RoPE frequencies were trained for (YaRN's reference length)."""
    beta_fast: float = 32.0
    """YaRN: dims that rotate at least this many times over ``original_seq_len`` keep their frequency."""
    beta_slow: float = 1.0
    """YaRN: dims that rotate at most this many times over ``original_seq_len`` are slowed down by
    ``rope_factor``; the band in between is blended linearly."""
    mscale: float = 1.0
    """YaRN attention temperature: the softmax scale is multiplied by
    ``(0.1 * mscale * ln(rope_factor) + 1) ** 2`` when ``rope_factor > 1``."""
    max_seq_len: int = 4096 * 4
    """Longest sequence the model accepts; the RoPE table has this many rows."""
    norm_eps: float = 1e-6
    """Epsilon added to the mean square inside every RMSNorm."""

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(
            min(self.dim, self.n_layers, self.n_heads, self.vocab_size) > 0,
            "dim, n_layers, n_heads and vocab_size must be positive",
        )
        need(
            0 <= self.n_dense_layers <= self.n_layers,
            f"n_dense_layers ({self.n_dense_layers}) must be in [0, n_layers={self.n_layers}]",
        )
        need(self.q_lora_rank >= 0, f"q_lora_rank ({self.q_lora_rank}) must be >= 0 (0 = plain wq)")
        need(
            min(self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim) > 0,
            "kv_lora_rank, qk_nope_head_dim and v_head_dim must be positive",
        )
        need(
            self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0,
            f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be positive and even for RoPE",
        )
        need(
            self.score_func in ("softmax", "sigmoid"),
            f"score_func must be 'softmax' or 'sigmoid', got {self.score_func!r}",
        )
        if self.n_dense_layers < self.n_layers:  # there are MoE layers
            need(self.n_routed_experts > 0, "n_routed_experts must be > 0 when there are MoE layers")
            need(
                0 < self.n_activated_experts <= self.n_routed_experts,
                f"n_activated_experts ({self.n_activated_experts}) must be in [1, n_routed_experts="
                f"{self.n_routed_experts}]",
            )
            need(
                self.moe_inter_dim > 0 and self.n_shared_experts >= 0,
                "moe_inter_dim must be > 0 and n_shared_experts >= 0",
            )
            need(
                self.n_expert_groups >= 1 and self.n_routed_experts % self.n_expert_groups == 0,
                f"n_expert_groups ({self.n_expert_groups}) must divide n_routed_experts ({self.n_routed_experts})",
            )
            need(
                1 <= self.n_limited_groups <= self.n_expert_groups,
                f"n_limited_groups ({self.n_limited_groups}) must be in [1, n_expert_groups={self.n_expert_groups}]",
            )
            need(
                self.n_activated_experts <= self.n_limited_groups * self.experts_per_group,
                f"n_activated_experts ({self.n_activated_experts}) exceeds the experts in the "
                f"{self.n_limited_groups} limited groups ({self.n_limited_groups * self.experts_per_group})",
            )
        if self.n_dense_layers > 0:
            need(self.inter_dim > 0, "inter_dim must be > 0 when there are dense layers")
        need(self.rope_factor >= 1.0, f"rope_factor ({self.rope_factor}) must be >= 1")
        need(self.beta_fast > self.beta_slow > 0, "YaRN needs beta_fast > beta_slow > 0")
        need(self.max_seq_len > 0 and self.original_seq_len > 0, "sequence lengths must be positive")

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: the no-RoPE part followed by the RoPE part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_expert_groups

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times YaRN's ``mscale ** 2`` when ``rope_factor > 1``
        (DeepSeek folds the attention temperature into the scale, applied to q and k alike)."""
        scale = self.qk_head_dim**-0.5
        if self.rope_factor > 1.0:
            m = 0.1 * self.mscale * math.log(self.rope_factor) + 1.0
            scale *= m * m
        return scale


# Shared by every flavor: DeepSeek's YaRN RoPE (theta 1e4, factor 40 over a 4k original context).
_YARN = dict(
    rope_theta=10000.0, rope_factor=40.0, original_seq_len=4096, beta_fast=32.0, beta_slow=1.0, max_seq_len=4096 * 4
)

FLAVORS: dict[str, DeepSeekV3Args] = {
    "debugmodel": DeepSeekV3Args(
        dim=256,
        n_layers=6,
        n_dense_layers=1,
        n_heads=16,
        vocab_size=2048,
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        inter_dim=1024,
        moe_inter_dim=256,
        n_routed_experts=8,
        n_shared_experts=2,
        n_activated_experts=3,
        score_func="softmax",
        mscale=0.70,
        **_YARN,
    ),
    # The debug model with DeepSeek-V3's own routing (sigmoid scores, group-limited top-k, normalised
    # and scaled weights) and low-rank queries: the size Hugging Face's DeepseekV3 tests load.
    "debugmodel_v3": DeepSeekV3Args(
        dim=256,
        n_layers=6,
        n_dense_layers=1,
        n_heads=16,
        vocab_size=2048,
        q_lora_rank=128,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        inter_dim=1024,
        moe_inter_dim=256,
        n_routed_experts=8,
        n_shared_experts=1,
        n_activated_experts=3,
        score_func="sigmoid",
        n_expert_groups=2,
        n_limited_groups=1,
        route_scale=2.5,
        route_norm=True,
        mscale=1.0,
        **_YARN,
    ),
    "16B": DeepSeekV3Args(
        dim=2048,
        n_layers=27,
        n_dense_layers=1,
        n_heads=16,
        vocab_size=102400,
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        inter_dim=10944,
        moe_inter_dim=1408,
        n_routed_experts=64,
        n_shared_experts=2,
        n_activated_experts=6,
        score_func="softmax",
        mscale=0.70,
        **_YARN,
    ),
    "671B": DeepSeekV3Args(
        dim=7168,
        n_layers=61,
        n_dense_layers=3,
        n_heads=128,
        vocab_size=129280,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        inter_dim=18432,
        moe_inter_dim=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        n_activated_experts=8,
        score_func="sigmoid",
        n_expert_groups=8,
        n_limited_groups=4,
        route_scale=2.5,
        route_norm=True,
        mscale=1.0,
        **_YARN,
    ),
}


def _attention_params(a: DeepSeekV3Args) -> int:
    d, h = a.dim, a.n_heads
    if a.q_lora_rank == 0:
        q = d * h * a.qk_head_dim  # wq
    else:
        q = d * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * h * a.qk_head_dim  # wq_a, q_norm, wq_b
    kv = d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank  # wkv_a, kv_norm
    kv += a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim)  # wkv_b
    return q + kv + h * a.v_head_dim * d  # + wo


def num_params(args: DeepSeekV3Args, exclude_embedding: bool = False, active_only: bool = False) -> int:
    """Number of parameters of ``DeepSeekV3(args)`` (output projection untied).

    ``exclude_embedding`` leaves out the token embedding table (a lookup, no FLOPs).
    ``active_only`` counts only the parameters one token goes through: of each MoE layer's
    routed experts only the top-k (``n_activated_experts``); the router gate (computed for
    every expert), the shared experts and everything else in full.
    """
    a, d = args, args.dim
    expert = 3 * d * a.moe_inter_dim  # one SwiGLU expert: w1, w2, w3
    routed = a.n_activated_experts if active_only else a.n_routed_experts
    moe = d * a.n_routed_experts + routed * expert + a.n_shared_experts * expert  # gate + routed + shared
    dense = 3 * d * a.inter_dim
    per_layer = _attention_params(a) + 2 * d  # + attention_norm, ffn_norm
    total = a.n_layers * per_layer + a.n_dense_layers * dense + a.n_moe_layers * moe
    total += d + a.vocab_size * d  # final norm + output
    if not exclude_embedding:
        total += a.vocab_size * d
    return total


def flops_per_token(args: DeepSeekV3Args, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token at sequence length ``seq_len``.

    ``6 * N_active + 6 * n_layers * n_heads * (qk_head_dim + v_head_dim) * seq_len``.
    N_active is ``num_params(exclude_embedding=True, active_only=True)``: a token only goes
    through its top-k routed experts (plus the shared experts and the router gate), so only
    those weights cost FLOPs; each costs 2 FLOPs forward and 4 backward (6 N). Attention's
    score matmul (Q K^T, width qk_head_dim) and value matmul (P V, width v_head_dim) are not
    parameters: per token and layer they cost 2 * n_heads * (qk_head_dim + v_head_dim) *
    seq_len forward and twice that backward. Causal masking is ignored (the usual convention,
    as for llama3, so MFU is comparable with other trainers).
    """
    a = args
    attention = 6 * a.n_layers * a.n_heads * (a.qk_head_dim + a.v_head_dim) * seq_len
    return 6 * num_params(a, exclude_embedding=True, active_only=True) + attention


__all__ = ["FLAVORS", "DeepSeekV3Args", "flops_per_token", "num_params"]
