"""Eager vs traced-graph step time of one job, measured in one run.

    python -m benchmarks.step_time [--job.config_file configs/llama3_debug.toml] [--section.key value ...]

Builds the same model twice (same seed), once per compile mode, and alternates their
steps on the same batches so both see the same machine noise. Prints the trace time and the
median step time of each mode over the measured steps (after warm-up), and graph/eager.
"""

from __future__ import annotations

import copy
import statistics
import sys
import tempfile
import time

import torch


def main(argv: list[str]) -> int:
    from graph_trainer.config_loading import load_config
    from graph_trainer.trainer import Trainer
    from graph_trainer.validation import validate_config

    warmup, measured = 3, 15
    base = load_config(argv or ["--job.config_file", "configs/llama3_debug.toml"])
    base.training.steps = warmup + measured
    base.metrics.enable_tensorboard = False
    base.metrics.log_freq = 1000
    validate_config(base)
    trainers = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("eager", "graph"):
            cfg = copy.deepcopy(base)
            cfg.compile.mode = mode
            cfg.job.dump_folder = f"{tmp}/{mode}"
            trainers[mode] = Trainer(cfg)
        data = iter(trainers["eager"].dataloader)
        times: dict[str, list[float]] = {"eager": [], "graph": []}
        trace_seconds = 0.0
        for i in range(warmup + measured):
            tokens, labels = next(data)
            for mode, trainer in trainers.items():
                start = time.perf_counter()
                trainer.train_step([(tokens, labels)])
                elapsed = time.perf_counter() - start
                if i >= warmup:
                    times[mode].append(elapsed)
                elif mode == "graph" and i == 0:
                    trace_seconds = next(iter(trainer.gradients.step_fn.graphs.values())).trace_seconds
        for trainer in trainers.values():
            trainer.metrics.close()
    eager, graph = (statistics.median(times[m]) for m in ("eager", "graph"))
    print(
        f"model {base.model.name} {base.model.flavor}, batch {base.training.local_batch_size}x{base.training.seq_len}, "
        f"threads {torch.get_num_threads()}, {measured} measured steps after {warmup} warm-up"
    )
    print(f"trace time: {trace_seconds:.2f}s")
    print(f"median step time: eager {eager * 1000:.1f} ms, graph {graph * 1000:.1f} ms")
    print(f"graph/eager: {graph / eager:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
