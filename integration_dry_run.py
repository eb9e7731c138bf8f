"""``integration_tests.py --dry-run``: trace each graph case at its real world size on the fake
process group in one CPU process, run its passes, and check the graph (``check_graph``).

Each row also shows the estimated per-rank peak memory of the case's training step and its parts
(``graph_trainer.analysis.memory.estimate_step_memory``: parameters, gradients, AdamW state,
activations, in GiB); for a suite on GPUs, a case whose peak exceeds an H100's memory gets a
warning line and ``mem`` says so (a warning: the case still passes or fails on its graph)."""

from __future__ import annotations

import copy
import dataclasses
import time

from integration_graph_checks import (
    COLLECTIVE_KINDS,
    FSDP_GATHER,
    check_backend,
    check_graph,
    check_stage_graph,
    collective_launches,
    fsdp_launches,
)
from suites import Case, Suite, job_args


def _without_flag(args: list[str], flag: str) -> list[str]:
    if flag not in args:
        return list(args)
    i = args.index(flag)
    return args[:i] + args[i + 2 :]


def _without_passes(args: list[str]) -> list[str]:
    """``args`` without ``--compile.passes X``: the layout."""
    return _without_flag(args, "--compile.passes")


def _trace_key(args: list[str]) -> tuple[str, ...]:
    """What the traced graph depends on: the layout, and whether (and how) ep_overlap chunks the
    model before tracing; not the passes that run after tracing (nor ep_overlap's reorder flag,
    nor the activation-checkpointing mode: its passes run on the traced graph, nor the backend)."""
    passes = args[args.index("--compile.passes") + 1] if "--compile.passes" in args else ""
    key = _without_passes(args)
    for flag in (
        "--compile.ep_overlap.reorder",
        "--activation_checkpoint.mode",
        "--compile.backend",
        "--compile.inductor_scope",
    ):
        key = _without_flag(key, flag)
    return (*key, "chunked") if "ep_overlap" in passes.split(",") else tuple(key)


_MEMORY_COLUMNS = ("peak GiB", "params", "grads", "optim", "activ")


def memory_columns(memory, limit: int | None) -> dict[str, str]:
    """The row's memory cells: the step's peak and its parts (GiB; grads with the gradient
    accumulation buffer), and ``mem``: "ok", or the limit it exceeds ("" without a limit, e.g. the
    cpu suite)."""
    from graph_trainer.analysis.memory import GIB

    if memory is None:
        return {**{c: "-" for c in _MEMORY_COLUMNS}, "mem": ""}
    p = memory.peak
    cells = dict(
        zip(
            _MEMORY_COLUMNS,
            (f"{v / GIB:.3g}" for v in (p.total, p.params, p.grads + p.accumulated_grads, p.optimizer, p.activations)),
            strict=True,
        )
    )
    cells["mem"] = "" if limit is None else "ok" if p.total <= limit else f"> {limit / GIB:.1f} GiB"
    return cells


