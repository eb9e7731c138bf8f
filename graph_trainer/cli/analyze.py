"""Simulate a job's training step on a device model, from one CPU process.

    python -m graph_trainer.cli.analyze --world_size N [--rank R] [--device h100|h200|h100_hbm2e_500w|cpu]
        [--attention cudnn|fa2|fa3] [--ranks_per_node 8] [--trace_out trace.json]
        [--compare "none;pass_a;pass_a,pass_b"] [--ac_modes none,selective,full]
        [--device_memory_gib G] [--json OUT.json] [--section.key value ...]

    python -m graph_trainer.cli.analyze --world_size 8 --model.flavor 8B --training.seq_len 8192 \\
        --training.local_batch_size 1 --training.mixed_precision_param bfloat16

The job flags are those of ``train.py`` (``graph_trainer.config_loading.load_config``); the flags
above are taken out first (``cli.analyze_flags``). The job is traced on the fake process group at
``world_size`` as global rank ``--rank`` (default 0: its mesh coordinates, e.g. which
context-parallel chunks it holds; ``graph_trainer.fake_trace``: fake tensors, nothing allocated,
no communication),
its passes run (``compile.passes``, or each list given to ``--compare``, one trace per list;
``none`` is the empty list; with ``--ac_modes``, each list once per activation-checkpointing
mode), and the graph is simulated with ``graph_trainer.analysis.simulator`` on the device model
(op by op; an inductor job as ``analysis.fusion`` fuses its kernels): ``--device`` names one of
``analysis.devices.DEVICES``, ``--attention`` the rates of its fused attention kernel (cuDNN,
FlashAttention-2 or -3; default the device's own; ``cli.device_flags``). Prints, per pass list, the
collectives by type, simulated step (the graph, x M microbatches, then the optimizer step:
``analysis.optimizer_step``, its own "optim ms"), tokens/s and model TFLOP/s per GPU
(``throughput``), compute / communication / exposed communication time (one graph) and the
estimated peak memory of one rank with its parts (parameters, gradients, AdamW state,
activations: ``graph_trainer.analysis.memory.estimate_step_memory``), then the communication
by collective kind, then per pass list the bytes one rank sends over NVLink and over
InfiniBand, in all and by kind (``traffic_line``; ``--ranks_per_node``, at least 1, places
global rank ``r`` on node ``r // ranks_per_node``), then one memory line per pass list and a
warning where the peak exceeds the device's memory (``--device_memory_gib``, default the
device's: 79.1 GiB for ``h100``, none for ``cpu``). ``--trace_out`` writes a Chrome/Perfetto
timeline (one file per pass list with ``--compare``).

A pipeline job (``--parallelism.pp`` P > 1) is traced stage by stage (``fake_trace.trace_pipeline``)
and estimated by ``graph_trainer.pipelining.timeline``: each stage's pieces are simulated, the
schedule is replayed with point-to-point transfers between stages, and every pipeline rank's memory
counts the microbatches its schedule keeps in flight. ``--pp_schedules a,b`` compares schedules
(default: ``parallelism.pp_schedule``). Prints one row per pass list and schedule (simulated step,
each rank's optimizer step last, bubble fraction, tokens/s and model TFLOP/s per GPU, the highest
rank's peak memory and its parts), then per stage its blocks, rank and the seconds of its pieces
(F, B, I, W; with weights resident per step, ``parallelism.fsdp_collectives``, also its once-per-step
gather and reduce) and what one microbatch holds, then the memory line of every pipeline rank.

``--json OUT.json`` also writes the tables for scripts and plots: ``{"job": the first line,
"summary": [...], "stages": [...], "kinds": [...]}``, one object per printed row keyed by the
printed table's column names ("tokens/s/GPU", "peak GiB", ...), numbers unrounded; "stages" is a
pipeline job's table of stages (empty without one), "kinds" the table by collective kind (empty for
a pipeline job). Its folder is checked writable before anything is traced.

With ``--training.global_batch_size`` giving M > 1 microbatches per step, the simulated graph is
one microbatch; the memory estimate counts the gradient accumulation buffer, and one line per pass
list (``accumulation_line``) gives the step (M graphs and the optimizer step), and what the gradient reductions send and
hold when every microbatch reduces its gradients (``fsdp_collectives`` per_microbatch) against
accumulating them unreduced and reducing once.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from dataclasses import dataclass

from graph_trainer.analysis.fusion import fuses
from graph_trainer.analysis.memory import (
    adamw_memory,
    estimate_peak_memory,
    estimate_step_memory,
    memory_warning,
)
from graph_trainer.analysis.simulator import format_table, simulate
from graph_trainer.cli.analyze_flags import CommandLine, parse_command_line
from graph_trainer.compiler.memory_policy import ac_description
from graph_trainer.config import JobConfig
from graph_trainer.distributed.parallel_dims import ParallelDims, job_microbatches, resolve_parallel_degrees
from graph_trainer.errors import ConfigError
from graph_trainer.fake_trace import fake_world, trace_job, trace_pipeline
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import is_collective
from graph_trainer.graph.tags import FSDP_ROLE, REDUCE_GRAD
from graph_trainer.pipelining.timeline import estimate_pipeline, traced_optimizer_step
from models.registry import MODEL_SPECS, model_args

GIB = float(1 << 30)
GB = 1e9
"""Link traffic is in decimal GB, the unit of link bandwidths (GB/s)."""
_KIND_COLUMNS = (("all_gather", "AG"), ("reduce_scatter", "RS"), ("all_reduce", "AR"), ("all_to_all", "A2A"))


def analyze_job(cfg, world_size: int, device, ranks_per_node: int = 8, rank: int = 0):
    """Trace ``cfg`` on the fake process group as global rank ``rank`` and simulate it.

    Returns (traced step, SimulationResult, seconds tracing + passes, seconds simulating).
    """
    start = time.perf_counter()
    with fake_world(world_size, rank):
        traced = trace_job(cfg, world_size, gpu_attention=device.fused_attention)
        traced_s = time.perf_counter() - start
        # Groups are resolved while the fake process group is alive.
        result = simulate(traced.gm.graph, device, ranks_per_node=ranks_per_node, fused=fuses(cfg.compile.backend))
    return traced, result, traced_s, time.perf_counter() - start - traced_s


def analyze_pipeline(cfg, world_size: int, device, ranks_per_node: int = 8, optimizer=None, rank: int = 0):
    """Trace a pipeline job stage by stage on the fake process group (as global ``rank``'s mesh
    coordinates outside pp) and estimate its step.

    Returns (``timeline.PipelineEstimate``, the stages' blocks, seconds tracing + passes, seconds estimating).
    """
    start = time.perf_counter()
    with fake_world(world_size, rank):
        traced = trace_pipeline(cfg, world_size, gpu_attention=device.fused_attention)
        traced_s = time.perf_counter() - start
        pipeline = traced.layout.pipeline
        plan, stages, fused = pipeline.plan, traced.stages, fuses(cfg.compile.backend)
        args = (device, world_size, ranks_per_node, optimizer, traced.resident, fused, cfg.training)
        estimate = estimate_pipeline(plan, stages, *args)
    return estimate, pipeline.stage_blocks, traced_s, time.perf_counter() - start - traced_s


def throughput(cfg: JobConfig, world_size: int, microbatches: int, step_seconds: float) -> dict[str, float]:
    """{"tokens/s/GPU", "TFLOP/s/GPU"} of a simulated step: the global batch's tokens (local batch x
    seq x microbatches x data-parallel ranks) over the step and the world size, and their model
    FLOPs (``flops_per_token``, as the trainer's MFU counts them)."""
    t = cfg.training
    dims = ParallelDims.from_degrees(resolve_parallel_degrees(cfg.parallelism, world_size))
    per_gpu = t.local_batch_size * t.seq_len * microbatches * dims.dp_size / step_seconds / world_size
    flops = MODEL_SPECS[cfg.model.name].flops_per_token(model_args(cfg), t.seq_len)
    return {"tokens/s/GPU": per_gpu, "TFLOP/s/GPU": per_gpu * flops / 1e12}


def pipeline_rows(label: str, cfg, world_size: int, estimate, stage_blocks) -> tuple[dict, list[dict]]:
    """(The summary row of one pipeline estimate, one row per stage; its throughput: ``throughput``.)"""
    plan, timeline = estimate.plan, estimate.timeline
    rank, memory = estimate.worst_memory()
    p = memory.peak
    summary = {
        "passes": label,
        "schedule": plan.schedule,
        "stages": plan.num_stages,
        "microbatches": plan.microbatches,
        "step ms": timeline.step_seconds * 1e3,
        "optim ms": max(o.seconds for o in estimate.optimizer.values()) * 1e3,  # (its rank's, in the step)
        "bubble %": 100 * timeline.bubble_fraction,
        **throughput(cfg, world_size, plan.microbatches, timeline.step_seconds),
        "peak GiB": p.total / GIB,
        "at rank": rank,
        "params GiB": p.params / GIB,
        "resident GiB": p.resident_weights / GIB,
        "grads GiB": (p.grads + p.accumulated_grads) / GIB,
        "optim GiB": p.optimizer / GIB,
        "activ GiB": p.activations / GIB,
    }
    stages = [
        {
            "passes": label,
            "schedule": plan.schedule,
            "stage": s,
            "blocks": f"{blocks.start}..{blocks.stop - 1}",
            "rank": plan.stage_to_rank[s],
            **{f"{k} ms": estimate.costs[s].seconds[k] * 1e3 for k in ("F", "B", "I", "W")},
            **{f"{k} ms": estimate.costs[s].once_seconds.get(k, 0.0) * 1e3 for k in ("gather", "reduce")},
            "held/mb GiB": estimate.costs[s].saved_bytes / GIB,
        }
        for s, blocks in enumerate(stage_blocks)
    ]
    return summary, stages


def summary_row(
    label, result, trace_s, sim_s, nodes, memory=None, optim=None, microbatches=1, rates=None
) -> dict[str, object]:
    """One table row. ``memory`` (a ``StepMemoryEstimate``): "peak GiB" is the step's peak and its parts
    follow; without it, "peak GiB" is the graph's own peak (no optimizer state). "step ms": ``microbatches``
    graphs and ``optim``, the optimizer step (an ``OptimizerStepCost``, also its own "optim ms");
    ``rates(step_seconds)`` (``throughput`` of the job) adds its columns after them."""
    counts = {k: 0 for k, _ in _KIND_COLUMNS}
    for c in result.collectives:
        counts[c.kind] = counts.get(c.kind, 0) + 1
    row: dict[str, object] = {"passes": label, "nodes": nodes}
    row.update({short: counts[k] for k, short in _KIND_COLUMNS})
    step_seconds = microbatches * result.step_time + (optim.seconds if optim else 0.0)
    row.update({"step ms": step_seconds * 1e3, "optim ms": (optim.seconds if optim else 0.0) * 1e3})
    row.update(rates(step_seconds) if rates is not None else {})
    row.update(
        {
            "compute ms": result.compute_time * 1e3,
            "comm ms": result.comm_time * 1e3,
            "exposed ms": result.exposed_comm_time * 1e3,
            "exposed %": 100 * result.exposed_fraction,
            "peak GiB": (memory.peak_bytes if memory is not None else result.peak_memory_bytes) / GIB,
        }
    )
    if memory is not None:
        peak = memory.peak
        row.update(
            {
                "params GiB": peak.params / GIB,
                "grads GiB": (peak.grads + peak.accumulated_grads) / GIB,  # with the accumulation buffer
                "optim GiB": peak.optimizer / GIB,
                "activ GiB": peak.activations / GIB,
            }
        )
    row.update({"trace s": trace_s, "sim s": sim_s})
    return row


def kind_rows(label: str, result) -> list[dict[str, object]]:
    return [
        {
            "passes": label,
            "kind": kind,
            "count": int(v["count"]),
            "GiB": v["bytes"] / GIB,
            "time ms": v["time"] * 1e3,
            "exposed ms": v["exposed"] * 1e3,
            "hidden %": 100 * (1 - v["exposed"] / v["time"]) if v["time"] else 100.0,
        }
        for kind, v in sorted(result.by_kind().items())
    ]


def traffic_line(label: str, result) -> str:
    """The bytes one rank sends in the step over NVLink and over InfiniBand, in all and per
    collective kind present ("NVLink + InfiniBand" each): ``SimulationResult.by_kind``, each
    collective split as ``cost_model.collective_traffic`` splits it (its NIC's share, the rest NVLink)."""
    kinds = result.by_kind()
    order = [k for k, _ in _KIND_COLUMNS if k in kinds] + sorted(set(kinds) - {k for k, _ in _KIND_COLUMNS})
    parts = ", ".join(f"{k} {_gb(kinds[k]['sent_intra_node'])} + {_gb(kinds[k]['sent_inter_node'])}" for k in order)
    line = (
        f"bytes/rank ({label}): over NVLink {_gb(result.sent_bytes(inter_node=False))} GB, "
        f"over InfiniBand {_gb(result.sent_bytes(inter_node=True))} GB"
    )
    return f"{line} (by kind, NVLink + InfiniBand: {parts} GB)" if parts else line


def gradient_reduction_costs(graph, result) -> tuple[float, int, int]:
    """One microbatch's gradient reductions (collectives tagged ``reduce_grad``) in ``result``, the
    simulation of ``graph``: (bytes this rank sends for them, bytes of the reduced gradients the
    graph outputs, bytes of the unreduced gradients they read: the reduce-scatters' full inputs, or
    the all-reduces' where nothing is scattered (DDP), in the reduce dtype)."""
    reductions = {n.name for n in graph.nodes if is_collective(n) and tags.get(n, FSDP_ROLE) == REDUCE_GRAD}
    records = [c for c in result.collectives if c.name in reductions]
    # HSDP's all-reduce reads the reduce-scatter's shard: only the reduce-scatters read whole gradients.
    scattered = [c for c in records if c.kind == "reduce_scatter"]
    unreduced = sum(c.bytes for c in (scattered or records))
    return sum(c.bytes_sent for c in records), estimate_peak_memory(graph).total_grad_bytes, unreduced


def accumulation_line(label: str, graph, result, microbatches: int, optim_seconds: float = 0.0) -> str:
    """Gradient accumulation over ``microbatches`` graphs of ``result``: the step's simulated time
    (with the optimizer step's ``optim_seconds``), and per step what the gradient reductions send and the
    accumulation buffer holds (``gradient_reduction_costs``) when each microbatch reduces (the
    trainer: the buffer is the reduced gradients) against accumulating the unreduced gradients and
    reducing once."""
    sent, reduced, unreduced = gradient_reduction_costs(graph, result)
    return (
        f"gradient accumulation ({label}): {microbatches} microbatches, simulated step "
        f"{microbatches} x {result.step_time * 1e3:.1f} + optimizer {optim_seconds * 1e3:.1f} = "
        f"{(microbatches * result.step_time + optim_seconds) * 1e3:.1f} ms; "
        f"reduced every microbatch: {_gb(microbatches * sent)} GB sent/rank, buffer {reduced / GIB:.2f} GiB; "
        f"unreduced, reduced once: {_gb(sent)} GB sent/rank, buffer {unreduced / GIB:.2f} GiB"
    )


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.3g}"


