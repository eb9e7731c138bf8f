"""Python's garbage collection at the same steps on every rank (``training.gc_freq``).

An automatic collection runs whenever allocation counts cross a threshold: at a different moment
on each rank, and a rank that pauses for it makes every other rank wait in the next collective.
``scheduled_collection(every)`` turns automatic collection off for the duration of the training
loop and collects (generations 0 and 1, as torchtitan does) once before the first step and after
every ``every``-th step, which happens at the same step on every rank. ``every == 0`` leaves
Python's automatic collection as it is. Leaving the block restores whether it was on.

Reads and writes no graph; changes no value computed.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator

logger = logging.getLogger("graph_trainer")

GENERATION = 1
"""Collect the young generations only: the full (generation 2) sweep is what takes long."""


def _collect(step: int) -> None:
    start = time.perf_counter()
    gc.collect(GENERATION)
    logger.debug("garbage collection at step %d took %.3fs", step, time.perf_counter() - start)


@contextlib.contextmanager
def scheduled_collection(every: int) -> Iterator[Callable[[int], None]]:
    """Yields ``after_step(step)``, to call after each step; see the module docstring."""
    if every == 0:
        yield lambda step: None
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        _collect(0)
        yield lambda step: _collect(step) if step % every == 0 else None
    finally:
        if was_enabled:
            gc.enable()
