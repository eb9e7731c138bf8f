"""LLaMA-3 model arguments, the standard flavors, and analytic size / FLOP counts.

Shapes follow Meta's LLaMA-3 / 3.1 releases (and torchtitan's llama3 flavors). Everything
here is plain arithmetic on the arguments, so it can be checked against a model built on
the meta device without allocating any memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """LLaMA-3.1's RoPE frequency scaling (Hugging Face's ``rope_type`` "llama3"): wavelengths longer
    than ``original_context / low_freq_factor`` are slowed down ``factor`` times, those shorter than
    ``original_context / high_freq_factor`` kept, the band between interpolated smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


LLAMA3_1_SCALING = RopeScaling()
"""The scaling of LLaMA 3.1 (8B, 70B, 405B, and the debug model)."""
LLAMA3_2_SCALING = RopeScaling(factor=32.0)
"""The scaling of LLaMA 3.2's 1B and 3B."""


@dataclass(frozen=True)
class Llama3Args:
    """The hyper-parameters that fully determine a LLaMA-3 model."""

    dim: int
    """Model (residual stream) width."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Number of query heads; the head size is ``dim // n_heads``."""
    vocab_size: int
    """Rows of the token embedding and of the output projection."""
    n_kv_heads: int | None = None
    """Number of key/value heads for grouped-query attention; ``None`` means ``n_heads`` (plain MHA)."""
    multiple_of: int = 256
    """The feed-forward hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Extra factor on the feed-forward hidden size (applied before rounding); ``None`` = 1."""
    norm_eps: float = 1e-5
    """Epsilon added to the mean square inside every RMSNorm."""
    rope_theta: float = 500000.0
    """RoPE base: frequencies are ``rope_theta ** (-2i / head_dim)``."""
    rope_scaling: RopeScaling | None = None
    """The RoPE frequency scaling (``RopeScaling``), or None for none."""
    max_seq_len: int = 2048
    """Longest sequence the model accepts; the RoPE table has this many rows."""
    ffn_hidden: int | None = None
    """The SwiGLU hidden size as given (a Hugging Face config's ``intermediate_size``); None: from
    ``multiple_of`` and ``ffn_dim_multiplier`` as Meta's flavors define it."""
    tie_embeddings: bool = False
    """The output projection computes with the token embedding's weight (one parameter, as
    LLaMA 3.2 1B / 3B ship); the model then has no ``output.weight``."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.n_heads % self.kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.kv_heads})")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """The effective number of key/value heads (``n_kv_heads`` resolved)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size: 2/3 of 4*dim (keeps the MLP's size close to a 4x GELU MLP),
        times ``ffn_dim_multiplier``, rounded up to ``multiple_of`` (or ``ffn_hidden`` when given)."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


FLAVORS: dict[str, Llama3Args] = {
    "debugmodel": Llama3Args(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=16,
        vocab_size=2048,
        multiple_of=256,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_1_SCALING,
        max_seq_len=2048,
    ),
    # The debug model with its output projection tied to the embedding, grouped-query attention
    # (4 of 16 kv heads) and LLaMA 3.2's RoPE scaling: the shape of LLaMA 3.2 1B / 3B, small.
    "debugmodel_tied": Llama3Args(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=4,
        vocab_size=2048,
        ffn_hidden=768,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_2_SCALING,
        max_seq_len=2048,
        tie_embeddings=True,
    ),
    # LLaMA 3.2 1B and 3B (Meta's published configs): tied embeddings, RoPE scaling factor 32.
    "1B": Llama3Args(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden=8192,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_2_SCALING,
        max_seq_len=131072,
        tie_embeddings=True,
    ),
    "3B": Llama3Args(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden=8192,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_2_SCALING,
        max_seq_len=131072,
        tie_embeddings=True,
    ),
    "8B": Llama3Args(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_1_SCALING,
        max_seq_len=8192,
    ),
    "70B": Llama3Args(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_1_SCALING,
        max_seq_len=8192,
    ),
    "405B": Llama3Args(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_1_SCALING,
        max_seq_len=8192,
    ),
}


def num_params(args: Llama3Args, exclude_embedding: bool = False) -> int:
    """Number of parameters of ``Transformer(args)`` (the output projection counted once more
    unless it is tied to the embedding).

    ``exclude_embedding`` leaves out the token embedding table (a lookup, no FLOPs); the
    output projection is a real matmul and is always counted.
    """
    d, hd = args.dim, args.head_dim
    attention = d * (args.n_heads * hd)  # wq
    attention += 2 * d * (args.kv_heads * hd)  # wk, wv
    attention += (args.n_heads * hd) * d  # wo
    feed_forward = 3 * d * args.ffn_hidden_dim  # w1, w2, w3
    norms = 2 * d  # attention_norm, ffn_norm
    per_layer = attention + feed_forward + norms
    total = args.n_layers * per_layer + d + args.vocab_size * d  # + final norm + output
    if not exclude_embedding and not args.tie_embeddings:
        total += args.vocab_size * d
    return total


def flops_per_token(args: Llama3Args, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token at sequence length ``seq_len``.

    ``6 * N + 12 * n_layers * n_heads * head_dim * seq_len``, where N is the number of
    parameters without the embedding table. Each weight costs 2 FLOPs per token forward
    (multiply + add) and 4 backward (gradient w.r.t. input and w.r.t. weight): 6N. The
    attention score (Q K^T) and value (P V) matmuls are not parameters; per token and
    layer they cost 2 * 2 * n_heads * head_dim * seq_len forward and twice that backward,
    i.e. 12 * n_heads * head_dim * seq_len. Causal masking is ignored (the usual
    convention, so MFU numbers are comparable with other trainers).
    """
    return 6 * num_params(args, exclude_embedding=True) + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


__all__ = [
    "FLAVORS",
    "LLAMA3_1_SCALING",
    "LLAMA3_2_SCALING",
    "Llama3Args",
    "RopeScaling",
    "flops_per_token",
    "num_params",
]
