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
- The MoE routes every token to its top-k experts, sorts the (token, slot) pairs by expert,
  and runs the experts on contiguous row blocks whose sizes are data-dependent
  (``counts.tolist()``: unbacked symbols in the fake trace, so one graph serves every
  routing). Expert parallelism plugs in as ``MoE.token_dispatcher`` (see
  ``LocalTokenDispatcher``).
- Aux-loss-free load balancing: a persistent ``expert_bias`` steers only the top-k choice;
  the forward counts tokens per expert into ``tokens_per_expert`` (an in-place buffer add,
  recorded in the traced graph), and ``DeepSeekV3.update_expert_bias`` turns the counts into
  a bias update between steps.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from graph_trainer.graph.tags import EP_ROLE, EXPERT_COMPUTE, annotate
from graph_trainer.torch_compat import grouped_mm
from models.common import (
    BASE,
    ONES,
    FeedForward,
    InitRule,
    RMSNorm,
    apply_rope,
    init_plain_parameters,
    rotary_table,
    run_stack,
    sorted_copies,
    stack_init_rules,
)
from models.deepseek_v3.flavors import DeepSeekV3Args
from models.sequence import SequenceLayout, SequencePlan

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
# Mixture of experts


class Router(nn.Module):
    """Top-k routing with optional group limits; the bias steers the choice, not the weights.

    scores = softmax (over experts) or sigmoid of ``gate(x)``, in float32. The choice uses
    ``scores + expert_bias``: with ``n_expert_groups > 1`` each group is rated by the sum of
    its two best biased scores (DeepSeek-V3), only the best ``n_limited_groups`` groups stay
    eligible, then the top-k experts among them are taken. The weights are the UNBIASED
    scores of the chosen experts, optionally normalised to sum 1 (``route_norm``), times
    ``route_scale``. Gradients reach ``gate`` through the weights only.
    """

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        self.gate = nn.Linear(args.dim, args.n_routed_experts, bias=False)
        self.top_k = args.n_activated_experts
        self.score_func = args.score_func
        self.n_groups = args.n_expert_groups
        self.n_limited_groups = args.n_limited_groups
        self.route_scale = args.route_scale
        self.route_norm = args.route_norm

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [T, dim] -> (expert ids [T, k] int64, weights [T, k] float32)."""
        logits = self.gate(x).float()
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        with torch.no_grad():
            choice = scores + expert_bias
            if self.n_groups > 1:
                tokens = choice.shape[0]
                grouped = choice.view(tokens, self.n_groups, -1)
                group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
                best_groups = group_score.topk(self.n_limited_groups, dim=-1).indices
                keep = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, best_groups, True)
                choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
            ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights * self.route_scale


class LocalTokenDispatcher:
    """Moves expert-sorted tokens to the ranks that own the experts, and back.

    Contract (what an expert-parallel dispatcher implements):

    - ``dispatch(x_sorted, counts) -> (x_local, local_counts, ctx)``: ``x_sorted`` holds this
      rank's token rows sorted by GLOBAL expert id, ``counts`` [E] int64 the rows per global
      expert. Returns the rows THIS rank's local experts must process, sorted by local expert,
      the rows per local expert (``local_counts``, one entry per local expert, i.e. per row of
      the local ``experts.w1``), and whatever ``combine`` needs.
    - ``combine(y_local, ctx) -> y_sorted``: the inverse: the experts' outputs for
      ``x_local``, returned to the rank and order of ``x_sorted`` (same shape as it).

    This one is for a single rank holding all E experts: both are the identity
    (``dispatch`` returns ``(x_sorted, counts, None)``, ``combine`` returns ``y_local``).
    """

    def dispatch(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        return x_sorted, counts, None

    def combine(self, y_local: torch.Tensor, ctx: Any) -> torch.Tensor:
        return y_local


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLU weights stacked on dim 0, computed on expert-sorted rows.

    ``w1``/``w3`` [E_local, moe_inter_dim, dim], ``w2`` [E_local, dim, moe_inter_dim];
    E_local = ``w1.shape[0]`` (all E experts unless expert parallel gives this rank a slice).
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.float8_matmul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        """``(rows, w, counts) -> rows @ w[e]ᵀ per expert`` in float8 (``models.float8.convert_routed_experts``);
        None: the parameter dtype's matmuls."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` [N, dim] rows sorted by local expert, ``counts`` [E_local] rows per expert -> [N, dim]."""
        w1, w2, w3 = self.w1, self.w2, self.w3  # read once: under SimpleFSDP each read gathers
        if counts.shape[0] != w1.shape[0]:
            raise ValueError(
                f"got token counts for {counts.shape[0]} experts, but this module holds {w1.shape[0]} (local) experts"
            )
        with annotate({EP_ROLE: EXPERT_COMPUTE}):
            if self.float8_matmul is not None:
                return _swiglu(functools.partial(self.float8_matmul, counts=counts), x, w1, w2, w3)
            if x.dtype == torch.bfloat16:  # what CUDA runs; PyTorch's CPU kernel takes bf16 too
                return _grouped_mm_swiglu(x, counts, w1, w2, w3)
            return _looped_swiglu(x, counts, w1, w2, w3)


