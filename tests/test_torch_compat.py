"""Fails loudly when a PyTorch upgrade changes a private API graph_trainer relies on."""

import os
import uuid

import pytest
import torch
import torch.fx.traceback as fx_traceback


from graph_trainer.graph import tags


def test_annotations_and_backward_seq_nr_reach_node_meta():
    # The tracer tags nodes with fx.traceback.annotate (under preserve_node_meta) and gives each
    # backward node its forward node's seq_nr through tag_backward_with_forward_seq_nr
    # (autograd hooks calling set_grad_fn_seq_nr / reset_grad_fn_seq_nr).
    from torch.fx.experimental.proxy_tensor import make_fx

    from graph_trainer.torch_compat import tag_backward_with_forward_seq_nr

    def step(x):
        x = x.detach().requires_grad_(True)
        with fx_traceback.annotate({"phase": "forward"}):
            loss = (torch.sin(x) * 3.0).sum()
        tag_backward_with_forward_seq_nr(loss)
        with fx_traceback.annotate({"phase": "backward"}):
            (grad,) = torch.autograd.grad(loss, [x])
        return grad

    with fx_traceback.preserve_node_meta(), torch.autograd.set_multithreading_enabled(False):
        gm = make_fx(step, tracing_mode="fake")(torch.randn(3))
    aten = torch.ops.aten
    sin, = (n for n in gm.graph.nodes if n.target == aten.sin.default)
    cos, = (n for n in gm.graph.nodes if n.target == aten.cos.default)  # d/dx sin, traced in backward
    muls = [n for n in gm.graph.nodes if n.target == aten.mul.Tensor]
    forward_mul = next(n for n in muls if n.args[0] is sin)  # sin(x) * 3
    backward_muls = [n for n in muls if n is not forward_mul]
    # (where graph_trainer.graph.tags reads them)
    assert tags.tags(sin) == {"phase": "forward"} and tags.tags(cos) == {"phase": "backward"}
    assert sin.meta["seq_nr"] != forward_mul.meta["seq_nr"]  # two forward ops, two numbers
    assert cos.meta["seq_nr"] == sin.meta["seq_nr"]
    # MulBackward's own mul (grad * 3) carries the forward mul's number, SinBackward's (grad * cos) sin's.
    assert sorted(n.meta["seq_nr"] for n in backward_muls) == sorted([forward_mul.meta["seq_nr"], sin.meta["seq_nr"]])


def test_autograd_node_sequence_numbers_and_hooks():
    # tag_backward_with_forward_seq_nr walks next_functions from the loss, reads _sequence_nr()
    # and needs each node's prehook to run right before the node computes, its hook right after.
    events = []

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            events.append(("run", "double"))
            return grad * 2

    x = torch.ones(2, requires_grad=True)
    y = Double.apply(x)
    loss = y.sum()
    double, total = y.grad_fn, loss.grad_fn
    assert double._sequence_nr() < total._sequence_nr()  # numbered in creation order
    assert total.next_functions[0][0] is double
    for node, name in ((double, "double"), (total, "sum")):
        node.register_prehook(lambda grad_outputs, name=name: events.append(("pre", name)))
        node.register_hook(lambda grad_inputs, grad_outputs, name=name: events.append(("post", name)))
    loss.backward()
    assert events == [("pre", "sum"), ("post", "sum"), ("pre", "double"), ("run", "double"), ("post", "double")]
    assert x.grad.tolist() == [2.0, 2.0]  # the hooks (returning None) leave the gradients alone


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


TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
NEEDS_2_13 = pytest.mark.skipif(TORCH < (2, 13), reason=f"auto_bucketing's overlap scheduler API is torch 2.13's; "
                                                       f"this is {torch.__version__} (see overlap_scheduler_problem)")


def test_overlap_scheduler_problem_names_what_is_missing(monkeypatch):
    from graph_trainer.torch_compat import overlap_scheduler_problem, overlap_scheduling_module

    if TORCH >= (2, 13):
        assert overlap_scheduler_problem() is None
    else:
        assert "lacks" in overlap_scheduler_problem()
    monkeypatch.delattr(overlap_scheduling_module(), "estimate_roofline_runtime_ms", raising=False)
    assert overlap_scheduler_problem().startswith("auto_bucketing needs PyTorch's overlap scheduler of torch 2.13; "
                                                  f"torch {torch.__version__}'s overlap_scheduling lacks "
                                                  "estimate_roofline_runtime_ms")


