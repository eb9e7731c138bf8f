"""What a checkpoint save every step costs the step loop: blocking saves vs background saves
(``checkpoint.async_mode async``) vs none, measured in one run on one process.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.save_step_time [--rounds 6] [--steps 4] \
        [--section.key value ...]

Three trainers of the same job (default: the LLaMA-3 debug model, seq_len 256, batch 4) take turns
in rounds: each runs ``--steps`` steps, saving after every step (but the one without saves), and
its round ends when its last save is sealed (the background one waited for), so no trainer's
work spills into another's round. Printed: the median seconds per step of each over the rounds
after the first (which traces), and the ratios to the run without saves. The background save
gains only where its writing and hashing overlap the next step: here on the second core, as
OMP_NUM_THREADS=1 leaves it to the save's thread.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

from graph_trainer.config_loading import load_config, take_flag
from graph_trainer.trainer import Trainer
from graph_trainer.validation import validate_config
from suites import debug_job

MODES = {"no saves": [], "blocking saves": ["--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2"]}
MODES["background saves"] = [*MODES["blocking saves"], "--checkpoint.async_mode", "async"]


def _trainer(folder: str, argv: list[str], mode: list[str], steps: int) -> Trainer:
    job = [*debug_job(), "--training.seq_len", "256", "--training.local_batch_size", "4"]
    job += ["--training.steps", str(steps)]
    cfg = load_config([*job, *argv, *mode, "--job.dump_folder", folder])
    validate_config(cfg)
    return Trainer(cfg)


def _round(trainer: Trainer, steps: int) -> float:
    """Seconds per step of ``steps`` more steps, the last save sealed."""
    trainer.cfg.training.steps = trainer.step + steps
    data = iter(trainer.dataloader)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step([next(data) for _ in range(trainer.microbatches)])
        trainer.step += 1
        if trainer.checkpointer.should_save(trainer.step, trainer.cfg.training.steps):
            trainer.checkpointer.save(
                trainer.step, trainer.model, trainer.optimizer, trainer.scheduler, trainer.dataloader
            )
    trainer.checkpointer.finish_pending()
    return (time.perf_counter() - start) / steps


def main(argv: list[str]) -> int:
    argv, rounds = take_flag(argv, "--rounds", 6, int)
    argv, steps = take_flag(argv, "--steps", 4, int)
    with tempfile.TemporaryDirectory() as root:
        trainers = {
            name: _trainer(os.path.join(root, str(i)), argv, mode, steps)
            for i, (name, mode) in enumerate(MODES.items())
        }
        per_step = {name: [] for name in trainers}
        for r in range(rounds):
            for name, trainer in trainers.items():
                seconds = _round(trainer, steps)
                if r > 0:
                    per_step[name].append(seconds)
    base = statistics.median(per_step["no saves"])
    print(f"{steps} steps a round, {rounds - 1} rounds measured (median seconds per step, and / no saves):")
    for name, times in per_step.items():
        median = statistics.median(times)
        print(f"  {name:17s} {median:.3f} s  {median / base:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
