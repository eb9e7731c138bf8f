"""Figures of one table row from what its job wrote, why a row failed, and the markdown table.

Everything here is read from the job's own records: ``<row>/metrics.jsonl`` (the trainer's
``--metrics.json_lines``: one object per step, one per setup event) and, for a failed row, the
tail of ``<row>.log``. No figure is computed anywhere else.

Definitions (the steady steps are those after ``warmup`` steps: step 1 traces and compiles,
step 2 is the first with the AdamW state allocated and every kernel warm):

- ``tokens_per_s``: the steady steps' tokens over their wall time, from the trainer's per-step
  tokens/s per device (every step has the same tokens, so this is their harmonic mean);
- ``mfu_percent``: the trainer's MFU over the same steps (proportional to tokens/s, so the
  same mean); None where the trainer knows no peak (CPU);
- ``step_ms`` / ``forward_backward_ms``: mean wall time of a steady step (data, graph, clip,
  AdamW) / mean device time of its forward, loss and backward (``ForwardBackwardTimer``);
- ``simulated_ms``: the analysis simulator's step for the graph the job ran (after the memory
  policy, before the backend; ``metrics.simulate_device``, here the H100 model), which covers
  the forward, loss and backward only: it is compared with ``forward_backward_ms``
  (``simulation_error_percent``: simulated minus measured, over measured);
- ``peak_gib``: the trainer's peak memory after the last step (CUDA:
  ``torch.cuda.max_memory_allocated`` over the whole run; CPU: the process's peak RSS, not
  comparable with the estimate); ``estimated_peak_gib``: the trainer's estimate before the
  first step (``graph_trainer.analysis.memory``: params, grads, AdamW state and the graph's
  activations as traced, before any Inductor fusion), ``estimate_error_percent`` likewise;
- ``first_step_s``: step 1's wall time (trace, memory policy, estimate, simulation, compile,
  and the step itself); ``trace_s`` and ``compile_s`` its logged parts.
"""

from __future__ import annotations

import json
import math
import os
import re

GIB = float(1 << 30)
OOM = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)
STATUSES = ("ok", "refused", "out of memory", "failed", "timed out", "skipped")


def read_records(path: str) -> list[dict]:
    """The JSON objects of a ``metrics.jsonl`` ([] when absent); a last line cut short by a killed
    job is left out."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


def _harmonic_mean(values: list[float]) -> float | None:
    if not values or any(not (v > 0 and math.isfinite(v)) for v in values):
        return None
    return len(values) / sum(1.0 / v for v in values)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _error_percent(estimate: float | None, measured: float | None) -> float | None:
    if estimate is None or not measured:
        return None
    return 100.0 * (estimate - measured) / measured


def _event(records: list[dict], name: str) -> dict:
    """The last record of event ``name`` ({} if none)."""
    found = [r for r in records if r.get("event") == name]
    return found[-1] if found else {}


def step_figures(steps: list[dict], warmup: int) -> dict:
    """Speed and measured memory from the per-step records (module docstring)."""
    steady = [s for s in steps if s["step"] > warmup]
    mfu = [s["mfu_percent"] for s in steady if "mfu_percent" in s]
    step_ms = _mean([s["step_time_s"] * 1e3 for s in steady])
    fwd_bwd = [s["forward_backward_s"] * 1e3 for s in steady if "forward_backward_s" in s]
    first = [s["step_time_s"] for s in steps if s["step"] == 1]
    return {
        "steps_recorded": len(steps),
        "steady_steps": len(steady),
        "tokens_per_s": _harmonic_mean([s["tokens_per_sec_per_device"] for s in steady]),
        "mfu_percent": _harmonic_mean(mfu) if mfu and len(mfu) == len(steady) else None,
        "step_ms": step_ms,
        "forward_backward_ms": _mean(fwd_bwd) if len(fwd_bwd) == len(steady) else None,
        "peak_gib": max((s["memory_gib"] for s in steps), default=None),
        "first_step_s": first[0] if first else None,
        "losses": [s["loss"] for s in steps],
    }


def estimate_figures(records: list[dict]) -> dict:
    """The memory estimate, the simulated step, and the trace and compile times."""
    memory = _event(records, "memory estimate")
    simulated = _event(records, "simulated step")
    parts = ("params", "grads", "optimizer", "transient")
    return {
        "estimated_peak_gib": memory["peak_bytes"] / GIB if memory else None,
        "estimated_peak_moment": memory.get("peak_moment"),
        "estimated_parts_gib": {p: memory[f"{p}_bytes"] / GIB for p in parts} if memory else None,
        "simulated_ms": simulated.get("step_ms"),
        "simulated_device": simulated.get("device"),
        "trace_s": _event(records, "trace").get("trace_seconds"),
        "compile_s": _event(records, "compile").get("compile_seconds"),
    }


def row_figures(records: list[dict], warmup: int) -> dict:
    """Every figure of a row from its job's records (module docstring); None where missing."""
    figures = {
        **step_figures([r for r in records if "step" in r], warmup),
        **estimate_figures(records),
    }
    figures["estimate_error_percent"] = _error_percent(figures["estimated_peak_gib"], figures["peak_gib"])
    figures["simulation_error_percent"] = _error_percent(figures["simulated_ms"], figures["forward_backward_ms"])
    return figures