def _looped_swiglu(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """One SwiGLU per expert on its block of rows. ``counts.tolist()`` gives data-dependent
    block sizes: unbacked symbols under fake tracing, so the graph stays valid for any routing."""
    # unbind (not w[e]): its backward stacks the E expert grads in one op, where indexing
    # would build and add up E full-size [E, ...] gradients.
    outs = []
    for rows, a, b, c in zip(torch.split(x, counts.tolist()), w1.unbind(0), w2.unbind(0), w3.unbind(0), strict=True):
        outs.append(F.linear(F.silu(F.linear(rows, a)) * F.linear(rows, c), b))
    return torch.cat(outs)


def _swiglu(matmul: Callable, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """SwiGLU of every expert on its rows, with ``matmul(rows, w)`` = each block times its ``w[e]``ᵀ."""
    return matmul(F.silu(matmul(x, w1)) * matmul(x, w3), w2)


def _grouped_mm_swiglu(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """All experts in three ``torch._grouped_mm`` calls (row blocks ending at the cumulative counts).

    The bf16 path on every device (what H100s run; on CPU, ``torch._grouped_mm`` takes only bf16);
    fp32 runs the per-expert loop. On H100 the kernel wants 16-byte aligned strides (dim and
    hidden multiples of 8).
    """
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = F.silu(grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
    h = h * grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
    return grouped_mm(h, w2.transpose(-2, -1), offs=offsets).type_as(x)


class MoE(nn.Module):
    """Routed experts (top-k of E) plus always-on shared experts.

    Buffers: ``expert_bias`` [E] float32, PERSISTENT (load-balancing state, part of the state
    dict) and ``tokens_per_expert`` [E] float32, non-persistent: routed (token, slot) pairs
    per expert accumulated by every forward since the last ``DeepSeekV3.update_expert_bias``.
    """

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        self.num_experts = args.n_routed_experts
        self.router = Router(args)
        self.experts = GroupedExperts(args.dim, args.moe_inter_dim, args.n_routed_experts)
        self.shared_experts = (
            FeedForward(args.dim, args.moe_inter_dim * args.n_shared_experts) if args.n_shared_experts > 0 else None
        )
        self.token_dispatcher = LocalTokenDispatcher()
        self.register_buffer("expert_bias", torch.zeros(args.n_routed_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_routed_experts), persistent=False)

    def init_buffers(self, device: torch.device | str) -> None:
        """Fresh load-balancing state on ``device``: zero bias, zero counts."""
        self.expert_bias = torch.zeros(self.num_experts, device=device)
        self.tokens_per_expert = torch.zeros(self.num_experts, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [T, dim]
        # 1. route
        ids, weights = self.router(tokens, self.expert_bias)  # [T, k] each
        top_k = ids.shape[1]
        slot_expert = ids.reshape(-1)  # slot t*k + j of token t
        # 2. sort the T*k slots by expert (stable: within an expert, token order) and count
        # them with a fixed-length op (bincount's output length would be data-dependent).
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device).scatter_add(
            0, slot_expert, torch.ones_like(slot_expert)
        )
        with torch.no_grad():
            self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))
        order = torch.argsort(slot_expert, stable=True)  # sorted position -> slot
        x_sorted = sorted_copies(tokens, order, top_k)  # [T*k, dim]: tokens.index_select(0, order // top_k)
        # 3. experts (through the dispatcher: the identity here, all_to_all under EP)
        y_sorted = self.experts_in_place(x_sorted, counts)
        # 4. un-sort into slot order, weight the k slots of each token and sum them
        y_slots = torch.zeros_like(y_sorted).index_copy(0, order, y_sorted).view(-1, top_k, shape[-1])
        out = (y_slots.float() * weights.unsqueeze(-1)).sum(dim=1).type_as(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view(shape)

    def experts_in_place(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert + counts [E] -> expert outputs in the same order:
        dispatch to the experts' owners, compute the local experts, combine back."""
        x_local, local_counts, ctx = self.token_dispatcher.dispatch(x_sorted, counts)
        y_local = self.experts(x_local, local_counts)
        return self.token_dispatcher.combine(y_local, ctx)


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


class DeepSeekV3(nn.Module):
    """DeepSeek-V3: token embedding, ``n_layers`` blocks, final RMSNorm, untied output projection.

    Buffers: ``rope_cache`` [max_seq_len, qk_rope_head_dim] float32, non-persistent (a pure
    function of the args; cos | sin halves as in llama3), and per MoE block ``expert_bias``
    (persistent) and ``tokens_per_expert`` (non-persistent). After building on the meta device
    and ``to_empty``, call ``init_buffers(device)``. Cast parameters, not the whole module, to
    lower precision (the RoPE table and the balancing buffers stay float32).
    """

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        self.args = args
        self.sequence_shards = 1
        """Pieces each rank's hidden state splits the sequence into (tensor parallel's degree under
        sequence parallel, set by the parallelize function): a pipeline stage without the embedding
        takes [B, S / sequence_shards, dim]."""
        self.sequence_layout = SequenceLayout()
        """What attention sees (``models.sequence``; set by the build)."""
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope_cache", torch.empty(args.max_seq_len, args.qk_rope_head_dim), persistent=False)
        self.init_buffers()

    def moe_layers(self) -> list[MoE]:
        return [block.moe for block in self.layers.values() if block.is_moe]

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute ``rope_cache`` and reset the MoE balancing buffers, on ``device``
        (default: where ``rope_cache`` lives now)."""
        if device is None:
            device = self.rope_cache.device
        self.rope_cache = rope_table(self.args, device=device)
        for moe in self.moe_layers():
            moe.init_buffers(device)

    def forward(
        self, tokens: torch.Tensor, head: Callable[[torch.Tensor, nn.Module], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """``tokens`` [B, S] int64 at positions 0..S-1 -> logits [B, S, vocab] in the output
        weight's dtype, or with ``head`` ``head(final normed hidden state, output module)``
        (see LLaMA-3). Also adds this batch's routing counts to every ``tokens_per_expert``."""
        return run_stack(self, tokens, head)

    @torch.no_grad()
    def update_expert_bias(self, all_reduce_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Aux-loss-free load balancing step; call it after the optimizer step, outside the graph.

        Stacks every MoE layer's ``tokens_per_expert`` into one [n_moe_layers, E] tensor, passes
        it through ``all_reduce_fn`` (which must return the SUM over the ranks whose batches
        differ, e.g. the data-parallel ranks; one collective for all layers), then per layer
        ``expert_bias += load_balance_coeff * sign(mean(counts) - counts)``: under-loaded
        experts become more attractive, over-loaded ones less. The counts are then zeroed.
        With ``load_balance_coeff`` None or 0 only the counts are zeroed. Every rank ends with
        the same bias as long as it started with the same bias.
        """
        moes = self.moe_layers()
        if not moes:
            return
        counts = torch.stack([moe.tokens_per_expert for moe in moes])
        if all_reduce_fn is not None:
            counts = all_reduce_fn(counts)
        coeff = self.args.load_balance_coeff
        for moe, layer_counts in zip(moes, counts, strict=True):
            if coeff:
                moe.expert_bias.add_(coeff * torch.sign(layer_counts.mean() - layer_counts))
            moe.tokens_per_expert.zero_()

    def init_rules(self) -> dict[str, InitRule]:
        """How every parameter (FQN of the unwrapped model) is initialised: ``models.common.stack_init_rules``,
        as in llama3. Norms (incl. q_norm, kv_norm) ones; projections reading the residual stream or a
        latent (wq, wq_a, wq_b, wkv_a, wkv_b, the w1 of every FFN/expert) at the base std; projections
        writing into the residual stream plus w3 (wo, w2, w3 of dense FFN, shared and routed experts)
        depth-scaled. The router gate uses the flat base std: it produces routing logits, not a
        residual update, so depth scaling would only make early routing more uniform in deep layers.
        Stacked expert weights are drawn as one [E, ...] tensor, so the draw does not depend on
        expert sharding."""
        return stack_init_rules(self, _block_init_rules)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise a plain (unsharded, materialised) model in place from ``seed``, exactly as
        the trainer does before sharding (each parameter from a generator seeded by
        ``stable_seed(seed, fqn)``), then fill / reset the buffers."""
        init_plain_parameters(self, self.init_rules(), seed)
        self.init_buffers(self.output.weight.device)


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
    "GroupedExperts",
    "LocalTokenDispatcher",
    "MoE",
    "Router",
    "TransformerBlock",
    "rope_table",
    "yarn_frequencies",
]
