"""FP8 linears on the CPU against bf16: the debug model's step with each float8 recipe, measured in
one run on one process.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.float8_cpu_step [--rounds 4] [--steps 4] \
        [--section.key value ...]

One trainer per mode of the same job (default: ``configs/llama3_debug.toml`` as it is, graph mode,
bf16 parameters): ``bf16`` (no float8), and ``--float8.recipe_name`` tensorwise, rowwise and
rowwise_with_gw_hp. They take turns in rounds of ``--steps`` steps, so that the machine's noise
falls on every mode alike; printed: the median seconds per step over the rounds after the first
(which traces), the ratio of each to bf16, and the CPU it ran on. On the CPU a float8 matmul is
``models.float8.scaled_mm_in_float32`` (the float8 operands widened to float32, one float32
matmul), so its cost follows the float32 matmul rate of the machine, not a float8 kernel that
some CPUs lack; the float8 casts (amax, scale, saturating cast) are the rest of the difference.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time

from graph_trainer.config_loading import load_config, take_flag
from graph_trainer.trainer import Trainer
from graph_trainer.validation import validate_config
from suites.cases import ROOT

CONFIG = os.path.join(ROOT, "configs", "llama3_debug.toml")
MODES = {
    "bf16": [],
    **{f"fp8 {r}": ["--float8.recipe_name", r] for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp")},
}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _trainer(folder: str, argv: list[str], mode: list[str]) -> Trainer:
    job = ["--job.config_file", CONFIG, "--job.device", "cpu", "--training.mixed_precision_param", "bfloat16"]
    job += ["--checkpoint.interval", "0", "--metrics.enable_tensorboard", "False"]
    cfg = load_config([*job, *argv, *mode, "--job.dump_folder", folder])
    validate_config(cfg)
    return Trainer(cfg)


def _round(trainer: Trainer, data, steps: int) -> float:
    """Seconds per step of ``steps`` more steps."""
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step += 1
        trainer.train_step([next(data) for _ in range(trainer.microbatches)])
    return (time.perf_counter() - start) / steps


def main(argv: list[str]) -> int:
    argv, rounds = take_flag(argv, "--rounds", 4, int)
    argv, steps = take_flag(argv, "--steps", 4, int)
    with tempfile.TemporaryDirectory() as root:
        trainers = {
            name: _trainer(os.path.join(root, str(i)), argv, mode) for i, (name, mode) in enumerate(MODES.items())
        }
        for trainer in trainers.values():  # every step of the benchmark inside the schedule
            trainer.cfg.training.steps = rounds * steps + 1
        data = {name: iter(trainer.dataloader) for name, trainer in trainers.items()}
        per_step: dict[str, list[float]] = {name: [] for name in trainers}
        for r in range(rounds):
            for name, trainer in trainers.items():
                seconds = _round(trainer, data[name], steps)
                if r > 0:
                    per_step[name].append(seconds)
    base = statistics.median(per_step["bf16"])
    threads = os.environ.get("OMP_NUM_THREADS", "torch's default")
    print(f"{cpu_model()}, {threads} thread(s): {steps} steps a round, {rounds - 1} rounds measured")
    print("(median seconds per step, and / bf16):")
    for name, times in per_step.items():
        median = statistics.median(times)
        print(f"  {name:22s} {median:.3f} s  {median / base:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
