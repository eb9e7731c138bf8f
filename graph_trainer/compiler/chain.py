"""The compile chain: what a traced step goes through before it runs.

    config -> build (graph_trainer.build) -> trace (graph_trainer.compiler.tracer)
           -> memory policy (graph_trainer.compiler.memory_policy) -> passes (graph_trainer.compiler.passes)
           -> backend (graph_trainer.compiler.backend) -> run

After tracing, each link takes the graph the previous one made and returns a new one:

- ``apply_memory_policy``: dead code out, activations saved or recomputed, parameters re-gathered
  for backward (bitwise the traced graph);
- ``apply_passes``: the user's ``--compile.passes``, in order (value-preserving ones bitwise);
- ``compile_graph``: op by op (``none``), or Inductor regions / the whole step (``inductor``).

``transform_graph`` runs the first two (what fake traces of real-size jobs analyse); the trainer
calls the three in turn. With weights resident per step (``compiler.resident``: a gather, a
microbatch and a reduce graph) ``transform_resident`` runs them on each graph: the passes that act
on SimpleFSDP's collectives on the gather and reduce graphs, the others on the microbatch's.
One ``PassRunner`` serves the memory policy and the passes, so their pass logs and
``--compile.dump_graphs`` files are numbered in the order the passes ran.
"""

from __future__ import annotations

import logging
import os

import torch.fx as fx

from graph_trainer.compiler.backend import BackendReport, apply_backend
from graph_trainer.compiler.memory_policy import memory_policy_passes
from graph_trainer.compiler.passes import PassContext, user_passes
from graph_trainer.compiler.passes.runner import PassRunner
from graph_trainer.compiler.resident import ResidentTrace
from graph_trainer.config import Compile

logger = logging.getLogger("graph_trainer")


def apply_memory_policy(gm: fx.GraphModule, runner: PassRunner) -> fx.GraphModule:
    """The memory policy (``graph_trainer.compiler.memory_policy``) for the runner's job."""
    return runner.run(gm, memory_policy_passes(runner.context.config))


def apply_passes(gm: fx.GraphModule, runner: PassRunner, names: list[str] | None = None) -> fx.GraphModule:
    """The user's passes: ``names``, or the job's ``compile.passes``."""
    if names is None:
        names = runner.context.config.compile.passes if runner.context.config is not None else []
    return runner.run(gm, user_passes(names))


def transform_graph(
    gm: fx.GraphModule, context: PassContext, names: list[str] | None = None, dump_folder: str = ""
) -> fx.GraphModule:
    """Memory policy, then passes (``names`` or the job's): the graph the backend would get."""
    runner = PassRunner(context, dump_folder)
    return apply_passes(apply_memory_policy(gm, runner), runner, names)


def passes_by_graph(names: list[str]) -> tuple[list[str], list[str]]:
    """(the passes for a microbatch's graph, those for the once-per-step gather and reduce graphs)
    of ``names`` with weights resident per step (``PassSpec.on_fsdp_collectives``)."""
    once = [n for n in names if user_passes([n])[0].on_fsdp_collectives]
    return [n for n in names if n not in once], once


def transform_resident(trace: ResidentTrace, context: PassContext, dump_folder: str = "") -> None:
    """``transform_graph`` for a step on resident weights (``compiler.resident``), in place: the
    step graph gets the memory policy and the passes that do not act on SimpleFSDP's collectives,
    the gather and reduce graphs those that do (their dumps in ``gather``/``reduce`` subfolders)."""
    names = context.config.compile.passes if context.config is not None else []
    step_passes, once = passes_by_graph(names)
    trace.step.gm = transform_graph(trace.step.gm, context, step_passes, dump_folder)
    for part in ("gather", "reduce"):
        runner = PassRunner(context, dump_folder and os.path.join(dump_folder, part))
        setattr(trace, part, apply_passes(getattr(trace, part), runner, once))


def compile_graph(gm: fx.GraphModule, settings: Compile, deterministic: bool) -> tuple[fx.GraphModule, BackendReport]:
    """The backend: the graph that runs, and what the backend did (logged)."""
    if settings.backend != "none":
        logger.info("compiling the graph with %s (%s) ...", settings.backend, settings.inductor_scope)
    gm, report = apply_backend(gm, settings.backend, settings.inductor_scope, settings.cache_dir, deterministic)
    if settings.backend != "none":
        logger.info("%s", report.summary())
    return gm, report


__all__ = [
    "apply_memory_policy",
    "apply_passes",
    "compile_graph",
    "passes_by_graph",
    "transform_graph",
    "transform_resident",
]