def _trace_path(path: str, label: str, several: bool) -> str:
    if not several:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.{label.replace(',', '+').replace(' ', '_')}{ext or '.json'}"


def main(argv: list[str] | None = None) -> int:
    """The command (module docstring); returns its exit code, 2 for a wrong flag or job config."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        command = parse_command_line(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg, t = command.cfg, command.cfg.training
    microbatches = job_microbatches(cfg.parallelism, t.global_batch_size, t.local_batch_size, command.world_size)
    print(job_header(command, microbatches))
    optimizer = adamw_memory("cpu" if command.device_name == "cpu" else "cuda")
    jobs = zip(command.configs, command.labels, strict=True)
    tables: dict[str, list] = {"summary": [], "stages": [], "kinds": []}
    if cfg.parallelism.pp > 1:
        pipeline_reports = [pipeline_report(c, label, command, optimizer) for c, label in jobs]
        print_pipeline_reports(pipeline_reports)
        tables["summary"] = [r.summary for r in pipeline_reports]
        tables["stages"] = [row for r in pipeline_reports for row in r.stages]
    else:
        graph_reports = [graph_report(c, label, command, optimizer, microbatches) for c, label in jobs]
        print_graph_reports(graph_reports)
        tables["summary"] = [r.summary for r in graph_reports]
        tables["kinds"] = [row for r in graph_reports for row in r.kinds]
    if command.json_out is not None:
        with open(command.json_out, "w", encoding="utf-8") as f:
            json.dump({"job": job_header(command, microbatches), **tables}, f, indent=1)
            f.write("\n")
        print(f"wrote {command.json_out}")
    return 0


def job_header(command: CommandLine, microbatches: int) -> str:
    """The first line: the job as given and the device it is simulated on."""
    cfg, t = command.cfg, command.cfg.training
    accumulating = f" x {microbatches} microbatches" if microbatches > 1 else ""
    gather = " (float8 all-gather)" if cfg.float8.enable_fsdp_float8_all_gather else ""
    fp8 = f", float8 {cfg.float8.recipe_name}{gather}" if cfg.float8.recipe_name != "none" else ""
    compute = "kernels fused as Inductor fuses them (model)" if fuses(cfg.compile.backend) else "op by op"
    return (
        f"{cfg.model.name} {cfg.model.flavor}, world size {command.world_size} (rank {command.rank}), per-rank batch "
        f"{t.local_batch_size}x{t.seq_len}{accumulating}, param dtype {t.mixed_precision_param}, reduce dtype "
        f"{t.mixed_precision_reduce}, activation checkpointing {ac_description(cfg.activation_checkpoint)}, "
        f"loss chunks {t.loss_chunks}{fp8}; simulated on {command.device.name} ({command.ranks_per_node} ranks/node), "
        f"{compute}"
    )


@dataclass
class GraphReport:
    """What the tables say of one job without a pipeline (one compared variant)."""

    summary: dict[str, object]
    kinds: list[dict[str, object]]
    traffic: str
    memory: list[str]
    """Its memory line, and a warning line where the peak exceeds the device's memory."""
    accumulation: str | None
    """``accumulation_line`` with more than one microbatch per step."""


