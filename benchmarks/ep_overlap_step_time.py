"""Measured step time with and without ep_overlap on real processes, as ratios from one run.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 -m benchmarks.ep_overlap_step_time \
        [--job.config_file configs/deepseek_v3_debug.toml] [--parallelism.ep 2] [--section.key value ...]

Every rank holds three Trainers of the same job (same seed, same weights, same batches), in
``compile.mode = "graph"``:

- ``plain``: no ep_overlap;
- ``chunked``: ep_overlap with ``compile.ep_overlap.reorder = false`` (two chunks, traced order:
  the cost of chunking alone);
- ``ep_overlap``: two chunks, scheduled so each all_to_all hides behind the other chunk.

Their steps alternate (``benchmarks.alternating``); after 3 warm-up steps (the first traces)
the medians of rank 0 over the measured steps are printed with ``ep_overlap/plain`` and
``ep_overlap/chunked``. On CPU with gloo, collectives run on gloo's own threads, so a wait
that comes later can find its all_to_all done; how much that shows depends on the cores free.
The losses of ``chunked`` and ``ep_overlap`` are bitwise equal (printed).
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from benchmarks.alternating import time_alternating

WARMUP, MEASURED = 3, 12
DEFAULT_ARGS = [
    "--job.config_file",
    "configs/deepseek_v3_debug.toml",
    "--parallelism.ep",
    "2",
    "--training.local_batch_size",
    "4",
    "--training.seq_len",
    "128",
]


def _loss_step(trainer):
    """A step function of ``trainer`` that returns only the loss (what ``time_alternating`` calls)."""
    return lambda tokens, labels: trainer.train_step([(tokens, labels)])[0]


def main(argv: list[str]) -> int:
    from graph_trainer.config import EpOverlap
    from graph_trainer.config_loading import load_config
    from graph_trainer.trainer import Trainer
    from graph_trainer.validation import validate_config

    world_size = int(os.environ.get("WORLD_SIZE", 1))
    base = load_config(DEFAULT_ARGS + argv)
    base.compile.mode = "graph"
    base.compile.passes = [p for p in base.compile.passes if p != "ep_overlap"]
    base.training.steps = WARMUP + MEASURED
    base.metrics.enable_tensorboard = False
    base.metrics.log_freq = 1000
    variants = {}
    for name, passes, reorder in (
        ("plain", [], True),
        ("chunked", ["ep_overlap"], False),
        ("ep_overlap", ["ep_overlap"], True),
    ):
        cfg = copy.deepcopy(base)
        cfg.compile.passes = ["ep_overlap", *cfg.compile.passes] if passes else list(cfg.compile.passes)
        cfg.compile.ep_overlap.reorder = reorder
        if not passes:  # (the plain job runs no ep_overlap: its settings would be refused as ignored)
            cfg.compile.ep_overlap = EpOverlap()
        validate_config(cfg, world_size=world_size)
        variants[name] = cfg
    if world_size < 2:
        raise SystemExit("run under torchrun with >= 2 processes (expert parallelism)")

    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for name, cfg in variants.items():
            cfg.job.dump_folder = os.path.join(tmp, name)
            trainers[name] = Trainer(cfg)
        steps = {name: _loss_step(tr) for name, tr in trainers.items()}
        timings = time_alternating(steps, iter(trainers["plain"].dataloader), WARMUP, MEASURED)
        for tr in trainers.values():
            tr.metrics.close()

    if dist.get_rank() == 0:
        t = base.training
        plain, chunked, overlap = (timings.median_ms(n) for n in ("plain", "chunked", "ep_overlap"))
        print(
            f"model: {base.model.name} {base.model.flavor}, world size {world_size}, ep {base.parallelism.ep}, "
            f"{torch.get_num_threads()} thread(s) per rank, passes besides ep_overlap: "
            f"{','.join(base.compile.passes) or 'none'}"
        )
        print(
            f"ep_overlap: module_fqn {base.compile.ep_overlap.module_fqn!r}, chunk_dim "
            f"{base.compile.ep_overlap.chunk_dim!r}"
        )
        print(
            f"batch: {t.local_batch_size} x {t.seq_len} tokens per rank; {MEASURED} measured steps each after "
            f"{WARMUP} warm-up, alternating"
        )
        print(
            "loss at the first measured step: "
            + ", ".join(f"{name} {loss!r}" for name, loss in timings.first_losses.items())
        )
        for name in steps:
            print(f"median step time {name}: {timings.median_ms(name):.1f} ms")
        print(f"ep_overlap/plain: {overlap / plain:.3f}")
        print(f"ep_overlap/chunked: {overlap / chunked:.3f}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
