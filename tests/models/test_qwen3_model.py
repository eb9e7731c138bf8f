"""Qwen3 model, dense (``qwen3``) and MoE (``qwen3_moe``): every flavor's size against the model built
on meta and against the published sizes, FLOPs per token, QK-norm per head and before RoPE with a head
size of its own, the output tied to the embedding, the MoE layer routing as Hugging Face's (no
balancing state), the layouts ``validate_parallelism`` refuses (one line each), and the QK norms'
gradients under TP=2 on gloo against one process on the same batch."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from graph_trainer.build import build_job_model, build_layout
from graph_trainer.config_loading import load_config
from graph_trainer.distributed.simple_fsdp import clean_fqn
from graph_trainer.errors import ConfigError
from graph_trainer.fake_trace import fake_world
from graph_trainer.loop.grad_record import compare_records, load_record, record_path
from graph_trainer.validation import validate_config
from models.common import ONES, apply_rope
from models.qwen3.flavors import FLAVORS, MOE_FLAVORS, Qwen3Args, flops_per_token, num_params
from models.qwen3.model import Qwen3
from models.qwen3.parallelize import validate_parallelism
from models.registry import MODEL_SPECS
from models.sequence import repeat_kv
from suites.cases import GRAD_RTOL, debug_job
from tests.conftest import ROOT
from tests.launch import run_forked
from tests.reliability.helpers import train_py

DENSE_CONFIG = os.path.join(ROOT, "configs/qwen3_debug.toml")
MOE_CONFIG = os.path.join(ROOT, "configs/qwen3_moe_debug.toml")

TINY = Qwen3Args(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, head_dim=32, ffn_hidden=96, max_seq_len=64
)
"""4 heads of 32 (128 features) over a 64-wide stream: the head size is not dim / n_heads."""
TINY_TIED = dataclasses.replace(TINY, tie_embeddings=True)
TINY_MOE = dataclasses.replace(TINY, ffn_hidden=0, n_routed_experts=4, n_activated_experts=2, moe_inter_dim=48)

EVERY_FLAVOR = [("qwen3", name) for name in FLAVORS] + [("qwen3_moe", name) for name in MOE_FLAVORS]

# Published sizes, in billions, at the precision they are printed (the Qwen3 model cards and the
# Hugging Face Hub's counts of the released safetensors files): total parameters, and without the
# embedding table and the output projection ("non-embedding": the tied one counted once) or, for
# the MoE releases, the parameters a token activates (embedding and output included).
PUBLISHED_DENSE = {"0.6B": (0.596, 0.44), "8B": (8.19, 6.95), "32B": (32.76, 31.21)}
PUBLISHED_MOE = {"30B-A3B": (30.53, 3.35), "235B-A22B": (235.09, 22.19)}


def _flavor(model_name: str, name: str) -> Qwen3Args:
    return MODEL_SPECS[model_name].flavors[name]


def _meta(args: Qwen3Args) -> Qwen3:
    with torch.device("meta"):
        return Qwen3(args)


def _billions(n: int, printed: float) -> float:
    """``n`` in billions, rounded to as many decimals as ``printed`` shows."""
    decimals = len(repr(printed).split(".")[1])
    return round(n / 1e9, decimals)


def _idle_expert_params(model: Qwen3) -> int:
    """Parameters of the built model a token does not multiply by: E - k of every block's E stacked experts."""
    args = model.args
    return sum(
        p.numel() * (args.n_routed_experts - args.n_activated_experts) // args.n_routed_experts
        for name, p in model.named_parameters()
        if ".moe.experts." in name
    )


# --------------------------------------------------------------------------------------
# Sizes and FLOPs


@pytest.mark.parametrize("model_name, name", EVERY_FLAVOR)
def test_num_params_and_flops_count_the_model_built_on_meta(model_name, name):
    args = _flavor(model_name, name)
    model = _meta(args)
    counted = sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel()
    assert num_params(args) == counted
    # the output projection is a matmul, counted even when it computes with the embedding's weight
    assert num_params(args, exclude_embedding=True) == counted - (0 if args.tie_embeddings else embedding)
    assert num_params(args, active=True) == counted - _idle_expert_params(model)
    active_matmul = num_params(args, exclude_embedding=True, active=True)
    assert active_matmul == counted - (0 if args.tie_embeddings else embedding) - _idle_expert_params(model)
    seq = 4096
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq
    assert flops_per_token(args, seq) == 6 * active_matmul + attention
    assert MODEL_SPECS[model_name].flops_per_token(args, seq) == flops_per_token(args, seq)


