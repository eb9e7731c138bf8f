"""DeepSeek-V3 model: sizes of every flavor, names and init rules, YaRN RoPE, causality, the traced
step bitwise equal to eager (also on a second routing through the same graph), validation and
the registry entry. The MoE's own tests are in test_deepseek_v3_moe.py."""

import dataclasses
import math

import pytest
import torch

from graph_trainer.compiler.tracer import GraphStep, eager_step
from graph_trainer.config_loading import load_config
from graph_trainer.distributed.parallel_dims import ParallelDims
from graph_trainer.distributed.simple_fsdp import MixedPrecision
from graph_trainer.errors import ConfigError
from graph_trainer.graph import tags
from graph_trainer.validation import validate_config
from models.common import InitRule
from models.deepseek_v3.flavors import FLAVORS, DeepSeekV3Args, flops_per_token, num_params
from models.deepseek_v3.model import (
    DeepSeekV3,
    yarn_frequencies,
)
from models.deepseek_v3.parallelize import parallelize_deepseek_v3, validate_parallelism
from models.registry import MODEL_SPECS
from tests.conftest import ROOT
from tests.deepseek_v3_tiny import TINY, TINY_V3, expert_counts, tiny_batch, tiny_model

EXPECTED_PARAMS = {"debugmodel": 33_014_016, "16B": 15_706_484_224, "671B": 671_026_404_352}

# --------------------------------------------------------------------------------------
# Sizes, names, init


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_parameter_counts_on_meta(name):
    args = FLAVORS[name]
    with torch.device("meta"):
        model = DeepSeekV3(args)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == EXPECTED_PARAMS[name] == num_params(args)
    embedding = model.tok_embeddings.weight.numel()
    assert num_params(args, exclude_embedding=True) == counted - embedding
    idle_experts = args.n_moe_layers * (args.n_routed_experts - args.n_activated_experts)
    assert num_params(args, exclude_embedding=True, active_only=True) == (
        counted - embedding - idle_experts * 3 * args.dim * args.moe_inter_dim
    )


def test_flops_per_token_counts_active_experts():
    args, seq = FLAVORS["16B"], 4096
    active = num_params(args, exclude_embedding=True, active_only=True)
    attention = 6 * args.n_layers * args.n_heads * (192 + 128) * seq
    assert flops_per_token(args, seq) == 6 * active + attention
    # DeepSeek-V2-Lite-sized: ~2.4B active parameters of 15.7B (embeddings excluded ~2.2B).
    assert 2.0e9 < active < 2.6e9


