"""The step's memory estimate: its parts, the optimizer state, FSDP sharding, the warning, and
the CLI (the 8B FSDP=8 acceptance command and the one point measured on an H100)."""

import dataclasses
import operator

import pytest
import torch
import torch.fx as fx

from graph_trainer.analysis.memory import (
    ADAMW,
    DEVICE_MEMORY_BYTES,
    GIB,
    MemoryParts,
    StepMemoryEstimate,
    estimate_peak_memory,
    estimate_step_memory,
    memory_warning,
    optimizer_memory,
)

aten = torch.ops.aten
FP32 = 4


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _step_graph() -> tuple[fx.Graph, str]:
    """A traced step's shape: params w1, w2, then x; out = (loss, grad w1, grad w2). grad w2 is
    produced first, then a big temporary peaks before grad w1 exists (backward order).
    Returns the graph and the name of the peak node."""
    g = fx.Graph()

    def call(target, args, val):
        n = g.call_function(target, args)
        n.meta["val"] = val
        return n

    w1, w2, x = (g.placeholder(name) for name in ("w1", "w2", "x"))
    w1.meta["val"], w2.meta["val"], x.meta["val"] = _meta(64, 64), _meta(64, 32), _meta(128, 64)
    h = call(aten.mm.default, (x, w1), _meta(128, 64))
    loss = call(aten.sum.default, (call(aten.mm.default, (h, w2), _meta(128, 32)),), _meta(()))
    gw2 = call(aten.mm.default, (h, x), _meta(64, 32))
    big = call(aten.mm.default, (x, w1), _meta(256, 256))
    reduced = call(aten.sum.dim_IntList, (big, [0]), _meta(64, 64))  # peak: big and reduced alive
    gw1 = call(aten.mul.Tensor, (reduced, reduced), _meta(64, 64))
    g.output((loss, gw1, gw2))
    return g, reduced.name


def test_each_output_of_a_multi_output_kernel_is_its_own_allocation():
    """Keeping attention's small logsumexp (here: layer norm's rstd) does not keep the large
    output alive: once the output's last reader ran, only the kept output counts."""
    g = fx.Graph()

    def call(target, args, val):
        n = g.call_function(target, args)
        n.meta["val"] = val
        return n

    x = g.placeholder("x")
    x.meta["val"] = _meta(64, 128)
    outs = call(
        aten.native_layer_norm.default, (x, [128], None, None, 1e-5), (_meta(64, 128), _meta(64, 1), _meta(64, 1))
    )
    out = call(operator.getitem, (outs, 0), _meta(64, 128))
    rstd = call(operator.getitem, (outs, 2), _meta(64, 1))
    total = call(aten.sum.default, (out,), _meta(()))
    big = call(aten.mul.Tensor, (x, x), _meta(64, 128))  # after out's last reader
    g.output((call(aten.add.Tensor, (total, call(aten.sum.default, (big,), _meta(()))), _meta(())), rstd))
    estimate = estimate_peak_memory(g)
    x_bytes, rows = 64 * 128 * FP32, 64 * FP32
    # the peak: x, out and both statistics (the kernel's outputs), before out is freed; were the
    # tuple one allocation, rstd would keep out alive beside big: 3 x_bytes + 2 rows
    assert estimate.peak_bytes == 2 * x_bytes + 2 * rows


def test_graph_replay_splits_params_and_grads_alive_at_the_peak():
    graph, peak_node = _step_graph()
    g = estimate_peak_memory(graph)
    assert g.param_bytes == (64 * 64 + 64 * 32) * FP32
    assert g.input_bytes == g.param_bytes + 128 * 64 * FP32
    assert g.total_grad_bytes == g.param_bytes  # gradients in the parameters' layout and dtype
    assert g.peak_node == peak_node
    assert g.grad_bytes == 64 * 32 * FP32  # grad w2 produced, grad w1 not yet
    assert g.peak_bytes == g.input_bytes + 4 + 64 * 32 * FP32 + (256 * 256 + 64 * 64) * FP32  # + loss
    assert g.transient_bytes == g.peak_bytes - g.param_bytes - g.grad_bytes


def test_parts_add_up_and_optimizer_is_two_fp32_moments():
    graph, _ = _step_graph()
    est = estimate_step_memory(graph)
    params = (64 * 64 + 64 * 32) * FP32
    assert [p.moment for p in est.moments] == ["graph", "optimizer step"]
    for p in est.moments:
        assert p.total == p.params + p.grads + p.optimizer + p.activations and p.accumulated_grads == 0
        assert p.params == params and p.optimizer == 2 * params
    assert est.peak_bytes == max(p.total for p in est.moments) == est.peak.total
    graph_moment = est.moments[0]
    assert graph_moment.total == estimate_peak_memory(graph).peak_bytes + 2 * params