def graph_report(cfg: JobConfig, label: str, command: CommandLine, optimizer, microbatches: int) -> GraphReport:
    """Trace and simulate one job (``analyze_job``) and estimate its step's memory; with
    ``--trace_out``, write its timeline and say where."""
    c = command
    traced, result, trace_s, sim_s = analyze_job(cfg, c.world_size, c.device, c.ranks_per_node, c.rank)
    graph = traced.gm.graph
    memory = estimate_step_memory(graph, None, optimizer, microbatches=microbatches)
    optim = traced_optimizer_step(traced, command.device, cfg.training, optimizer.all_at_once, command.ranks_per_node)
    accumulation = accumulation_line(label, graph, result, microbatches, optim.seconds) if microbatches > 1 else None
    rates = functools.partial(throughput, cfg, c.world_size, microbatches)
    summary = summary_row(label, result, trace_s, sim_s, len(graph.nodes), memory, optim, microbatches, rates)
    memory_lines = [f"memory per rank ({label}): {memory.summary()}"]
    warning = memory_warning(memory, command.memory_limit, command.device.name)
    if warning:
        memory_lines.append(f"WARNING ({label}): {warning}")
    report = GraphReport(summary, kind_rows(label, result), traffic_line(label, result), memory_lines, accumulation)
    if command.trace_out:
        path = _trace_path(command.trace_out, label, len(command.configs) > 1)
        result.to_chrome_trace(path)
        print(f"wrote {path}")
    return report


