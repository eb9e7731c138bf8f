"""Private APIs of torch.distributed: ``_StridedShard``, mesh flattening, process groups by name
and their timeouts, the fake process group's store, functional all_reduce and all_to_all, gloo's worker threads."""

from __future__ import annotations

import torch

from graph_trainer.torch_compat.versions import private_api

with private_api("torch.distributed.tensor.placement_types._StridedShard"):
    from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: F401


def fake_store():
    """A store for ``init_process_group("fake", ...)``: collectives are recorded, never run."""
    with private_api("torch.testing._internal.distributed.fake_pg.FakeStore"):
        from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def clear_dtensor_sharding_caches() -> None:
    """Forget DTensor's cached sharding decisions (C++ fast path and Python propagator).

    They are keyed by a mesh's value (ranks and dim names) and hold the mesh object of the first
    world that made them, with its process-group names: after that world is destroyed, a later
    world (the fake process group traces one layout after another in one process) with an equal
    mesh would get collectives on groups that no longer exist."""
    with private_api("torch._C._clear_DTensor_sharding_propagator_cache"):
        clear_fast_path = torch._C._clear_DTensor_sharding_propagator_cache
    from torch.distributed.tensor import DTensor

    with private_api("DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear"):
        clear_propagator = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear
    clear_fast_path()
    clear_propagator()


def flatten_mesh_dims(mesh, dim_names: tuple[str, ...], name: str):
    """Make ``mesh[name]`` the flattening of ``dim_names`` (``DeviceMesh._flatten``).

    PyTorch 2.13 warns that slicing a flattened dim from the root mesh "will be deprecated";
    it still works, and it is what lets ``mesh[("dp_replicate", "dp_shard")]`` name the dense
    data-parallel dims when ``dp_shard`` is ``efsdp x ep``.
    """
    import warnings

    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
    with private_api("DeviceMesh._flatten"):
        flatten = mesh[dim_names]._flatten
    return flatten(name)


def resolve_process_group(group_name: str):
    """The live ProcessGroup registered under ``group_name`` (as baked into graph collectives)."""
    with private_api("torch.distributed.distributed_c10d._resolve_process_group"):
        from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def all_to_all_single(x: torch.Tensor, output_split_sizes, input_split_sizes, group) -> torch.Tensor:
    """Functional ``all_to_all_single`` without autograd (``torch.distributed._functional_collectives``):
    one ``_c10d_functional.all_to_all_single`` node and its wait in a traced graph."""
    with private_api("torch.distributed._functional_collectives.all_to_all_single"):
        import torch.distributed._functional_collectives as funcol

    return funcol.all_to_all_single(x, output_split_sizes, input_split_sizes, group)


def all_to_all_single_autograd(x: torch.Tensor, output_split_sizes, input_split_sizes, group) -> torch.Tensor:
    """Functional ``all_to_all_single`` whose backward is the reverse exchange (``_functional_collectives``)."""
    with private_api("torch.distributed._functional_collectives.all_to_all_single_autograd"):
        from torch.distributed._functional_collectives import all_to_all_single_autograd as exchange
    return exchange(x, output_split_sizes, input_split_sizes, group)


def all_reduce(x: torch.Tensor, op: str, group) -> torch.Tensor:
    """Functional ``all_reduce`` (``"sum"``, ``"max"``, ...) without autograd (``_functional_collectives``):
    one ``_c10d_functional.all_reduce`` node and its wait in a traced graph; eagerly, the reduced tensor
    once it has arrived (``group``: a process group or a 1-D device mesh)."""
    with private_api("torch.distributed._functional_collectives.all_reduce"):
        import torch.distributed._functional_collectives as funcol

        reduced = funcol.all_reduce(x, op, group)
        return reduced.wait() if isinstance(reduced, funcol.AsyncCollectiveTensor) else reduced


ONE_THREAD_GLOO = "gloo_one_thread"
"""Backend name of gloo with one worker thread per process group (``cpu_backend``)."""


def cpu_backend() -> str:
    """The ``init_process_group`` backend for CPU jobs: gloo, with ONE worker thread per group.

    PyTorch's ``ProcessGroupGloo`` runs each group's collectives on two worker threads by
    default, so two collectives of one group can be in flight at once. With PyTorch 2.13 that
    corrupted the heap now and then: 4-process HSDP jobs with
    ``transformer_block_bucketing,auto_bucketing`` (many collectives of one group in flight)
    aborted under ``MALLOC_CHECK_=3`` with ``malloc(): unaligned tcache chunk detected``, and the
    core dump showed one worker of the group inside an ``all_gather_into_tensor_coalesced`` and the
    other inside an ``_allgather_base`` of that same group. With one worker per group no run failed,
    at the same step time (each group's collectives run in issue order, still beside compute and
    beside other groups); the run counts are in docs/performance.md. The faulty code inside
    PyTorch's gloo backend was not pinned down; the evidence (the dump, and no crash with one
    worker) points at two collectives of one group running at once.

    ``ProcessGroupGloo._Options._threads`` is private, and ``init_process_group`` ignores
    options for gloo; so this registers (once) a backend that builds gloo groups with those
    options, through the public ``Backend.register_backend``. Returns its name.
    """
    import torch.distributed as dist
    from torch.distributed import ProcessGroupGloo

    def create(store, rank: int, size: int, timeout):
        with private_api("ProcessGroupGloo._Options (_timeout, _threads, _devices)"):
            options = ProcessGroupGloo._Options()
            options._timeout = timeout
            options._threads = 1
            options._devices = [ProcessGroupGloo.create_default_device()]
        return ProcessGroupGloo(store, rank, size, options)

    if ONE_THREAD_GLOO not in dist.Backend.backend_list:
        dist.Backend.register_backend(ONE_THREAD_GLOO, create, devices=["cpu"])
    return ONE_THREAD_GLOO


def process_groups() -> list:
    """Every process group this process belongs to (the world and each group a device mesh made),
    from ``distributed_c10d._world.pg_map``."""
    with private_api("torch.distributed.distributed_c10d._world.pg_map"):
        from torch.distributed.distributed_c10d import _world

        return list(_world.pg_map)


def set_group_timeout(group, timeout) -> None:
    """Give ``group``'s gloo or NCCL backend a new collective timeout (``distributed_c10d._set_pg_timeout``)."""
    with private_api("torch.distributed.distributed_c10d._set_pg_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout
    _set_pg_timeout(timeout, group)
