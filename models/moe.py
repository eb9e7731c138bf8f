"""The mixture-of-experts layer both MoE families share, written to be traced into one aten graph.

``MoE`` routes every token to its top-k experts (``Router``), sorts the (token, slot) pairs by
expert, runs the experts on contiguous row blocks whose sizes are data-dependent
(``counts.tolist()``: unbacked symbols in the fake trace, so one graph serves every routing), then
un-sorts the outputs and sums each token's k slots with its routing weights, in float32. Expert
parallelism plugs in as ``MoE.token_dispatcher`` (the contract: ``LocalTokenDispatcher``;
``models.moe_parallel`` installs the all_to_all one).

A family's arguments object gives the MoE its shape and routing by these fields: ``dim``,
``moe_inter_dim`` (one expert's hidden size), ``n_routed_experts``, ``n_activated_experts``
(top-k), ``n_shared_experts`` (0: none), ``score_func`` ("softmax" or "sigmoid"),
``n_expert_groups`` / ``n_limited_groups`` (group-limited routing; 1 / 1: none), ``route_norm``
(renormalise the top-k weights), ``route_scale``.

Load balancing by expert bias (DeepSeek-V3's auxiliary-loss-free method) is a choice of the family
(``MoE(args, bias_balancing=...)``): with it, a persistent ``expert_bias`` steers only the top-k
choice and the forward counts tokens per expert into ``tokens_per_expert`` (an in-place buffer add,
recorded in the traced graph), which ``update_expert_bias`` turns into a bias update between steps.
Without it the routing is the plain top-k of the scores and the layer holds no buffer.

Graph metadata: the experts' matmuls are tagged ``ep_role`` expert_compute (the dispatcher tags
its exchanges; ``graph_trainer.graph.tags``). Numerics: the sort and un-sort are exact
permutations (``models.common.sorted_copies``: a gather both ways, no scatter-add), so a layout
that splits the experts computes each token's rows as one process does. A dispatcher that hands
the experts counts for another number of experts than they hold raises ``ValueError``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from graph_trainer.graph.tags import EP_ROLE, EXPERT_COMPUTE, annotate
from graph_trainer.torch_compat import grouped_mm
from models.common import FeedForward, sorted_copies


class Router(nn.Module):
    """Top-k routing with optional group limits; a bias steers the choice, not the weights.

    scores = softmax (over experts) or sigmoid of ``gate(x)``, in float32. The choice uses
    ``scores + expert_bias`` (the scores alone when the layer has no bias): with
    ``n_expert_groups > 1`` each group is rated by the sum of its two best biased scores
    (DeepSeek-V3), only the best ``n_limited_groups`` groups stay eligible, then the top-k experts
    among them are taken. The weights are the UNBIASED
    scores of the chosen experts, optionally normalised to sum 1 (``route_norm``), times
    ``route_scale``. Gradients reach ``gate`` through the weights only.
    """

    def __init__(self, args):
        super().__init__()
        self.gate = nn.Linear(args.dim, args.n_routed_experts, bias=False)
        self.top_k = args.n_activated_experts
        self.score_func = args.score_func
        self.n_groups = args.n_expert_groups
        self.n_limited_groups = args.n_limited_groups
        self.route_scale = args.route_scale
        self.route_norm = args.route_norm

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [T, dim] -> (expert ids [T, k] int64, weights [T, k] float32)."""
        logits = self.gate(x).float()
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        with torch.no_grad():
            choice = scores if expert_bias is None else scores + expert_bias
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
    """Routed experts (top-k of E), plus always-on shared experts when ``args.n_shared_experts`` > 0.

    With ``bias_balancing`` (module docstring), buffers: ``expert_bias`` [E] float32, PERSISTENT
    (load-balancing state, part of the state dict) and ``tokens_per_expert`` [E] float32,
    non-persistent: routed (token, slot) pairs per expert accumulated by every forward since the
    last ``update_expert_bias``. Without it, none.
    """

    def __init__(self, args, bias_balancing: bool = True):
        super().__init__()
        self.num_experts = args.n_routed_experts
        self.bias_balancing = bias_balancing
        self.router = Router(args)
        self.experts = GroupedExperts(args.dim, args.moe_inter_dim, args.n_routed_experts)
        self.shared_experts = (
            FeedForward(args.dim, args.moe_inter_dim * args.n_shared_experts) if args.n_shared_experts > 0 else None
        )
        self.token_dispatcher = LocalTokenDispatcher()
        if bias_balancing:
            self.register_buffer("expert_bias", torch.zeros(args.n_routed_experts), persistent=True)
            self.register_buffer("tokens_per_expert", torch.zeros(args.n_routed_experts), persistent=False)

    def init_buffers(self, device: torch.device | str) -> None:
        """Fresh load-balancing state on ``device``: zero bias, zero counts (nothing without bias balancing)."""
        if self.bias_balancing:
            self.expert_bias = torch.zeros(self.num_experts, device=device)
            self.tokens_per_expert = torch.zeros(self.num_experts, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [T, dim]
        # 1. route
        ids, weights = self.router(tokens, self.expert_bias if self.bias_balancing else None)  # [T, k] each
        top_k = ids.shape[1]
        slot_expert = ids.reshape(-1)  # slot t*k + j of token t
        # 2. sort the T*k slots by expert (stable: within an expert, token order) and count
        # them with a fixed-length op (bincount's output length would be data-dependent).
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device).scatter_add(
            0, slot_expert, torch.ones_like(slot_expert)
        )
        if self.bias_balancing:
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


@torch.no_grad()
def update_expert_bias(
    moes: list[MoE], coeff: float | None, all_reduce_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> None:
    """Auxiliary-loss-free load balancing step over a model's MoE layers (those with bias
    balancing); call it after the optimizer step, outside the graph.

    Stacks every layer's ``tokens_per_expert`` into one [n_moe_layers, E] tensor, passes it through
    ``all_reduce_fn`` (which must return the SUM over the ranks whose batches differ, e.g. the
    data-parallel ranks; one collective for all layers), then per layer
    ``expert_bias += coeff * sign(mean(counts) - counts)``: under-loaded experts become more
    attractive, over-loaded ones less. The counts are then zeroed. With ``coeff`` None or 0 only the
    counts are zeroed. Every rank ends with the same bias as long as it started with the same bias.
    """
    moes = [moe for moe in moes if moe.bias_balancing]
    if not moes:
        return
    counts = torch.stack([moe.tokens_per_expert for moe in moes])
    if all_reduce_fn is not None:
        counts = all_reduce_fn(counts)
    for moe, layer_counts in zip(moes, counts, strict=True):
        if coeff:
            moe.expert_bias.add_(coeff * torch.sign(layer_counts.mean() - layer_counts))
        moe.tokens_per_expert.zero_()


__all__ = ["GroupedExperts", "LocalTokenDispatcher", "MoE", "Router", "update_expert_bias"]