def dry_run_pipelines(suite: Suite, cases: list[Case]) -> list[dict[str, object]]:
    """The pipeline cases: trace each stage (cases differing in the staging alone share traces),
    check every stage graph, estimate the step (``graph_trainer.pipelining.timeline``), and print
    each case's simulated step, bubble fraction, throughput and worst rank's memory."""
    from graph_trainer.analysis.devices import DEVICES
    from graph_trainer.analysis.memory import DEVICE_MEMORY_BYTES, adamw_memory, memory_warning
    from graph_trainer.cli.analyze import pipeline_rows
    from graph_trainer.config_loading import load_config
    from graph_trainer.distributed.parallel_dims import resolve_parallel_degrees
    from graph_trainer.fake_trace import fake_world, trace_pipeline
    from graph_trainer.graph.collectives import collective_name
    from graph_trainer.pipelining.timeline import estimate_pipeline
    from graph_trainer.validation import validate_config

    device = DEVICES["h100" if suite.gpus else "cpu"]
    limit = DEVICE_MEMORY_BYTES["h100"] if suite.gpus else None
    shared: dict[tuple, dict] = {}
    rows = []
    for case in cases:
        row: dict[str, object] = {"case": case.name, "world": case.nproc, "regions": "-"}
        start = time.perf_counter()
        memory, graphs, line = None, [], ""
        try:
            cfg = load_config(job_args(suite, case, suite.dry_run_overrides))
            validate_config(cfg, case.nproc)
            degrees = resolve_parallel_degrees(cfg.parallelism, case.nproc)
            # (a stage's graph depends on its blocks and ends, which trace_pipeline's keys hold)
            layout_args = _without_flag(
                _without_flag(case.args, "--parallelism.pp_schedule"), "--parallelism.pp_stage_blocks"
            )
            traces = shared.setdefault((case.nproc, case.config, *layout_args), {})
            with fake_world(case.nproc):
                traced = trace_pipeline(cfg, case.nproc, gpu_attention=suite.gpus, traces=traces)
                pipeline = traced.layout.pipeline
                optimizer = adamw_memory("cuda" if suite.gpus else "cpu")
                estimate = estimate_pipeline(
                    pipeline.plan, traced.stages, device, case.nproc, 8, optimizer, traced.resident
                )
            problems, checked = [], set()
            for s in range(pipeline.plan.num_stages):
                gm = traced.stages[s].gm
                if id(gm) not in checked:  # (a trace shared by stages of one signature: checked once)
                    checked.add(id(gm))
                    ends = (s == 0, s == pipeline.last_stage)
                    resident = traced.resident.get(s)
                    found = check_stage_graph(gm, cfg, degrees, traced.traced_blocks[s], *ends, resident)
                    problems += [f"stage {s}: {p}" for p in found]
            graphs = [traced.stages[s].gm for s in range(pipeline.plan.num_stages)]
            graphs += [gm for r in traced.resident.values() for gm in (r.gather, r.reduce)]
            summary, _ = pipeline_rows(case.name, cfg, case.nproc, estimate, pipeline.stage_blocks)
            rank, memory = estimate.worst_memory()
            line = (
                f"{summary['schedule']}, {summary['stages']} stages x {summary['microbatches']} microbatches: "
                f"simulated step {summary['step ms'] / 1e3:.2f} s, bubble {summary['bubble %']:.1f}%, "
                f"{summary['tokens/s/GPU']:.0f} tokens/s/GPU ({summary['TFLOP/s/GPU']:.0f} TFLOP/s/GPU), "
                f"peak {summary['peak GiB']:.1f} GiB on pipeline rank {rank}"
            )
        except Exception as e:  # the config, a trace or a check failed: that is this case's result
            problems = [f"{type(e).__name__}: {e}"]
        nodes = [n for gm in graphs for n in collective_launches(gm)]
        fsdp_ag = [len(fsdp_launches(nodes, FSDP_GATHER, p)) for p in ("forward", "backward")]
        row.update({k: sum(collective_name(n) in v for n in nodes) for k, v in COLLECTIVE_KINDS.items()})
        row.update(
            {
                "FSDP AG fwd+bwd": f"{fsdp_ag[0]}+{fsdp_ag[1]}",
                **memory_columns(memory, limit),
                "trace s": f"{time.perf_counter() - start:.1f}",
                "passes s": "-",
                "status": "FAIL: " + "; ".join(problems) if problems else "PASS",
            }
        )
        rows.append(row)
        print(f"[dry-run] {case.name:34s} {row['status']}", flush=True)
        if line:
            print(f"[dry-run] {case.name:34s} {line}", flush=True)
        warning = memory_warning(memory, limit, "an H100") if memory is not None else None
        if warning:
            print(f"[dry-run] {case.name:34s} WARNING: {warning}", flush=True)
    return rows


NOT_TRACED = "NOT TRACED"
"""Status of a case whose layout the fake process group does not trace (the reason follows): not
checked by the dry run, and not a failure (the job itself runs it)."""


def _not_traced_row(case: Case, nproc: int, reason: str) -> dict[str, object]:
    print(f"[dry-run] {case.name:34s} {NOT_TRACED}: {reason}", flush=True)
    row: dict[str, object] = {"case": case.name, "world": nproc, "regions": "-"}
    row.update({k: "-" for k in COLLECTIVE_KINDS})
    row.update({"FSDP AG fwd+bwd": "-", **memory_columns(None, None), "trace s": "-", "passes s": "-"})
    return {**row, "status": f"{NOT_TRACED}: {reason}"}


def _pipeline_key(case: Case) -> tuple:
    """What a pipeline case's stage traces depend on besides the stages' blocks and ends."""
    staging = ("--parallelism.pp_schedule", "--parallelism.pp_stage_blocks")
    args = case.args
    for flag in staging:
        args = _without_flag(args, flag)
    return (case.nproc, case.config, *args)


