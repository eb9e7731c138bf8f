"""End-to-end suites: every case is a real ``torchrun train.py`` job, checked from its outputs.

    python integration_tests.py cpu  [--only NAME[,NAME]] [--output_dir DIR] [--list]
    python integration_tests.py h100 [--only NAME[,NAME]] [--output_dir DIR] [--list]

``cpu`` runs on gloo with the debug LLaMA-3 (what CI can run: 2 cores, no GPU). ``h100`` runs
the same layouts at real sizes on 8 GPUs with NCCL; it refuses to start without 8 CUDA
devices. A case passes when its job exits 0 and its loss falls; a case naming ``same_as``
must have per-step losses bitwise those of that case (graph vs eager of one layout), and a
case naming ``close_to`` must stay within ``CLOSE_RTOL`` of that one-process run. The exit code is the number of failed cases (0: all passed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Case:
    name: str
    nproc: int
    args: list[str]
    same_as: str = ""
    """Name of an earlier case whose per-step losses this one must equal bitwise."""
    close_to: str = ""
    """Name of an earlier case (one process, same global batch) whose losses this one must
    match within ``CLOSE_RTOL``: only the order of the gradient sums differs."""
    config: str = ""
    """Job config of this case; empty: the suite's."""


CLOSE_RTOL = 1e-4


@dataclass(frozen=True)
class Suite:
    config: str
    overrides: list[str]
    cases: list[Case] = field(default_factory=list)
    needs_gpus: int = 0


def _layout_cases(layouts: dict[str, tuple[int, list[str], str]], config: str = "") -> list[Case]:
    """A graph case and its eager twin per layout: (processes, args, one-process reference)."""
    cases = []
    for name, (nproc, args, reference) in layouts.items():
        cases.append(Case(f"{name}_graph", nproc, args, close_to=reference, config=config))
        cases.append(Case(f"{name}_eager", nproc, [*args, "--compile.mode", "eager"], same_as=f"{name}_graph",
                          config=config))
    return cases


def _batch(n: int) -> list[str]:
    return ["--training.local_batch_size", str(n)]


