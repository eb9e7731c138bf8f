"""DeepSeek-V3 in Hugging Face's format (``DeepseekV3ForCausalLM``): names, ``config.json``.

``sources(args)`` maps every tensor of ``DeepSeekV3(args)`` to Hugging Face tensors
(``models.hf_weights``). Attention (MLA): ``self_attn.q_proj`` (or ``q_a_proj``,
``q_a_layernorm``, ``q_b_proj``), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
``o_proj``. The first ``first_k_dense_replace`` blocks: ``mlp.{gate,down,up}_proj``; the others:
``mlp.gate.weight`` (our router gate), ``mlp.gate.e_score_correction_bias`` (our persistent
``moe.expert_bias``, which steers the top-k choice exactly as the correction bias does),
``mlp.experts.E.{gate,down,up}_proj`` stacked into our ``[E, ...]`` expert weights, and
``mlp.shared_experts.*`` (our fused shared-expert SwiGLU). Hugging Face keeps DeepSeek's
interleaved RoPE pairs (``rope_interleave``), so no row is permuted.

Hugging Face's DeepSeek-V3 routes with sigmoid scores only: a softmax flavor (``debugmodel``,
``16B``, which are DeepSeek-V2-style) has no Hugging Face twin here, and ``config_problems``
says so. One difference no config shows: with group-limited routing, Hugging Face fills the
experts of excluded groups with a choice score of 0 where we use -inf; the two pick the same
experts unless a biased score of an allowed expert is negative.
"""

from __future__ import annotations

