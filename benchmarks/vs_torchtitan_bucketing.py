"""Our transformer_block_bucketing against torchtitan 0.3.0's own, on one traced graph.

    python -m benchmarks.vs_torchtitan_bucketing [--world_size 8] [--ranks_per_node 8] [--section.key value ...]
    python -m benchmarks.vs_torchtitan_bucketing --world_size 8 --model.flavor 8B --training.seq_len 8192 \\
        --training.local_batch_size 1 --training.mixed_precision_param bfloat16

The job (default: Llama3 debugmodel) is traced ONCE on the fake process group at
``world_size`` with ``compile.passes`` empty, so the graph has had only the default passes
(dead-code removal and, unless ``fsdp_reshard_after_forward never``, reshard_after_forward).
That graph is deep-copied (the copies share the trace's fake mode) and each copy gets one
transformer-block bucketing pass:

- ``ours``: ``graph_trainer.compiler.passes.transformer_block_bucketing`` with the model's bucket plan
  (``[["tok_embeddings"], ["layers.0"], ..., ["norm", "output"]]``), called as ``run_passes``
  would call it (then lint).
- ``torchtitan``: ``torchtitan.experiments.graph_trainer.fsdp_passes.
  joint_transformer_block_bucketing_reordering_pass``, the joint forward+backward pass
  torchtitan's graph_trainer runs by default (``passes.py``), on the SAME plan, with
  ``fsdp_param_module_order`` from the model's parameter FQNs as torchtitan computes it, and
  ``insert_overlap_deps=False`` (its default). It reads ``node.meta["custom"]["module_fqn"]``,
  the tag our tracer already writes, so no module-stack adaptation is needed.

Both graphs (and the unbucketed one, for reference) are simulated with
``graph_trainer.analysis.simulator.simulate`` on ``devices.DEVICES["h100"]``; the table
gives collectives by type and simulated step / exposed communication time
(``graph_trainer.cli.analyze.summary_row``; its "trace s" column is the pass time here).

Adaptations, all local to this script, none to torchtitan:

1. Before its bucketing, torchtitan's pipeline (``passes.py``) runs ``eliminate_dead_code_pass``,
   ``canonicalize_graph_pass`` and ``deduplicate_fsdp_unshard_chains_pass``. The first two run
   here on the torchtitan copy: the pass needs them (without them its prefetch moves the
   ``norm``/``output`` gather bucket above the ``detach`` of its parameter, and the pass
   fails its own ``graph.lint()``). The third is left out: it folds every
   backward re-gather made by reshard_after_forward into the forward gather (15 -> 8
   all-gathers on the debug model, parameters then live from forward to backward), so the
   two passes would no longer start from the same collectives. Canonicalization removes
   ``detach`` nodes and identity views and turns ``view`` into ``reshape``: all aliasing ops,
   free in our cost model.
2. ``node.meta["autograd_backward"]`` (torchtitan's forward/backward test,
   ``common_utils._is_backward_node``) is set on the torchtitan copy from our tag
   ``node.meta["custom"]["phase"] == "backward"`` (which includes the re-gathers
   reshard_after_forward puts in the backward).
3. PyTorch's ``ManualOverlapScheduler`` estimates every compute node with
   ``overlap_scheduling.estimate_roofline_runtime_ms``, which asks Triton for a GPU's DRAM
   bandwidth and raises ``0 active drivers`` on a CPU-only machine. While torchtitan's pass
   runs, that function is replaced by our H100 compute estimate
   (``cost_model.node_compute_time(node, DEVICES["h100"]) * 1e3`` ms) and restored after. The
   manual scheduler's bucketing and prefetch order follow the plan, not these estimates.

Only this script imports ``torchtitan.experiments``; the project itself does not.
"""

from __future__ import annotations

import copy
import sys
import time

import torch
import torch.fx as fx


def _cpu_roofline(device):
    """PyTorch's GPU roofline estimate replaced by ours while torchtitan's pass runs."""
    from graph_trainer.analysis.cost_model import node_compute_time
    from graph_trainer.graph.sizes import SizeHints
    from graph_trainer.torch_compat import roofline_estimate

    hints = SizeHints()
    return roofline_estimate(lambda node: node_compute_time(node, device, hints) * 1e3)


def run_ours(gm: fx.GraphModule, cfg, degrees: dict, plan: list[list[str]]) -> fx.GraphModule:
    from graph_trainer.compiler.passes import PassContext
    from graph_trainer.compiler.passes.transformer_block_bucketing import TRANSFORMER_BLOCK_BUCKETING

    context = PassContext(config=cfg, degrees=degrees, extras={"bucket_plan": plan})
    gm = TRANSFORMER_BLOCK_BUCKETING.fn(gm, context)
    gm.graph.lint()
    return gm


