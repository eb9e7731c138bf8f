"""The private PyTorch APIs graph_trainer depends on, in one place.

Everything here reaches below PyTorch's public surface, grouped by area: ``versions`` (which torch
this is, ``private_api``), ``fx`` (tracing metadata hooks, autograd node sequence numbers,
``OpOverload.is_view`` / ``_opname`` / ``_schema``, SymInt internals the cost model reads, fake
tensor modes, lazily recompiled graph modules, ``torch._grouped_mm``, ``torch._scaled_mm`` and
its CPU kernel, replaced by ours),
``distributed`` (``_StridedShard``, the dp-over-tp placement SimpleFSDP needs; mesh flattening;
process groups by name and their timeouts; the fake process group's store; functional all_reduce and all_to_all;
gloo's worker-thread count), ``checkpoint`` (DCP internals: the classes a checkpoint's metadata
pickle holds, a reader that unpickles it safely), ``pipelining`` (the action order of PyTorch's
pipeline schedules), ``profiler`` (the record-function ops a graph can call, the CUDA allocator's
history and snapshots), and ``inductor`` (the overlap scheduler, whose compute estimate, torch
2.13's roofline or 2.11's benchmark, is swapped for ours inside one context manager, and its
counters; partition fusing; standalone compilation; its logs and caches).
Import them from this package; the import-linter contract in pyproject.toml keeps every other
module away from private torch modules. ``tests/torch_compat/`` checks each entry against the
installed PyTorch so that an upgrade that changes one fails loudly there, not deep inside a
training run; and a lookup that fails at run time raises ``TorchCompatError`` (one line: the API,
the installed torch, the supported range ``SUPPORTED_TORCH``), not an ImportError deep in a
traceback.
"""

from graph_trainer.torch_compat.checkpoint import (
    DCP_METADATA_FILE,
    dcp_metadata_globals,
    dcp_reader,
    dcp_storage_files,
)
from graph_trainer.torch_compat.distributed import (
    ONE_THREAD_GLOO,
    StridedShard,
    all_reduce,
    all_to_all_single,
    all_to_all_single_autograd,
    clear_dtensor_sharding_caches,
    cpu_backend,
    fake_store,
    flatten_mesh_dims,
    process_groups,
    resolve_process_group,
    set_group_timeout,
)
from graph_trainer.torch_compat.fx import (
    SCALED_MM_ARGUMENTS,
    UNPAIRED_SEQ_NR,
    fake_mode_of,
    fake_mode_of_nodes,
    grouped_mm,
    has_side_effects,
    is_op_overload,
    is_view_op,
    lazy_graph_modules,
    new_fake_mode,
    op_name,
    op_schema,
    scaled_mm,
    sym_expr,
    sym_has_hint,
    sym_hint,
    tag_backward_with_forward_seq_nr,
    unpaired_seq_nr,
    use_cpu_scaled_mm,
)
from graph_trainer.torch_compat.inductor import (
    ESTIMATED_COMPUTE_ARGS,
    OVERLAP_SCHEDULER_ARGS,
    compute_estimate_api,
    default_cache_dir,
    deterministic_algorithms,
    fuse_partitions,
    fx_graph_cache_enabled,
    inductor_compile,
    inductor_counters,
    inductor_graph_pass,
    inductor_output_files,
    overlap_scheduler_problem,
    overlap_scheduling_module,
    roofline_estimate,
    run_overlap_scheduler,
)
from graph_trainer.torch_compat.pipelining import COMPUTE_KINDS, schedule_compute_order
from graph_trainer.torch_compat.profiler import (
    dump_cuda_memory_snapshot,
    record_cuda_memory_history,
    record_function_ops,
)
from graph_trainer.torch_compat.versions import (
    SUPPORTED_TORCH,
    TORCH_VERSION,
    private_api,
)

__all__ = [
    "COMPUTE_KINDS",
    "DCP_METADATA_FILE",
    "ESTIMATED_COMPUTE_ARGS",
    "ONE_THREAD_GLOO",
    "OVERLAP_SCHEDULER_ARGS",
    "SUPPORTED_TORCH",
    "StridedShard",
    "TORCH_VERSION",
    "SCALED_MM_ARGUMENTS",
    "UNPAIRED_SEQ_NR",
    "all_reduce",
    "all_to_all_single",
    "all_to_all_single_autograd",
    "clear_dtensor_sharding_caches",
    "compute_estimate_api",
    "cpu_backend",
    "dcp_metadata_globals",
    "dcp_reader",
    "dcp_storage_files",
    "default_cache_dir",
    "deterministic_algorithms",
    "dump_cuda_memory_snapshot",
    "fake_mode_of",
    "fake_mode_of_nodes",
    "fake_store",
    "flatten_mesh_dims",
    "fuse_partitions",
    "fx_graph_cache_enabled",
    "grouped_mm",
    "scaled_mm",
    "use_cpu_scaled_mm",
    "has_side_effects",
    "inductor_compile",
    "inductor_counters",
    "inductor_graph_pass",
    "inductor_output_files",
    "is_op_overload",
    "is_view_op",
    "lazy_graph_modules",
    "new_fake_mode",
    "op_name",
    "op_schema",
    "overlap_scheduler_problem",
    "overlap_scheduling_module",
    "private_api",
    "process_groups",
    "record_cuda_memory_history",
    "record_function_ops",
    "resolve_process_group",
    "roofline_estimate",
    "run_overlap_scheduler",
    "schedule_compute_order",
    "set_group_timeout",
    "sym_expr",
    "sym_has_hint",
    "sym_hint",
    "tag_backward_with_forward_seq_nr",
    "unpaired_seq_nr",
]
