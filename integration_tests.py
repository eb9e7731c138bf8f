"""End-to-end suites: every case is a real multi-process ``train.py`` job, checked from its outputs.

    python integration_tests.py OUTPUT_DIR --suite cpu|h100|gpu [--test_name NAME[,NAME]] [--ngpu N]
                                [--dry-run [--shard K/N]] [--list]

``cpu`` runs on gloo with the debug LLaMA-3 and DeepSeek-V3, 1 to 4 processes (what CI can run:
2 cores, no GPU). ``h100`` runs real flavors with NCCL on 8 GPUs (4 where a case says so).
``gpu`` needs ONE GPU: the debug models graph vs eager and run-to-run, bitwise under
``--debug.deterministic True``, and real 8B- and 16B-shaped models cut to 4 layers in bf16, whose
tok/s, MFU and peak memory the table shows. The GPU suites refuse to start without the GPUs
their cases need; their jobs run under torchrun. The cpu suite's ranks are forked from one
interpreter that imported torch once (``tests/forked_ranks.py``: torchrun's environment and
failure handling, without each rank's start-up). ``--ngpu N`` skips the cases (and their
dependents) that need more than N processes. ``--test_name`` runs the named cases and the cases
they are compared with.

A case passes when its job exits 0, writes one finite loss per step, the loss falls, and the
log has the metrics line (loss, tok/s/dev, mem) agreeing with ``losses.txt``. A case naming
``same_as`` must have per-step losses bitwise those of that case (graph vs eager of one layout,
graph vs graph + a value-preserving pass); one naming ``close_to`` must stay within
``CLOSE_RTOL`` of that one-process run on the same global batch. Where the suite records
gradients (``--debug.grad_record_step 1``, the cpu suite), the first step's gradients before
clipping are compared too (``graph_trainer.loop.grad_record``): bitwise for ``same_as``; for
``close_to`` the global norm and every parameter's norm and sampled entries within
``GRAD_RTOL`` of the one-process run, which catches a wrong gradient scale that the losses
cannot show (AdamW and clipping hide it).

``--dry-run`` runs no job: each graph case is traced at its real world size on the fake process
group in this one CPU process (``graph_trainer.fake_trace``, as ``analyze`` does), its
passes run, and the graph is checked (``integration_graph_checks.check_graph``): the collectives its layout needs, EP
tags, transformer-block bucket counts. Cases of one layout share one trace: its graph is copied
for each pass list (``tests/test_integration_tests.py`` checks that a copy gives the same graph
as a fresh trace). A pipeline case (``--parallelism.pp`` > 1) is traced stage by stage, each stage
graph checked (``integration_graph_checks.check_stage_graph``), and its step estimated
(``graph_trainer.pipelining.timeline``: simulated step, bubble fraction, tokens/s per GPU, every
pipeline rank's memory with its schedule's in-flight microbatches). Cases marked
``dry_run_only`` (cluster layouts: the h100 suite's 405B on 512 GPUs, 671B on 256) are checked
by the dry run alone; a run skips them. The exit code is the number of failed cases (2 for bad
command-line input). ``--shard K/N`` makes this process the K-th of N that split the suite: a
dry run takes every N-th group of cases that share a trace; a run takes its share of the groups
of cases compared with each other (``shard_names``: one-process references run in every shard
that needs them). CI runs the cpu suite and the h100 dry run in two shards each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.abspath(__file__))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from graph_trainer.loop.grad_record import compare_records, load_record, record_path  # noqa: E402
from integration_dry_run import NOT_TRACED, dry_run  # noqa: E402
from suites import GRAD_RECORD_STEP, GRAD_RTOL, SUITES, Case, Suite, job_args  # noqa: E402  (the case tables)
from tests.launch import run_forked, run_torchrun  # noqa: E402  (the launchers of multi-process jobs)

LOG_LINE = re.compile(r"step (\d+) \| loss (\S+) \|.*\| tok/s/dev ([\d,.e+-]+) \| mfu (\S+) \| mem ([\d.]+) GiB")
"""The metrics line of ``graph_trainer.loop.metrics.MetricsLogger`` (loss, tokens/s per device, MFU, memory)."""


@dataclass
class Result:
    case: Case
    seconds: float = 0.0
    problem: str | None = None
    """None: passed."""
    skipped: str = ""
    note: str = ""

    @property
    def status(self) -> str:
        return f"SKIP ({self.skipped})" if self.skipped else "PASS" if self.problem is None else "FAIL"


def read_losses(folder: str) -> list[tuple[int, str]]:
    """``(step, loss text)`` pairs of ``losses.txt``: the text is the exact ``repr`` of the loss."""
    with open(os.path.join(folder, "losses.txt")) as f:
        return [(int(step), loss) for step, loss in (line.split() for line in f if line.strip())]


def check_job(output: str, losses: list[tuple[int, str]], steps: int) -> str | None:
    """Why a finished job's outputs are wrong (None when they are right)."""
    if [s for s, _ in losses] != list(range(1, steps + 1)):
        return f"losses.txt has steps {[s for s, _ in losses][:3]}...{[s for s, _ in losses][-1:]}, not 1..{steps}"
    values = [float(v) for _, v in losses]
    if not all(math.isfinite(v) for v in values):
        return f"non-finite loss at step {next(i for i, v in enumerate(values, 1) if not math.isfinite(v))}"
    if values[-1] >= values[0]:
        return f"loss did not fall: {losses[0][1]} -> {losses[-1][1]}"
    logged = {int(m[1]): m for m in LOG_LINE.finditer(output)}
    if 1 not in logged or steps not in logged:
        return f"no metrics line (loss, tok/s/dev, mem) for step 1 and step {steps} in the log"
    for step in (1, steps):
        m = logged[step]
        if m[2] != f"{values[step - 1]:.6f}":
            return f"step {step}: the log says loss {m[2]}, losses.txt {losses[step - 1][1]}"
        if float(m[3].replace(",", "")) <= 0 or float(m[5]) <= 0:
            return f"step {step}: tok/s/dev {m[3]} and mem {m[5]} GiB must be > 0"
    return None


