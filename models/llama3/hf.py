"""LLaMA-3 in Hugging Face's format (``LlamaForCausalLM``): names, the q/k row order, ``config.json``.

``sources(args)`` maps every tensor of ``Transformer(args)`` to its Hugging Face tensor
(``models.hf_weights``): ``model.embed_tokens``, ``model.layers.N.self_attn.{q,k,v,o}_proj``,
``mlp.{gate,down,up}_proj`` (our w1, w2, w3), ``input_layernorm`` / ``post_attention_layernorm``,
``model.norm``, ``lm_head``. wq and wk differ by a row permutation within each head (RoPE pair
layouts, ``RotaryRows``). ``config_problems`` lists what a ``config.json`` says that the flavor does
not (every field that changes shapes or numerics); ``hf_config`` writes the flavor as one.
"""

from __future__ import annotations

from models.hf_weights import ConfigCheck, HFAdapter, HFSource, RotaryRows, Same, decoder_config
from models.llama3.flavors import Llama3Args
from models.llama3.model import _HIGH_FREQ_FACTOR, _LOW_FREQ_FACTOR, _ORIGINAL_CONTEXT, _SCALE_FACTOR

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
_SCALING = {
    "rope_type": "llama3",
    "factor": _SCALE_FACTOR,
    "low_freq_factor": _LOW_FREQ_FACTOR,
    "high_freq_factor": _HIGH_FREQ_FACTOR,
    "original_max_position_embeddings": _ORIGINAL_CONTEXT,
}


def sources(args: Llama3Args) -> dict[str, HFSource]:
    out: dict[str, HFSource] = {
        "tok_embeddings.weight": Same("model.embed_tokens.weight"),
        "norm.weight": Same("model.norm.weight"),
        "output.weight": Same("lm_head.weight"),
    }
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
    check.rope(args.rope_theta, _SCALING if args.rope_scaling else None)
    return check.problems


def hf_config(args: Llama3Args, dtype: str) -> dict:
    """``config.json`` of ``args`` for ``transformers``' ``LlamaForCausalLM`` (weights in ``dtype``)."""
    return {
        **decoder_config(ARCHITECTURE, MODEL_TYPE, args, dtype),
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.ffn_hidden_dim,
        "rope_scaling": dict(_SCALING) if args.rope_scaling else None,
        "mlp_bias": False,
    }


ADAPTER = HFAdapter(ARCHITECTURE, MODEL_TYPE, sources, config_problems, hf_config)

__all__ = ["ADAPTER", "ARCHITECTURE", "MODEL_TYPE", "config_problems", "hf_config", "sources"]
