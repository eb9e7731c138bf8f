"""FP8 linears on the CPU against bf16: the debug model's step with each float8 recipe, measured in
one run on one process.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.float8_cpu_step [--warmup 3] [--steps 12] \
        [--section.key value ...]

One trainer per mode of the same job (default: ``configs/llama3_debug.toml`` as it is, graph mode,
bf16 parameters): ``bf16`` (no float8), and ``--float8.recipe_name`` tensorwise, rowwise and
rowwise_with_gw_hp. They take turns step by step on the same batches
(``alternating.time_alternating``), so that the machine's noise falls on every mode alike; printed:
the median seconds per step of the ``--steps`` after ``--warmup`` (the first traces), the ratio of
each to bf16, and the CPU it ran on. On the CPU a float8 matmul is
``models.float8.scaled_mm_in_float32`` (the float8 operands widened to float32, one float32
matmul), so its cost follows the float32 matmul rate of the machine, not a float8 kernel that
some CPUs lack; the float8 casts (amax, scale, saturating cast) are the rest of the difference.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile

from benchmarks.alternating import time_alternating
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


def _step(trainer: Trainer):
    """One optimizer step of ``trainer`` on a batch; its loss (``alternating.time_alternating``)."""

    def step(tokens, labels) -> float:
        trainer.step += 1
        return trainer.train_step([(tokens, labels)])[0]

    return step


def main(argv: list[str]) -> int:
    argv, warmup = take_flag(argv, "--warmup", 3, int)
    argv, measured = take_flag(argv, "--steps", 12, int)
    with tempfile.TemporaryDirectory() as root:
        trainers = {
            name: _trainer(os.path.join(root, str(i)), argv, mode) for i, (name, mode) in enumerate(MODES.items())
        }
        for trainer in trainers.values():  # every step of the benchmark inside the schedule
            trainer.cfg.training.steps = warmup + measured + 1
        batches = iter(trainers["bf16"].dataloader)  # (every mode steps on the same batches)
        timings = time_alternating({name: _step(t) for name, t in trainers.items()}, batches, warmup, measured)
    base = timings.median_ms("bf16")
    threads = os.environ.get("OMP_NUM_THREADS", "torch's default")
    print(f"{cpu_model()}, {threads} thread(s): {measured} steps measured after {warmup} (median per step, / bf16):")
    for name in trainers:
        median = timings.median_ms(name)
        print(f"  {name:22s} {median / 1000:.3f} s  {median / base:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
