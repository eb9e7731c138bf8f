"""graph_trainer/torch_compat/profiler.py against the installed torch."""

import inspect

import torch
from torch.profiler import profile

from graph_trainer.torch_compat import record_function_ops


def test_record_function_ops_open_and_close_a_named_range():
    enter, leave = record_function_ops()
    with profile() as prof:
        handle = enter("graph_trainer range", None)
        torch.ones(4).sum()
        leave(handle)
    assert [e.name for e in prof.events() if e.name == "graph_trainer range"] == ["graph_trainer range"]


def test_the_cuda_allocator_history_and_snapshot_functions_take_our_arguments():
    """(called on CUDA only; here their signatures are what the wrappers pass)"""
    record = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert list(record)[0] == "enabled" and "max_entries" in record
    assert list(inspect.signature(torch.cuda.memory._dump_snapshot).parameters)[0] == "filename"
