"""Graph passes: the registry behind ``--compile.passes`` and the runner that applies them.

Every pass has one signature, ``pass_fn(gm, context) -> gm``. ``context`` (``PassContext``)
carries what a pass may need beyond the graph: the job config, the resolved parallel
degrees and the model's bucket plan. A pass finds the nodes it works on through
``node.meta["custom"]`` tags written by the code that created them (see
``graph_trainer.tracer`` for the tags every node carries).

``run_passes`` applies the default passes (chosen by the config; they keep values bitwise:
dead code, the activation-checkpointing memory policy, reshard-after-forward) and then the
user's passes in the order given. For each pass it logs wall time, node count and
collectives by type before -> after, can dump the readable graph code before and after (in
``DIR/rank<r>/`` when several processes run), and lints the result: a pass that leaves a
broken graph raises ``PassError`` naming it.
"""

from __future__ import annotations

import logging
import os
import time

import torch.distributed as dist
import torch.fx as fx

from graph_trainer.analysis.collectives import collective_counts, format_counts
from graph_trainer.passes.activation_checkpoint import recompute_activations, tag_activations
from graph_trainer.passes.auto_bucketing import AUTO_BUCKETING
from graph_trainer.passes.ep_overlap import EP_OVERLAP
from graph_trainer.passes.registry import PASS_REGISTRY, PassContext, PassError, PassSpec, register_pass
from graph_trainer.passes.reshard_after_forward import reshard_after_forward
from graph_trainer.passes.transformer_block_bucketing import TRANSFORMER_BLOCK_BUCKETING

logger = logging.getLogger("graph_trainer")

register_pass(TRANSFORMER_BLOCK_BUCKETING)
register_pass(AUTO_BUCKETING)
register_pass(EP_OVERLAP)


def prepare_model_for_passes(model, config) -> None:
    """Let each listed pass prepare the model before tracing (``PassSpec.prepare_model``)."""
    for name in config.compile.passes:
        spec = PASS_REGISTRY[name]
        if spec.prepare_model is not None:
            spec.prepare_model(model, config)


def remove_dead_code(gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
    """Drop nodes whose values nobody uses (collectives and waits are kept: they have effects)."""
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def default_passes(context: PassContext) -> list[PassSpec]:
    """Passes that run before the user's, chosen by the config; each keeps every value bitwise."""
    specs = [PassSpec("remove_dead_code", remove_dead_code, "drop unused pure nodes")]
    config = context.config
    if config is not None and (config.activation_checkpoint.mode != "none" or config.training.loss_chunks > 1):
        # Before reshard_after_forward: the recomputations are backward readers of the gathered
        # parameters, so they read its re-gathers (one gather per block for backward).
        specs.append(PassSpec("tag_activations", tag_activations,
                              f"activation checkpointing ({config.activation_checkpoint.mode}, "
                              f"{config.training.loss_chunks} loss chunks): save or recompute"))
        specs.append(PassSpec("recompute_activations", recompute_activations,
                              "copy recomputed activations before their first backward use"))
    if config is None or config.parallelism.fsdp_reshard_after_forward == "always":
        specs.append(PassSpec("reshard_after_forward", reshard_after_forward,
                              "re-gather parameters for backward instead of keeping them from forward"))
    return specs


def _dump(gm: fx.GraphModule, folder: str, index: int, name: str, when: str) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        folder = os.path.join(folder, f"rank{dist.get_rank()}")  # ranks' graphs differ (their groups, offsets)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{index:02d}_{name}_{when}.py")
    with open(path, "w") as f:
        f.write(gm.print_readable(print_output=False, include_stride=True, include_device=True))


def _check_graph(gm: fx.GraphModule, name: str) -> None:
    try:
        gm.graph.lint()
    except Exception as e:  # lint raises RuntimeError with the offending node
        raise PassError(f"pass {name!r} left an invalid graph: {e}") from e


def run_passes(
    gm: fx.GraphModule,
    context: PassContext,
    names: list[str],
    dump_folder: str = "",
) -> fx.GraphModule:
    """Run the default passes, then the named user passes in order; returns the final graph."""
    specs = default_passes(context)
    for name in names:
        if name not in PASS_REGISTRY:
            raise PassError(f"unknown pass {name!r}; available: {', '.join(sorted(PASS_REGISTRY))}")
        specs.append(PASS_REGISTRY[name])
    for index, spec in enumerate(specs):
        before_nodes = len(gm.graph.nodes)
        before = collective_counts(gm.graph)
        if dump_folder:
            _dump(gm, dump_folder, index, spec.name, "before")
        start = time.perf_counter()
        result = spec.fn(gm, context)
        elapsed = time.perf_counter() - start
        if not isinstance(result, fx.GraphModule):
            raise PassError(f"pass {spec.name!r} returned {type(result).__name__}, not a GraphModule")
        gm = result
        _check_graph(gm, spec.name)
        if dump_folder:
            _dump(gm, dump_folder, index, spec.name, "after")
        logger.info(
            "pass %s: %.2fs, nodes %d -> %d, collectives %s -> %s",
            spec.name,
            elapsed,
            before_nodes,
            len(gm.graph.nodes),
            format_counts(before),
            format_counts(collective_counts(gm.graph)),
        )
    return gm


__all__ = ["PASS_REGISTRY", "PassContext", "PassError", "PassSpec", "default_passes", "prepare_model_for_passes", "register_pass",
           "remove_dead_code", "run_passes"]