@pytest.mark.parametrize("name", sorted(PUBLISHED_DENSE))
def test_dense_sizes_are_the_published_ones(name):
    args = FLAVORS[name]
    model = _meta(args)
    total = sum(p.numel() for p in model.parameters())
    matrices = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)  # embedding, output
    published_total, published_non_embedding = PUBLISHED_DENSE[name]
    assert _billions(total, published_total) == published_total
    assert _billions(total - matrices, published_non_embedding) == published_non_embedding
    assert args.tie_embeddings == (name == "0.6B")  # as the releases: tied up to 4B
    assert ("output.weight" in dict(model.named_parameters())) == (not args.tie_embeddings)


@pytest.mark.parametrize("name", sorted(PUBLISHED_MOE))
def test_moe_sizes_are_the_published_ones(name):
    args = MOE_FLAVORS[name]
    model = _meta(args)
    total = sum(p.numel() for p in model.parameters())
    published_total, published_active = PUBLISHED_MOE[name]
    assert _billions(total, published_total) == published_total
    assert _billions(total - _idle_expert_params(model), published_active) == published_active
    assert (args.n_routed_experts, args.n_activated_experts, args.n_shared_experts) == (128, 8, 0)


def test_registry_entries():
    dense, moe = MODEL_SPECS["qwen3"], MODEL_SPECS["qwen3_moe"]
    assert dense.flavors is FLAVORS and moe.flavors is MOE_FLAVORS and dense.build is moe.build is Qwen3
    assert set(FLAVORS) == {"debugmodel", "debugmodel_tied", "0.6B", "8B", "32B"}
    assert set(MOE_FLAVORS) == {"debugmodel", "30B-A3B", "235B-A22B"}
    assert not any(a.is_moe for a in FLAVORS.values()) and all(a.is_moe for a in MOE_FLAVORS.values())
    assert (dense.hf.model_type, moe.hf.model_type) == ("qwen3", "qwen3_moe")
    assert dense.bucket_plan(_meta(TINY)) == [["tok_embeddings"], ["layers.0"], ["layers.1"], ["norm", "output"]]


@pytest.mark.parametrize("config", [DENSE_CONFIG, MOE_CONFIG], ids=["qwen3", "qwen3_moe"])
def test_debug_configs_validate(config):
    cfg = load_config(["--job.config_file", config])
    validate_config(cfg, world_size=1)
    assert cfg.model.name == ("qwen3" if config == DENSE_CONFIG else "qwen3_moe")


# --------------------------------------------------------------------------------------
# Names, init, forward


@pytest.mark.parametrize("args", [TINY, TINY_TIED, TINY_MOE], ids=["dense", "tied", "moe"])
def test_parameter_names_shapes_and_init_rules(args):
    model = _meta(args)
    params = dict(model.named_parameters())
    block = {"attention.wq", "attention.wk", "attention.wv", "attention.wo", "attention.q_norm", "attention.k_norm"}
    block |= {"attention_norm", "ffn_norm"}
    block = {f"{b}.weight" for b in block}
    if args.is_moe:
        block |= {"moe.router.gate.weight", "moe.experts.w1", "moe.experts.w2", "moe.experts.w3"}
    else:
        block |= {f"feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
    expected = {f"layers.{i}.{b}" for i in range(args.n_layers) for b in block} | {
        "tok_embeddings.weight",
        "norm.weight",
    }
    if not args.tie_embeddings:
        expected.add("output.weight")
    assert set(params) == expected
    # the head size is its own: 4 heads of 32 read and write a 64-wide stream
    assert params["layers.0.attention.wq.weight"].shape == (args.n_heads * args.head_dim, args.dim) == (128, 64)
    assert params["layers.0.attention.wk.weight"].shape == (args.n_kv_heads * args.head_dim, args.dim)
    assert params["layers.0.attention.wo.weight"].shape == (args.dim, args.n_heads * args.head_dim)
    assert params["layers.1.attention.q_norm.weight"].shape == (args.head_dim,)
    assert model.rope_cache.shape == (args.max_seq_len, args.head_dim)
    if args.is_moe:
        assert params["layers.1.moe.experts.w2"].shape == (4, args.dim, args.moe_inter_dim)
    rules = model.init_rules()
    assert set(rules) == expected
    assert rules["layers.0.attention.q_norm.weight"] == rules["layers.1.attention.k_norm.weight"] == ONES


@pytest.mark.parametrize("args", [TINY, TINY_TIED, TINY_MOE], ids=["dense", "tied", "moe"])
def test_forward_shape_finite_causal_and_meta_init_equals_cpu_init(args):
    model = Qwen3(args)
    model.init_weights(3)
    tokens = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens)
        assert logits.shape == (2, 12, args.vocab_size) and torch.isfinite(logits).all()
        changed = tokens.clone()
        changed[:, 5] = (changed[:, 5] + 1) % args.vocab_size
        other = model(changed)
        assert torch.equal(logits[:, :5], other[:, :5])
        assert (logits[:, 5:] != other[:, 5:]).flatten(2).any(-1).all()
        meta = _meta(args)
        meta.to_empty(device="cpu")
        meta.init_weights(3)
        assert torch.equal(meta(tokens), logits)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, args.max_seq_len + 1, dtype=torch.long))