from graph_trainer.errors import ConfigError
from models.deepseek_v3.flavors import DeepSeekV3Args
from models.hf_weights import (
    ConfigCheck,
    ExpertStack,
    HFAdapter,
    HFSource,
    Same,
    decoder_config,
    represented,
    required_fields,
    rope_parameters,
)

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPE = "deepseek_v3"
_FFN = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def sources(args: DeepSeekV3Args) -> dict[str, HFSource]:
    out: dict[str, HFSource] = {
        "tok_embeddings.weight": Same("model.embed_tokens.weight"),
        "norm.weight": Same("model.norm.weight"),
        "output.weight": Same("lm_head.weight"),
    }
    for i in range(args.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        att, hf_att = ours + "attention.", theirs + "self_attn."
        if args.q_lora_rank == 0:
            out[att + "wq.weight"] = Same(hf_att + "q_proj.weight")
        else:
            out[att + "wq_a.weight"] = Same(hf_att + "q_a_proj.weight")
            out[att + "q_norm.weight"] = Same(hf_att + "q_a_layernorm.weight")
            out[att + "wq_b.weight"] = Same(hf_att + "q_b_proj.weight")
        out[att + "wkv_a.weight"] = Same(hf_att + "kv_a_proj_with_mqa.weight")
        out[att + "kv_norm.weight"] = Same(hf_att + "kv_a_layernorm.weight")
        out[att + "wkv_b.weight"] = Same(hf_att + "kv_b_proj.weight")
        out[att + "wo.weight"] = Same(hf_att + "o_proj.weight")
        out[ours + "attention_norm.weight"] = Same(theirs + "input_layernorm.weight")
        out[ours + "ffn_norm.weight"] = Same(theirs + "post_attention_layernorm.weight")
        mlp = theirs + "mlp."
        if i < args.n_dense_layers:
            out.update({f"{ours}feed_forward.{w}.weight": Same(f"{mlp}{p}.weight") for w, p in _FFN.items()})
            continue
        moe = ours + "moe."
        out[moe + "router.gate.weight"] = Same(mlp + "gate.weight")
        out[moe + "expert_bias"] = Same(mlp + "gate.e_score_correction_bias")
        for w, p in _FFN.items():
            names = tuple(f"{mlp}experts.{e}.{p}.weight" for e in range(args.n_routed_experts))
            out[f"{moe}experts.{w}"] = ExpertStack(names)
            if args.n_shared_experts > 0:
                out[f"{moe}shared_experts.{w}.weight"] = Same(f"{mlp}shared_experts.{p}.weight")
    return out


def _yarn(args: DeepSeekV3Args) -> dict:
    return {
        "rope_type": "yarn",
        "factor": args.rope_factor,
        "original_max_position_embeddings": args.original_seq_len,
        "beta_fast": args.beta_fast,
        "beta_slow": args.beta_slow,
        # mscale == mscale_all_dim: Hugging Face's cos/sin factor is their ratio (1, as ours);
        # mscale_all_dim is the softmax-scale temperature (our ``mscale``).
        "mscale": args.mscale,
        "mscale_all_dim": args.mscale,
    }


def config_problems(config: dict, args: DeepSeekV3Args) -> list[str]:
    """What ``config`` says that ``args`` does not, one phrase each (empty: they agree)."""
    check = ConfigCheck(config)
    check.require(
        args.score_func == "sigmoid",
        f"the flavor routes with {args.score_func} scores; Hugging Face's DeepSeek-V3 routes with sigmoid",
    )
    check.equal("scoring_func", "sigmoid", default="sigmoid")
    check.decoder(args)
    check.equal("num_key_value_heads", args.n_heads, default=args.n_heads)
    check.equal("first_k_dense_replace", args.n_dense_layers)
    check.equal("q_lora_rank", args.q_lora_rank or None, what=f" {args.q_lora_rank}")
    for field, ours in (
        ("kv_lora_rank", args.kv_lora_rank),
        ("qk_nope_head_dim", args.qk_nope_head_dim),
        ("qk_rope_head_dim", args.qk_rope_head_dim),
        ("v_head_dim", args.v_head_dim),
        ("intermediate_size", args.inter_dim),
        ("moe_intermediate_size", args.moe_inter_dim),
        ("n_routed_experts", args.n_routed_experts),
        ("n_shared_experts", args.n_shared_experts),
        ("num_experts_per_tok", args.n_activated_experts),
        ("n_group", args.n_expert_groups),
        ("topk_group", args.n_limited_groups),
        ("norm_topk_prob", args.route_norm),
    ):
        check.equal(field, ours)
    check.equal("routed_scaling_factor", float(args.route_scale))
    check.equal("moe_layer_freq", 1, default=1)  # every block after the dense ones is a MoE
    check.equal("rope_interleave", True, default=True)
    check.rope(args.rope_theta, _yarn(args) if args.rope_factor > 1.0 else None)
    # Hugging Face scales cos/sin by attention_factor (derived from mscale / mscale_all_dim when absent)
    attention_factor = (rope_parameters(config)[1] or {}).get("attention_factor")
    check.require(attention_factor in (None, 1, 1.0), f"rope attention_factor {attention_factor!r} (flavor: 1)")
    return check.problems


def hf_config(args: DeepSeekV3Args, dtype: str) -> dict:
    """``config.json`` of ``args`` for ``transformers``' ``DeepseekV3ForCausalLM`` (weights in ``dtype``)."""
    return {
        **decoder_config(ARCHITECTURE, MODEL_TYPE, args, dtype),
        "num_key_value_heads": args.n_heads,
        "first_k_dense_replace": args.n_dense_layers,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "intermediate_size": args.inter_dim,
        "moe_intermediate_size": args.moe_inter_dim,
        "n_routed_experts": args.n_routed_experts,
        "n_shared_experts": args.n_shared_experts,
        "num_experts_per_tok": args.n_activated_experts,
        "n_group": args.n_expert_groups,
        "topk_group": args.n_limited_groups,
        "norm_topk_prob": args.route_norm,
        "routed_scaling_factor": float(args.route_scale),
        "scoring_func": "sigmoid",
        "rope_scaling": _yarn(args) if args.rope_factor > 1.0 else None,
        "rope_interleave": True,
        "num_nextn_predict_layers": 0,
    }


_FIELDS = {
    # our argument: its config.json field
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "vocab_size": "vocab_size",
    "n_dense_layers": "first_k_dense_replace",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "inter_dim": "intermediate_size",
    "moe_inter_dim": "moe_intermediate_size",
    "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "n_activated_experts": "num_experts_per_tok",
    "n_expert_groups": "n_group",
    "n_limited_groups": "topk_group",
    "max_seq_len": "max_position_embeddings",
}


def _rope_args(config: dict) -> dict:
    """Our RoPE arguments from the config's (YaRN, or none: factor 1); another kind is left to
    ``config_problems`` to name."""
    theta, scaling = rope_parameters(config)
    out = {"rope_theta": float(theta if theta is not None else 10000.0), "rope_factor": 1.0}
    if scaling is None or scaling.get("rope_type") != "yarn":
        return out
    try:
        return {
            **out,
            "rope_factor": float(scaling["factor"]),
            "original_seq_len": int(scaling["original_max_position_embeddings"]),
            "beta_fast": float(scaling.get("beta_fast", 32.0)),
            "beta_slow": float(scaling.get("beta_slow", 1.0)),
            "mscale": float(scaling.get("mscale_all_dim", 1.0)),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"config.json rope_scaling {scaling!r} is not YaRN as DeepSeek-V3 uses it ({e})") from None


def args_from_config(config: dict) -> DeepSeekV3Args:
    """The DeepSeek-V3 model ``config`` describes (sigmoid routing, as Hugging Face's): every shape
    from it, routing, RoPE (YaRN). ``ConfigError`` when a field is missing or the config says
    something this model cannot be (its ``config_problems`` are not empty)."""
    required_fields(
        config, [*_FIELDS.values(), "rms_norm_eps", "routed_scaling_factor", "norm_topk_prob"], "DeepSeek-V3"
    )
    try:
        args = DeepSeekV3Args(
            **{ours: int(config[theirs]) for ours, theirs in _FIELDS.items()},
            q_lora_rank=int(config.get("q_lora_rank") or 0),
            score_func="sigmoid",
            route_scale=float(config["routed_scaling_factor"]),
            route_norm=bool(config["norm_topk_prob"]),
            norm_eps=float(config["rms_norm_eps"]),
            **_rope_args(config),
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.json does not describe a DeepSeek-V3 model: {e}") from None
    return represented(args, config_problems(config, args), "DeepSeek-V3")


ADAPTER = HFAdapter(ARCHITECTURE, MODEL_TYPE, sources, config_problems, hf_config, args_from_config)

__all__ = ["ADAPTER", "ARCHITECTURE", "MODEL_TYPE", "args_from_config", "config_problems", "hf_config", "sources"]