def _problem_line(log_tail: str) -> str:
    """The job's own error line (``error: ...``), else the last line (a traceback's exception)."""
    lines = [line.strip() for line in log_tail.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    line = errors[-1] if errors else lines[-1] if lines else "(no output)"
    return line if len(line) <= 300 else line[:297] + "..."


def classify(returncode: int | None, log_tail: str, steps_recorded: int, steps: int) -> tuple[str, str | None]:
    """(status, problem): ``returncode`` None means the job was killed at its timeout."""
    if returncode is None:
        return "timed out", None
    oom = [line for line in log_tail.splitlines() if OOM.search(line)]
    if returncode != 0 and oom:
        return "out of memory", _problem_line(oom[-1])
    if returncode == 2:
        return "refused", _problem_line(log_tail)
    if returncode != 0:
        return "failed", f"exit code {returncode}: {_problem_line(log_tail)}"
    if steps_recorded != steps:
        return "failed", f"the job exited 0 but metrics.jsonl holds {steps_recorded} of {steps} steps"
    return "ok", None


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _pair(measured: float | None, estimated: float | None, error: float | None, spec: str) -> str:
    """'measured / estimated (error)'."""
    return f"{_fmt(measured, spec)} / {_fmt(estimated, spec)} ({_fmt(error, '+.1f', '%')})"


def _first_step(row: dict) -> str:
    compile_s = row.get("compile_s") or 0.0
    parts = f" ({_fmt(row.get('trace_s'), '.1f')} + {compile_s:.1f})" if row.get("first_step_s") else ""
    return _fmt(row.get("first_step_s"), ".1f") + parts


def markdown_row(row: dict) -> str:
    cells = [
        row["name"],
        row["model"],
        row["backend"],
        row["activation_checkpoint"],
        _fmt(row.get("tokens_per_s"), ",.0f"),
        _fmt(row.get("mfu_percent"), ".1f", "%"),
        _pair(row.get("peak_gib"), row.get("estimated_peak_gib"), row.get("estimate_error_percent"), ".2f"),
        _pair(row.get("forward_backward_ms"), row.get("simulated_ms"), row.get("simulation_error_percent"), ".1f"),
        _fmt(row.get("step_ms"), ".1f"),
        _first_step(row),
        row["status"],
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| row | model | backend | AC | tok/s | MFU | peak GiB: measured / estimated (error) | "
    "fwd+bwd ms: measured / simulated (error) | step ms | first step s (trace + compile) | status |"
)


def markdown_table(table: dict) -> str:
    """The table (``gpu_table``'s JSON) as markdown: a line naming the run, the rows, their problems."""
    m = table["machine"]
    memory = "torch.cuda.max_memory_allocated" if table["mode"] == "gpu" else "process peak RSS (not comparable)"
    lines = [
        f"One-GPU table ({table['mode']}), {table['started']}: {m['device']}, torch {m['torch']}, "
        f"commit {table['commit'] or 'unknown'}; {table['steps']} steps per row, figures over steps "
        f"{table['warmup_steps'] + 1}-{table['steps']}; measured memory: {memory}; wall "
        f"{table['wall_s']:.0f} s" + (f" of a {table['budget_s']:.0f} s budget." if table["budget_s"] else "."),
        "",
        HEADER,
        "|" + "---|" * HEADER.count(" | ") + "---|",
        *(markdown_row(row) for row in table["rows"]),
    ]
    problems = [f"- {r['name']}: {r['status']}: {r['problem']}" for r in table["rows"] if r.get("problem")]
    return "\n".join(lines + ([""] + problems if problems else [])) + "\n"


__all__ = [
    "STATUSES",
    "classify",
    "estimate_figures",
    "markdown_table",
    "read_records",
    "row_figures",
    "step_figures",
]
