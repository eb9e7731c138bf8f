"""Private APIs of profiling: the profiler's record-function ops (a named range inside an FX graph)
and the CUDA caching allocator's history and snapshots."""

from __future__ import annotations

import torch

from graph_trainer.torch_compat.versions import private_api


def record_function_ops():
    """The ops ``torch.autograd.profiler.record_function`` is made of, callable from an FX graph:
    ``enter(name, None) -> handle`` opens a range named ``name`` in the profiler's trace,
    ``exit(handle)`` closes it."""
    with private_api("torch.ops.profiler._record_function_enter_new / _record_function_exit"):
        return (
            torch.ops.profiler._record_function_enter_new.default,
            torch.ops.profiler._record_function_exit._RecordFunction,
        )


def record_cuda_memory_history(enabled: bool, max_entries: int = 100_000) -> None:
    """Start (``enabled``) or stop recording every CUDA allocation with its stack trace."""
    with private_api("torch.cuda.memory._record_memory_history"):
        record = torch.cuda.memory._record_memory_history
    record("all" if enabled else None, max_entries=max_entries)


def dump_cuda_memory_snapshot(path: str) -> None:
    """The recorded CUDA allocator history and current segments, as a pickle memory_viz reads."""
    with private_api("torch.cuda.memory._dump_snapshot"):
        dump = torch.cuda.memory._dump_snapshot
    dump(path)
