"""Where a job's simulated time goes, kernel class by kernel class, for the job and its variants.

    python -m benchmarks.stage_breakdown --world_size N [--stage S] [--variant "FLAGS"]... [--json FILE]
        --job.config_file CONFIG [--section.key value ...]

Traces the job on the fake process group as ``graph_trainer.cli.analyze`` does and simulates it on
the H100 model (its compute fused as Inductor fuses it with ``--compile.backend inductor``). A
pipeline job (``parallelism.pp`` > 1) is read at its stage ``S`` (default 0), cut into the pieces
its schedule runs as analyze cuts it (``pipelining.split``): the forward F and the backward B
(recomputation included); any other job is one piece, its step. Each ``--variant`` adds its flags
to the job's (``--variant "--float8.recipe_name tensorwise"``) and gets a column.

Prints, per piece and per variant: the piece's time; its compute per kernel class
(``analysis.cost_model.kernel_class``, ``fused ...`` for Inductor's fused kernels); the matmuls'
share of it and the rest; per collective kind its time and the part the compute stream waited
for (exposed). Then, per variant against the first column, the ratio of the time of all pieces
together (per microbatch: F + B for a pipeline stage), of their compute alone (as if every
collective were hidden), and of their matmuls alone. Those three say how far a change of the
compute (FP8 matmuls, say) can move the step: the first as simulated, the second once the
exchanges are hidden, the third once everything but the matmuls is free.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Iterable

from graph_trainer.analysis.devices import DEVICES
from graph_trainer.analysis.fusion import fuses
from graph_trainer.analysis.memory import SizeHints
from graph_trainer.analysis.simulator import SimulationResult, simulate
from graph_trainer.config_loading import load_config, take_flag
from graph_trainer.errors import ConfigError
from graph_trainer.fake_trace import fake_world, trace_job, trace_pipeline
from graph_trainer.pipelining.schedule import SCHEDULES
from graph_trainer.pipelining.split import split_stage
from graph_trainer.validation import validate_config

MATMUL_CLASSES = ("matmul", "grouped_mm", "scaled_mm_tensorwise", "scaled_mm_rowwise")
"""Kernel classes that are matmuls (``devices.KernelEfficiency``'s fields)."""
DEVICE = DEVICES["h100"]


def piece_results(argv: list[str], world_size: int, stage: int) -> dict[str, SimulationResult]:
    """The job's pieces (F and B of ``stage`` for a pipeline job, else the step), simulated."""
    cfg = load_config(argv)
    validate_config(cfg, world_size)
    fused = fuses(cfg.compile.backend)
    stages = cfg.parallelism.pp * SCHEDULES[cfg.parallelism.pp_schedule].stages_per_rank
    if cfg.parallelism.pp > 1 and not 0 <= stage < stages:
        raise ConfigError(f"--stage {stage}: the job has stages 0..{stages - 1}")
    with fake_world(world_size):
        if cfg.parallelism.pp == 1:
            gm = trace_job(cfg, world_size, gpu_attention=DEVICE.fused_attention).gm
            return {"step": simulate(gm.graph, DEVICE, fused=fused)}
        traced = trace_pipeline(cfg, world_size, gpu_attention=DEVICE.fused_attention)
        step = traced.stages[stage]
        graphs = split_stage(step.gm, step.num_flat_param_grads, grads_into_sums=True)
        hints = SizeHints.from_graph(step.gm.graph)  # (the backward's sizes are made in the forward)
        return {
            piece: simulate(getattr(graphs, attr).graph, DEVICE, fused=fused, hints=hints)
            for piece, attr in (("F", "forward"), ("B", "backward"))
        }


def piece_lines(result: SimulationResult) -> dict[str, float]:
    """One piece's lines (module docstring), in milliseconds."""
    lines = {"time": result.step_time, "compute": result.compute_time}
    matmuls = sum(t for c, t in result.compute_by_class.items() if c in MATMUL_CLASSES)
    lines["  matmuls"] = matmuls
    lines["  the rest"] = result.compute_time - matmuls
    for cls, seconds in sorted(result.compute_by_class.items()):
        lines[f"    {cls}"] = seconds
    for kind, row in sorted(result.by_kind().items()):
        lines[f"{kind} ({row['count']:.0f})"] = row["time"]
        lines[f"  exposed {kind}"] = row["exposed"]
    return {k: v * 1e3 for k, v in lines.items()}


def totals(pieces: dict[str, dict[str, float]]) -> dict[str, float]:
    """All pieces together: time, compute, matmuls (ms)."""
    return {
        key: sum(lines.get(line, 0.0) for lines in pieces.values())
        for key, line in (("time", "time"), ("compute", "compute"), ("matmuls", "  matmuls"))
    }


_SUMMARY_LINES = ("time", "compute", "  matmuls", "  the rest")


def _line_order(names: Iterable[str]) -> list[str]:
    """The lines of several columns in one order: the summary, every column's kernel classes
    (sorted), then the collectives as they first appear, each with its exposed line."""

    def section(name: str) -> tuple[int, str]:
        if name in _SUMMARY_LINES:
            return 0, ""
        return (1, name) if name.startswith("    ") else (2, "")

    return sorted(names, key=section)


def table(labels: list[str], columns: list[dict[str, dict[str, float]]]) -> str:
    """The per-piece lines side by side, then the ratios against the first column."""
    out = [f"({i + 1}) {label}" for i, label in enumerate(labels)]
    out.append(f"{'':32s}" + "".join(f"{f'({i + 1})':>24s}" for i in range(len(labels))))
    for piece in columns[0]:
        out.append(f"-- {piece} (ms)")
        names = _line_order(dict.fromkeys(n for c in columns for n in c.get(piece, {})))
        for name in names:
            out.append(f"{name:32s}" + "".join(f"{c.get(piece, {}).get(name, 0.0):24.2f}" for c in columns))
    base = totals(columns[0])
    out.append("-- all pieces: against the first column")
    for key in ("time", "compute", "matmuls"):
        cells = [f"{t[key]:11.2f} ({base[key] / t[key]:5.3f}x)" for t in map(totals, columns)]
        out.append(f"{key:32s}" + "".join(f"{c:>24s}" for c in cells))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """The command (module docstring); 2 for a wrong flag or job."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv, world_size = take_flag(argv, "--world_size", 8, int)
        argv, stage = take_flag(argv, "--stage", 0, int)
        argv, json_out = take_flag(argv, "--json", None)
        variants = [""]
        while (flags := take_flag(argv, "--variant", None))[1] is not None:
            argv = flags[0]
            variants.append(flags[1])
        columns = [
            {piece: piece_lines(r) for piece, r in piece_results(argv + shlex.split(v), world_size, stage).items()}
            for v in variants
        ]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    labels = ["the job"] + [f"the job with {v}" for v in variants[1:]]
    print(table(labels, columns))
    if json_out is not None:
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump({"variants": labels, "pieces": columns}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
