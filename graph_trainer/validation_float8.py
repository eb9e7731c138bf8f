"""The float8 settings of a job against its model and layout (part of ``graph_trainer.validation``):
torchao's recipes, which linears they convert, the float8 all-gather and dispatch. The first problem
raises ``ConfigError`` with one line."""

from __future__ import annotations

import torch

from graph_trainer.config import JobConfig
from graph_trainer.distributed.parallel_dims import weights_per_step
from graph_trainer.errors import require
from models.float8 import EXPERTS_RECIPE, SCALED_MM_MULTIPLE, select_linears, torchao_float8
from models.registry import MODEL_SPECS


def check_float8(cfg: JobConfig, args, degrees: dict[str, int]) -> None:
    """FP8 linears: torchao importable, the router setting only for a model with a router, every
    ``filter_fqns`` entry matching a linear of the model (built on meta: no memory), the float8
    all-gather only where there is a gather per microbatch to make float8, the float8 dispatch
    only where tokens are dispatched (expert parallel)."""
    f = cfg.float8
    if f.enable_fsdp_float8_all_gather:
        _check_float8_all_gather(cfg, degrees)
    if f.recipe_name == "none":
        return
    torchao_float8()
    require(
        not f.convert_router or getattr(args, "n_routed_experts", 0) > 0,
        f"float8.convert_router: {cfg.model.name} ({cfg.model.flavor}) has no router (a MoE model has one)",
    )
    require(
        not (f.convert_output and getattr(args, "tie_embeddings", False)),
        "float8.convert_output: this model's output projection computes with its embedding's weight "
        "(tied), which is no linear to convert",
    )
    with torch.device("meta"):
        model = MODEL_SPECS[cfg.model.name].build(args)
    select_linears(model, f, degrees["tp"])
    if f.convert_routed_experts:
        _check_float8_experts(cfg, args)
        require(
            not f.dispatch_in_float8 or degrees["ep"] > 1,
            f"float8.dispatch_in_float8 sends expert parallel's tokens in float8: it needs parallelism.ep > 1 "
            f"(it is {degrees['ep']}; no token is sent)",
        )


def _check_float8_experts(cfg: JobConfig, args) -> None:
    name = "float8.convert_routed_experts"
    require(
        cfg.float8.recipe_name == EXPERTS_RECIPE,
        f"{name} computes the experts' weight gradients in high precision: it needs float8.recipe_name "
        f"{EXPERTS_RECIPE!r} (it is {cfg.float8.recipe_name!r})",
    )
    require(
        getattr(args, "n_routed_experts", 0) > 0,
        f"{name}: {cfg.model.name} ({cfg.model.flavor}) has no routed experts",
    )
    for what in ("dim", "moe_inter_dim"):
        size = getattr(args, what)
        require(
            size % SCALED_MM_MULTIPLE == 0,
            f"{name}: the experts' {what} ({size}) is not a multiple of {SCALED_MM_MULTIPLE}, as _scaled_mm needs",
        )


def _check_float8_all_gather(cfg: JobConfig, degrees: dict[str, int]) -> None:
    name, recipe = "float8.enable_fsdp_float8_all_gather", cfg.float8.recipe_name
    require(
        recipe == "tensorwise",
        f"{name} casts each weight with one scale for the whole tensor: it needs float8.recipe_name "
        f"'tensorwise' (it is {recipe!r})",
    )
    require(
        degrees["dp_shard"] > 1,
        f"{name} makes SimpleFSDP's all-gathers float8: it needs parallelism.dp_shard > 1 "
        f"(it is {degrees['dp_shard']}; nothing is gathered)",
    )
    require(
        not weights_per_step(cfg.parallelism, degrees["dp_shard"] * degrees["dp_replicate"]),
        f"{name} casts the weights each microbatch gathers; with weights gathered once per step "
        f"(parallelism.fsdp_collectives {cfg.parallelism.fsdp_collectives!r}"
        f"{', the default under pp > 1' if cfg.parallelism.fsdp_collectives == 'default' else ''}) "
        "there is no such gather: set parallelism.fsdp_collectives = 'per_microbatch' or leave it out",
    )


__all__ = ["check_float8"]