def test_private_api_turns_a_missing_api_into_one_line_naming_it_and_the_version():
    from graph_trainer.errors import TorchCompatError
    from graph_trainer.torch_compat import SUPPORTED_TORCH, private_api

    with pytest.raises(TorchCompatError) as info:
        with private_api("torch._no_such_thing"):
            torch._no_such_thing  # noqa: B018
    message = str(info.value)
    assert "\n" not in message and message.startswith("PyTorch private API torch._no_such_thing is not available in "
                                                      f"torch {torch.__version__} (")
    assert message.endswith(f"graph_trainer supports torch {SUPPORTED_TORCH}")
    with pytest.raises(ZeroDivisionError):  # other errors pass through untouched
        with private_api("x"):
            1 / 0


def test_sym_hint_falls_back_to_hint_int_before_torch_2_13(monkeypatch):
    import torch.fx.experimental.symbolic_shapes as symbolic_shapes
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from graph_trainer.errors import TorchCompatError
    from graph_trainer.torch_compat import sym_hint

    env = ShapeEnv()
    backed = env.create_symintnode(env.create_symbol(7, ConstantSource("y"), dynamic_dim=DimDynamic.DYNAMIC), hint=7)
    calls = []
    monkeypatch.delattr(symbolic_shapes, "guarding_hint_or_throw", raising=False)
    monkeypatch.setattr(symbolic_shapes, "hint_int", lambda x: calls.append(x) or 7, raising=False)
    assert sym_hint(backed) == 7 and calls == [backed]
    monkeypatch.delattr(symbolic_shapes, "hint_int")
    with pytest.raises(TorchCompatError, match="guarding_hint_or_throw"):
        sym_hint(backed)


def test_fake_mode_functional_all_to_all_and_grouped_mm_entries():
    import torch.distributed as dist

    from graph_trainer.fake_trace import fake_world
    from graph_trainer.torch_compat import (
        all_to_all_single, all_to_all_single_autograd, grouped_mm, is_op_overload, new_fake_mode,
    )

    mode = new_fake_mode(static_shapes=True)
    with mode:
        fake = torch.empty(3, 4)
    assert fake.fake_mode is mode and fake.shape == (3, 4)
    assert is_op_overload(torch.ops.aten.mm.default) and not is_op_overload(torch.mm)
    assert not is_op_overload(torch.ops.aten.mm)  # the packet, not an overload
    # Each exchange is one _c10d_functional.all_to_all_single node (and its wait) when traced,
    # with the split sizes it was given; the autograd one has the reverse exchange as backward.
    from torch.fx.experimental.proxy_tensor import make_fx

    with fake_world(2):
        group = dist.group.WORLD

        def exchange(x):
            y = all_to_all_single(x, [1, 3], [2, 2], group)
            return all_to_all_single_autograd(y, [3, 1], [1, 3], group)

        gm = make_fx(exchange, tracing_mode="fake")(torch.randn(4, 2))
    a2a = [n for n in gm.graph.nodes if n.target == torch.ops._c10d_functional.all_to_all_single.default]
    assert [n.args[1:3] for n in a2a] == [([1, 3], [2, 2]), ([3, 1], [1, 3])]
    # grouped_mm: row block i of a times b[i] (bf16 on CPU), as two separate matmuls would give.
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 16, generator=g).bfloat16()  # strides must be multiples of 16 bytes
    b = torch.randn(2, 16, 8, generator=g).bfloat16()
    out = grouped_mm(a, b, offs=torch.tensor([2, 5], dtype=torch.int32))
    torch.testing.assert_close(out.float(), torch.cat([a[:2] @ b[0], a[2:] @ b[1]]).float(), rtol=2e-2, atol=2e-2)


@NEEDS_2_13
def test_roofline_estimate_is_swapped_only_inside_the_block():
    import inspect

    from graph_trainer.torch_compat import overlap_scheduling_module, roofline_estimate

    module = overlap_scheduling_module()
    original = module.estimate_roofline_runtime_ms

    def ours(node):
        return 1.0

    with roofline_estimate(ours):
        assert module.estimate_roofline_runtime_ms is ours
    assert module.estimate_roofline_runtime_ms is original
    with pytest.raises(ValueError, match="boom"):  # the error goes through, the original comes back
        with roofline_estimate(ours):
            raise ValueError("boom")
    assert module.estimate_roofline_runtime_ms is original
    params = inspect.signature(module.schedule_overlap_bucketing).parameters
    from graph_trainer.torch_compat import OVERLAP_SCHEDULER_ARGS

    for name in OVERLAP_SCHEDULER_ARGS:
        assert name in params, name


