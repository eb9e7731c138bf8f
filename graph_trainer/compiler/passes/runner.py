"""Running a list of graph passes: time, node count and collectives per pass, dumps, lint.

``PassRunner.run(gm, specs)`` applies each ``PassSpec`` in order. For each pass it logs wall
time, node count and collectives by type before -> after, can dump the readable graph code
before and after (``NN_<pass>_before.py`` / ``_after.py``, numbered across every ``run`` of one
runner; in ``DIR/rank<r>/`` when several processes run: each rank has its own graph), and lints
the result: a pass that leaves a broken graph, or returns something else than a GraphModule,
raises ``PassError`` naming it.
"""

from __future__ import annotations

import logging
import os
import time

import torch.distributed as dist
import torch.fx as fx

from graph_trainer.compiler.passes.registry import PassContext, PassError, PassSpec
from graph_trainer.graph.collectives import collective_counts, format_counts

logger = logging.getLogger("graph_trainer")


class PassRunner:
    """Applies passes with the same context, numbering dumps across calls (see the module docstring)."""

    def __init__(self, context: PassContext, dump_folder: str = ""):
        self.context = context
        self.dump_folder = dump_folder
        self.index = 0

    def run(self, gm: fx.GraphModule, specs: list[PassSpec]) -> fx.GraphModule:
        for spec in specs:
            gm = self._run_one(gm, spec)
        return gm

    def _run_one(self, gm: fx.GraphModule, spec: PassSpec) -> fx.GraphModule:
        before_nodes, before = len(gm.graph.nodes), collective_counts(gm.graph)
        self._dump(gm, spec.name, "before")
        start = time.perf_counter()
        result = spec.fn(gm, self.context)
        elapsed = time.perf_counter() - start
        if not isinstance(result, fx.GraphModule):
            raise PassError(f"pass {spec.name!r} returned {type(result).__name__}, not a GraphModule")
        try:
            result.graph.lint()
        except Exception as e:  # lint raises RuntimeError with the offending node
            raise PassError(f"pass {spec.name!r} left an invalid graph: {e}") from e
        self._dump(result, spec.name, "after")
        self.index += 1
        logger.info(
            "pass %s: %.2fs, nodes %d -> %d, collectives %s -> %s",
            spec.name,
            elapsed,
            before_nodes,
            len(result.graph.nodes),
            format_counts(before),
            format_counts(collective_counts(result.graph)),
        )
        return result

    def _dump(self, gm: fx.GraphModule, name: str, when: str) -> None:
        if not self.dump_folder:
            return
        folder = self.dump_folder
        if dist.is_initialized() and dist.get_world_size() > 1:
            folder = os.path.join(folder, f"rank{dist.get_rank()}")  # ranks' graphs differ (their groups, offsets)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{self.index:02d}_{name}_{when}.py"), "w") as f:
            f.write(gm.print_readable(print_output=False, include_stride=True, include_device=True))


__all__ = ["PassRunner"]