def run_torchtitan(gm: fx.GraphModule, plan: list[list[str]], param_fqns: list[str], device) -> fx.GraphModule:
    from torchtitan.experiments.graph_trainer.fsdp_passes import (
        get_fsdp_param_module_order,
        joint_transformer_block_bucketing_reordering_pass,
    )
    from torchtitan.experiments.graph_trainer.remove_noop_passes import (
        canonicalize_graph_pass,
        eliminate_dead_code_pass,
    )

    from graph_trainer.graph import tags
    from graph_trainer.graph.tags import BACKWARD

    # torchtitan's mandatory normalization before its bucketing (passes.py), less
    # deduplicate_fsdp_unshard_chains_pass, which would fold our backward re-gathers
    # (reshard_after_forward) into the forward ones.
    for normalize in (eliminate_dead_code_pass, canonicalize_graph_pass):
        gm = normalize(gm, None)

    for node in gm.graph.nodes:
        node.meta["autograd_backward"] = tags.phase(node) == BACKWARD
    with _cpu_roofline(device):
        gm = joint_transformer_block_bucketing_reordering_pass(
            gm, None, module_bucket_plans=plan, fsdp_param_module_order=get_fsdp_param_module_order(param_fqns)
        )
    gm.graph.lint()
    return gm


def main(argv: list[str]) -> int:
    from graph_trainer.analysis.devices import DEVICES
    from graph_trainer.analysis.simulator import format_table, simulate
    from graph_trainer.build import build_model
    from graph_trainer.cli.analyze import summary_row
    from graph_trainer.config_loading import load_config, take_flag
    from graph_trainer.distributed.parallel_dims import ParallelDims, resolve_parallel_degrees
    from graph_trainer.fake_trace import fake_world, trace_job
    from graph_trainer.validation import validate_config
    from models.registry import MODEL_SPECS

    argv, world_size = take_flag(argv, "--world_size", 8, int)
    argv, ranks_per_node = take_flag(argv, "--ranks_per_node", 8, int)
    device = DEVICES["h100"]
    cfg = load_config(argv)
    cfg.compile.passes = []
    validate_config(cfg, world_size)
    spec = MODEL_SPECS[cfg.model.name]
    model = build_model(spec.build, spec.flavors[cfg.model.flavor], torch.device("meta"), cfg.training.seed)
    plan = spec.bucket_plan(model)
    param_fqns = [name for name, _ in model.named_parameters()]
    degrees = ParallelDims.from_degrees(resolve_parallel_degrees(cfg.parallelism, world_size)).as_dict()

    rows = []
    with fake_world(world_size):
        start = time.perf_counter()
        traced = trace_job(cfg, world_size)
        trace_s = time.perf_counter() - start
        base = traced.gm
        graphs = {"none": (base, 0.0)}
        for label, run in (
            ("ours", lambda gm: run_ours(gm, cfg, degrees, plan)),
            ("torchtitan", lambda gm: run_torchtitan(gm, plan, param_fqns, device)),
        ):
            start = time.perf_counter()
            gm = run(copy.deepcopy(base))
            graphs[label] = (gm, time.perf_counter() - start)
        for label, (gm, pass_s) in graphs.items():
            start = time.perf_counter()
            result = simulate(gm.graph, device, ranks_per_node=ranks_per_node)
            row = summary_row(label, result, pass_s, time.perf_counter() - start, len(gm.graph.nodes))
            row["pass s"] = row.pop("trace s")
            rows.append(row)

    t = cfg.training
    print(
        f"{cfg.model.name} {cfg.model.flavor}, world size {world_size} ({degrees}), per-rank batch "
        f"{t.local_batch_size}x{t.seq_len}, param dtype {t.mixed_precision_param}, reduce dtype "
        f"{t.mixed_precision_reduce}, reshard_after_forward {cfg.parallelism.fsdp_reshard_after_forward}; "
        f"one trace ({trace_s:.1f} s, {len(base.graph.nodes)} nodes), simulated on {device.name} "
        f"({ranks_per_node} ranks/node)"
    )
    print(
        "ours = graph_trainer transformer_block_bucketing; torchtitan = torchtitan 0.3.0 "
        "joint_transformer_block_bucketing_reordering_pass; none = the trace both started from"
    )
    print(f"bucket plan ({len(plan)} buckets): {plan[:2]} ... {plan[-1:]}")
    columns = (
        "AG",
        "RS",
        "exposed ms",
        "exposed %",
        "step ms",
        "AR",
        "A2A",
        "comm ms",
        "compute ms",
        "peak GiB",
        "nodes",
        "pass s",
        "sim s",
    )
    print(format_table([{"pass": row["passes"], **{k: row[k] for k in columns}} for row in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