def test_parameter_names_buffers_and_init_rules():
    with torch.device("meta"):
        model = DeepSeekV3(TINY)
        v3 = DeepSeekV3(TINY_V3)
    names = {name for name, _ in model.named_parameters()}
    attention = {f"layers.{i}.attention.{p}.weight" for i in (0, 1) for p in ("wq", "wkv_a", "kv_norm", "wkv_b", "wo")}
    dense = {
        f"layers.0.{p}.weight"
        for p in ("attention_norm", "ffn_norm", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    }
    moe = {
        "layers.1.attention_norm.weight",
        "layers.1.ffn_norm.weight",
        "layers.1.moe.router.gate.weight",
        "layers.1.moe.experts.w1",
        "layers.1.moe.experts.w2",
        "layers.1.moe.experts.w3",
        "layers.1.moe.shared_experts.w1.weight",
        "layers.1.moe.shared_experts.w2.weight",
        "layers.1.moe.shared_experts.w3.weight",
    }
    assert names == attention | dense | moe | {"tok_embeddings.weight", "norm.weight", "output.weight"}
    assert dict(model.named_parameters())["layers.1.moe.experts.w2"].shape == (4, 64, 32)
    assert dict(model.named_parameters())["layers.1.moe.experts.w1"].shape == (4, 32, 64)
    v3_names = {name for name, _ in v3.named_parameters()}
    assert {
        "layers.2.attention.wq_a.weight",
        "layers.2.attention.q_norm.weight",
        "layers.2.attention.wq_b.weight",
    } <= v3_names
    assert not any(".wq." in n or "shared_experts" in n for n in v3_names)

    buffers = dict(model.named_buffers())
    assert {"rope_cache", "layers.1.moe.expert_bias", "layers.1.moe.tokens_per_expert"} == set(buffers)
    state = model.state_dict()
    assert "layers.1.moe.expert_bias" in state  # persistent: load-balancing state
    assert "rope_cache" not in state and "layers.1.moe.tokens_per_expert" not in state

    for m in (model, v3):
        rules = m.init_rules()
        assert set(rules) == {name for name, _ in m.named_parameters()}
    rules = model.init_rules()
    assert rules["tok_embeddings.weight"] == InitRule("normal", std=1.0)
    assert rules["layers.1.moe.router.gate.weight"] == InitRule("trunc_normal", std=0.02)
    assert rules["layers.1.moe.experts.w2"].std == pytest.approx(0.02 / math.sqrt(4))
    assert rules["layers.0.attention.wo.weight"].std == pytest.approx(0.02 / math.sqrt(2))
    assert rules["layers.1.attention.kv_norm.weight"].kind == "ones"


def test_init_is_deterministic_and_meta_init_equals_cpu_init():
    with torch.device("meta"):
        meta_model = DeepSeekV3(TINY)
    meta_model.to_empty(device="cpu")
    meta_model.init_weights(3)
    cpu_model = tiny_model(seed=3)
    other = tiny_model(seed=4)
    pm, pc, po = (dict(m.named_parameters()) for m in (meta_model, cpu_model, other))
    assert all(torch.equal(pm[k], pc[k]) for k in pc)
    assert all(not torch.equal(pc[k], po[k]) for k in pc if not k.endswith("norm.weight"))
    for name, buf in cpu_model.named_buffers():
        assert torch.equal(dict(meta_model.named_buffers())[name], buf), name
    assert not meta_model.layers["1"].moe.expert_bias.any()
    tokens = torch.randint(0, TINY.vocab_size, (1, 8))
    with torch.no_grad():
        assert torch.equal(meta_model(tokens), cpu_model(tokens))


def test_args_validation():
    with pytest.raises(ValueError, match="n_activated_experts"):
        dataclasses.replace(TINY, n_activated_experts=5)
    with pytest.raises(ValueError, match="n_expert_groups"):
        dataclasses.replace(TINY, n_expert_groups=3)
    with pytest.raises(ValueError, match="n_limited_groups"):
        dataclasses.replace(TINY, n_expert_groups=2, n_limited_groups=3)
    with pytest.raises(ValueError, match="score_func"):
        dataclasses.replace(TINY, score_func="relu")
    with pytest.raises(ValueError, match="limited groups"):  # top-3 of 1 group of 2 experts
        dataclasses.replace(TINY, n_routed_experts=8, n_activated_experts=3, n_expert_groups=4, n_limited_groups=1)


# --------------------------------------------------------------------------------------
# RoPE / attention


def test_yarn_frequencies_and_softmax_scale():
    args = FLAVORS["debugmodel"]
    plain = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    yarn = yarn_frequencies(args)
    assert torch.equal(yarn_frequencies(dataclasses.replace(args, rope_factor=1.0)), plain)
    # Fast-rotating dims (>= 32 turns over 4096 positions) are kept, slow ones (< 1 turn)
    # slowed down 40x, the ramp in between is monotone.
    turns = 4096 * plain / (2 * math.pi)
    assert torch.equal(yarn[turns > 32], plain[turns > 32]) and (turns > 32).sum() >= 8
    torch.testing.assert_close(yarn[turns < 1], plain[turns < 1] / 40, rtol=1e-12, atol=0)
    ratio = yarn / plain
    assert (ratio[1:] <= ratio[:-1] + 1e-12).all()
    m = 0.1 * 0.70 * math.log(40.0) + 1.0
    assert args.softmax_scale == pytest.approx(192**-0.5 * m * m)
    assert dataclasses.replace(args, rope_factor=1.0).softmax_scale == pytest.approx(192**-0.5)


@pytest.mark.parametrize("args", [TINY, TINY_V3], ids=["softmax", "sigmoid_grouped_qlora"])
def test_forward_shape_finite_and_causal(args):
    model = tiny_model(args)
    tokens = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens)
        assert logits.shape == (2, 12, args.vocab_size) and logits.dtype == torch.float32
        assert torch.isfinite(logits).all()
        t = 5
        changed = tokens.clone()
        changed[:, t] = (changed[:, t] + 1) % args.vocab_size
        other = model(changed)
    assert torch.equal(logits[:, :t], other[:, :t])
    assert (logits[:, t:] != other[:, t:]).flatten(2).any(-1).all()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, args.max_seq_len + 1, dtype=torch.long))


