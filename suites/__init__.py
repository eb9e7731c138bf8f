"""The end-to-end suites' case tables: every case of ``integration_tests.py`` (the runner) and of
its ``--dry-run`` (``integration_dry_run.py``), the bounds they are held to, and the flags each
case's job gets (``job_args``). Both runners import this package; it imports neither.

``cases`` says what a case and a suite are; ``cpu`` (with ``cpu_context_parallel`` and
``cpu_qwen3``), ``h100`` and ``gpu`` hold the tables.
"""

from __future__ import annotations

from suites.cases import (
    BUCKETING,
    CLOSE_RTOL,
    EP_OVERLAP,
    GRAD_RECORD_STEP,
    GRAD_RTOL,
    INDUCTOR_RTOL,
    ROOT,
    SMALL_CPU_JOB,
    Case,
    Suite,
    debug_job,
    job_args,
)
from suites.cpu import CPU_BLOCK_COUNT, CPU_BLOCKS, CPU_CASES
from suites.cpu_context_parallel import CPU_CONTEXT_PARALLEL_CASES
from suites.cpu_qwen3 import CPU_QWEN3_CASES
from suites.gpu import GPU_CASES
from suites.h100 import H100_CASES

SUITES = {
    "cpu": Suite(
        config="configs/llama3_debug.toml",
        # The debug models cut to 2 of their 6 blocks unless a case says how many (DeepSeek-V3's
        # cases: 2 or 3; pipelines: 4, a block per stage): every per-block plan, pass and policy
        # still runs on a stack of blocks, at a third of the 6 blocks' trace and half their step.
        overrides=[*SMALL_CPU_JOB, *CPU_BLOCKS, "--metrics.log_freq", "5", "--checkpoint.interval", "0"],
        # 5 steps: the step-1 gradients are compared, then 4 AdamW updates bitwise (or within the
        # bound); steps 6 to 10 were a third of a case's time and found nothing the first 5 did not
        steps=5,
        record_grads=True,
        cases=CPU_CASES + CPU_CONTEXT_PARALLEL_CASES + CPU_QWEN3_CASES,
    ),
    "h100": Suite(
        config="configs/llama3_8b.toml",
        # bitwise comparisons on CUDA need deterministic kernels (attention backward)
        overrides=[
            "--metrics.log_freq",
            "5",
            "--checkpoint.interval",
            "0",
            "--job.device",
            "cuda",
            "--debug.deterministic",
            "True",
        ],
        steps=20,
        cases=H100_CASES,
        gpus=True,
        timeout=3600,
    ),
    "gpu": Suite(
        config="configs/llama3_debug.toml",
        overrides=[
            "--metrics.log_freq",
            "5",
            "--checkpoint.interval",
            "0",
            "--job.device",
            "cuda",
            "--metrics.enable_tensorboard",
            "False",
        ],
        steps=10,
        cases=GPU_CASES,
        gpus=True,
        report_speed=True,
        timeout=1800,
    ),
}

__all__ = [
    "BUCKETING",
    "CPU_BLOCK_COUNT",
    "CPU_BLOCKS",
    "CLOSE_RTOL",
    "EP_OVERLAP",
    "GRAD_RECORD_STEP",
    "GRAD_RTOL",
    "INDUCTOR_RTOL",
    "ROOT",
    "SMALL_CPU_JOB",
    "SUITES",
    "Case",
    "Suite",
    "debug_job",
    "job_args",
]
