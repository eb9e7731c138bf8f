"""DeepSeek-V3 MoE: routing (softmax and grouped sigmoid), the token counts and expert-bias
load balancing, the token-dispatcher contract and the grouped experts."""

import dataclasses

import pytest
import torch

from models.moe import (
    GroupedExperts,
    LocalTokenDispatcher,
    Router,
    _grouped_mm_swiglu,
    _looped_swiglu,
)
from tests.deepseek_v3_tiny import TINY, TINY_V3, tiny_batch, tiny_model

# --------------------------------------------------------------------------------------
# Routing and load balancing


def _router(args, seed=0):
    router = Router(args)
    torch.nn.init.normal_(router.gate.weight, std=0.5, generator=torch.Generator().manual_seed(seed))
    return router


def test_grouped_routing_picks_experts_in_the_best_groups():
    args = TINY_V3  # 8 experts, 4 groups of 2, 2 groups kept, top-3, sigmoid, route_norm, scale 2.5
    router = _router(args)
    x = torch.randn(200, args.dim, generator=torch.Generator().manual_seed(1))
    bias = torch.linspace(-0.2, 0.2, 8)
    with torch.no_grad():
        ids, weights = router(x, bias)
        scores = router.gate(x).float().sigmoid()
    assert ids.shape == weights.shape == (200, 3)
    biased = (scores + bias).view(200, 4, 2)
    best_groups = biased.sum(-1).topk(2, dim=-1).indices  # a group's top-2 of 2 = its sum
    for t in range(200):
        allowed = {2 * g + j for g in best_groups[t].tolist() for j in (0, 1)}
        assert set(ids[t].tolist()) <= allowed and len(set(ids[t].tolist())) == 3
    # The weights are the UNBIASED scores, normalised over the k, times route_scale.
    picked = scores.gather(1, ids)
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True) * 2.5)
    torch.testing.assert_close(weights.sum(-1), torch.full((200,), 2.5))


