"""graph_trainer.torch_compat.distributed: the torch.distributed entries: _StridedShard, DTensor
flattening, groups by name, gloo's threads, timeouts.

Fails loudly when a PyTorch upgrade changes a private API graph_trainer relies on."""

import torch


def test_strided_shard_placement():
    from torch.distributed.tensor import Shard

    from graph_trainer.torch_compat import StridedShard

    p = StridedShard(0, split_factor=2)
    assert p.dim == 0 and p.split_factor == 2
    # graph_trainer.loop.optim relies on it not being a Shard and not being replicated.
    assert not isinstance(p, Shard) and not p.is_replicate()


def test_dtensor_flattens_its_mesh_as_an_inner_attribute():
    # The tracer keeps non-tensor inners (the mesh) out of the graph inputs.
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate

    from graph_trainer.torch_compat import fake_store

    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=2)
    try:
        mesh = DeviceMesh("cpu", [0, 1])
        d = DTensor.from_local(torch.ones(2), mesh, [Replicate()], run_check=False)
        names, _ = d.__tensor_flatten__()
        kinds = {n: type(getattr(d, n)) for n in names}
        assert kinds.get("_local_tensor") is torch.Tensor, kinds
        assert all(k is torch.Tensor or k is DeviceMesh for k in kinds.values()), kinds
    finally:
        dist.destroy_process_group()


def test_resolve_process_group_by_name():
    import torch.distributed as dist

    from graph_trainer.torch_compat import fake_store, resolve_process_group

    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=4)
    try:
        group = dist.new_group([0, 1])
        assert resolve_process_group(group.group_name).size() == 2
        assert resolve_process_group(dist.group.WORLD.group_name).size() == 4
    finally:
        dist.destroy_process_group()


def _two_rank_worker(rank: int, store: str, folder: str) -> None:
    """One of two processes (torch.multiprocessing.spawn) on the backend cpu_backend registers."""
    import os

    import torch.distributed as dist

    from graph_trainer.torch_compat import cpu_backend

    dist.init_process_group(cpu_backend(), init_method=f"file://{store}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])  # subgroups (device mesh dims) must get the same backend
    x = torch.arange(4.0) * (rank + 1)
    dist.all_reduce(x)
    y = torch.tensor([10.0**rank])
    dist.all_reduce(y, group=group)
    threads = [g._get_backend(torch.device("cpu")).options._threads for g in (dist.group.WORLD, group)]
    report = {
        "backends": [dist.get_backend(), dist.get_backend(group)],
        "threads": threads,
        "world": x.tolist(),
        "group": y.tolist(),
    }
    with open(os.path.join(folder, f"rank{rank}.txt"), "w") as f:
        f.write(repr(report))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown with gloo threads around, as train.py does


def test_cpu_backend_is_gloo_with_one_worker_thread(tmp_path):
    import ast

    import torch.distributed as dist
    import torch.multiprocessing as mp

    from graph_trainer.torch_compat import ONE_THREAD_GLOO, cpu_backend

    cpu_backend()
    assert cpu_backend() == ONE_THREAD_GLOO  # a second call (a second trainer in one process) works too
    assert ONE_THREAD_GLOO in dist.Backend.backend_list  # registered with torch.distributed
    # Two ranks, so that the all_reduces really exchange data (over one rank they are no-ops).
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        report = ast.literal_eval((tmp_path / f"rank{rank}.txt").read_text())
        assert report == {
            "backends": [ONE_THREAD_GLOO] * 2,
            "threads": [1, 1],
            "world": [0.0, 3.0, 6.0, 9.0],
            "group": [11.0],
        }, (rank, report)


def _timeout_worker(rank: int, store: str, folder: str) -> None:
    """One of two ranks: init with a timeout, a mesh group, comm.set_timeout, then a peer that is late."""
    import os
    import time
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from graph_trainer.distributed import comm
    from graph_trainer.torch_compat import cpu_backend, process_groups

    def timeouts():
        return sorted(g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in process_groups())

    dist.init_process_group(
        cpu_backend(), init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=42)
    )
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("rep", "dp"))  # groups of its own
    report = {
        "groups": len(process_groups()),
        "mesh_in_groups": mesh.get_group("dp") in process_groups(),
        "init": timeouts(),
    }
    comm.set_timeout(1.5)
    report["set"] = timeouts()
    if rank == 1:
        time.sleep(4)  # late: rank 0 waits in the all_reduce longer than the timeout
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=mesh.get_group("dp"))
        report["error"] = None
    except RuntimeError as e:
        report["error"] = comm.failure_message(e, 1.5) is not None
        report["waited"] = round(time.monotonic() - start)
    with open(os.path.join(folder, f"rank{rank}.txt"), "w") as f:
        f.write(repr(report))
    os._exit(0)


def test_comm_timeouts_reach_every_process_group_and_a_late_peer_times_out(tmp_path):
    import ast

    import torch.multiprocessing as mp

    mp.spawn(_timeout_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    report = ast.literal_eval((tmp_path / "rank0.txt").read_text())
    assert report["mesh_in_groups"] and report["groups"] >= 2
    # The world group has the init timeout; a mesh's own group gets torch's default (30 min on gloo in 2.13),
    # which is why comm.set_timeout visits every group.
    assert 42.0 in report["init"]
    assert report["set"] == [1.5] * report["groups"]
    assert report["error"] is True and report["waited"] in (1, 2), report


def test_dtensor_sharding_caches_can_be_cleared():
    # fake_world relies on it between worlds (tests/test_fake_trace.py shows why)
    from torch.distributed.tensor import DTensor

    from graph_trainer.torch_compat import clear_dtensor_sharding_caches

    propagate = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    clear_dtensor_sharding_caches()
    assert propagate.cache_info().currsize == 0
