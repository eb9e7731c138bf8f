"""The memory policy: what one step keeps alive from forward to backward, and what it makes again.

It runs on the traced graph before the user's passes (``graph_trainer.compiler.chain``), as these
passes, in order, each keeping every value bitwise:

1. ``remove_dead_code``: drop nodes nobody reads (collectives and waits are kept: they have effects);
2. with ``activation_checkpoint.mode`` other than ``none`` (or ``full_blocks`` > 0), or
   ``training.loss_chunks > 1``:
   ``tag_activations`` decides save or recompute per transformer block and loss row block, and
   ``recompute_activations`` copies each recomputed value before its first backward use
   (``activation_checkpoint``);
3. with ``parallelism.fsdp_reshard_after_forward`` ``default`` or ``always``: ``reshard_after_forward``
   re-gathers every parameter (``default``: but the final norm's and output projection's) for its
   backward readers instead of keeping the forward's gather (``reshard_after_forward``). It runs
   after step 2 so that recomputations read the re-gathers: one gather per block for backward.

Later stages never re-decide: they read the ``activation``, ``recomputed`` and ``recompute_of``
tags (``graph_trainer.graph.tags``) and schedule the copies like any backward node.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from graph_trainer.compiler.memory_policy.activation_checkpoint import recompute_activations, tag_activations
from graph_trainer.compiler.memory_policy.reshard_after_forward import reshard_after_forward
from graph_trainer.compiler.passes.registry import PassContext, PassSpec


def remove_dead_code(gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
    """Drop nodes whose values nobody uses (collectives and waits are kept: they have effects)."""
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def ac_description(ac: Any) -> str:
    """``activation_checkpoint``'s mode in words, e.g. ``selective (each stage's first 2 blocks full)``
    or ``selective, every other matmul recomputed``."""
    mode = ac.mode
    if mode == "selective" and ac.selective_matmuls == "every_other":
        mode += ", every other matmul recomputed"
    return mode if ac.full_blocks == 0 else f"{mode} (each stage's first {ac.full_blocks} blocks full)"


def memory_policy_passes(config: Any) -> list[PassSpec]:
    """The policy's passes for a job (module docstring); ``config`` None: dead code and resharding only."""
    specs = [PassSpec("remove_dead_code", remove_dead_code, "drop unused pure nodes")]
    ac = config.activation_checkpoint if config is not None else None
    if ac is not None and (ac.mode != "none" or ac.full_blocks > 0 or config.training.loss_chunks > 1):
        specs.append(
            PassSpec(
                "tag_activations",
                tag_activations,
                f"activation checkpointing ({ac_description(ac)}, "
                f"{config.training.loss_chunks} loss chunks): save or recompute",
            )
        )
        specs.append(
            PassSpec(
                "recompute_activations",
                recompute_activations,
                "copy recomputed activations before their first backward use",
            )
        )
    reshard = "always" if config is None else config.parallelism.fsdp_reshard_after_forward
    if reshard != "never":
        which = "parameters" if reshard == "always" else "parameters but the head's"
        specs.append(
            PassSpec(
                "reshard_after_forward",
                reshard_after_forward,
                f"re-gather {which} for backward instead of keeping them from forward",
            )
        )
    return specs


__all__ = [
    "ac_description",
    "memory_policy_passes",
    "recompute_activations",
    "remove_dead_code",
    "reshard_after_forward",
    "tag_activations",
]