def test_accumulation_buffer_is_resident_during_a_later_microbatchs_graph():
    graph, _ = _step_graph()
    one, four = estimate_step_memory(graph), estimate_step_memory(graph, microbatches=4)
    all_grads = estimate_peak_memory(graph).total_grad_bytes
    assert all_grads > 0
    assert four.moments[0] == dataclasses.replace(one.moments[0], accumulated_grads=all_grads)
    assert four.moments[0].total == one.moments[0].total + all_grads
    assert four.moments[1] == one.moments[1]  # the optimizer sees the buffer as its gradients
    assert estimate_step_memory(graph, microbatches=2) == four  # one buffer, however many microbatches
    assert ("accumulated grads" in four.summary()) == (four.peak.moment == "graph")
    with pytest.raises(ValueError, match="microbatches = 0 must be >= 1"):
        estimate_step_memory(graph, microbatches=0)


def test_eager_estimate_is_model_state_and_a_lower_bound():
    params = [_meta(1000, 10), _meta(10)]
    est = estimate_step_memory(None, params, ADAMW)
    (moment,) = est.moments
    n = 10_010 * FP32
    assert (moment.params, moment.grads, moment.optimizer) == (n, n, 2 * n)
    assert moment.activations == 2 * 10_000 * FP32  # AdamW's two temporaries of the largest parameter
    assert not est.activations_estimated and "at least" in est.summary()


def test_optimizer_memory_from_the_config_or_a_torch_optimizer():
    from graph_trainer.config import Training
    from graph_trainer.loop.optim import build_optimizer

    w = torch.nn.Parameter(torch.zeros(4))
    assert optimizer_memory(Training()) == ADAMW == optimizer_memory(build_optimizer([w], Training()))
    assert optimizer_memory(torch.optim.AdamW([w], amsgrad=True)).state_tensors == 3
    assert optimizer_memory(torch.optim.AdamW([w], foreach=True)).all_at_once
    with pytest.raises(ValueError, match="SGD"):
        optimizer_memory(torch.optim.SGD([w], lr=0.1))


