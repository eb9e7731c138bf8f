"""Run train.py as a real multi-process gloo job for tests, and read what it wrote.

Every test that needs several processes goes through this module: ``run_train`` runs train.py
with the small, fast debug settings below on ranks forked from a server that imported torch once
(``run_forked``, ``tests/forked_ranks.py``: torchrun's environment, one CPU thread per process);
a test of what torchrun itself shows (its failure report) uses ``run_torchrun``. Both take a free
rendezvous port, so tests may run side by side, and fail the test with the job's stderr if it
exits non-zero.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from suites import CPU_BLOCKS, debug_job
from tests.conftest import ROOT
from tests.forked_ranks import run_job as forked_ranks_job

FAST_ARGS = [*debug_job(), *CPU_BLOCKS, "--metrics.log_freq", "5"]
"""Debug LLaMA-3 as ``suites.SMALL_CPU_JOB``, cut to the cpu suite's 2 blocks (``suites.CPU_BLOCKS``;
a test's own ``--model.n_layers`` wins): a step takes a fraction of a second."""


def run_torchrun(
    nproc: int, script: str, *args: str, timeout: float = 600, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc script args`` with one CPU thread per process.

    ``env`` adds to (or overrides) the environment. The job runs once: one that fails is a
    failure, never retried (a retry could hide a real one). The gloo abort at interpreter
    teardown that once made a retry necessary cannot happen since train.py ends multi-process
    jobs with ``os._exit(0)`` once every rank has left the process group.
    """
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return _run([sys.executable, *launcher, script, *args], timeout, check, env)


def run_forked(
    nproc: int, script: str, *args: str, timeout: float = 600, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``run_torchrun``'s job with its ranks forked from a server that imported torch and the trainer
    once (``tests/forked_ranks.py``): torchrun's environment contract without each rank's seconds
    of start-up. CPU jobs only."""
    return _run([script, *args], timeout, check, env, forked_ranks=nproc)


def _run(
    cmd: list[str], timeout: float, check: bool, env: dict[str, str] | None, forked_ranks: int = 0
) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **(env or {})}
    if forked_ranks:
        result = forked_ranks_job(forked_ranks, cmd, env, ROOT, timeout)
    else:
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)}\nexited {result.returncode}\n--- stderr (tail) ---\n{result.stderr[-6000:]}"
        )
    return result


def run_train(
    nproc: int, dump_folder: Path, *args: str, timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess:
    """``train.py FAST_ARGS --job.dump_folder dump_folder args`` on ``nproc`` forked ranks."""
    return run_forked(
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
