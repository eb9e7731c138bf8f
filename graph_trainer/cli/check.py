"""Check a multi-process job in one process, before torchrun starts its ranks.

    python -m graph_trainer.cli.check --nproc_per_node N [--nnodes M] [--section.key value ...]

Runs what every rank of ``torchrun --nproc_per_node N --nnodes M train.py ...`` checks before it
builds anything (``loop.preflight.check_job``: the configuration for N x M processes, the device
for N local ones, the files and folders the job reads, this machine's folders, threads and
memory), as the first rank of this node would. A mistake is one line on stderr and exit code 2;
a job that passes prints one line and exits 0. ``scripts/run_train.sh`` runs it before torchrun,
so that a mistake reads as one line instead of one per rank followed by torchrun's failure report.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from graph_trainer.config_loading import take_flag
from graph_trainer.errors import ConfigError, OneLineError
from graph_trainer.loop.preflight import check_job


def _processes(argv: list[str]) -> tuple[list[str], int, int]:
    argv, nproc = take_flag(argv, "--nproc_per_node", 1, int)
    argv, nnodes = take_flag(argv, "--nnodes", 1, int)
    if nproc < 1 or nnodes < 1:
        raise ConfigError(f"--nproc_per_node {nproc} and --nnodes {nnodes} must be >= 1")
    return argv, nproc, nnodes


@contextlib.contextmanager
def _as_first_rank(nproc: int, nnodes: int) -> Iterator[None]:
    """The environment torchrun gives this node's first process, while inside."""
    seen = {"WORLD_SIZE": str(nproc * nnodes), "LOCAL_WORLD_SIZE": str(nproc), "RANK": "0", "LOCAL_RANK": "0"}
    before = {k: os.environ.get(k) for k in seen}
    os.environ.update(seen)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str]) -> int:
    try:
        argv, nproc, nnodes = _processes(argv)
        with _as_first_rank(nproc, nnodes):
            cfg = check_job(argv, nproc * nnodes)
    except OneLineError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    print(
        f"checked: {cfg.model.name} {cfg.model.flavor} on {nproc * nnodes} processes "
        f"({nnodes} node(s) of {nproc}), {cfg.training.steps} steps, dump folder {cfg.job.dump_folder}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
