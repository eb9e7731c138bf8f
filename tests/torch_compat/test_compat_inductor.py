"""graph_trainer.torch_compat.inductor: the Inductor entries: the overlap scheduler and its estimate,
partition fusing, standalone compile.

Fails loudly when a PyTorch upgrade changes a private API graph_trainer relies on."""

import os
import uuid

import pytest
import torch

TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


NEEDS_2_13 = pytest.mark.skipif(
    TORCH < (2, 13),
    reason=f"auto_bucketing's overlap scheduler API is torch 2.13's; "
    f"this is {torch.__version__} (see overlap_scheduler_problem)",
)


def test_overlap_scheduler_problem_names_what_is_missing(monkeypatch):
    from graph_trainer.torch_compat import overlap_scheduler_problem, overlap_scheduling_module

    if TORCH >= (2, 13):
        assert overlap_scheduler_problem() is None
    else:
        assert "lacks" in overlap_scheduler_problem()
    monkeypatch.delattr(overlap_scheduling_module(), "estimate_roofline_runtime_ms", raising=False)
    assert overlap_scheduler_problem().startswith(
        "auto_bucketing needs PyTorch's overlap scheduler of torch 2.13; "
        f"torch {torch.__version__}'s overlap_scheduling lacks "
        "estimate_roofline_runtime_ms"
    )


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
                gm,
                collective_bucketing=False,
                insert_overlap_deps=False,
                collective_estimator="analytical",
                compute_estimator="analytical",
                pre_bucketing_fsdp_collectives=False,
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