@dataclass(frozen=True)
class Finished:
    """What a passed job left for the cases compared with it."""

    losses: list[str]
    grads: dict | None = None
    """Its gradient record (``graph_trainer.loop.grad_record``) if the suite asked for one."""


FIRST_STEP = re.compile(r"first step \(including [^)]*\) took ([\d.]+)s")


def steady_metrics(output: str) -> str:
    """Speed and memory of the last logged step (``tok/s``, MFU, peak memory) and the first step's
    time (trace, passes, compile), for the table."""
    last = list(LOG_LINE.finditer(output))[-1]
    first = FIRST_STEP.search(output)
    return f"tok/s {last[3]}, mfu {last[4]}, mem {last[5]} GiB, first step {first[1] if first else '?'} s"


def compare(case: Case, run: Finished, done: dict[str, Finished]) -> tuple[str | None, str]:
    """Check a case's losses (and gradient record) against its reference; (problem or None, note)."""
    name = case.same_as or case.close_to
    if not name:
        return None, ""
    reference = done.get(name)
    losses = run.losses
    if reference is None or len(reference.losses) != len(losses):
        return f"reference case {name} did not produce {len(losses)} losses", ""
    if (run.grads is None) != (reference.grads is None):
        return f"only one of {case.name} and {name} wrote a gradient record", ""
    if case.same_as:
        if reference.losses != losses:
            step = next(i for i, (a, b) in enumerate(zip(reference.losses, losses, strict=True), 1) if a != b)
            return (
                f"losses differ from {name} from step {step}: {reference.losses[step - 1]} vs {losses[step - 1]}"
            ), ""
        note = f"bitwise {name}"
        if run.grads is not None:
            problems, _ = compare_records(run.grads, reference.grads, rtol=0.0)
            if problems:
                return f"step-{GRAD_RECORD_STEP} gradients differ from {name}: {'; '.join(problems[:3])}", note
            note += " (losses, grads)"
        return None, note
    deviation = max(abs(float(a) - float(b)) / abs(float(b)) for a, b in zip(losses, reference.losses, strict=True))
    note = f"max rel dev vs {name} {deviation:.1e}"
    if deviation > case.rtol:
        return f"losses deviate {deviation:.1e} (> {case.rtol}) from {name}", note
    if run.grads is not None:
        grad_rtol = case.grad_rtol or GRAD_RTOL
        problems, worst = compare_records(run.grads, reference.grads, rtol=grad_rtol)
        note += f", grads {worst:.1e}"
        if problems:
            return (
                f"step-{GRAD_RECORD_STEP} gradients deviate from {name} (> {grad_rtol:.0e}): "
                f"{'; '.join(problems[:3])}" + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
            ), note
    return None, note


