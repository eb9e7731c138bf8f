"""Qwen3 model arguments (dense and MoE), the standard flavors, and analytic size / FLOP counts.

Shapes follow the published ``config.json`` of Qwen's releases (Qwen3-0.6B, -8B, -32B, -30B-A3B,
-235B-A22B): vocabulary 151936, RoPE base 1e6 with no scaling, RMSNorm epsilon 1e-6, head size 128
whatever the width (``head_dim`` is its own argument, not ``dim // n_heads``), no biases, the
embedding tied to the output projection in the small dense sizes only. The MoE sizes make every
block a MoE layer (``decoder_sparse_step`` 1, no ``mlp_only_layers``) with 128 experts, top-8,
softmax scores, the top-8 weights renormalised, and no shared expert. Everything here is plain
arithmetic on the arguments, so it can be checked against a model built on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Qwen3Args:
    """The hyper-parameters that fully determine a Qwen3 model (dense when ``n_routed_experts`` is 0)."""

    dim: int
    """Model (residual stream) width."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Number of query heads."""
    n_kv_heads: int
    """Number of key/value heads (grouped-query attention)."""
    vocab_size: int
    """Rows of the token embedding and of the output projection."""
    head_dim: int = 128
    """Size of one attention head (queries, keys, values); ``n_heads * head_dim`` need not be ``dim``."""
    ffn_hidden: int = 0
    """Hidden size of a dense block's SwiGLU (``intermediate_size``); unused when every block is a MoE."""
    n_routed_experts: int = 0
    """Routed experts per MoE layer (E); 0: a dense model."""
    n_activated_experts: int = 0
    """Routed experts per token (top-k)."""
    moe_inter_dim: int = 0
    """Hidden size of one expert's SwiGLU (``moe_intermediate_size``)."""
    route_norm: bool = True
    """Renormalise each token's top-k softmax weights to sum 1 (``norm_topk_prob``)."""
    norm_eps: float = 1e-6
    """Epsilon added to the mean square inside every RMSNorm (the QK norms' too)."""
    rope_theta: float = 1_000_000.0
    """RoPE base: frequencies are ``rope_theta ** (-2i / head_dim)``."""
    max_seq_len: int = 40960
    """Longest sequence the model accepts; the RoPE table has this many rows."""
    tie_embeddings: bool = False
    """The output projection computes with the token embedding's weight (one parameter)."""

    # The routing of Qwen3's MoE layers, fixed (the fields ``models.moe`` reads).
    score_func = "softmax"
    n_shared_experts = 0
    n_expert_groups = 1
    n_limited_groups = 1
    route_scale = 1.0

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(min(self.dim, self.n_layers, self.n_heads, self.n_kv_heads, self.vocab_size) > 0, "sizes must be > 0")
        need(self.head_dim > 0 and self.head_dim % 2 == 0, f"head_dim ({self.head_dim}) must be positive and even")
        need(
            self.n_heads % self.n_kv_heads == 0,
            f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})",
        )
        if self.is_moe:
            need(
                0 < self.n_activated_experts <= self.n_routed_experts and self.moe_inter_dim > 0,
                f"a MoE needs 0 < n_activated_experts ({self.n_activated_experts}) <= n_routed_experts "
                f"({self.n_routed_experts}) and moe_inter_dim > 0 ({self.moe_inter_dim})",
            )
        else:
            need(self.ffn_hidden > 0, f"a dense model needs ffn_hidden > 0 ({self.ffn_hidden})")

    @property
    def is_moe(self) -> bool:
        """Whether every block is a MoE layer (else every block is dense)."""
        return self.n_routed_experts > 0

    @property
    def n_dense_layers(self) -> int:
        """The leading blocks that are dense (DeepSeek-V3's field of the same meaning): all of them, or
        none for a MoE."""
        return 0 if self.is_moe else self.n_layers

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads


FLAVORS: dict[str, Qwen3Args] = {
    # Small, for tests and CPU runs: head_dim 64 with dim 256 and 8 heads (their product is not dim,
    # as in the real sizes), grouped-query attention 8:4, untied (pipeline stages may split it).
    "debugmodel": Qwen3Args(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=2048, head_dim=64, ffn_hidden=768, max_seq_len=2048
    ),
    # The debug model with its output projection tied to the embedding, as Qwen3-0.6B / 1.7B / 4B.
    "debugmodel_tied": Qwen3Args(
        dim=256,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=2048,
        head_dim=64,
        ffn_hidden=768,
        max_seq_len=2048,
        tie_embeddings=True,
    ),
    "0.6B": Qwen3Args(
        dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, vocab_size=151936, ffn_hidden=3072, tie_embeddings=True
    ),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, vocab_size=151936, ffn_hidden=12288),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, vocab_size=151936, ffn_hidden=25600),
}

MOE_FLAVORS: dict[str, Qwen3Args] = {
    # Small: 8 experts, top-2, every block a MoE.
    "debugmodel": Qwen3Args(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=2048,
        head_dim=64,
        n_routed_experts=8,
        n_activated_experts=2,
        moe_inter_dim=256,
        max_seq_len=2048,
    ),
    "30B-A3B": Qwen3Args(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        vocab_size=151936,
        ffn_hidden=6144,
        n_routed_experts=128,
        n_activated_experts=8,
        moe_inter_dim=768,
    ),
    "235B-A22B": Qwen3Args(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        vocab_size=151936,
        ffn_hidden=12288,
        n_routed_experts=128,
        n_activated_experts=8,
        moe_inter_dim=1536,
    ),
}
"""``ffn_hidden`` of the MoE sizes is their ``config.json``'s ``intermediate_size``: no block uses it
(every block is a MoE), but it is what the published files say, and an export writes it back."""


def num_params(args: Qwen3Args, exclude_embedding: bool = False, active: bool = False) -> int:
    """Number of parameters of ``Qwen3(args)`` (the output projection counted once more unless it is
    tied to the embedding). ``exclude_embedding`` leaves out the token embedding table (a lookup,
    no FLOPs; the output projection is a matmul and always counted); ``active`` counts the routed
    experts a token activates (top-k of E) instead of all of them."""
    d, hd = args.dim, args.head_dim
    attention = d * args.n_heads * hd + 2 * d * args.n_kv_heads * hd + args.n_heads * hd * d + 2 * hd  # + q/k norms
    if args.is_moe:
        experts = args.n_activated_experts if active else args.n_routed_experts
        feed_forward = d * args.n_routed_experts + 3 * experts * d * args.moe_inter_dim  # router + experts
    else:
        feed_forward = 3 * d * args.ffn_hidden
    total = args.n_layers * (attention + feed_forward + 2 * d) + d + args.vocab_size * d  # + final norm, output
    if not exclude_embedding and not args.tie_embeddings:
        total += args.vocab_size * d
    return total


def flops_per_token(args: Qwen3Args, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token at sequence length ``seq_len``: ``6 * N_active +
    12 * n_layers * n_heads * head_dim * seq_len``, N_active the parameters a token multiplies by
    (no embedding table; routed experts at top-k of E), the second term attention's score and value
    matmuls with causal masking ignored (the usual convention, as the other families count)."""
    n = num_params(args, exclude_embedding=True, active=True)
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


__all__ = ["FLAVORS", "MOE_FLAVORS", "Qwen3Args", "flops_per_token", "num_params"]