@pytest.mark.parametrize("args", [TINY, TINY_V3], ids=["softmax", "sigmoid_grouped_qlora"])
def test_graph_matches_eager_bitwise_on_new_routings(args):
    model = tiny_model(args)
    graph_step = GraphStep(model)
    for seed in (1, 2):  # the second batch routes differently, through the SAME graph
        tokens, labels = tiny_batch(args, seed=seed)
        before = expert_counts(model)
        loss, grads = graph_step(tokens, labels)
        graph_counts = expert_counts(model) - before
        ref_loss, ref_grads = eager_step(model, tokens, labels)
        eager_counts = expert_counts(model) - before - graph_counts
        assert len(graph_step.graphs) == 1
        assert torch.equal(loss, ref_loss)
        assert len(grads) == len(ref_grads) == len(list(model.parameters()))
        for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads, strict=True):
            assert torch.equal(g, r), name
        # The graph's in-place buffer add counted exactly what eager counted.
        assert torch.equal(graph_counts, eager_counts) and graph_counts.sum() > 0
        if seed == 1:
            first_counts = graph_counts
    assert not torch.equal(first_counts, graph_counts)  # the routing really changed

    gm = graph_step.get(tokens, labels).gm
    nodes = list(gm.graph.nodes)
    # Expert sizes are data-dependent scalars read inside the graph, not constants baked in.
    n_moe = args.n_moe_layers
    assert sum(n.target == torch.ops.aten._local_scalar_dense.default for n in nodes) == n_moe * args.n_routed_experts
    expert_nodes = [n for n in nodes if tags.get(n, "ep_role") == "expert_compute"]
    assert expert_nodes and {tags.get(n, "module_fqn") for n in expert_nodes if tags.get(n, "phase") == "forward"} == {
        f"layers.{i}.moe.experts" for i in range(args.n_dense_layers, args.n_layers)
    }
    adds = [n for n in nodes if n.target == torch.ops.aten.add_.Tensor]
    assert {tags.get(a.args[0], "input_fqn") for a in adds} == {
        f"layers.{i}.moe.tokens_per_expert" for i in range(args.n_dense_layers, args.n_layers)
    }


# --------------------------------------------------------------------------------------
# Parallel layouts and the registry


def test_validate_and_parallelize_errors():
    args = FLAVORS["debugmodel"]
    degrees = {"dp_replicate": 1, "dp_shard": 4, "tp": 1, "ep": 1}
    validate_parallelism(args, degrees)
    validate_parallelism(args, {**degrees, "ep": 4})
    with pytest.raises(ConfigError, match="does not divide the model's n_routed_experts"):
        validate_parallelism(args, {**degrees, "ep": 3})
    with pytest.raises(ConfigError, match="does not divide the model's n_heads"):
        validate_parallelism(args, {**degrees, "tp": 3})
    validate_parallelism(args, {**degrees, "tp": 2})  # tensor parallel: tests/models/test_deepseek_v3_tp.py
    with torch.device("meta"):
        model = DeepSeekV3(TINY)
    assert parallelize_deepseek_v3(model, None, ParallelDims(), MixedPrecision()) is model


def test_registry_entry():
    spec = MODEL_SPECS["deepseek_v3"]
    assert spec.flavors is FLAVORS and spec.build is DeepSeekV3
    assert set(spec.flavors) == {"debugmodel", "debugmodel_v3", "16B", "671B"}
    assert all(isinstance(a, DeepSeekV3Args) for a in spec.flavors.values())
    with torch.device("meta"):
        model = spec.build(TINY)
    assert spec.bucket_plan(model) == [["tok_embeddings"], ["layers.0"], ["layers.1"], ["norm", "output"]]
    assert spec.flops_per_token is flops_per_token
    # MFU of the debug model: 6 FLOPs per active weight (counted on the built model: all but the
    # embedding and the experts a token does not visit) plus 6 * n_heads * (qk + v head dims) * seq
    # per layer for attention's score and value matmuls.
    args, seq = FLAVORS["debugmodel"], 128
    with torch.device("meta"):
        debug = spec.build(args)
    idle = [
        p.numel() * (args.n_routed_experts - args.n_activated_experts) // args.n_routed_experts
        for name, p in debug.named_parameters()
        if ".moe.experts." in name
    ]
    active = sum(p.numel() for p in debug.parameters()) - debug.tok_embeddings.weight.numel() - sum(idle)
    head_dims = args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim
    assert spec.flops_per_token(args, seq) == 6 * active + 6 * args.n_layers * args.n_heads * head_dims * seq


def test_debug_config_validates():
    cfg = load_config(["--job.config_file", f"{ROOT}/configs/deepseek_v3_debug.toml"])
    validate_config(cfg, world_size=1)
    assert (cfg.model.name, cfg.model.flavor) == ("deepseek_v3", "debugmodel")
