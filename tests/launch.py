"""Run train.py as a real multi-process gloo job for tests, and read what it wrote.

Every test that needs several processes goes through ``run_train``: it launches
``torchrun --standalone`` (a free rendezvous port, so tests may run side by side) with one
CPU thread per process and the small, fast debug settings below, and fails the test with
the job's output if it exits non-zero.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from suites import debug_job
from tests.conftest import ROOT

FAST_ARGS = [*debug_job(), "--metrics.log_freq", "5"]
"""Debug LLaMA-3 as ``suites.SMALL_CPU_JOB``: a step takes well under a second."""


def run_torchrun(
    nproc: int, script: str, *args: str, timeout: float = 600, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc script args`` with one CPU thread per process.

    ``env`` adds to (or overrides) the environment. The job runs once: one that fails is a
    failure, never retried (a retry could hide a real one). The gloo abort at interpreter
    teardown that once made a retry necessary cannot happen since train.py ends multi-process
    jobs with ``os._exit(0)`` once every rank has left the process group.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), script, *args]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)}\nexited {result.returncode}\n--- stderr (tail) ---\n{result.stderr[-6000:]}"
        )
    return result


def run_train(
    nproc: int, dump_folder: Path, *args: str, timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node nproc train.py FAST_ARGS --job.dump_folder dump_folder args``."""
    return run_torchrun(
        nproc,
        os.path.join(ROOT, "train.py"),
        *FAST_ARGS,
        "--job.dump_folder",
        str(dump_folder),
        *args,
        timeout=timeout,
        check=check,
    )


def read_losses(dump_folder: Path) -> list[tuple[int, float]]:
    """The ``(step, loss)`` pairs of ``losses.txt``, exactly as written (repr round-trips)."""
    lines = (Path(dump_folder) / "losses.txt").read_text().split("\n")
    return [(int(s), float(v)) for s, v in (line.split() for line in lines if line.strip())]