@NEEDS_2_13
def test_overlap_scheduler_reads_our_estimate_and_counts_collectives():
    # auto_bucketing relies on schedule_overlap_bucketing (1) looking up the module's
    # estimate_roofline_runtime_ms when it runs (so roofline_estimate replaces it), (2) moving a
    # collective ahead of independent compute, (3) counting exposed and hideable collectives in
    # inductor_counters().
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    from graph_trainer.fake_trace import fake_world
    from graph_trainer.torch_compat import inductor_counters, overlap_scheduling_module, roofline_estimate

    c10d = torch.ops._c10d_functional
    with fake_world(2):
        group = dist.group.WORLD.group_name

        def step(x, w):
            y = torch.mm(w, w)  # independent of the first gather: can hide it
            z = torch.mm(c10d.wait_tensor(c10d.all_gather_into_tensor(x, 2, group)), y)
            # the second gather needs z and the only compute left needs its result: nothing can hide it
            return torch.mm(c10d.wait_tensor(c10d.all_gather_into_tensor(z, 2, group)), y)

        gm = make_fx(step, tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 8))
        estimated = []

        def ours(node):
            estimated.append(node.name)
            return 1.0

        keys = ("overlap_scheduling_exposed", "overlap_scheduling_potentially_hidden")
        start = {k: inductor_counters()[k] for k in keys}
        with roofline_estimate(ours):
            gm = overlap_scheduling_module().schedule_overlap_bucketing(
                gm, collective_bucketing=False, insert_overlap_deps=False, collective_estimator="analytical",
                compute_estimator="analytical", pre_bucketing_fsdp_collectives=False,
                custom_runtime_estimation=lambda node, size: 1.0 if node.target == c10d.all_gather_into_tensor.default
                else None)
    assert set(estimated) == {"mm", "mm_1", "mm_2"}
    order = [n.name for n in gm.graph.nodes]
    assert order.index("all_gather_into_tensor") < order.index("mm")  # issued before the compute that hides it
    assert {k: inductor_counters()[k] - start[k] for k in keys} == {
        "overlap_scheduling_exposed": 1, "overlap_scheduling_potentially_hidden": 1}