def print_graph_reports(reports: list[GraphReport]) -> None:
    """The summary table, the table by collective kind, then the traffic, memory and gradient
    accumulation lines (module docstring)."""
    print(format_table([r.summary for r in reports]))
    print()
    print(format_table([row for r in reports for row in r.kinds]))
    print()
    print("\n".join(r.traffic for r in reports))
    print()
    print("\n".join(line for r in reports for line in r.memory))
    accumulation = [r.accumulation for r in reports if r.accumulation is not None]
    if accumulation:
        print()
        print("\n".join(accumulation))


@dataclass
class PipelineReport:
    """What the tables say of one pipeline job (one compared variant)."""

    summary: dict[str, object]
    stages: list[dict[str, object]]
    memory: list[str]
    """The memory line of every pipeline rank, and a warning line for the highest peak where it
    exceeds the device's memory."""


def pipeline_report(cfg: JobConfig, label: str, command: CommandLine, optimizer) -> PipelineReport:
    """Trace a pipeline job stage by stage and estimate its step (``analyze_pipeline``)."""
    c = command
    estimate, stage_blocks, trace_s, estimate_s = analyze_pipeline(
        cfg, c.world_size, c.device, c.ranks_per_node, optimizer, c.rank
    )
    row, stage_rows = pipeline_rows(label, cfg, command.world_size, estimate, stage_blocks)
    name = f"{label}, {estimate.plan.schedule}"
    memory_lines = [
        f"memory of pipeline rank {rank} ({name}): {memory.summary()}"
        for rank, memory in sorted(estimate.memory.items())
    ]
    worst_rank, worst = estimate.worst_memory()
    warning = memory_warning(worst, command.memory_limit, command.device.name)
    if warning:
        memory_lines.append(f"WARNING ({name}, pipeline rank {worst_rank}): {warning}")
    return PipelineReport({**row, "trace s": trace_s, "sim s": estimate_s}, stage_rows, memory_lines)


def print_pipeline_reports(reports: list[PipelineReport]) -> None:
    """The summary table (one row per compared variant), the table of stages, then the memory lines."""
    print(format_table([r.summary for r in reports]))
    print()
    print(format_table([row for r in reports for row in r.stages]))
    print()
    print("\n".join(line for r in reports for line in r.memory))


if __name__ == "__main__":
    sys.exit(main())