def run_case(
    suite: Suite, case: Case, output_dir: str, done: dict[str, Finished], script: str = os.path.join(ROOT, "train.py")
) -> Result:
    """Run one case as a job of ``script`` in ``output_dir/<name>`` (log: ``<name>.log``) and check it
    (tests run scripts that inject a bug into train.py, to see the checks catch it). GPU suites
    launch with torchrun; CPU ones fork their ranks (``tests.launch.run_forked``)."""
    folder = os.path.join(output_dir, case.name)
    shutil.rmtree(folder, ignore_errors=True)  # a stale checkpoint would be resumed
    start = time.perf_counter()
    try:
        proc = (run_torchrun if suite.gpus else run_forked)(
            case.nproc,
            script,
            *job_args(suite, case, ["--job.dump_folder", folder]),
            timeout=suite.timeout,
            check=False,
        )
        output, code = proc.stdout + proc.stderr, proc.returncode
    except Exception as e:  # subprocess.TimeoutExpired
        output, code = str(e), "timeout"
    result = Result(case, time.perf_counter() - start)
    log_path = os.path.join(output_dir, f"{case.name}.log")
    with open(log_path, "w") as log:
        log.write(output)
    if code != 0:
        result.problem = f"exit code {code} (log: {log_path})"
        return result
    losses = read_losses(folder) if os.path.exists(os.path.join(folder, "losses.txt")) else []
    result.problem = check_job(output, losses, suite.steps)
    if result.problem is None:
        grads = None
        if suite.record_grads:
            path = record_path(folder, GRAD_RECORD_STEP)
            if not os.path.exists(path):
                result.problem = f"no gradient record {path}"
                return result
            grads = load_record(path)
        done[case.name] = Finished([v for _, v in losses], grads)
        result.note = f"loss {losses[0][1][:6]} -> {losses[-1][1][:6]}"
        if suite.report_speed:
            result.note += f", {steady_metrics(output)}"
        result.problem, note = compare(case, done[case.name], done)
        result.note += f", {note}" if note else ""
    return result


def default_ngpu(cases: list[Case]) -> int:
    """The processes of the largest case a run (not a dry run) can take."""
    return max((c.nproc for c in cases if not c.dry_run_only), default=1)


def select(cases: list[Case], names: list[str], ngpu: int, dry_run: bool = False) -> tuple[list[Case], dict[str, str]]:
    """The named cases (all if none) plus everything they are compared with, in table order; and
    the cases skipped because they (or a reference) need more than ``ngpu`` processes, or only a
    dry run can check them."""
    by_name = {c.name: c for c in cases}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; --list shows the cases")
    wanted = set(names or by_name)
    frontier = list(wanted)
    while frontier:
        for ref in by_name[frontier.pop()].references:
            if ref not in wanted:
                wanted.add(ref)
                frontier.append(ref)
    chosen = [c for c in cases if c.name in wanted]
    skipped: dict[str, str] = {}
    for c in chosen:  # table order: a reference comes before its dependents
        if c.dry_run_only and not dry_run:
            skipped[c.name] = f"a {c.nproc}-GPU layout: checked by --dry-run only"
        elif c.nproc > ngpu and not (dry_run and c.dry_run_only):
            skipped[c.name] = f"needs {c.nproc} > --ngpu {ngpu}"
        elif any(r in skipped for r in c.references):
            skipped[c.name] = "its reference is skipped"
    return chosen, skipped


