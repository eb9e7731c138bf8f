"""The user's graph passes (``--compile.passes``): the registry and what each needs before tracing.

Every pass has one signature, ``pass_fn(gm, context) -> gm``. ``context`` (``PassContext``)
carries what a pass may need beyond the graph: the job config, the resolved parallel degrees
and the model's bucket plan. A pass finds the nodes it works on through the tags of
``graph_trainer.graph.tags`` written by the code that created them, never by matching patterns.
The passes run after the memory policy, in the order given, through ``runner.PassRunner``
(``graph_trainer.compiler.chain`` says where in the step's stages).
"""

from __future__ import annotations

from graph_trainer.compiler.passes.auto_bucketing import AUTO_BUCKETING
from graph_trainer.compiler.passes.ep_overlap import EP_OVERLAP
from graph_trainer.compiler.passes.registry import (
    PASS_REGISTRY,
    PassContext,
    PassError,
    PassSpec,
    register_pass,
    unknown_pass,
)
from graph_trainer.compiler.passes.transformer_block_bucketing import TRANSFORMER_BLOCK_BUCKETING

register_pass(TRANSFORMER_BLOCK_BUCKETING)
register_pass(AUTO_BUCKETING)
register_pass(EP_OVERLAP)


def user_passes(names: list[str]) -> list[PassSpec]:
    """The registered passes named in ``names``, in that order (``PassError`` for an unknown one)."""
    for name in names:
        if name not in PASS_REGISTRY:
            raise PassError(unknown_pass(name))
    return [PASS_REGISTRY[name] for name in names]


def prepare_model_for_passes(model, config) -> None:
    """Let each listed pass prepare the model before tracing (``PassSpec.prepare_model``)."""
    for spec in user_passes(config.compile.passes):
        if spec.prepare_model is not None:
            spec.prepare_model(model, config)


__all__ = [
    "PASS_REGISTRY",
    "PassContext",
    "PassError",
    "PassSpec",
    "prepare_model_for_passes",
    "register_pass",
    "unknown_pass",
    "user_passes",
]
