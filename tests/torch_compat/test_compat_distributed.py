"""graph_trainer.torch_compat.distributed: the torch.distributed entries: _StridedShard, DTensor
flattening, groups by name, gloo's threads, timeouts; and how DTensor's traced graphs differ
between releases (an identity slice after a gather, an identity view before a reduce-scatter,
autograd sequence numbers advanced in backward).

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


# SimpleFSDP's parameter path traced through DTensor, whose traced graphs differ between releases
# in the three ways the tests below pin down. The passes are written to hold under both: an
# identity view or slice inside a gather chain is tagged like the chain, and the tracer does not
# pair a backward node with a forward op by a number autograd did not give it.

TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def _gathered(local: torch.Tensor, mesh, rows: int) -> torch.Tensor:
    """SimpleFSDP's gather of a (rows, 4) parameter sharded on dim 0: all-gather forward,
    reduce-scatter of the gradient backward."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size((rows, 4)), stride=(4, 1))
    return sharded.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])


def _trace_two_gathers(rows: int, unpaired: bool):
    """A step over 4 fake ranks where ``a`` is used twice and its two gradient contributions are
    summed by autograd after the second parameter's DTensor backward has run (autograd runs the
    later-created node first: w2's gather before ``a * 3``)."""
    import contextlib

    import torch.fx.traceback as fx_traceback
    from torch.distributed.device_mesh import init_device_mesh
    from torch.fx.experimental.proxy_tensor import make_fx

    from graph_trainer.fake_trace import fake_world
    from graph_trainer.torch_compat import tag_backward_with_forward_seq_nr, unpaired_seq_nr

    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,))

        def step(x, s1, s2):
            s1, s2 = (s.detach().requires_grad_(True) for s in (s1, s2))
            a = x * _gathered(s1, mesh, rows)
            c = a * 3.0
            loss = (a * _gathered(s2, mesh, rows) + c).sum()
            tag_backward_with_forward_seq_nr(loss)
            with unpaired_seq_nr() if unpaired else contextlib.nullcontext():
                return torch.autograd.grad(loss, [s1, s2])

        with fx_traceback.preserve_node_meta(), torch.autograd.set_multithreading_enabled(False):
            inputs = (torch.randn(rows, 4), torch.randn(rows // 4, 4), torch.randn(rows // 4, 4))
            return make_fx(step, tracing_mode="fake")(*inputs)


def _calls(gm, target) -> list:
    return [n for n in gm.graph.nodes if n.target == target]


def test_dtensor_gather_ends_in_an_identity_slice_from_2_13_for_large_dims():
    # Shard._maybe_unpad_tensor of 2.13 narrows the gathered tensor to its logical size whenever
    # the two sizes are not the same Python object (`is not`): a dim above 256 is not a cached
    # small int, so a full-size slice follows the wait. 2.11 narrows only padded gathers.
    c10d = torch.ops._c10d_functional
    for rows in (256, 768):
        gm = _trace_two_gathers(rows, unpaired=True)
        after_wait = [u for w in _calls(gm, c10d.wait_tensor.default) for u in w.users]
        slices = [n for n in after_wait if n.target == torch.ops.aten.slice.Tensor]
        assert len(slices) == (2 if rows > 256 and TORCH >= (2, 13) else 0), (rows, slices)
        for s in slices:
            assert s.meta["val"].shape == s.args[0].meta["val"].shape  # identity: the whole gathered tensor


def test_dtensor_gradient_reaches_its_reduce_scatter_through_an_identity_view_from_2_13():
    # 2.13's to_local backward wraps the gradient with DTensor.from_local, whose forward is a
    # view_as: an identity view between the gradient and its reduce-scatter, tagged (in a real
    # trace) like the reduce-scatter. 2.11 wraps it directly: the reduce-scatter reads the gradient.
    # from_local is an autograd function, so 2.13's backward also advances autograd's sequence
    # number (the next test).
    c10d, aten = torch.ops._c10d_functional, torch.ops.aten
    gm = _trace_two_gathers(256, unpaired=True)
    reduce_scatters = _calls(gm, c10d.reduce_scatter_tensor.default)
    assert len(reduce_scatters) == 2
    for rs in reduce_scatters:
        grad = rs.args[0]
        if TORCH >= (2, 13):
            assert grad.target == aten.view.default and grad.meta["val"].shape == grad.args[0].meta["val"].shape
        else:
            assert grad.target == aten.mul.Tensor  # the op that computed the gradient


def test_autograd_sums_after_a_dtensor_backward_pair_with_no_forward_op_only_when_unpaired():
    # The add summing a's two gradient contributions runs outside every backward node. Without
    # unpaired_seq_nr its seq_nr is autograd's current number minus one: on 2.11 the last forward
    # op's (here the loss's sum, a forward op the tracer would pair it with), on 2.13 a number past
    # every forward op, because from_local inside w2's DTensor backward made autograd nodes.
    # With unpaired_seq_nr it is UNPAIRED_SEQ_NR on both.
    from graph_trainer.torch_compat import UNPAIRED_SEQ_NR

    aten = torch.ops.aten
    for unpaired in (False, True):
        gm = _trace_two_gathers(256, unpaired)
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        (loss_sum,) = _calls(gm, aten.sum.default)
        forward, backward = nodes[: nodes.index(loss_sum) + 1], nodes[nodes.index(loss_sum) + 1 :]
        (add,) = [n for n in backward if n.target == aten.add.Tensor]
        if unpaired:
            assert add.meta["seq_nr"] == UNPAIRED_SEQ_NR
        elif TORCH >= (2, 13):
            assert add.meta["seq_nr"] > max(n.meta["seq_nr"] for n in forward)
        else:
            assert add.meta["seq_nr"] == loss_sum.meta["seq_nr"] == max(n.meta["seq_nr"] for n in forward)


def test_functional_all_reduce_is_one_node_and_its_wait_when_traced():
    # The vocabulary-parallel loss reduces its row maxima and sums over tp with it (graph_trainer.loss).
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    from graph_trainer.fake_trace import fake_world
    from graph_trainer.torch_compat import all_reduce

    with fake_world(2):
        gm = make_fx(lambda x: all_reduce(x, "max", dist.group.WORLD) + 1, tracing_mode="fake")(torch.randn(3))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    c10d = torch.ops._c10d_functional
    assert [n.target for n in calls] == [c10d.all_reduce.default, c10d.wait_tensor.default, torch.ops.aten.add.Tensor]
    assert calls[0].args[1] == "max" and calls[1].args[0] is calls[0]