def run_suite(
    suite_name: str, output_dir: str, names: list[str] = (), ngpu: int | None = None, echo: bool = True
) -> list[Result]:
    """Run (the selected cases of) a suite; the Python API behind the command line."""
    suite = SUITES[suite_name]
    cases, skipped = select(suite.cases, list(names), ngpu if ngpu is not None else default_ngpu(suite.cases))
    os.makedirs(output_dir, exist_ok=True)
    done: dict[str, Finished] = {}
    results = []
    for case in cases:
        result = (
            Result(case, skipped=skipped[case.name])
            if case.name in skipped
            else run_case(suite, case, output_dir, done)
        )
        results.append(result)
        if echo:
            print(
                f"[{suite_name}] {case.name:34s} {result.seconds:6.1f}s  {result.status}  "
                f"{result.problem or ''}  {result.note}",
                flush=True,
            )
    write_seconds(os.path.join(output_dir, "case_seconds.json"), suite_name, results)
    return results


def write_seconds(path: str, suite_name: str, results: list[Result]) -> None:
    """The wall seconds of the cases that ran, in ``CASE_SECONDS``'s format (the shards of a CI run
    merged into that file are what ``shard_names`` balances next)."""
    ran = {r.case.name: round(r.seconds, 1) for r in results if not r.skipped}
    measured = f"{time.strftime('%Y-%m-%d')}, integration_tests.py --suite {suite_name}"
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"measured": measured, "seconds": {suite_name: ran}}, f, indent=1)
        f.write("\n")


