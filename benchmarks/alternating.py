"""Time several training-step functions on the same batches, alternating, in one run.

Machines here are noisy (shared CPUs): timing A for a while and then B would mostly measure
the noise. ``time_alternating`` runs one step of each function per batch, in turn, so all see
the same conditions, each step timed from a barrier (every rank starts together) to its loss
as a Python float (the step is finished). Medians over the measured steps are what the
benchmarks print.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Timings:
    times: dict[str, list[float]] = field(default_factory=dict)
    """Seconds of every measured step, per function."""
    first_losses: dict[str, float] = field(default_factory=dict)
    """Loss of the first measured step, per function."""
    first_step_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds of the very first (warm-up) step, per function: includes tracing for graphs."""

    def median_ms(self, name: str) -> float:
        return 1000 * statistics.median(self.times[name])


def time_alternating(
    steps: dict[str, Callable[[torch.Tensor, torch.Tensor], float]],
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    warmup: int,
    measured: int,
) -> Timings:
    """One step of each function per batch, in the order given; ``warmup`` batches are not timed."""
    result = Timings(times={name: [] for name in steps})
    for i in range(warmup + measured):
        tokens, labels = next(batches)
        for name, step in steps.items():
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            loss = step(tokens, labels)
            elapsed = time.perf_counter() - start
            if i == 0:
                result.first_step_seconds[name] = elapsed
            if i == warmup:
                result.first_losses[name] = loss
            if i >= warmup:
                result.times[name].append(elapsed)
    return result
