"""graph_trainer.torch_compat.inductor: the Inductor entries: the overlap scheduler and its estimate,
partition fusing, standalone compile.

Fails loudly when a PyTorch upgrade changes a private API graph_trainer relies on."""

import os
import uuid

import pytest
import torch

TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def test_overlap_scheduler_estimates_compute_as_this_release_does():
    # torch 2.13 and later estimate compute with a roofline (estimate_roofline_runtime_ms, with
    # compute_estimator and pre_bucketing_fsdp_collectives arguments); 2.11 benchmarks it
    # (benchmark_node*, aligned across ranks), with neither argument. A release that has moved
    # to another way must be looked at before auto_bucketing runs on it.
    import inspect

    from graph_trainer.torch_compat import (
        ESTIMATED_COMPUTE_ARGS,
        OVERLAP_SCHEDULER_ARGS,
        compute_estimate_api,
        overlap_scheduler_problem,
        overlap_scheduling_module,
    )

    module = overlap_scheduling_module()
    assert compute_estimate_api(module) == ("roofline" if TORCH >= (2, 13) else "benchmark")
    assert overlap_scheduler_problem() is None
    params = inspect.signature(module.schedule_overlap_bucketing).parameters
    for name in OVERLAP_SCHEDULER_ARGS:
        assert name in params, name
    assert all(name in params for name in ESTIMATED_COMPUTE_ARGS) == (TORCH >= (2, 13))


def test_overlap_scheduler_problem_names_what_is_missing(monkeypatch):
    from graph_trainer.torch_compat import compute_estimate_api, overlap_scheduler_problem, overlap_scheduling_module

    module = overlap_scheduling_module()
    for name in ("estimate_roofline_runtime_ms", "benchmark_node"):
        monkeypatch.delattr(module, name, raising=False)
    assert compute_estimate_api(module) is None
    assert overlap_scheduler_problem().startswith(
        "auto_bucketing needs PyTorch's overlap scheduler of torch 2.11 or 2.13; "
        f"torch {torch.__version__}'s overlap_scheduling lacks estimate_roofline_runtime_ms, benchmark_node"
    )


def test_roofline_estimate_is_swapped_only_inside_the_block():
    from graph_trainer.torch_compat import overlap_scheduling_module, roofline_estimate

    module = overlap_scheduling_module()

    def snapshot():
        return {**vars(module), **{f"OverlapScheduler.{k}": v for k, v in vars(module.OverlapScheduler).items()}}

    before = snapshot()

    def ours(node):
        return 1.0

    with roofline_estimate(ours):
        inside = snapshot()
        if TORCH >= (2, 13):
            assert module.estimate_roofline_runtime_ms is ours
    changed = {k for k in before if inside[k] is not before[k]}
    assert changed == (
        {"estimate_roofline_runtime_ms"}
        if TORCH >= (2, 13)
        else {
            "benchmark_node",
            "benchmark_node_with_cache_key",
            "OverlapScheduler._align_compute_nodes_runtime_estimations_across_all_distributed_ranks",
        }
    )
    assert snapshot() == before
    with pytest.raises(ValueError, match="boom"):  # the error goes through, the originals come back
        with roofline_estimate(ours):
            raise ValueError("boom")
    assert snapshot() == before


def test_overlap_scheduler_reads_our_estimate_and_counts_collectives(tmp_path, monkeypatch):
    # auto_bucketing relies on schedule_overlap_bucketing (1) taking every compute node's runtime
    # from the estimate run_overlap_scheduler installs (2.13: the module's roofline function,
    # looked up when it runs; 2.11: benchmark_node, with no GPU, no random inputs and nothing
    # written to Inductor's on-disk cache, whose entries would otherwise win over ours), (2)
    # moving a collective ahead of independent compute, (3) counting exposed and hideable
    # collectives in inductor_counters().
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    from graph_trainer.fake_trace import fake_world
    from graph_trainer.torch_compat import inductor_counters, run_overlap_scheduler

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
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
        gm = run_overlap_scheduler(
            gm,
            ours,
            collective_bucketing=False,
            insert_overlap_deps=False,
            collective_estimator="analytical",
            custom_runtime_estimation=lambda node, size: (
                1.0 if node.target == c10d.all_gather_into_tensor.default else None
            ),
        )
    assert set(estimated) == {"mm", "mm_1", "mm_2"}
    order = [n.name for n in gm.graph.nodes]
    assert order.index("all_gather_into_tensor") < order.index("mm")  # issued before the compute that hides it
    assert {k: inductor_counters()[k] - start[k] for k in keys} == {
        "overlap_scheduling_exposed": 1,
        "overlap_scheduling_potentially_hidden": 1,
    }
    assert not (tmp_path / "cache").exists()  # no estimate cached on disk


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
    from graph_trainer.torch_compat import (
        default_cache_dir,
        fake_mode_of,
        inductor_compile,
        inductor_graph_pass,
        inductor_output_files,
    )

    gm = _fake_graph(lambda x, y: (torch.sin(x) * y + 1.0,), torch.randn(8, 16), torch.randn(8, 16))
    fake = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    seen = []
    before = torch.are_deterministic_algorithms_enabled()
    with inductor_output_files() as paths:
        compiled = inductor_compile(
            gm,
            fake,
            fake_mode_of(fake[0]),
            post_grad_pass=lambda g: seen.append(len(g.nodes)),
            deterministic=True,
            eager_precision=True,
        )
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