def format_table(rows: list[dict[str, object]]) -> str:
    columns = list(rows[0]) if rows else []
    cells = [[str(r[c]) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


CASE_SECONDS = os.path.join(ROOT, "suites", "case_seconds.json")
"""Measured wall seconds of each case of a run (``{"measured": where and when, "seconds": {suite:
{case: s}}}``): what ``shard_names`` balances. A run writes its own as ``OUT/case_seconds.json``."""


def recorded_seconds(suite_name: str) -> dict[str, float]:
    """The measured seconds of a suite's cases in ``CASE_SECONDS`` (empty if none were recorded)."""
    if not os.path.isfile(CASE_SECONDS):
        return {}
    with open(CASE_SECONDS, encoding="utf-8") as f:
        return json.load(f)["seconds"].get(suite_name, {})


def case_weights(cases: list[Case], seconds: dict[str, float]) -> dict[str, float]:
    """Each case's expected wall seconds: its measured time, or for a case not measured yet its
    processes times the measured cases' mean seconds per process (1 per process if none was)."""
    measured = [c for c in cases if c.name in seconds]
    per_proc = sum(seconds[c.name] for c in measured) / sum(c.nproc for c in measured) if measured else 1.0
    return {c.name: seconds.get(c.name, c.nproc * per_proc) for c in cases}


def compared_groups(cases: list[Case]) -> list[list[Case]]:
    """Cases compared with each other (components of the same_as / close_to graph), leaving out the
    one-process references that compare with nothing: ``select`` adds those to every shard that needs one."""
    by_name = {c.name: c for c in cases}
    root_of = {c.name: c.name for c in cases}

    def find(name: str) -> str:
        while root_of[name] != name:
            name = root_of[name]
        return name

    for c in cases:
        for ref in c.references:
            shared = by_name[ref].nproc == 1 and not by_name[ref].references
            if not shared:
                root_of[find(c.name)] = find(ref)
    groups: dict[str, list[Case]] = {}
    for c in cases:
        if not (c.nproc == 1 and not c.references and any(c.name in d.references for d in cases)):
            groups.setdefault(find(c.name), []).append(c)
    return list(groups.values())


def shard_names(cases: list[Case], shard: tuple[int, int], seconds: dict[str, float] | None = None) -> list[str]:
    """The cases of shard K of N of a run: groups of compared cases (``compared_groups``) go, the
    longest first, to the shard with the least expected time so far (``case_weights`` of the
    measured ``seconds``), so that the shards, run side by side, end together."""
    index, count = shard
    if count == 1:
        return [c.name for c in cases]
    weight = case_weights(cases, seconds or {})
    loads, owner = [0.0] * count, {}
    for group in sorted(compared_groups(cases), key=lambda g: -sum(weight[c.name] for c in g)):
        k = loads.index(min(loads))
        loads[k] += sum(weight[c.name] for c in group)
        owner.update({c.name: k for c in group})
    return [c.name for c in cases if owner.get(c.name) == index]


def _parse_shard(text: str) -> tuple[int, int] | None:
    """'K/N' -> (K, N) with 0 <= K < N; None if it is not that."""
    parts = text.split("/")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        return None
    index, count = int(parts[0]), int(parts[1])
    return (index, count) if 0 <= index < count else None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str]) -> int:
    parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", help="where the jobs write (one folder and one .log per case)")
    parser.add_argument("--suite", required=True, choices=sorted(SUITES))
    parser.add_argument("--test_name", default="", help="comma-separated case names (their references run too)")
    parser.add_argument("--ngpu", type=int, default=None, help="most processes a case may use (default: all)")
    parser.add_argument("--dry_run", action="store_true", help="trace each graph case on the fake process group")
    parser.add_argument(
        "--shard",
        default="0/1",
        help="K/N: the K-th of N processes splitting the suite (a run: groups of compared cases; "
        "--dry-run: groups of cases sharing a trace)",
    )
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    from graph_trainer.config_loading import normalize_flags

    opts = parser.parse_args(normalize_flags(argv))  # dashes or underscores: --dry-run is --dry_run
    suite = SUITES[opts.suite]
    if opts.ngpu is not None and opts.ngpu < 1:
        parser.error(f"--ngpu must be >= 1, got {opts.ngpu}")
    shard = _parse_shard(opts.shard)
    if shard is None:
        parser.error(f"--shard {opts.shard!r} must be K/N with 0 <= K < N, e.g. 0/2")
    ngpu = opts.ngpu if opts.ngpu is not None else default_ngpu(suite.cases)
    names = [n for n in opts.test_name.split(",") if n]
    if shard != (0, 1) and not opts.dry_run:
        if names:
            parser.error("--shard splits a whole suite; with --test_name, name the cases of each process")
        names = shard_names(suite.cases, shard, recorded_seconds(opts.suite))
    try:
        cases, skipped = select(suite.cases, names, ngpu, dry_run=opts.dry_run)
    except ValueError as e:
        parser.error(str(e))
    if opts.list:
        for c in cases:
            refs = f"  (same_as {c.same_as})" if c.same_as else f"  (close_to {c.close_to})" if c.close_to else ""
            print(f"{c.name}: {c.nproc} proc, {c.config or suite.config} {' '.join(c.args)}{refs}")
        return 0
    if opts.dry_run:
        rows = dry_run(suite, [c for c in cases if c.name not in skipped], shard)
        print(format_table(rows))
        untraced = sum(str(r["status"]).startswith(NOT_TRACED) for r in rows)
        failures = sum(r["status"] != "PASS" for r in rows) - untraced
        print(
            f"{len(rows) - failures - untraced} passed, {failures} failed, {untraced} not traced (dry run: graphs "
            f"traced on the fake process group; eager cases have no graph, their graph twins are checked)"
        )
        return failures
    needed = max([c.nproc for c in cases if c.name not in skipped], default=0)
    if suite.gpus:
        import torch

        if torch.cuda.device_count() < needed:
            parser.error(
                f"suite {opts.suite} needs {needed} CUDA devices, this machine has "
                f"{torch.cuda.device_count()} (--dry-run checks its graphs without GPUs)"
            )
    start = time.perf_counter()
    results = run_suite(opts.suite, opts.output_dir, names, ngpu)
    print()
    print(
        format_table(
            [
                {
                    "case": r.case.name,
                    "procs": r.case.nproc,
                    "wall s": f"{r.seconds:.1f}",
                    "status": r.status,
                    "detail": r.problem or r.note,
                }
                for r in results
            ]
        )
    )
    failures = sum(r.problem is not None for r in results)
    print(
        f"{len(results) - failures - len(skipped)} passed, {failures} failed, {len(skipped)} skipped "
        f"in {time.perf_counter() - start:.0f}s"
    )
    return failures


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
