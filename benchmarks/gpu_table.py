"""Measure the one-GPU table: each row a ``train.py`` job in its own process, with its own timeout,
all of them inside one time budget.

    python3 -m benchmarks.gpu_table OUT [--smoke] [--rows NAME[,NAME...]] [--steps N] [--budget SECONDS] [--list]

On the offline H100 machine run it through ``bash scripts/gpu_table.sh OUT``, which first
installs the wheels ``../shared/gpu/prepare.sh`` carried there. The rows, and why these, are in
``benchmarks.gpu_table_rows``; each figure's definition in ``benchmarks.gpu_table_report``.

Without ``--smoke`` the jobs run on CUDA (refused, exit 2, when no CUDA device is visible), 8
steps each, in a budget of 500 s from this script's start: a row runs only if at least 60 s are
left, and is killed (its whole process group: Inductor's compile workers too) at its own
timeout or when the budget ends. ``--smoke`` runs the same rows, through the same code, on the
CPU at the debug flavors' tiny sizes, 4 steps each, with no budget (each row still has its
timeout): what CI runs so this script cannot rot between GPUs.

Writes, under OUT (created if missing): ``gpu_table.json`` and ``gpu_table.md`` (rewritten after
every row, so a run cut short keeps the rows it finished), and per row its job folder
``OUT/<row>/`` (``metrics.jsonl``, ``losses.txt``; Inductor rows compile into a cold cache
there, so every first step is a cold compile) and its log ``OUT/<row>.log``. A row that fails
(refused, out of memory, a crash, its timeout) is recorded with its status and the job's own
error line; the other rows go on.

JSON: ``{"format", "mode": "gpu"|"smoke", "started", "machine": {"device", "torch", "cuda",
"python", "cpus"}, "commit", "steps", "warmup_steps", "budget_s", "wall_s", "rows": [...]}``;
each row: ``name, model, backend, activation_checkpoint, chunked, float8, tokens_per_step, command, log,
timeout_s, seconds, status, problem`` and the figures of ``gpu_table_report.row_figures``.

Exit code: 0 when every row measured, 1 when some row did not (the table says which and why), 2
for bad command-line input or a machine that cannot run the mode.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time

from benchmarks.gpu_table_report import classify, markdown_table, read_records, row_figures
from benchmarks.gpu_table_rows import OP_BY_OP, Row, table_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMAT = "graph_trainer one-GPU table, version 1"
WARMUP_STEPS = 2
"""Steps left out of the figures: step 1 traces and compiles, step 2 allocates the AdamW state."""
DEFAULT_STEPS = {"gpu": 8, "smoke": 4}
DEFAULT_BUDGET_S = {"gpu": 500.0, "smoke": 0.0}
"""Seconds for all rows (0: none). 500 s leaves the 10-minute slot 100 s for the wheels' install,
starting Python and writing the table."""
MIN_ROW_S = 60.0
"""A row starts only with this many seconds of the budget left (process start, CUDA, building)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", help="folder for the table (gpu_table.json, gpu_table.md) and the rows' jobs")
    parser.add_argument("--smoke", action="store_true", help="the same rows on the CPU at tiny sizes")
    parser.add_argument("--rows", default="", help="comma-separated row names (default: all; --list shows them)")
    parser.add_argument("--steps", type=int, default=None, help="steps per row (default: 8, smoke 4)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all rows (default: 500, smoke none)")
    parser.add_argument("--list", action="store_true", help="print the rows and their jobs' flags, and exit")
    opts = parser.parse_args(argv)
    mode = "smoke" if opts.smoke else "gpu"
    opts.mode = mode
    opts.output_dir = os.path.abspath(opts.output_dir)  # the jobs run in ROOT
    opts.steps = DEFAULT_STEPS[mode] if opts.steps is None else opts.steps
    opts.budget = DEFAULT_BUDGET_S[mode] if opts.budget is None else opts.budget
    if opts.steps <= WARMUP_STEPS:
        parser.error(f"--steps {opts.steps} leaves no steady step: it must be > {WARMUP_STEPS}")
    if opts.budget < 0:
        parser.error(f"--budget {opts.budget} must be >= 0 (0: no budget)")
    if os.path.exists(opts.output_dir) and not os.path.isdir(opts.output_dir):
        parser.error(f"{opts.output_dir} exists and is not a folder")
    rows = table_rows(opts.smoke, opts.steps)
    names = [n for n in opts.rows.split(",") if n]
    unknown = sorted(set(names) - {r.name for r in rows})
    if unknown:
        parser.error(f"unknown row {unknown[0]!r}; rows: {', '.join(r.name for r in rows)}")
    opts.table_rows = [r for r in rows if not names or r.name in names]
    return opts