def _two_rank_worker(rank: int, store: str, folder: str) -> None:
    """One of two processes (torch.multiprocessing.spawn) on the backend cpu_backend registers."""
    import os

    import torch.distributed as dist

    from graph_trainer.torch_compat import cpu_backend

    dist.init_process_group(cpu_backend(), init_method=f"file://{store}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])  # subgroups (device mesh dims) must get the same backend
    x = torch.arange(4.0) * (rank + 1)
    dist.all_reduce(x)
    y = torch.tensor([10.0 ** rank])
    dist.all_reduce(y, group=group)
    threads = [g._get_backend(torch.device("cpu")).options._threads for g in (dist.group.WORLD, group)]
    report = {"backends": [dist.get_backend(), dist.get_backend(group)], "threads": threads,
              "world": x.tolist(), "group": y.tolist()}
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
        assert report == {"backends": [ONE_THREAD_GLOO] * 2, "threads": [1, 1],
                          "world": [0.0, 3.0, 6.0, 9.0], "group": [11.0]}, (rank, report)


# ------------------------------------------------------------------ checkpoint metadata, process-group timeouts

class _Recording(__import__("pickle").Unpickler):
    """Plain unpickling (of a file this test wrote) that records every global the pickle names."""

    def __init__(self, file, seen):
        super().__init__(file)
        self.seen = seen

    def find_class(self, module, name):
        self.seen.add((module, name))
        return super().find_class(module, name)


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to (save|load) in a single process")
def test_dcp_metadata_globals_cover_a_real_checkpoint_and_the_reader_never_pickle_loads(tmp_path, monkeypatch):
    import pickle

    import torch.distributed.checkpoint as dcp

    from graph_trainer.safe_metadata import load_dcp_metadata, safe_reader
    from graph_trainer.torch_compat import DCP_METADATA_FILE, dcp_metadata_globals, dcp_storage_files

    state = {"model.w": torch.randn(4, 3), "model.h": torch.randn(5, dtype=torch.bfloat16),
             "optim.w.step": torch.zeros((), dtype=torch.float32), "model.i": torch.arange(3)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    seen: set = set()
    with open(tmp_path / DCP_METADATA_FILE, "rb") as f:
        _Recording(f, seen).load()
    allowed = dcp_metadata_globals()
    assert seen <= set(allowed), seen - set(allowed)  # DCP started pickling something new: admit it knowingly
    md = "torch.distributed.checkpoint.metadata"
    assert {(md, "Metadata"), (md, "TensorStorageMetadata"), (md, "ChunkStorageMetadata"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "bfloat16")} <= seen
    assert (md, "BytesStorageMetadata") not in allowed
    assert dcp_storage_files(load_dcp_metadata(str(tmp_path / DCP_METADATA_FILE))) == {"__0_0.distcp"}

    def no_pickle(*args, **kwargs):
        raise AssertionError("pickle.load called")

    monkeypatch.setattr(pickle, "load", no_pickle)
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, storage_reader=safe_reader(str(tmp_path)), no_dist=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def _timeout_worker(rank: int, store: str, folder: str) -> None:
    """One of two ranks: init with a timeout, a mesh group, comm.set_timeout, then a peer that is late."""
    import os
    import time
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from graph_trainer import comm
    from graph_trainer.torch_compat import cpu_backend, process_groups

    def timeouts():
        return sorted(g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in process_groups())

    dist.init_process_group(cpu_backend(), init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=42))
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("rep", "dp"))  # groups of its own
    report = {"groups": len(process_groups()), "mesh_in_groups": mesh.get_group("dp") in process_groups(),
              "init": timeouts()}
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


def _fake_graph(fn, *inputs):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*inputs)


def test_fuse_partitions_calls_each_partition_where_its_last_node_was():
    from graph_trainer.torch_compat import fuse_partitions

    gm = _fake_graph(lambda x: torch.relu(torch.sin(x) * 2).cos(), torch.randn(4))
    sin, mul, relu, cos = [n for n in gm.graph.nodes if n.op == "call_function"]
    fused = fuse_partitions(gm, [dict.fromkeys([sin, mul])], prefix="part_")
    ops = [n.op for n in fused.graph.nodes]
    assert ops == ["placeholder", "call_module", "call_function", "call_function", "call_function", "output"]
    call = next(n for n in fused.graph.nodes if n.op == "call_module")
    assert call.target == "part_0" and next(iter(call.users)).target.__name__ == "getitem"  # always a tuple
    x = torch.randn(4)
    assert torch.equal(fused(x), torch.relu(torch.sin(x) * 2).cos())


def test_inductor_compile_runs_in_the_trace_and_restores_the_deterministic_setting():
    from graph_trainer.torch_compat import (default_cache_dir, fake_mode_of, inductor_compile, inductor_graph_pass,
                                            inductor_output_files)

    gm = _fake_graph(lambda x, y: (torch.sin(x) * y + 1.0,), torch.randn(8, 16), torch.randn(8, 16))
    fake = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    seen = []
    before = torch.are_deterministic_algorithms_enabled()
    with inductor_output_files() as paths:
        compiled = inductor_compile(gm, fake, fake_mode_of(fake[0]), post_grad_pass=lambda g: seen.append(len(g.nodes)),
                                    deterministic=True, eager_precision=True)
    assert torch.are_deterministic_algorithms_enabled() == before
    assert seen and paths and os.path.isfile(paths[-1])  # the pass saw the lowered graph; the code file exists
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    torch.testing.assert_close(compiled(x, y)[0], torch.sin(x) * y + 1.0, rtol=1e-6, atol=1e-6)
    assert "torchinductor" in default_cache_dir()
    # A pass with a version keys Inductor's cache: a new version lowers the graph, the same one again is a hit.
    version, runs = f"test-{uuid.uuid4()}", []
    versioned = inductor_graph_pass(lambda g: runs.append(len(g.nodes)), version)
    assert versioned.uuid() == version
    for _ in range(2):
        inductor_compile(gm, fake, fake_mode_of(fake[0]), post_grad_pass=versioned)
    assert len(runs) == 1
