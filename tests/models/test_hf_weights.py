"""The Hugging Face adapters (models/hf_weights.py, models/<family>/hf.py) without ``transformers``: sources read
any box exactly and only its elements, and the config checks accept the published releases' config.json and
name each differing field."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from models.deepseek_v3.flavors import FLAVORS as DEEPSEEK
from models.hf_weights import ExpertStack, RotaryRows, Same, hf_names, rope_parameters
from models.llama3.flavors import FLAVORS as LLAMA
from models.registry import MODEL_SPECS


def _reader(tensors: dict[str, torch.Tensor], counted: list[int]):
    def read(name, index):
        piece = tensors[name][index].clone()
        counted.append(piece.numel())
        return piece

    return read


@pytest.mark.parametrize("source", ["same", "rotary", "experts"])
def test_every_box_reads_back_what_to_hf_wrote_and_only_its_elements(source):
    torch.manual_seed(0)
    full = torch.randn(6, 12, 5) if source == "experts" else torch.randn(24, 5)
    src = {
        "same": Same("w"),
        "rotary": RotaryRows("w", head_dim=8),
        "experts": ExpertStack(tuple(f"e{i}" for i in range(6))),
    }[source]
    hf = src.to_hf(full)
    assert {n: list(t.shape) for n, t in hf.items()} == src.hf_shapes(list(full.shape))
    # every box of dim 0 (all starts and lengths: inside a head, across heads, odd and even rows)
    for start, end in itertools.combinations(range(full.shape[0] + 1), 2):
        for cols in ((0, full.shape[-1]), (1, 3)):
            offsets = [start] + [0] * (full.dim() - 2) + [cols[0]]
            lengths = [end - start] + list(full.shape[1:-1]) + [cols[1] - cols[0]]
            counted: list[int] = []
            got = src.read(_reader(hf, counted), offsets, lengths)
            want = full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]
            assert torch.equal(got, want), (start, end, cols)
            assert sum(counted) == want.numel()  # not an element more than the box


def test_rotary_rows_is_the_rotate_half_layout():
    """Our row 2i + c of a head is Hugging Face's row c * head_dim/2 + i."""
    head_dim, heads = 8, 2
    ours = torch.arange(heads * head_dim, dtype=torch.float32).unsqueeze(1)
    theirs = RotaryRows("w", head_dim).to_hf(ours)["w"].squeeze(1).tolist()
    assert theirs[:head_dim] == [0, 2, 4, 6, 1, 3, 5, 7]
    assert theirs[head_dim:] == [8, 10, 12, 14, 9, 11, 13, 15]


@pytest.mark.parametrize("family,flavor", [("llama3", "debugmodel"), ("llama3", "405B"), ("deepseek_v3", "671B")])
def test_sources_cover_every_tensor_of_the_model_once(family, flavor):
    spec = MODEL_SPECS[family]
    args = spec.flavors[flavor]
    with torch.device("meta"):
        model = spec.build(args)
    persistent = set(model.state_dict())
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    shapes.update({n: list(b.shape) for n, b in model.named_buffers() if n in persistent})
    sources = spec.hf.sources(args)
    assert sorted(sources) == sorted(shapes)
    names = hf_names(sources, shapes)
    assert sum(len(s.hf_shapes(shapes[f])) for f, s in sources.items()) == len(names)  # no name read twice
    assert sum(torch.Size(s).numel() for s in names.values()) == sum(torch.Size(s).numel() for s in shapes.values())


