"""Tiny DeepSeek-V3 shapes and helpers shared by the model and MoE tests."""

import dataclasses

import torch

from models.deepseek_v3.flavors import FLAVORS
from models.deepseek_v3.model import DeepSeekV3

# dim 64, 2 layers (1 dense + 1 MoE), 4 experts top-2, softmax, plain wq.
TINY = dataclasses.replace(
    FLAVORS["debugmodel"],
    dim=64,
    n_layers=2,
    n_dense_layers=1,
    n_heads=4,
    vocab_size=128,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    inter_dim=128,
    moe_inter_dim=32,
    n_routed_experts=4,
    n_shared_experts=1,
    n_activated_experts=2,
    max_seq_len=64,
)
# The 671B-style variant: low-rank q, sigmoid scores, 8 experts in 4 groups (2 kept), top-3,
# normalised weights times 2.5, no shared experts, 2 MoE layers.
TINY_V3 = dataclasses.replace(
    TINY,
    n_layers=3,
    q_lora_rank=24,
    score_func="sigmoid",
    n_routed_experts=8,
    n_activated_experts=3,
    n_expert_groups=4,
    n_limited_groups=2,
    route_scale=2.5,
    route_norm=True,
    n_shared_experts=0,
)


def tiny_model(args=TINY, seed=0):
    model = DeepSeekV3(args)
    model.init_weights(seed)
    return model


def tiny_batch(args=TINY, batch=2, seq=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def expert_counts(model):
    return torch.stack([m.tokens_per_expert.clone() for m in model.moe_layers()])