# Every layout trains 2 sequences per data-parallel rank; its reference is one process on
# the same global batch.
# ("single_graph" is the reference at 2 sequences.)
_CPU_REFERENCES = [Case(f"single_b{n}", 1, _batch(n)) for n in (4, 8)]
_CPU_LAYOUTS = {
    "single": (1, [], ""),
    "fsdp2": (2, [], "single_b4"),
    "fsdp4": (4, [], "single_b8"),
    "hsdp2x2": (4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"], "single_b8"),
    "ddp2": (2, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1"], "single_b4"),
    "tp2": (2, ["--parallelism.tp", "2"], "single_graph"),
    "fsdp2xtp2": (4, ["--parallelism.tp", "2"], "single_b4"),
    "fsdp2_keep_params": (2, ["--parallelism.fsdp_reshard_after_forward", "never"], "single_b4"),
}
_DEEPSEEK = "configs/deepseek_v3_debug.toml"
_CPU_DEEPSEEK_REFERENCES = [Case("deepseek_single_b4", 1, _batch(4), config=_DEEPSEEK)]
_CPU_DEEPSEEK_LAYOUTS = {
    "deepseek_ep2": (2, ["--parallelism.ep", "2"], "deepseek_single_b4"),
    "deepseek_fsdp2xep2": (4, ["--parallelism.ep", "2", *_batch(1)], "deepseek_single_b4"),
}

SUITES = {
    "cpu": Suite(
        config="configs/llama3_debug.toml",
        overrides=["--training.steps", "10", "--training.seq_len", "64", "--training.local_batch_size", "2",
                   "--metrics.log_freq", "5", "--metrics.enable_tensorboard", "False", "--job.device", "cpu"],
        cases=(_CPU_REFERENCES + _layout_cases(_CPU_LAYOUTS)
               + _CPU_DEEPSEEK_REFERENCES + _layout_cases(_CPU_DEEPSEEK_LAYOUTS, _DEEPSEEK)),
    ),
    "h100": Suite(
        config="configs/llama3_8b.toml",
        overrides=["--training.steps", "20", "--metrics.log_freq", "5", "--checkpoint.interval", "0",
                   "--job.device", "cuda"],
        cases=_layout_cases({
            "fsdp8": (8, [], ""),
            "hsdp2x4": (8, ["--parallelism.dp_replicate", "2"], ""),
            "fsdp4xtp2": (8, ["--parallelism.tp", "2"], ""),
        }) + _layout_cases({
            "deepseek16b_fsdp8xep8": (8, [], ""),
            "deepseek16b_fsdp8xep4": (8, ["--parallelism.ep", "4"], ""),
        }, "configs/deepseek_v3_16b.toml"),
        needs_gpus=8,
    ),
}


def _read_losses(folder: str) -> list[str]:
    with open(os.path.join(folder, "losses.txt")) as f:
        return [line.split()[1] for line in f if line.strip()]


def run_case(suite: Suite, case: Case, output_dir: str, done: dict[str, list[str]]) -> tuple[str | None, str]:
    """Run one case; returns (None when it passed, else why it failed; a note on its numerics)."""
    folder = os.path.join(output_dir, case.name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(case.nproc),
           os.path.join(ROOT, "train.py"), "--job.config_file", os.path.join(ROOT, case.config or suite.config),
           *suite.overrides, "--job.dump_folder", folder, *case.args]
    env = {**os.environ, "PYTHONPATH": ROOT}
    if suite.needs_gpus == 0:
        env["OMP_NUM_THREADS"] = "1"
    log_path = os.path.join(output_dir, f"{case.name}.log")
    with open(log_path, "w") as log:
        result = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if result.returncode != 0:
        return f"exit code {result.returncode} (log: {log_path})", ""
    losses = _read_losses(folder)
    done[case.name] = losses
    note = f"loss {float(losses[0]):.4f} -> {float(losses[-1]):.4f}" if losses else ""
    if not losses or float(losses[-1]) >= float(losses[0]):
        return f"loss did not fall: {losses[:1]} -> {losses[-1:]}", note
    reference_name = case.same_as or case.close_to
    if reference_name:
        reference = done.get(reference_name)
        if reference is None or len(reference) != len(losses):
            return f"reference case {reference_name} did not produce {len(losses)} losses", note
        if case.same_as and reference != losses:
            step = next(i for i, (a, b) in enumerate(zip(reference, losses), 1) if a != b)
            return (f"losses differ from {case.same_as} from step {step}: "
                    f"{reference[step - 1]} vs {losses[step - 1]}"), note
        if case.same_as:
            note += f", bitwise {case.same_as}"
        else:
            deviation = max(abs(float(a) - float(b)) / abs(float(b)) for a, b in zip(losses, reference))
            note += f", max rel dev vs {case.close_to} {deviation:.1e}"
            if deviation > CLOSE_RTOL:
                return f"losses deviate {deviation:.1e} (> {CLOSE_RTOL}) from {case.close_to}", note
    return None, note


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--only", default="", help="comma-separated case names (a reference runs too)")
    parser.add_argument("--output_dir", default="", help="where jobs write; default a temporary folder")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    opts = parser.parse_args(argv)
    suite = SUITES[opts.suite]
    cases = suite.cases
    if opts.only:
        wanted = set(opts.only.split(","))
        unknown = wanted - {c.name for c in cases}
        if unknown:
            parser.error(f"unknown case(s) {sorted(unknown)}; cases: {', '.join(c.name for c in cases)}")
        by_name = {c.name: c for c in cases}
        frontier = list(wanted)
        while frontier:  # the references of the wanted cases, and theirs
            case = by_name[frontier.pop()]
            for ref in (case.same_as, case.close_to):
                if ref and ref not in wanted:
                    wanted.add(ref)
                    frontier.append(ref)
        cases = [c for c in cases if c.name in wanted]
    if opts.list:
        for c in cases:
            print(f"{c.name}: {c.nproc} processes {' '.join(c.args)}")
        return 0
    if suite.needs_gpus:
        import torch

        if torch.cuda.device_count() < suite.needs_gpus:
            print(f"error: suite {opts.suite} needs {suite.needs_gpus} CUDA devices, this machine has "
                  f"{torch.cuda.device_count()}", file=sys.stderr)
            return 2
    output_dir = opts.output_dir or tempfile.mkdtemp(prefix=f"integration_{opts.suite}_")
    os.makedirs(output_dir, exist_ok=True)
    done: dict[str, list[str]] = {}
    failures = 0
    for case in cases:
        start = time.perf_counter()
        problem, note = run_case(suite, case, output_dir, done)
        status = "PASS" if problem is None else f"FAIL: {problem}"
        failures += problem is not None
        print(f"[{opts.suite}] {case.name:24s} {time.perf_counter() - start:6.1f}s  {status}  {note}", flush=True)
    print(f"{len(cases) - failures} passed, {failures} failed")
    return failures


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
