"""Qwen3 in Hugging Face's format (``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``): names, the q/k
feature order, ``config.json``.

``sources(args)`` maps every tensor of ``Qwen3(args)`` to its Hugging Face tensor
(``models.hf_weights``): ``model.embed_tokens``, ``model.layers.N.self_attn.{q,k,v,o}_proj`` and
``self_attn.{q,k}_norm``, ``input_layernorm`` / ``post_attention_layernorm``, then a dense block's
``mlp.{gate,down,up}_proj`` (our w1, w2, w3) or a MoE block's ``mlp.gate`` (our router gate) and
``mlp.experts.E.{gate,down,up}_proj`` stacked into our ``[E, ...]`` expert weights, ``model.norm``,
``lm_head`` (none when tied: ``tie_word_embeddings``). Hugging Face rotates (i, i + head_dim/2)
where we rotate (2i, 2i+1), so wq and wk differ by a row permutation within each head
(``RotaryRows``), and the QK norms' weights, which scale those same features, by the same
permutation of their ``head_dim`` entries.

The two architectures are two model names (``qwen3``, ``qwen3_moe``, as Hugging Face's
``model_type``s), one adapter each; ``config_problems`` lists what a ``config.json`` says that the
flavor does not (every field that changes shapes or numerics, sliding-window attention included,
which this model does not compute). The MoE's ``router_aux_loss_coef`` is a training setting, not
the model's: it is neither checked nor written (``models.qwen3.model`` on the auxiliary loss).
"""

from __future__ import annotations

from graph_trainer.errors import ConfigError
from models.hf_weights import (
    ConfigCheck,
    ExpertStack,
    HFAdapter,
    HFSource,
    RotaryRows,
    Same,
    decoder_config,
    represented,
    required_fields,
    rope_parameters,
    with_aliases,
)
from models.qwen3.flavors import Qwen3Args

DENSE_ARCHITECTURE, DENSE_MODEL_TYPE = "Qwen3ForCausalLM", "qwen3"
MOE_ARCHITECTURE, MOE_MODEL_TYPE = "Qwen3MoeForCausalLM", "qwen3_moe"
_FFN = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "intermediate_size",
    "rms_norm_eps",
    "max_position_embeddings",
)
_MOE_REQUIRED = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