def _estimate(peak: int) -> StepMemoryEstimate:
    """A graph-moment estimate of ``peak`` bytes: params 1/4, optimizer 1/2, activations the rest."""
    return StepMemoryEstimate(
        (MemoryParts("graph", peak // 4, 0, peak // 2, peak - peak // 4 - peak // 2, "mm"),), True
    )


def test_warning_above_the_device_memory_only():
    limit = DEVICE_MEMORY_BYTES["h100"]
    assert limit == round(79.1 * GIB)
    assert memory_warning(_estimate(round(75.25 * GIB)), limit, "H100 SXM") is None
    assert memory_warning(_estimate(limit), limit, "H100 SXM") is None  # at the limit: fits
    assert memory_warning(_estimate(limit + 1), limit, "H100 SXM") is not None
    message = memory_warning(_estimate(80 * (1 << 30)), limit, "H100 SXM")
    assert message is not None and "\n" not in message
    assert "peak 80.00 GiB" in message and "79.10 GiB" in message and "H100 SXM" in message
    assert "params 20.00 GiB" in message and "optimizer 40.00 GiB" in message
    assert memory_warning(_estimate(1 << 50), None) is None  # no limit known: no warning


def _debug_step(world_size: int):
    """The debug LLaMA-3 (fp32) traced at ``world_size`` with FSDP over all ranks, and its
    parameters (DTensors when sharded) as the trainer holds them."""
    from graph_trainer.build import build_model
    from graph_trainer.config_loading import load_config
    from graph_trainer.distributed.parallel_dims import ParallelDims, build_mesh, resolve_parallel_degrees
    from graph_trainer.distributed.simple_fsdp import MixedPrecision
    from graph_trainer.fake_trace import fake_world, trace_without_passes
    from models.registry import MODEL_SPECS

    cfg = load_config(
        [
            "--job.config_file",
            "configs/llama3_debug.toml",
            "--training.local_batch_size",
            "1",
            "--training.seq_len",
            "64",
        ]
    )
    spec = MODEL_SPECS[cfg.model.name]
    with fake_world(world_size):
        traced, _ = trace_without_passes(cfg, world_size)
        dims = ParallelDims.from_degrees(resolve_parallel_degrees(cfg.parallelism, world_size))
        mesh = build_mesh(dims, "cpu")
        model = build_model(
            spec.build,
            spec.flavors[cfg.model.flavor],
            torch.device("meta"),
            0,
            parallelize=lambda m: spec.parallelize(m, mesh, dims, MixedPrecision()),
        )
        params = list(model.parameters())
    return traced.gm.graph, params, cfg


def test_traced_debug_model_optimizer_is_exactly_two_fp32_moments_per_local_element():
    from torch.distributed.tensor import DTensor

    from graph_trainer.loop.optim import build_optimizer

    graph, params, cfg = _debug_step(8)
    assert all(isinstance(p, DTensor) for p in params)
    local_elements = sum(p.to_local().numel() for p in params)
    assert local_elements < sum(p.numel() for p in params) // 4  # sharded, not the full model
    from_graph = estimate_step_memory(graph, None, cfg.training)
    as_trainer = estimate_step_memory(graph, params, build_optimizer(params, cfg.training))
    assert as_trainer == from_graph
    for moment in from_graph.moments:
        assert moment.optimizer == 2 * 4 * local_elements
        assert moment.params == 4 * local_elements
    assert from_graph.moments[-1].grads == 4 * local_elements  # all gradients, once the graph has run


def test_fsdp8_divides_params_grads_and_optimizer_by_about_8():
    one = estimate_step_memory(_debug_step(1)[0])
    eight = estimate_step_memory(_debug_step(8)[0])
    after_graph = [e.moments[-1] for e in (one, eight)]  # every gradient alive
    for part in ("params", "grads", "optimizer"):
        ratio = getattr(after_graph[0], part) / getattr(after_graph[1], part)
        assert ratio == pytest.approx(8, rel=0.02), part
    assert eight.peak_bytes < one.peak_bytes


def test_estimate_of_the_measured_h100_point():
    """LLaMA-3 8B shape, 4 layers, fp32, one process, 1x4096 tokens: 33.6 GiB peak allocated on
    one H100 (``docs/performance.md``); the estimate lands within 2%."""
    from graph_trainer.config_loading import load_config
    from graph_trainer.fake_trace import fake_world, trace_job
    from models.registry import MODEL_SPECS

    cfg = load_config(["--model.flavor", "8B", "--training.seq_len", "4096", "--training.local_batch_size", "1"])
    args = dataclasses.replace(MODEL_SPECS["llama3"].flavors["8B"], n_layers=4)
    with fake_world(1):
        graph = trace_job(cfg, 1, model_args=args).gm.graph
    est = estimate_step_memory(graph, None, cfg.training)
    n_params = 4 * 218_112_000 + 2 * 128_256 * 4096 + 4096  # blocks, embedding + output, final norm
    assert est.peak.optimizer == 2 * 4 * n_params
    assert est.peak_bytes / GIB == pytest.approx(33.6, rel=0.02)


def test_acceptance_command_prints_the_parts(capsys):
    """``python -m graph_trainer.cli.analyze --world_size 8 --job.config_file configs/llama3_8b.toml``,
    cut to 2 of its 32 blocks (what it prints is per part; the 32 blocks cost CI a minute)."""
    from graph_trainer.cli.analyze import main

    args = ["--world_size", "8", "--job.config_file", "configs/llama3_8b.toml", "--model.n_layers", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("passes  nodes"))
    for column in ("peak GiB", "params GiB", "grads GiB", "optim GiB", "activ GiB"):
        assert column in header
    line = next(line for line in out.splitlines() if line.startswith("memory per rank (none): peak "))
    n_params = 2 * 218_112_000 + 2 * 128_256 * 4096 + 4096  # blocks, embedding + output, final norm
    params_gib, optimizer_gib = (k * 4 * n_params / 8 / GIB for k in (1, 2))
    assert f"optimizer {optimizer_gib:.2f} GiB" in line and f"params {params_gib:.2f} GiB" in line
    assert "grads" in line and "activations" in line


def test_dry_run_memory_cells():
    from integration_dry_run import memory_columns

    limit = DEVICE_MEMORY_BYTES["h100"]
    cells = memory_columns(_estimate(round(75.25 * GIB)), limit)
    assert cells == {"peak GiB": "75.2", "params": "18.8", "grads": "0", "optim": "37.6", "activ": "18.8", "mem": "ok"}
    assert memory_columns(_estimate(round(86.5 * GIB)), limit)["mem"] == "> 79.1 GiB"
    assert memory_columns(_estimate(round(86.5 * GIB)), None)["mem"] == ""  # cpu suite: no limit
    assert set(memory_columns(None, limit).values()) == {"-", ""}  # a failed case has no graph
