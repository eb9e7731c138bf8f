"""Graph passes: the registry behind ``--compile.passes`` and the runner that applies them.

Every pass has one signature, ``pass_fn(gm, context) -> gm``. ``context`` (``PassContext``)
carries what a pass may need beyond the graph: the job config, the resolved parallel
degrees and the model's bucket plan. A pass finds the nodes it works on through
``node.meta["custom"]`` tags written by the code that created them (see
``graph_trainer.tracer`` for the tags every node carries).

``run_passes`` applies the default passes (always; they keep values bitwise) and then the
user's passes in the order given. For each pass it logs wall time, node count and
collectives by type before -> after, can dump the readable graph code before and after,
and lints the result: a pass that leaves a broken graph raises ``PassError`` naming it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx

from graph_trainer.analysis.collectives import collective_counts, format_counts

logger = logging.getLogger("graph_trainer")


class PassError(RuntimeError):
    """A graph pass failed or left the graph invalid."""


@dataclass
class PassContext:
    """What a pass may read besides the graph."""

    config: Any = None
    """The JobConfig of the run (None in unit tests that build graphs by hand)."""
    degrees: dict[str, int] = field(default_factory=dict)
    """Resolved parallel degrees: dp_replicate, dp_shard, tp, ep."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Model-provided information (e.g. the transformer block bucket plan)."""


@dataclass(frozen=True)
class PassSpec:
    """A registered pass: its function and the config check run at validation time."""

    name: str
    fn: Callable[[fx.GraphModule, PassContext], fx.GraphModule]
    description: str
    check_config: Callable[[Any, dict[str, int]], None] = lambda cfg, degrees: None


PASS_REGISTRY: dict[str, PassSpec] = {}
"""User-selectable passes by name (``--compile.passes``)."""


def register_pass(spec: PassSpec) -> PassSpec:
    if spec.name in PASS_REGISTRY:
        raise ValueError(f"pass {spec.name!r} registered twice")
    PASS_REGISTRY[spec.name] = spec
    return spec


def remove_dead_code(gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
    """Drop nodes whose values nobody uses (collectives and waits are kept: they have effects)."""
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


DEFAULT_PASSES: list[PassSpec] = [
    PassSpec("remove_dead_code", remove_dead_code, "drop unused pure nodes"),
]
"""Passes that always run first; each keeps every value bitwise."""


def _dump(gm: fx.GraphModule, folder: str, index: int, name: str, when: str) -> None:
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
    specs = list(DEFAULT_PASSES)
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
