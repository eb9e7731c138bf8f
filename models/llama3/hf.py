"""LLaMA-3 in Hugging Face's format (``LlamaForCausalLM``): names, the q/k row order, ``config.json``.

``sources(args)`` maps every tensor of ``Transformer(args)`` to its Hugging Face tensor
(``models.hf_weights``): ``model.embed_tokens``, ``model.layers.N.self_attn.{q,k,v,o}_proj``,
``mlp.{gate,down,up}_proj`` (our w1, w2, w3), ``input_layernorm`` / ``post_attention_layernorm``,
``model.norm``, ``lm_head``. wq and wk differ by a row permutation within each head (RoPE pair
layouts, ``RotaryRows``). ``config_problems`` lists what a ``config.json`` says that the flavor does
not (every field that changes shapes or numerics); ``hf_config`` writes the flavor as one;
``args_from_config`` is the model a ``config.json`` describes (``--model.flavor hf``). A model
whose output projection is tied to its embedding (``tie_word_embeddings``) has no ``lm_head``.
"""

from __future__ import annotations

from graph_trainer.errors import ConfigError
from models.hf_weights import (
    ConfigCheck,
    HFAdapter,
    HFSource,
    RotaryRows,
    Same,
    decoder_config,
    represented,
    required_fields,
    rope_parameters,
)
from models.llama3.flavors import Llama3Args, RopeScaling

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
    "rms_norm_eps",
    "max_position_embeddings",
)


def _scaling(scaling: RopeScaling | None) -> dict | None:
    """``rope_scaling`` of a ``config.json`` for ``scaling`` (Hugging Face's ``rope_type`` llama3)."""
    if scaling is None:
        return None
    return {
        "rope_type": "llama3",
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_context,
    }


def sources(args: Llama3Args) -> dict[str, HFSource]:
    out: dict[str, HFSource] = {
        "tok_embeddings.weight": Same("model.embed_tokens.weight"),
        "norm.weight": Same("model.norm.weight"),
    }
    if not args.tie_embeddings:
        out["output.weight"] = Same("lm_head.weight")
    for i in range(args.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        out.update(
            {
                ours + "attention.wq.weight": RotaryRows(theirs + "self_attn.q_proj.weight", args.head_dim),
                ours + "attention.wk.weight": RotaryRows(theirs + "self_attn.k_proj.weight", args.head_dim),
                ours + "attention.wv.weight": Same(theirs + "self_attn.v_proj.weight"),
                ours + "attention.wo.weight": Same(theirs + "self_attn.o_proj.weight"),
                ours + "feed_forward.w1.weight": Same(theirs + "mlp.gate_proj.weight"),
                ours + "feed_forward.w2.weight": Same(theirs + "mlp.down_proj.weight"),
                ours + "feed_forward.w3.weight": Same(theirs + "mlp.up_proj.weight"),
                ours + "attention_norm.weight": Same(theirs + "input_layernorm.weight"),
                ours + "ffn_norm.weight": Same(theirs + "post_attention_layernorm.weight"),
            }
        )
    return out


def config_problems(config: dict, args: Llama3Args) -> list[str]:
    """What ``config`` says that ``args`` does not, one phrase each (empty: they agree)."""
    check = ConfigCheck(config)
    check.decoder(args)
    check.equal("num_key_value_heads", args.kv_heads, default=config.get("num_attention_heads"))
    check.equal("head_dim", args.head_dim, default=args.head_dim)
    check.equal("intermediate_size", args.ffn_hidden_dim)
    check.equal("mlp_bias", False, default=False)
    check.rope(args.rope_theta, _scaling(args.rope_scaling))
    return check.problems


def _rope_scaling_of(config: dict) -> RopeScaling | None:
    """The config's RoPE scaling when it is LLaMA-3's kind (another kind is left to
    ``config_problems`` to name)."""
    scaling = rope_parameters(config)[1]
    if scaling is None or scaling.get("rope_type") != "llama3":
        return None
    try:
        return RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_context=int(scaling["original_max_position_embeddings"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"config.json rope_scaling {scaling!r} is not LLaMA-3's (missing or bad {e})") from None


def args_from_config(config: dict) -> Llama3Args:
    """The LLaMA-3 model ``config`` describes: every shape from it, the feed-forward's hidden size
    as given, RoPE and its scaling, tied embeddings. ``ConfigError`` when a field is missing or the
    config says something this model cannot be (its ``config_problems`` are not empty)."""
    required_fields(config, _REQUIRED, "LLaMA-3")
    try:
        args = Llama3Args(
            dim=int(config["hidden_size"]),
            n_layers=int(config["num_hidden_layers"]),
            n_heads=int(config["num_attention_heads"]),
            vocab_size=int(config["vocab_size"]),
            n_kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
            norm_eps=float(config["rms_norm_eps"]),
            rope_theta=float(rope_parameters(config)[0] or 10000.0),
            rope_scaling=_rope_scaling_of(config),
            max_seq_len=int(config["max_position_embeddings"]),
            ffn_hidden=int(config["intermediate_size"]),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.json does not describe a LLaMA-3 model: {e}") from None
    return represented(args, config_problems(config, args), "LLaMA-3")


def hf_config(args: Llama3Args, dtype: str) -> dict:
    """``config.json`` of ``args`` for ``transformers``' ``LlamaForCausalLM`` (weights in ``dtype``)."""
    return {
        **decoder_config(ARCHITECTURE, MODEL_TYPE, args, dtype),
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.ffn_hidden_dim,
        "rope_scaling": _scaling(args.rope_scaling),
        "mlp_bias": False,
    }


ADAPTER = HFAdapter(ARCHITECTURE, MODEL_TYPE, sources, config_problems, hf_config, args_from_config)

__all__ = ["ADAPTER", "ARCHITECTURE", "MODEL_TYPE", "args_from_config", "config_problems", "hf_config", "sources"]
