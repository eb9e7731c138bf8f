"""auto_bucketing: PyTorch's overlap scheduler and bucketer, driven by our cost model.

Contract
--------
Reads: the graph's ``_c10d_functional`` collectives and their ``wait_tensor`` nodes (every
collective, whatever created it: FSDP gathers / reduce-scatters, TP all_reduces, ...), and each
node's ``meta["val"]`` (fake tensors of ONE trace: PyTorch re-traces its bucket code in that
fake mode). Our ``meta["custom"]`` tags are not read by PyTorch's scheduler.

Changes: calls ``torch._inductor.fx_passes.overlap_scheduling.schedule_overlap_bucketing``:

- it list-schedules the graph so that collectives start early and their waits are deferred
  until compute has hidden them (within ``MAX_IN_FLIGHT_GB`` of in-flight collective bytes and
  a prefetch memory budget of ``MAX_MEMORY_INCREASE_GB`` / ``MAX_MEMORY_INCREASE_RATIO`` over
  the graph's peak; both caps explicit: passing both as None crashes in PyTorch 2.13);
- with ``collective_bucketing=True`` it then merges collectives of the same kind, process
  group, dtype (and reduce op) when that keeps every overlap it found (overlap-preserving
  bucketing). PyTorch's merged all-gathers write into a preallocated buffer
  (``all_gather_into_tensor_out(..., out=buf)``): the graph is no longer functional, so this
  pass must run LAST (``check_config`` rejects any pass after it).

Decisions (identical on every rank, so that all ranks issue the same collectives):

- Runtimes come from ``graph_trainer.analysis.cost_model`` (``node_compute_time`` and
  ``collective_time``), always on the **H100** model (``DEVICE``): decisions target the
  production hardware and do not depend on where the pass runs, so CPU tests exercise exactly
  the schedule a GPU job gets. They reach PyTorch as ``custom_runtime_estimation`` and, for
  compute nodes, through ``torch_compat.run_overlap_scheduler``, which for the duration of the
  call replaces the compute estimate PyTorch makes itself: torch 2.13's roofline (it probes the
  GPU through Triton and crashes on CPU), torch 2.11's benchmark (an on-disk cache of earlier
  values first, then a GPU benchmark, aligned across ranks by an ``all_gather_object``).
- Compute and collectives estimated, never benchmarked, on CPU and CUDA alike, with no
  cross-rank alignment of estimates (every rank computes the same numbers from the same graph):
  2.13's ``compute_estimator = collective_estimator = "analytical"``; on 2.11, which has no
  ``compute_estimator``, the swapped benchmark and a skipped alignment.
- No pre-bucketing: 2.13's ``pre_bucketing_fsdp_collectives=False`` (its default greedy FSDP
  pre-bucketing sizes buckets with its own NCCL saturation model before scheduling, ignoring our
  cost model and overlap; 2.11 has none); all bucketing is the overlap-preserving kind, decided
  from our estimates.
- ``insert_overlap_deps=False``: graph order is what our executor runs (a plain GraphModule).
- Collective group sizes are read from the ops' arguments, node crossing from the resolved
  process group's ranks (``ranks_per_node = RANKS_PER_NODE``), as in ``analyze``.

Why backward reductions mostly stay unmerged: PyTorch's bucketer only merges two collectives when every
overlap the scheduler found survives. It records each overlap as graph edges
``start -> hiding compute -> wait`` and refuses a merge that would need a path between the two
starts. In a backward pass the compute hiding one parameter's reduce-scatter is the backward
of the previous module, which produces the NEXT parameter's gradient: there is always a path
from one reduce-scatter's start, through its hiding compute, to the next one's input ("has
ancestor conflicts" / "path exists between starts" in PyTorch's bucket log). So each
reduce-scatter stays alone but hidden, while all-gathers, whose inputs are all ready early,
merge (measured: docs/performance.md). DDP's gradient all-reduces are the reduce-scatters' case
(PyTorch's bucketer can merge all-reduces, and merges the few whose starts no compute path
joins); HSDP's all-reduces of the shards merge more, their inputs being the reduce-scatters'
waits. For per-block reduction buckets run ``transformer_block_bucketing`` before this pass.

Tags: PyTorch copies the ``meta`` (so the tags) of a bucket's FIRST collective onto
the nodes it creates for that bucket (buffer, copies, merged collective, wait, splits): their
``fsdp_param`` names only that first member, ``phase`` / ``fsdp_role`` are right. Any new
``call_function`` node still without tags gets ``{"phase": <first tagged neighbour's>,
"module_fqn": "", "auto_bucket": True}`` (none on the debug LLaMA). Existing nodes keep theirs.

Numerics: bucketing only copies data in and out of larger buffers; gathers move the same bytes
and reduce-scatters sum the same elements (bitwise the same if the backend sums each element's
contributions in the same order in a larger buffer: always for 2 ranks and for ring
reduce-scatters; see the tests). Reordering changes no value.

With ``ep_overlap`` earlier in the list: PyTorch's scheduler reorders the chunked MoE modules
too and breaks their schedule (a chunk waits on its dispatch before the other chunk issues
its own), so this pass re-applies ``ep_overlap``'s schedule to its result
(``ep_overlap.schedule_chunked_modules``: only the chunked modules' nodes move, and the outside nodes they
need, e.g. a bucket's wait, move to just before the module) and checks it as ``ep_overlap``
does. Values are unchanged: both only reorder.

Logs: collectives exposed / hidden by the scheduler's estimate (PyTorch's ``counters``), and the
gradient reductions (``fsdp_role`` ``reduce_grad``: FSDP reduce-scatters, DDP / HSDP
all-reduces) before and after, apart from other collectives of the same kind (TP all-reduces).

Errors: config validation rejects the pass without any multi-process collective layout
(dp_shard, dp_replicate, tp and ep all 1), and with any pass listed after it (including
``transformer_block_bucketing``: run it BEFORE ``auto_bucketing`` if you want both; then
auto_bucketing reschedules and may further merge the per-block buckets). At run time a graph
without collectives raises ``PassError``.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch.fx as fx

from graph_trainer.analysis.cost_model import collective_time, node_compute_time
from graph_trainer.analysis.devices import DEVICES
from graph_trainer.compiler.passes.ep_overlap import find_chunked_modules, reorders, schedule_chunked_modules
from graph_trainer.compiler.passes.registry import PassContext, PassError, PassSpec
from graph_trainer.errors import ConfigError
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import collective_bytes, collective_counts, format_counts, is_collective, kind
from graph_trainer.graph.sizes import SizeHints
from graph_trainer.graph.tags import AUTO_BUCKET, FSDP_ROLE, MODULE_FQN, PHASE, REDUCE_GRAD
from graph_trainer.torch_compat import inductor_counters, overlap_scheduler_problem, run_overlap_scheduler

logger = logging.getLogger("graph_trainer")

NAME = "auto_bucketing"
DEVICE = DEVICES["h100"]
"""The device model every decision is made for, whatever device runs the pass (see the docstring)."""
RANKS_PER_NODE = 8
MAX_IN_FLIGHT_GB = 5.0
MAX_MEMORY_INCREASE_GB = 1.0
MAX_MEMORY_INCREASE_RATIO = 0.05


class CostModelEstimator:
    """``custom_runtime_estimation(node, override_size) -> ms`` and the roofline stand-in, from our cost model."""

    def __init__(self, graph: fx.Graph, device=DEVICE, ranks_per_node: int = RANKS_PER_NODE):
        self.device, self.ranks_per_node = device, ranks_per_node
        self.hints = SizeHints.from_graph(graph)

    def compute_ms(self, node: fx.Node) -> float:
        return 1e3 * node_compute_time(node, self.device, self.hints)

    def __call__(self, node: fx.Node, override_size: int | None) -> float | None:
        if not is_collective(node):
            return self.compute_ms(node)
        seconds = collective_time(node, self.device, ranks_per_node=self.ranks_per_node, hints=self.hints)
        if override_size is not None:  # the bucketer asks for another size in bytes (0: latency only)
            latency = self.device.collective_latency
            nbytes = collective_bytes(node, self.hints)
            seconds = latency + ((seconds - latency) / nbytes * override_size if nbytes else 0.0)
        return 1e3 * seconds


def gradient_reduction_counts(graph: fx.Graph) -> Counter[str]:
    """Collectives tagged ``reduce_grad`` (the data-parallel gradient reductions), by kind."""
    return Counter(kind(n) for n in graph.nodes if is_collective(n) and tags.get(n, FSDP_ROLE) == REDUCE_GRAD)


def _tag_new_nodes(graph: fx.Graph) -> int:
    """Tag the nodes PyTorch added (no tags at all); returns how many."""
    added = [n for n in graph.nodes if n.op == "call_function" and not tags.tags(n)]
    for node in added:
        tags.replace(node, {PHASE: _neighbour_phase(node), MODULE_FQN: "", AUTO_BUCKET: True})
    # a node tagged above may feed another new node: second sweep fills phases still empty
    for node in added:
        if not tags.phase(node):
            tags.update(node, {PHASE: _neighbour_phase(node)})
    return len(added)


def _neighbour_phase(node: fx.Node) -> str:
    """The phase of the first input or user of ``node`` that has one ("" if none)."""
    return next((p for n in (*node.all_input_nodes, *node.users) if (p := tags.phase(n))), "")


def auto_bucketing(gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
    before, reductions_before = collective_counts(gm.graph), gradient_reduction_counts(gm.graph)
    if not sum(before.values()):
        raise PassError(
            "auto_bucketing: the graph has no collectives; it needs a multi-process layout (data parallel, TP or EP)"
        )
    estimator = CostModelEstimator(gm.graph)
    counters = inductor_counters()
    keys = ("overlap_scheduling_exposed", "overlap_scheduling_potentially_hidden", "collective_buckets")
    start = {k: counters[k] for k in keys}
    gm = run_overlap_scheduler(
        gm,
        estimator.compute_ms,
        max_in_flight_gb=MAX_IN_FLIGHT_GB,
        collective_bucketing=True,
        insert_overlap_deps=False,
        custom_runtime_estimation=estimator,
        collective_estimator="analytical",
        max_memory_increase_gb=MAX_MEMORY_INCREASE_GB,
        max_memory_increase_ratio=MAX_MEMORY_INCREASE_RATIO,
    )
    added = _tag_new_nodes(gm.graph)
    gm.graph.lint()
    gm.recompile()
    chunked = find_chunked_modules(gm.graph)
    if chunked and reorders(context.config):
        # PyTorch's list scheduler knows nothing of ep_overlap's two-chunk schedule and undoes it
        # (it waits on a chunk's dispatch before the other chunk issues its own): restore it.
        schedule_chunked_modules(gm, chunked)
        logger.info("auto_bucketing: restored ep_overlap's schedule of %d chunked modules", len(chunked))
    delta = {k: counters[k] - start[k] for k in keys}
    logger.info(
        "auto_bucketing: collectives %s -> %s (gradient reductions %s -> %s), exposed %d, hidden-able %d, "
        "buckets %d, new nodes %d (estimates: %s model)",
        format_counts(before),
        format_counts(collective_counts(gm.graph)),
        format_counts(reductions_before),
        format_counts(gradient_reduction_counts(gm.graph)),
        delta[keys[0]],
        delta[keys[1]],
        delta[keys[2]],
        added,
        DEVICE.name,
    )
    return gm


def check_config(cfg: Any, degrees: dict[str, int]) -> None:
    problem = overlap_scheduler_problem()
    if problem:
        raise ConfigError(f"compile.passes: {problem}")
    if all(degrees.get(k, 1) <= 1 for k in ("dp_replicate", "dp_shard", "tp", "ep")):
        raise ConfigError(
            "compile.passes: auto_bucketing schedules and buckets collectives and needs a "
            "multi-process layout (parallelism.dp_shard, dp_replicate, tp or ep > 1)"
        )
    passes = list(getattr(getattr(cfg, "compile", None), "passes", []) or [])
    if NAME in passes and passes[-1] != NAME:
        raise ConfigError(
            f"compile.passes: auto_bucketing must be the last pass (its buckets write with out=, "
            f"the graph is no longer functional); got {passes}. To combine it with "
            "transformer_block_bucketing, list transformer_block_bucketing first"
        )


AUTO_BUCKETING = PassSpec(
    NAME,
    auto_bucketing,
    "PyTorch's overlap scheduler + overlap-preserving bucketing, on our (H100) cost model; must run last",
    check_config,
    on_fsdp_collectives=True,
)

__all__ = ["AUTO_BUCKETING", "CostModelEstimator", "auto_bucketing", "gradient_reduction_counts"]