def dry_run(suite: Suite, cases: list[Case], shard: tuple[int, int] = (0, 1)) -> list[dict[str, object]]:
    """Trace each layout once per world size, run each graph case's passes on a copy, check it;
    pipeline cases go to ``dry_run_pipelines`` (their rows come last). ``shard`` (K, N): only every
    N-th group of cases that share a trace, from the K-th (N processes then split the dry run)."""
    from graph_trainer.analysis.memory import DEVICE_MEMORY_BYTES, adamw_memory, estimate_step_memory, memory_warning
    from graph_trainer.compiler.chain import transform_graph
    from graph_trainer.config_loading import load_config
    from graph_trainer.distributed.parallel_dims import job_microbatches, resolve_parallel_degrees
    from graph_trainer.errors import ConfigError
    from graph_trainer.fake_trace import fake_world, trace_without_passes
    from graph_trainer.graph.collectives import collective_name
    from graph_trainer.validation import validate_config

    groups: dict[tuple, list[Case]] = {}
    pipeline_groups: dict[tuple, list[Case]] = {}
    for case in cases:
        if case.eager:
            continue
        if load_config(job_args(suite, case, suite.dry_run_overrides)).parallelism.pp > 1:
            pipeline_groups.setdefault(_pipeline_key(case), []).append(case)
        else:
            groups.setdefault((case.nproc, case.config, _trace_key(case.args)), []).append(case)
    index, count = shard
    keys = [*groups, *pipeline_groups]
    mine = {key for i, key in enumerate(keys) if i % count == index}
    groups = {key: group for key, group in groups.items() if key in mine}
    pipelines = [case for key, group in pipeline_groups.items() if key in mine for case in group]
    limit = DEVICE_MEMORY_BYTES["h100"] if suite.gpus else None
    rows = []
    for (nproc, _, key), group in groups.items():
        chunked = key[-1:] == ("chunked",)
        layout = list(key[:-1] if chunked else key)
        base = load_config(job_args(suite, dataclasses.replace(group[0], args=layout), suite.dry_run_overrides))
        base.compile.passes = ["ep_overlap"] if chunked else []  # ep_overlap chunks the model before tracing
        start = time.perf_counter()
        with fake_world(nproc):
            try:  # (a GPU suite's graphs are traced with the attention kernels its GPUs run)
                traced, context = trace_without_passes(base, nproc, gpu_attention=suite.gpus)
            except ConfigError as e:  # a layout the fake process group does not trace: said, not failed
                rows += [_not_traced_row(case, nproc, str(e)) for case in group]
                continue
            reference = transform_graph(copy.deepcopy(traced.gm), context, [])
            trace_s = time.perf_counter() - start
            for case in group:
                row: dict[str, object] = {"case": case.name, "world": nproc, "regions": "-"}
                start = time.perf_counter()
                try:
                    cfg = load_config(job_args(suite, case, suite.dry_run_overrides))
                    validate_config(cfg, nproc)
                    gm = transform_graph(
                        copy.deepcopy(traced.gm), dataclasses.replace(context, config=cfg), cfg.compile.passes
                    )
                    degrees = resolve_parallel_degrees(cfg.parallelism, nproc)
                    problems = check_graph(gm, reference, cfg, degrees, context.extras["bucket_plan"])
                    t = cfg.training
                    microbatches = job_microbatches(cfg.parallelism, t.global_batch_size, t.local_batch_size, nproc)
                    optimizer = adamw_memory("cuda" if suite.gpus else "cpu")
                    memory = estimate_step_memory(gm.graph, None, optimizer, microbatches=microbatches)
                    problems += check_backend(gm, cfg, row)  # (last: it cuts gm into regions)
                except Exception as e:  # a pass or the config failed: that is this case's result
                    gm, memory, problems = None, None, [f"{type(e).__name__}: {e}"]
                nodes = collective_launches(gm) if gm is not None else []
                fsdp_ag = [len(fsdp_launches(nodes, FSDP_GATHER, p)) for p in ("forward", "backward")]
                row.update({k: sum(collective_name(n) in v for n in nodes) for k, v in COLLECTIVE_KINDS.items()})
                row.update(
                    {
                        "FSDP AG fwd+bwd": f"{fsdp_ag[0]}+{fsdp_ag[1]}",
                        **memory_columns(memory, limit),
                        "trace s": f"{trace_s:.1f}",
                        "passes s": f"{time.perf_counter() - start:.1f}",
                        "status": "FAIL: " + "; ".join(problems) if problems else "PASS",
                    }
                )
                trace_s = 0.0
                rows.append(row)
                print(f"[dry-run] {case.name:34s} {row['status']}", flush=True)
                warning = memory_warning(memory, limit, "an H100") if memory is not None else None
                if warning:
                    print(f"[dry-run] {case.name:34s} WARNING: {warning}", flush=True)
    return rows + dry_run_pipelines(suite, pipelines)