class _RecordingPlan:
    """A sequence plan that keeps the q, k, v attention is given (then attends as the real plan)."""

    def __init__(self, plan):
        self.plan = plan
        self.seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def attend(self, q, k, v, scale=None):
        self.seen.append((q, k, v))
        return self.plan.attend(q, k, v, scale)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _attention_inputs(model: Qwen3, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (q, k) block 0's attention hands to the attention kernel for the hidden state ``x``."""
    plan = _RecordingPlan(model.sequence_layout.plan(None, x.shape[1], x.device))
    model.layers["0"].attention(x, plan.plan.rope(model.rope_cache), plan)
    ((q, k, _),) = plan.seen
    return q, k


def test_qk_norm_is_per_head_before_rope_and_scales_the_scores():
    model = Qwen3(TINY)
    model.init_weights(0)
    attention = model.layers["0"].attention
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # uneven weights: a norm after RoPE, or over all heads, would give other values
        attention.q_norm.weight.copy_(torch.rand(TINY.head_dim, generator=g) + 0.5)
        attention.k_norm.weight.copy_(torch.rand(TINY.head_dim, generator=g) + 0.5)
        x = torch.randn(2, 10, TINY.dim, generator=g)
        q, k = _attention_inputs(model, x)
        rope = model.rope_cache[:10]
        raw_q = attention.wq(x).view(2, 10, TINY.n_heads, TINY.head_dim)
        raw_k = attention.wk(x).view(2, 10, TINY.n_kv_heads, TINY.head_dim)
        w_q, w_k, eps = attention.q_norm.weight, attention.k_norm.weight, TINY.norm_eps
        torch.testing.assert_close(q, apply_rope(_rms(raw_q, w_q, eps), rope), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(k, apply_rope(_rms(raw_k, w_k, eps), rope), rtol=1e-6, atol=1e-6)
        after_rope = _rms(apply_rope(raw_q, rope), w_q, eps)
        over_all_heads = apply_rope((_rms(raw_q.flatten(2), 1.0, eps).view_as(raw_q) * w_q), rope)
        for wrong in (after_rope, over_all_heads):
            assert (wrong - q).abs().max() > 1e-3

        def scores(q, k):
            return torch.einsum("bshd,bthd->bhst", q, repeat_kv(k, TINY.n_heads))

        attention.q_norm.weight.mul_(2.0)
        doubled_q, same_k = _attention_inputs(model, x)
    assert torch.equal(same_k, k) and torch.equal(doubled_q, 2 * q)
    assert torch.equal(scores(doubled_q, same_k), 2 * scores(q, k))


def test_tied_output_computes_with_the_embedding_weight_and_sums_both_gradients():
    tied = Qwen3(TINY_TIED)
    tied.init_weights(0)
    assert "output.weight" not in tied.state_dict() and "output.weight" not in dict(tied.named_parameters())
    untied = Qwen3(TINY)
    untied.load_state_dict({**tied.state_dict(), "output.weight": tied.tok_embeddings.weight.detach().clone()})
    tokens = torch.randint(0, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    logits = tied(tokens)
    hidden = tied(tokens, head=lambda normed, output, local: normed)
    assert torch.equal(logits, F.linear(hidden, tied.tok_embeddings.weight))
    assert torch.equal(untied(tokens), logits)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    (logits * weights).sum().backward()
    (untied(tokens) * weights).sum().backward()
    both = untied.tok_embeddings.weight.grad + untied.output.weight.grad
    torch.testing.assert_close(tied.tok_embeddings.weight.grad, both, rtol=1e-5, atol=1e-7)
    for part in (untied.tok_embeddings.weight.grad, untied.output.weight.grad):  # both uses count
        assert (tied.tok_embeddings.weight.grad - part).abs().max() > 1e-3 * both.abs().max()


# --------------------------------------------------------------------------------------
# The MoE layer


def test_moe_layer_routes_as_hugging_face_and_holds_no_balancing_state():
    model = Qwen3(TINY_MOE)
    model.init_weights(0)
    assert {name for name, _ in model.named_buffers()} == {"rope_cache"}
    assert set(model.state_dict()) == {name for name, _ in model.named_parameters()}
    assert all(block.is_moe and not hasattr(block, "feed_forward") for block in model.layers.values())
    moe = model.layers["1"].moe
    assert not hasattr(moe, "expert_bias") and not hasattr(moe, "tokens_per_expert") and moe.shared_experts is None
    x = torch.randn(24, TINY_MOE.dim, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ids, weights = moe.router(x, None)
        # Hugging Face's Qwen3-MoE: softmax over every expert, its top-k, those k renormalised
        probs = F.linear(x, moe.router.gate.weight).float().softmax(dim=-1)
        top = probs.topk(TINY_MOE.n_activated_experts, dim=-1)
        assert torch.equal(ids, top.indices)
        torch.testing.assert_close(weights, top.values / top.values.sum(-1, keepdim=True), rtol=1e-6, atol=0)
        out = moe(x)
        w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
        expected = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for e, w in zip(ids[t].tolist(), weights[t], strict=True):
                expected[t] += w * F.linear(F.silu(F.linear(x[t], w1[e])) * F.linear(x[t], w3[e]), w2[e])
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        tokens = torch.randint(0, TINY_MOE.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
        assert torch.equal(model(tokens), model(tokens))  # no state moves between forwards
    unnormed = Qwen3(dataclasses.replace(TINY_MOE, route_norm=False))
    unnormed.load_state_dict(model.state_dict())
    with torch.no_grad():
        _, raw = unnormed.layers["1"].moe.router(x, None)
    torch.testing.assert_close(raw, top.values, rtol=1e-6, atol=0)
    assert (raw.sum(-1) < 1).all()


# --------------------------------------------------------------------------------------
# Layouts refused


@pytest.mark.parametrize(
    "config, flags, world_size, message",
    [
        (
            DENSE_CONFIG,
            ["--parallelism.ep", "2"],
            2,
            "parallelism.ep > 1 needs a model with experts; this qwen3 flavor is dense",
        ),
        (
            MOE_CONFIG,
            ["--parallelism.ep", "16"],
            16,
            "parallelism.ep = 16 does not divide the model's n_routed_experts (8)",
        ),
        (
            MOE_CONFIG,
            ["--parallelism.cp", "2"],
            2,
            "parallelism.cp = 2: context parallel is built for the dense models' layouts; a qwen3 MoE does not "
            "split its sequences over cp yet (use cp = 1)",
        ),
        (
            DENSE_CONFIG,
            ["--model.flavor", "debugmodel_tied", "--parallelism.pp", "2", "--parallelism.dp_shard", "1"],
            2,
            "parallelism.pp = 2: this model's output projection is tied to its embedding, and pipeline stages "
            "would hold the two apart (the first and the last stage); use pp = 1",
        ),
        (
            DENSE_CONFIG,
            ["--parallelism.tp", "8", "--parallelism.dp_shard", "1"],
            8,
            "parallelism.tp = 8 does not divide the model's n_kv_heads (4)",
        ),
        (
            MOE_CONFIG,
            ["--parallelism.tp", "16", "--parallelism.dp_shard", "1"],
            16,
            "parallelism.tp = 16 does not divide the model's n_heads (8)",
        ),
    ],
    ids=["ep_dense", "ep_not_dividing_experts", "cp_moe", "tied_pp", "tp_kv_heads", "tp_heads"],
)
def test_layouts_the_model_cannot_take_are_one_line_each(config, flags, world_size, message):
    with pytest.raises(ConfigError) as info:
        validate_config(load_config(["--job.config_file", config, *flags]), world_size=world_size)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "change, tp, message",
    [
        ({"vocab_size": 2050}, 4, "parallelism.tp = 4 does not divide the model's vocab_size (2050)"),
        ({"ffn_hidden": 770}, 4, "parallelism.tp = 4 does not divide the model's ffn_hidden (770)"),
    ],
    ids=["vocab_size", "ffn_hidden"],
)
def test_tp_not_dividing_a_split_shape_is_one_line(change, tp, message):
    degrees = {"dp_replicate": 1, "dp_shard": 1, "tp": tp, "ep": 1, "pp": 1}
    with pytest.raises(ConfigError) as info:
        validate_parallelism(dataclasses.replace(FLAVORS["debugmodel"], **change), degrees)
    assert str(info.value) == message
    # a MoE has no dense feed-forward for tp to split (its experts stay whole on every tp rank)
    validate_parallelism(dataclasses.replace(MOE_FLAVORS["debugmodel"], ffn_hidden=770, moe_inter_dim=258), degrees)


def test_train_py_refuses_ep_on_the_dense_model_with_exit_2(tmp_path, monkeypatch):
    # Validation runs before any process group exists, on the WORLD_SIZE torchrun sets: one process
    # with that environment does what every rank of a 2-process job does first.
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = train_py("--job.config_file", DENSE_CONFIG, "--job.dump_folder", str(tmp_path), "--parallelism.ep", "2")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: parallelism.ep > 1 needs a model with experts; this qwen3 flavor is dense"
    ], result.stderr


# --------------------------------------------------------------------------------------
# Tensor parallel: the plan, and the QK norms' gradients on gloo


def test_tp_plan_splits_heads_and_replicates_the_qk_norms():
    cfg = load_config(["--job.config_file", DENSE_CONFIG, "--model.flavor", "debugmodel_tied", "--parallelism.tp", "2"])
    cfg.parallelism.dp_shard = 1
    validate_config(cfg, world_size=2)
    with fake_world(2):
        model = build_job_model(cfg, build_layout(cfg, 2, "cpu"), torch.device("meta"))
    placements = {
        clean_fqn(name): tuple(p.placements) for name, p in model.named_parameters() if isinstance(p, DTensor)
    }
    for i in range(FLAVORS["debugmodel_tied"].n_layers):
        for name, placement in (("wq", Shard(0)), ("wk", Shard(0)), ("wv", Shard(0)), ("wo", Shard(1))):
            assert placements[f"layers.{i}.attention.{name}.weight"] == (placement,)
        for norm in ("q_norm", "k_norm"):
            assert placements[f"layers.{i}.attention.{norm}.weight"] == (Replicate(),)
    assert placements["tok_embeddings.weight"] == (Shard(0),) and "output.weight" not in placements


def test_tp2_qk_norm_gradients_equal_one_process(tmp_path):
    """Each tp rank normalises only its own heads, so each QK norm's weight gradient is partial there
    and must be summed over tp: the step-1 gradients of TP=2 (sequence parallel) match one process on
    the same batch within ``GRAD_RTOL``. Without that sum the comparison fails (the record holds rank
    0's gradient: its heads' part only)."""
    job = [*debug_job(DENSE_CONFIG), "--model.n_layers", "2", "--compile.mode", "eager"]
    job += ["--training.steps", "1", "--debug.grad_record_step", "1"]
    train = os.path.join(ROOT, "train.py")
    run_forked(1, train, *job, "--job.dump_folder", str(tmp_path / "one"))
    run_forked(2, train, *job, "--parallelism.tp", "2", "--job.dump_folder", str(tmp_path / "tp2"))
    one, tp2 = (load_record(record_path(str(tmp_path / n), 1)) for n in ("one", "tp2"))
    norms = [f"layers.{i}.attention.{n}.weight" for i in range(2) for n in ("q_norm", "k_norm")]
    assert set(norms) <= set(one["params"]) and all(one["params"][n]["norm"] > 0 for n in norms)
    problems, worst = compare_records(
        {"norm": one["norm"], "params": {n: tp2["params"][n] for n in norms}},
        {"norm": one["norm"], "params": {n: one["params"][n] for n in norms}},
        rtol=GRAD_RTOL,
    )
    print(f"qwen3 tp2 QK-norm step-1 gradients vs one process: largest relative deviation {worst:.1e}")
    assert problems == []
    assert compare_records(tp2, one, rtol=GRAD_RTOL)[0] == []