def machine(mode: str) -> dict:
    """What runs the rows; in gpu mode ``ValueError`` when no CUDA device is visible."""
    import torch

    if mode == "gpu" and not torch.cuda.is_available():
        reason = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
        raise ValueError(f"the table runs on CUDA, but {reason} (torch {torch.__version__}); --smoke runs on the CPU")
    return {
        "device": torch.cuda.get_device_name() if mode == "gpu" else f"CPU ({platform.machine()})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def git_commit() -> str | None:
    """The checkout's commit (None without git or a repository), '+dirty' with uncommitted changes."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return None
    if sha.returncode != 0:
        return None
    return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def job_command(row: Row, folder: str, device: str) -> list[str]:
    """The row's job: ``train.py`` (the chunked row: ``benchmarks.chunked_job``) with its flags,
    its device and its output folder (and a cold Inductor cache inside it)."""
    entry = ["-m", "benchmarks.chunked_job"] if row.chunked else [os.path.join(ROOT, "train.py")]
    cache = [] if row.backend == OP_BY_OP else ["--compile.cache_dir", os.path.join(folder, "inductor_cache")]
    return [sys.executable, *entry, *row.args, "--job.device", device, "--job.dump_folder", folder, *cache]


def run_job(command: list[str], log_path: str, timeout: float) -> int | None:
    """Run ``command`` in ROOT, its output into ``log_path``; its exit code, or None when it was
    killed at ``timeout`` seconds (with every process it started: it runs in a session of its
    own, so its compile workers are killed with it, and so is it when this script is stopped)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(process)
            return None
        except BaseException:  # Ctrl-C: the job is in its own session and would not see it
            _kill(process)
            raise


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # (it ended meanwhile)
        pass
    process.wait()


def _tail(path: str, size: int = 20000) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        f.seek(max(0, os.path.getsize(path) - size))
        return f.read()


def row_entry(row: Row) -> dict:
    """A row's table entry before it runs."""
    return {
        "name": row.name,
        "model": row.model,
        "backend": row.backend,
        "activation_checkpoint": row.ac,
        "chunked": row.chunked,
        "float8": row.float8,
        "tokens_per_step": row.tokens_per_step,
    }


def run_row(row: Row, out: str, device: str, steps: int, timeout: float) -> dict:
    """Run one row's job and read its figures; a failure is recorded, never raised."""
    folder = os.path.join(out, row.name)
    log_path = folder + ".log"
    shutil.rmtree(folder, ignore_errors=True)
    command = job_command(row, folder, device)
    start = time.perf_counter()
    returncode = run_job(command, log_path, timeout)
    seconds = time.perf_counter() - start
    figures = row_figures(read_records(os.path.join(folder, "metrics.jsonl")), WARMUP_STEPS)
    status, problem = classify(returncode, _tail(log_path), figures["steps_recorded"], steps)
    if status == "timed out":
        cut = " (the rest of the budget)" if timeout < row.timeout_s else ""
        problem = f"killed after {timeout:.0f} s{cut}, at step {figures['steps_recorded']} of {steps}"
    return {
        **row_entry(row),
        "command": command[1:],
        "log": os.path.relpath(log_path, out),
        "timeout_s": timeout,
        "seconds": seconds,
        "status": status,
        "problem": problem,
        **figures,
    }


def skipped_row(row: Row, left: float, budget: float) -> dict:
    return {
        **row_entry(row),
        "status": "skipped",
        "problem": f"{max(left, 0):.0f} s left of the {budget:.0f} s budget (a row needs {MIN_ROW_S:.0f} s)",
    }


def write_table(out: str, table: dict) -> None:
    """``gpu_table.json`` and ``gpu_table.md`` under ``out``, each replaced whole."""
    for name, text in (
        ("gpu_table.json", json.dumps(table, indent=1) + "\n"),
        ("gpu_table.md", markdown_table(table)),
    ):
        path = os.path.join(out, name)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


def table_header(opts: argparse.Namespace, about: dict) -> dict:
    """What the table's JSON says before its rows (module docstring)."""
    return {
        "format": FORMAT,
        "mode": opts.mode,
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": about,
        "commit": git_commit(),
        "steps": opts.steps,
        "warmup_steps": WARMUP_STEPS,
        "budget_s": opts.budget,
        "wall_s": 0.0,
    }


def run_table(opts: argparse.Namespace, header: dict) -> dict:
    """Run the selected rows in order inside the budget, writing the table after each."""
    start = time.perf_counter()
    deadline = start + opts.budget if opts.budget else float("inf")
    device = "cuda" if opts.mode == "gpu" else "cpu"
    table = {**header, "rows": []}
    for row in opts.table_rows:
        left = deadline - time.perf_counter()
        if left < MIN_ROW_S:
            entry = skipped_row(row, left, opts.budget)
        else:
            entry = run_row(row, opts.output_dir, device, opts.steps, min(row.timeout_s, left))
        table["rows"].append(entry)
        table["wall_s"] = time.perf_counter() - start
        write_table(opts.output_dir, table)
        detail = f": {entry['problem']}" if entry.get("problem") else ""
        print(f"{row.name}: {entry['status']} ({entry.get('seconds', 0):.0f} s){detail}", flush=True)
    return table


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    if opts.list:
        for row in opts.table_rows:
            print(f"{row.name}: {row.model}; {row.backend}, ac {row.ac}\n    {' '.join(row.args)}")
        return 0
    try:
        about = machine(opts.mode)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(opts.output_dir, exist_ok=True)
    print(f"{opts.mode} table on {about['device']}, torch {about['torch']}: {len(opts.table_rows)} rows", flush=True)
    table = run_table(opts, table_header(opts, about))
    print()
    print(markdown_table(table), end="")
    return int(any(r["status"] != "ok" for r in table["rows"]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