@pytest.mark.parametrize(
    "family,flavor",
    [("llama3", "debugmodel"), ("llama3", "8B"), ("deepseek_v3", "debugmodel_v3"), ("deepseek_v3", "671B")],
)
def test_written_config_fits_and_each_changed_field_is_named(family, flavor):
    adapter, args = MODEL_SPECS[family].hf, MODEL_SPECS[family].flavors[flavor]
    config = adapter.config(args, "bfloat16")
    assert adapter.config_problems(config, args) == []
    changed = dict(config, hidden_size=config["hidden_size"] * 2, rms_norm_eps=0.1)
    problems = adapter.config_problems(changed, args)
    assert f"hidden_size {config['hidden_size'] * 2} (flavor: {args.dim})" in problems
    assert f"rms_norm_eps 0.1 (flavor: {args.norm_eps})" in problems and len(problems) == 2
    other_layers = dataclasses.replace(args, n_layers=args.n_layers - 1)
    assert adapter.config_problems(config, other_layers) == [
        f"num_hidden_layers {args.n_layers} (flavor: {args.n_layers - 1})"
    ]


def test_published_config_keys_and_newer_rope_parameters_read_alike():
    """Published folders write rope_theta / rope_scaling ("type" or "rope_type"); newer transformers rope_parameters."""
    args = LLAMA["8B"]
    published = MODEL_SPECS["llama3"].hf.config(args, "bfloat16")
    scaling = dict(published.pop("rope_scaling"))
    theta = published.pop("rope_theta")
    newer = dict(published, rope_parameters={"rope_theta": theta, **scaling})
    old_style = dict(published, rope_theta=theta, rope_scaling={"type": "llama3", **scaling})
    for config in (newer, old_style):
        assert rope_parameters(config)[0] == theta
        assert MODEL_SPECS["llama3"].hf.config_problems(config, args) == []
    no_scaling = dict(published, rope_theta=theta, rope_scaling=None)
    assert MODEL_SPECS["llama3"].hf.config_problems(no_scaling, args)[0].startswith("rope_scaling None")


# config.json of the published releases (meta-llama/Llama-3.1-8B, deepseek-ai/DeepSeek-V3), as distributed.
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_published_configs_fit_our_flavors():
    assert MODEL_SPECS["llama3"].hf.config_problems(LLAMA_3_1_8B, LLAMA["8B"]) == []
    assert MODEL_SPECS["deepseek_v3"].hf.config_problems(DEEPSEEK_V3, DEEPSEEK["671B"]) == []
    assert MODEL_SPECS["llama3"].hf.config_problems(LLAMA_3_1_8B, LLAMA["70B"])[0] == "hidden_size 4096 (flavor: 8192)"


def test_deepseek_softmax_flavor_and_unequal_yarn_mscale_are_named():
    adapter = MODEL_SPECS["deepseek_v3"].hf
    args = DEEPSEEK["debugmodel"]  # DeepSeek-V2-style softmax routing
    problems = adapter.config_problems(adapter.config(args, "float32"), args)
    assert problems == ["the flavor routes with softmax scores; Hugging Face's DeepSeek-V3 routes with sigmoid"]
    args = DEEPSEEK["671B"]
    config = adapter.config(args, "bfloat16")
    config["rope_scaling"] = dict(config["rope_scaling"], mscale=0.707)  # cos/sin would be scaled by HF
    assert adapter.config_problems(config, args)[0].startswith("rope_scaling {")


def test_a_folder_of_another_family_names_the_model_name_that_loads_it():
    from graph_trainer.errors import ConfigError
    from models.registry import check_hf_family

    for name, spec in MODEL_SPECS.items():  # by architecture or by model type alone
        check_hf_family("f", {"architectures": [spec.hf.architecture]}, name)
        check_hf_family("f", {"model_type": spec.hf.model_type}, name)
    with pytest.raises(ConfigError) as info:
        check_hf_family("f", {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, "qwen3_moe")
    assert str(info.value) == (
        "f/config.json is a ['Qwen3ForCausalLM'] model; model.name qwen3_moe loads Qwen3MoeForCausalLM "
        "(model_type qwen3_moe) (model.name qwen3 loads it)"
    )
    with pytest.raises(ConfigError, match=r"is a 'mistral' model; model.name llama3 .* \(no model.name loads it\)$"):
        check_hf_family("f", {"model_type": "mistral"}, "llama3")
