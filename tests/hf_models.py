"""Tiny Hugging Face models saved as folders, for the tests of Hugging Face weights in and out.

``transformers`` is a test-only dependency: the library never imports it (an import-linter
contract). The two models are shaped like our debug flavors with few layers, so a job
``--model.flavor <flavor> --model.n_layers <layers>`` loads them.
"""

from __future__ import annotations

from pathlib import Path

import torch

LLAMA_JOB = ["--job.config_file", "configs/llama3_debug.toml", "--model.n_layers", "2"]
DEEPSEEK_JOB = [
    "--job.config_file",
    "configs/deepseek_v3_debug.toml",
    "--model.flavor",
    "debugmodel_v3",
    "--model.n_layers",
    "3",
]

QWEN3_JOB = [
    "--job.config_file",
    "configs/qwen3_debug.toml",
    "--model.flavor",
    "debugmodel_tied",
    "--model.n_layers",
    "2",
]
QWEN3_MOE_JOB = ["--job.config_file", "configs/qwen3_moe_debug.toml", "--model.n_layers", "2"]


def llama_model(seed: int = 0):
    """LLaMA-3 debugmodel (2 layers) with LLaMA-3.1 RoPE scaling, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def deepseek_model(seed: int = 0):
    """DeepSeek-V3 debugmodel_v3 (3 layers: 1 dense, 2 MoE) with YaRN RoPE, random weights and a
    random score-correction bias (so that it steers the routing)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_shared_experts=1,
        n_routed_experts=8,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=16384,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers[config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.02)
    return model


def qwen3_model(seed: int = 0):
    """Qwen3 debugmodel_tied (2 layers): QK-norm, head_dim 64 with 8 heads of a 256-wide stream,
    grouped-query 8:4, the output tied to the embedding; random weights, the QK norms' weights too
    (so that their feature order matters)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    )
    return _randomised_norms(Qwen3ForCausalLM, config, seed)


def qwen3_moe_model(seed: int = 0):
    """Qwen3-MoE debugmodel (2 layers, each a MoE of 8 experts, top-2 with renormalised weights);
    random weights, the QK norms' too."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    )
    return _randomised_norms(Qwen3MoeForCausalLM, config, seed)


def _randomised_norms(cls, config, seed: int):
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def save(model, folder: Path, max_shard_size: str = "50GB", dtype: torch.dtype = torch.float32) -> Path:
    """``model`` (in ``dtype``) saved as a Hugging Face folder, in several files when larger than ``max_shard_size``."""
    model.to(dtype).save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


def file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files, by name."""
    from safetensors import safe_open

    tensors = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits.float()


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest absolute difference over the largest absolute reference value."""
    return ((ours - reference).abs().max() / reference.abs().max()).item()
