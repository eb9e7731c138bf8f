"""torch.profiler traces and CUDA memory snapshots of chosen steps (``[profiling]``, torchtitan's names).

``step_profiling(cfg, rank, device, start_step)`` wraps the step loop (``start_step``: the steps
done before it) and yields ``after_step(step)``, to call after each step:

- ``enable_profiling``: a ``torch.profiler.profile`` (CPU, and CUDA activity on a GPU) whose
  schedule records every ``profile_freq``-th step after ``WARMUP_STEPS`` warm-up steps and writes
  it as a Chrome trace, ``<traces folder>/iteration_<N>/rank<r>_trace.json``. Steps count from the
  job's start, so a resumed job traces the same steps as one that did not stop. In graph mode the
  graph's nodes are named ranges in the trace (``compiler.profiler_ranges``).
- ``enable_memory_snapshot`` (CUDA): the allocator records its history from the first step;
  every ``profile_freq``-th step writes ``<snapshot folder>/iteration_<N>/rank<r>_memory_snapshot.pickle``.
  On another device one warning says it is unavailable, and the job goes on.

A trace or snapshot that cannot be written (its folder cannot be created, a file or folder is in
the way, the disk is full) is one warning line naming the step and the reason, and the job goes on:
they observe the job, they are never worth stopping it. (An exception must never leave
``on_trace_ready``: torch.profiler calls it in the middle of a schedule transition, after it closed
the recorded session and before it prepares the next; one escaping leaves the profiler pointing at
the closed session, which the profiler's exit then closes again, and that double close crashes the
process in C++ with a segmentation fault, exit 139 and no message.)

Reads and writes no graph; changes no value computed (the profiler observes).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from collections.abc import Callable, Iterator

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from graph_trainer.config import JobConfig
from graph_trainer.config_paths import in_dump_folder
from graph_trainer.errors import TorchCompatError, one_line
from graph_trainer.torch_compat import dump_cuda_memory_snapshot, record_cuda_memory_history

logger = logging.getLogger("graph_trainer")

WARMUP_STEPS = 3
"""Steps the profiler runs before a recorded one, so that its start-up cost stays out of the trace."""


def profiler_action(step: int, freq: int) -> ProfilerAction:
    """What the profiler does during ``step`` (1-based, counted from the job's start)."""
    if step % freq == 0:
        return ProfilerAction.RECORD_AND_SAVE
    if freq - step % freq <= WARMUP_STEPS:
        return ProfilerAction.WARMUP
    return ProfilerAction.NONE


def iteration_folder(cfg: JobConfig, folder: str, step: int) -> str:
    """``<folder>/iteration_<step>`` (``folder`` relative to ``job.dump_folder`` unless absolute), created."""
    path = os.path.join(in_dump_folder(cfg, folder), f"iteration_{step}")
    os.makedirs(path, exist_ok=True)
    return path


def write_step_file(cfg: JobConfig, folder: str, step: int, name: str, what: str, write: Callable[[str], None]) -> bool:
    """``write(path)`` for ``path`` = ``<folder>/iteration_<step>/<name>`` (the folder created first) and
    one log line naming ``what`` it wrote; whether it was written. Any failure (creating the folder,
    writing the file) is one warning line and ``False`` (module docstring); only a ``TorchCompatError``
    (a torch without the writer's private API, never the trace's writer) is raised."""
    try:
        path = os.path.join(iteration_folder(cfg, folder, step), name)
        write(path)
    except TorchCompatError:  # a torch without the API: the job's error (exit 2), not a missing file
        raise
    except Exception as e:  # whatever the writer raises: a trace or snapshot is never worth the job
        logger.warning("%s of step %d not written (the job goes on): %s", what, step, one_line(e))
        return False
    logger.info("%s of step %d: %s", what, step, path)
    return True


def export_trace(prof: profile, path: str) -> None:
    """The profiler's last recorded cycle as a Chrome trace at ``path``; ``OSError`` where it is not written.

    Kineto's writer reports a file it cannot open on stderr only and returns as if it wrote it: the
    file is opened here first, so that an unwritable path raises, and must not be empty after."""
    with open(path, "w"):
        pass
    prof.export_chrome_trace(path)
    if os.path.getsize(path) == 0:
        raise OSError(f"the profiler wrote nothing to {path}")


@contextlib.contextmanager
def _traces(cfg: JobConfig, rank: int, device: torch.device, start_step: int) -> Iterator[Callable[[int], None]]:
    p = cfg.profiling
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    current = [start_step]

    def save(prof) -> None:  # on_trace_ready: must not raise (module docstring)
        write = functools.partial(export_trace, prof)
        write_step_file(cfg, p.save_traces_folder, current[0], f"rank{rank}_trace.json", "profiler trace", write)

    # (the schedule's index counts this run's steps from 0; the action is that of the job's step)
    schedule = lambda index: profiler_action(start_step + 1 + index, p.profile_freq)  # noqa: E731
    with warnings.catch_warnings(), profile(activities=activities, schedule=schedule, on_trace_ready=save) as prof:
        # (each trace is meant to hold its one step: torch's note that a cycle drops the last one's events)
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")

        def after_step(step: int) -> None:
            current[0] = step
            prof.step()

        yield after_step


@contextlib.contextmanager
def _memory_snapshots(cfg: JobConfig, rank: int, device: torch.device) -> Iterator[Callable[[int], None]]:
    p = cfg.profiling
    if device.type != "cuda":
        logger.warning("profiling.enable_memory_snapshot: memory snapshots need CUDA; none on %s", device.type)
        yield lambda step: None
        return
    record_cuda_memory_history(True)

    def after_step(step: int) -> None:
        if step % p.profile_freq == 0:
            name = f"rank{rank}_memory_snapshot.pickle"
            write_step_file(
                cfg, p.save_memory_snapshot_folder, step, name, "memory snapshot", dump_cuda_memory_snapshot
            )

    try:
        yield after_step
    finally:
        record_cuda_memory_history(False)


@contextlib.contextmanager
def step_profiling(cfg: JobConfig, rank: int, device: torch.device, start_step: int) -> Iterator[Callable[[int], None]]:
    """Yields ``after_step(step)`` (module docstring); without either option it does nothing."""
    p = cfg.profiling
    with contextlib.ExitStack() as stack:
        hooks = []
        if p.enable_profiling:
            hooks.append(stack.enter_context(_traces(cfg, rank, device, start_step)))
        if p.enable_memory_snapshot:
            hooks.append(stack.enter_context(_memory_snapshots(cfg, rank, device)))

        def after_step(step: int) -> None:
            for hook in hooks:
                hook(step)

        yield after_step


__all__ = ["WARMUP_STEPS", "export_trace", "iteration_folder", "profiler_action", "step_profiling", "write_step_file"]
