"""Fails loudly when a PyTorch upgrade changes a private API graph_trainer relies on."""

import torch
import torch.fx.traceback as fx_traceback


def test_fx_traceback_apis():
    for name in ("annotate", "preserve_node_meta", "set_grad_fn_seq_nr", "reset_grad_fn_seq_nr"):
        assert callable(getattr(fx_traceback, name)), name


def test_autograd_node_sequence_numbers():
    x = torch.ones(2, requires_grad=True)
    y = (x * 2).sum()
    assert isinstance(y.grad_fn._sequence_nr(), int)
    assert hasattr(y.grad_fn, "register_prehook") and hasattr(y.grad_fn, "next_functions")


def test_strided_shard_placement():
    from torch.distributed.tensor import Shard

    from graph_trainer.torch_compat import StridedShard

    p = StridedShard(0, split_factor=2)
    assert p.dim == 0 and p.split_factor == 2
    # graph_trainer.optim relies on it not being a Shard and not being replicated.
    assert not isinstance(p, Shard) and not p.is_replicate()


def test_is_view_op():
    import torch.fx as fx

    from graph_trainer.torch_compat import is_view_op

    graph = fx.Graph()
    x = graph.placeholder("x")
    t = graph.call_function(torch.ops.aten.t.default, (x,))
    mm = graph.call_function(torch.ops.aten.mm.default, (x, t))
    assert is_view_op(t) and not is_view_op(mm) and not is_view_op(x)


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


def test_op_name_and_schema():
    from graph_trainer.torch_compat import op_name, op_schema

    target = torch.ops._c10d_functional.all_gather_into_tensor.default
    assert op_name(target) == "all_gather_into_tensor"
    assert [a.name for a in op_schema(target).arguments][:2] == ["input", "group_size"]


def test_symint_internals():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from graph_trainer.torch_compat import sym_expr, sym_has_hint, sym_hint

    env = ShapeEnv()
    backed = env.create_symintnode(env.create_symbol(5, ConstantSource("x"), dynamic_dim=DimDynamic.DYNAMIC), hint=5)
    unbacked = env.create_unbacked_symint()
    assert sym_has_hint(backed) and sym_hint(backed) == 5
    assert not sym_has_hint(unbacked)
    assert len(sym_expr(unbacked).free_symbols) == 1


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


def test_fake_mode_of_a_fake_value():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graph_trainer.torch_compat import fake_mode_of

    mode = FakeTensorMode()
    with mode:
        fake = torch.empty(2, 3)
    assert fake_mode_of(fake) is mode
    assert fake_mode_of(torch.empty(2)) is None and fake_mode_of(None) is None
    with fake_mode_of(fake):  # new ops on fake values give fake values of the same mode
        out = torch.cat([fake.view(-1), fake.view(-1)])
    assert fake_mode_of(out) is mode and out.shape == (12,)


def test_roofline_estimate_is_swapped_only_inside_the_block():
    import inspect

    from graph_trainer.torch_compat import inductor_counters, overlap_scheduling_module, roofline_estimate

    module = overlap_scheduling_module()
    original = module.estimate_roofline_runtime_ms

    def ours(node):
        return 1.0

    with roofline_estimate(ours):
        assert module.estimate_roofline_runtime_ms is ours
    assert module.estimate_roofline_runtime_ms is original
    try:
        with roofline_estimate(ours):
            raise ValueError("boom")
    except ValueError:
        pass
    assert module.estimate_roofline_runtime_ms is original
    params = inspect.signature(module.schedule_overlap_bucketing).parameters
    for name in ("collective_bucketing", "insert_overlap_deps", "custom_runtime_estimation", "collective_estimator",
                 "compute_estimator", "max_memory_increase_gb", "max_memory_increase_ratio", "max_in_flight_gb",
                 "pre_bucketing_fsdp_collectives"):
        assert name in params, name
    assert isinstance(inductor_counters()["overlap_scheduling_exposed"], int)


def test_cpu_backend_is_gloo_with_one_worker_thread(tmp_path):
    import torch.distributed as dist
    from torch.distributed import ProcessGroupGloo

    from graph_trainer.torch_compat import cpu_backend

    assert cpu_backend() == cpu_backend()  # registering twice is harmless
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(cpu_backend(), store=store, rank=0, world_size=1)
    try:
        gloo = dist.group.WORLD._get_backend(torch.device("cpu"))
        assert isinstance(gloo, ProcessGroupGloo)
        assert gloo.options._threads == 1
        group = dist.new_group([0])  # subgroups (device mesh dims) get the same backend
        assert dist.get_backend(group) == cpu_backend()
        x = torch.arange(4.0)
        dist.all_reduce(x, group=group)
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        dist.destroy_process_group()