def sources(args: Qwen3Args) -> dict[str, HFSource]:
    out: dict[str, HFSource] = {
        "tok_embeddings.weight": Same("model.embed_tokens.weight"),
        "norm.weight": Same("model.norm.weight"),
    }
    if not args.tie_embeddings:
        out["output.weight"] = Same("lm_head.weight")
    hd = args.head_dim
    for i in range(args.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        att, hf_att, mlp = ours + "attention.", theirs + "self_attn.", theirs + "mlp."
        out.update(
            {
                att + "wq.weight": RotaryRows(hf_att + "q_proj.weight", hd),
                att + "wk.weight": RotaryRows(hf_att + "k_proj.weight", hd),
                att + "wv.weight": Same(hf_att + "v_proj.weight"),
                att + "wo.weight": Same(hf_att + "o_proj.weight"),
                att + "q_norm.weight": RotaryRows(hf_att + "q_norm.weight", hd),
                att + "k_norm.weight": RotaryRows(hf_att + "k_norm.weight", hd),
                ours + "attention_norm.weight": Same(theirs + "input_layernorm.weight"),
                ours + "ffn_norm.weight": Same(theirs + "post_attention_layernorm.weight"),
            }
        )
        if not args.is_moe:
            out.update({f"{ours}feed_forward.{w}.weight": Same(f"{mlp}{p}.weight") for w, p in _FFN.items()})
            continue
        out[ours + "moe.router.gate.weight"] = Same(mlp + "gate.weight")
        for w, p in _FFN.items():
            names = tuple(f"{mlp}experts.{e}.{p}.weight" for e in range(args.n_routed_experts))
            out[f"{ours}moe.experts.{w}"] = ExpertStack(names)
    return out


EXPERT_COUNT_ALIASES = {"num_local_experts": "num_experts"}
"""``transformers`` 5 writes a Qwen3-MoE's expert count as ``num_local_experts``; the published
files and our exports name it ``num_experts``."""


def _config_problems(config: dict, args: Qwen3Args, moe: bool) -> list[str]:
    """What ``config`` says that ``args`` does not, one phrase each (empty: they agree)."""
    check = ConfigCheck(with_aliases(config, EXPERT_COUNT_ALIASES))
    check.require(args.is_moe == moe, f"the flavor is {'a MoE' if args.is_moe else 'dense'}; the config is not")
    check.decoder(args)
    check.equal("num_key_value_heads", args.n_kv_heads, default=config.get("num_attention_heads"))
    check.equal("head_dim", args.head_dim, default=config.get("hidden_size", 0) // config.get("num_attention_heads", 1))
    check.rope(args.rope_theta, None)
    check.equal("use_sliding_window", False, default=False)
    if not moe:
        check.equal("intermediate_size", args.ffn_hidden)
        check.require(
            not check.config.get("num_experts"), f"num_experts {check.config.get('num_experts')!r} (a MoE: qwen3_moe)"
        )
        return check.problems
    for field, ours in (
        ("num_experts", args.n_routed_experts),
        ("num_experts_per_tok", args.n_activated_experts),
        ("moe_intermediate_size", args.moe_inter_dim),
        ("norm_topk_prob", args.route_norm),
    ):
        check.equal(field, ours)
    check.equal("num_local_experts", args.n_routed_experts, default=args.n_routed_experts)  # (both names: agree)
    check.equal("decoder_sparse_step", 1, default=1)  # every block a MoE
    check.equal("mlp_only_layers", [], default=[])
    return check.problems


def _config(args: Qwen3Args, dtype: str, moe: bool) -> dict:
    """``config.json`` of ``args`` for ``transformers``' Qwen3 (weights in ``dtype``)."""
    architecture, model_type = (MOE_ARCHITECTURE, MOE_MODEL_TYPE) if moe else (DENSE_ARCHITECTURE, DENSE_MODEL_TYPE)
    config = {
        **decoder_config(architecture, model_type, args, dtype),
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.ffn_hidden,
        "rope_scaling": None,
        "use_sliding_window": False,
    }
    if moe:
        config.update(
            {
                "num_experts": args.n_routed_experts,
                "num_experts_per_tok": args.n_activated_experts,
                "moe_intermediate_size": args.moe_inter_dim,
                "norm_topk_prob": args.route_norm,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            }
        )
    return config


def _args_from_config(config: dict, moe: bool) -> Qwen3Args:
    """The Qwen3 model ``config`` describes: every shape from it, RoPE base, tied embeddings, and for
    a MoE the experts and their routing. ``ConfigError`` when a field is missing or the config says
    something this model cannot be (its problems are not empty)."""
    config = with_aliases(config, EXPERT_COUNT_ALIASES)
    family = "Qwen3-MoE" if moe else "Qwen3"
    required_fields(config, (*_REQUIRED, *(_MOE_REQUIRED if moe else ())), family)
    try:
        experts = (
            {
                "n_routed_experts": int(config["num_experts"]),
                "n_activated_experts": int(config["num_experts_per_tok"]),
                "moe_inter_dim": int(config["moe_intermediate_size"]),
                "route_norm": bool(config.get("norm_topk_prob", False)),
            }
            if moe
            else {}
        )
        args = Qwen3Args(
            dim=int(config["hidden_size"]),
            n_layers=int(config["num_hidden_layers"]),
            n_heads=int(config["num_attention_heads"]),
            n_kv_heads=int(config["num_key_value_heads"]),
            vocab_size=int(config["vocab_size"]),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"])),
            ffn_hidden=int(config["intermediate_size"]),
            norm_eps=float(config["rms_norm_eps"]),
            rope_theta=float(rope_parameters(config)[0] or 10000.0),
            max_seq_len=int(config["max_position_embeddings"]),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            **experts,
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.json does not describe a {family} model: {e}") from None
    return represented(args, _config_problems(config, args, moe), family)


def _adapter(moe: bool) -> HFAdapter:
    return HFAdapter(
        MOE_ARCHITECTURE if moe else DENSE_ARCHITECTURE,
        MOE_MODEL_TYPE if moe else DENSE_MODEL_TYPE,
        sources,
        lambda config, args: _config_problems(config, args, moe),
        lambda args, dtype: _config(args, dtype, moe),
        lambda config: _args_from_config(config, moe),
        EXPERT_COUNT_ALIASES if moe else {},
    )


DENSE_ADAPTER = _adapter(moe=False)
MOE_ADAPTER = _adapter(moe=True)

__all__ = ["DENSE_ADAPTER", "MOE_ADAPTER", "sources"]