def test_expert_bias_changes_the_choice_not_the_weights():
    router = _router(TINY)  # softmax, 4 experts, top-2, no groups
    x = torch.randn(64, TINY.dim, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        scores = router.gate(x).float().softmax(-1)
        ids, weights = router(x, torch.zeros(4))
        assert torch.equal(ids, scores.topk(2, dim=-1).indices)
        ids_b, weights_b = router(x, torch.tensor([0.0, 0.0, 0.0, 10.0]))
    assert (ids_b == 3).any(-1).all()  # every token now takes expert 3 ...
    assert torch.equal(weights_b, scores.gather(1, ids_b))  # ... weighted by its unbiased score
    assert torch.equal(weights, scores.gather(1, ids))
    # The gate gets gradients through the weights; the bias is never differentiated.
    bias = torch.zeros(4, requires_grad=True)
    _, w = router(x, bias)
    w.sum().backward()
    assert router.gate.weight.grad is not None and bias.grad is None


def test_token_counts_accumulate_in_the_buffer():
    model = tiny_model()
    tokens, _ = tiny_batch()
    moe = model.layers["1"].moe
    seen = []
    moe.router.register_forward_hook(lambda mod, inp, out: seen.append(out[0].flatten()))
    with torch.no_grad():
        model(tokens)
        first = moe.tokens_per_expert.clone()
        model(tokens)
    assert torch.equal(first, torch.bincount(seen[0], minlength=4).float())
    assert first.sum() == 2 * 16 * 2  # tokens x top-k
    assert torch.equal(moe.tokens_per_expert, 2 * first)


def test_update_expert_bias_moves_toward_balance():
    args = dataclasses.replace(TINY, load_balance_coeff=0.01)
    model = tiny_model(args)
    tokens, _ = tiny_batch(args, batch=4, seq=32)
    moe = model.layers["1"].moe
    moe.expert_bias.copy_(torch.tensor([0.3, 0.2, 0.0, 0.0]))  # experts 0 and 1 take everything
    calls = []

    def all_reduce(t):  # a stand-in for the sum over 2 identical ranks
        calls.append(t.shape)
        return t * 2

    def imbalance():
        with torch.no_grad():
            model(tokens)
        c = moe.tokens_per_expert
        return (c.max() - c.min()).item()

    start = imbalance()
    counts = moe.tokens_per_expert.clone()
    model.update_expert_bias(all_reduce)
    assert calls == [torch.Size([1, 4])]  # one collective for all MoE layers
    assert not moe.tokens_per_expert.any()
    expected = torch.tensor([0.3, 0.2, 0.0, 0.0]) + 0.01 * torch.sign(2 * counts.mean() - 2 * counts)
    assert torch.equal(moe.expert_bias, expected)
    for _ in range(30):
        imbalance()
        model.update_expert_bias()
    assert start == 4 * 32 and imbalance() < start / 4  # 128 vs 0 tokens -> within ~10
    # Disabled balancing: only the counts are reset.
    frozen = tiny_model(dataclasses.replace(TINY, load_balance_coeff=None))
    with torch.no_grad():
        frozen(tokens)
    frozen.update_expert_bias()
    assert not frozen.layers["1"].moe.expert_bias.any() and not frozen.layers["1"].moe.tokens_per_expert.any()


# --------------------------------------------------------------------------------------
# Experts and the dispatcher contract


def test_local_token_dispatcher_is_the_identity():
    d = LocalTokenDispatcher()
    x, counts = torch.randn(6, 4), torch.tensor([2, 0, 4])
    x_local, local_counts, ctx = d.dispatch(x, counts)
    assert x_local is x and local_counts is counts and ctx is None
    y = torch.randn(6, 4)
    assert d.combine(y, ctx) is y


class _TwoRankDispatcher:
    """Simulates expert parallel over 2 "ranks" in one process: this rank owns the first half
    of the experts; the second half is computed by a stand-in for the remote rank."""

    def __init__(self, remote_experts):
        self.remote = remote_experts
        self.calls = 0

    def dispatch(self, x_sorted, counts):
        self.calls += 1
        half = counts.shape[0] // 2
        n_local = int(counts[:half].sum())
        remote_out = self.remote(x_sorted[n_local:], counts[half:])
        return x_sorted[:n_local], counts[:half], remote_out

    def combine(self, y_local, ctx):
        return torch.cat([y_local, ctx])


def test_moe_runs_through_a_dispatcher_with_a_local_slice_of_experts():
    model = tiny_model()
    tokens, _ = tiny_batch()
    moe = model.layers["1"].moe
    with torch.no_grad():
        reference = model(tokens)
        local, remote = GroupedExperts(64, 32, 2), GroupedExperts(64, 32, 2)
        for name in ("w1", "w2", "w3"):
            full = getattr(moe.experts, name)
            getattr(local, name).copy_(full[:2])
            getattr(remote, name).copy_(full[2:])
        moe.experts = local  # this "rank" holds experts 0 and 1 only (w1.shape[0] == 2)
        moe.token_dispatcher = _TwoRankDispatcher(remote)
        sliced = model(tokens)
    assert moe.token_dispatcher.calls == 1
    assert torch.equal(sliced, reference)


def test_grouped_experts_checks_counts_and_grouped_mm_matches_loop():
    experts = GroupedExperts(16, 32, 3)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.1, generator=torch.Generator().manual_seed(0))
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="3 \\(local\\) experts"):
        experts(x, torch.tensor([5, 5]))
    counts = torch.tensor([3, 0, 7])
    loop = _looped_swiglu(x, counts, experts.w1, experts.w2, experts.w3)
    assert torch.equal(experts(x, counts), loop)
    # bf16 (on CUDA or CPU) takes the grouped_mm path: the same function, to bf16 rounding.
    bf = [t.detach().to(torch.bfloat16) for t in (x, experts.w1, experts.w2, experts.w3)]
    grouped = _grouped_mm_swiglu(bf[0], counts, *bf[1:])
    torch.testing.assert_close(grouped.float(), loop.detach(), rtol=3e-2, atol=3e-3)
    assert torch.equal(experts.to(torch.bfloat16)(bf[0], counts), grouped)


# --------------------------------------------------------------------------------------
# The traced step
