"""The model of Inductor's kernels (``analysis.fusion``): which nodes fuse, what a kernel moves,
the fused simulation against the Inductor rows the one-GPU table measured, and Inductor's gain over
op by op, simulated on the measured rows' shapes, against the measured gain."""

import json
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer.analysis.cost_model import is_free
from graph_trainer.analysis.devices import H100_SXM, H200_SXM
from graph_trainer.analysis.fusion import Iteration, fits, fuse_kernels
from graph_trainer.analysis.simulator import simulate
from graph_trainer.graph.ops import is_matmul, name_of

F8 = torch.float8_e4m3fn
F8_MAX = torch.finfo(F8).max
TABLE = Path(__file__).parents[2] / "docs" / "h100_profiles" / "h200_gpu_table_2026-11-28.json"


def _graph(f, *shapes, dtype=torch.bfloat16):
    return make_fx(f, tracing_mode="fake")(*(torch.randn(s).to(dtype) for s in shapes)).graph


def _compute_nodes(graph):
    return [n for n in graph.nodes if not is_free(n)]


def _nbytes(t):
    return t.numel() * t.element_size()


def _rms_norm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def _tensorwise_cast(x):
    amax = x.abs().max().float()
    scale = F8_MAX / amax.clamp(min=1e-12)
    return (x.float() * scale).clamp(-F8_MAX, F8_MAX).to(F8), scale


def _rowwise_cast(x):
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = F8_MAX / amax.clamp(min=1e-12)
    return (x.float() * scale).clamp(-F8_MAX, F8_MAX).to(F8), scale


def test_rms_norm_is_one_kernel_reading_its_input_once():
    g = _graph(_rms_norm, (64, 256), (256,))
    plan = fuse_kernels(g)
    (kernel,) = plan.kernels
    assert set(kernel.nodes) | plan.inlined == set(_compute_nodes(g))
    assert {name_of(n) for n in plan.inlined} >= {"_to_copy", "pow"}  # x.float() recomputed by both readers
    assert kernel.space == Iteration(64, 256) and kernel.kernel_class == "reduction" and kernel.launches == 1
    x, w = (n.meta["val"] for n in g.nodes if n.op == "placeholder")
    assert kernel.bytes == _nbytes(x) + _nbytes(w) + _nbytes(x)  # x and w in, the bf16 output out


def test_tensorwise_cast_reads_its_input_twice():
    """A reduction to one value is split by Inductor: the amax is a kernel (two launches) of its
    own, the scaling and cast another, and each reads the activation."""
    g = _graph(_tensorwise_cast, (64, 256))
    plan = fuse_kernels(g)
    amax, cast = sorted(plan.kernels, key=lambda k: k.space.x)
    x = next(n.meta["val"] for n in g.nodes if n.op == "placeholder")
    assert amax.space == Iteration(1, x.numel()) and amax.launches == 2
    assert "max" in {name_of(n) for n in amax.nodes}
    assert "abs" in {name_of(n) for n in plan.inlined}  # computed inside the amax kernel: never written
    assert amax.bytes == _nbytes(x) + 4  # x in, the fp32 scale out (read by the cast kernel and the output)
    assert cast.space == Iteration(x.numel()) and cast.launches == 1
    assert cast.bytes == _nbytes(x) + 4 + x.numel()  # x and the scale in, one byte per element out


def test_rowwise_cast_is_one_kernel():
    g = _graph(_rowwise_cast, (64, 256))
    (kernel,) = fuse_kernels(g).kernels
    x = next(n.meta["val"] for n in g.nodes if n.op == "placeholder")
    assert kernel.space == Iteration(64, 256)
    assert kernel.bytes == _nbytes(x) + x.numel() + 64 * 4  # x in; fp8 and one fp32 scale per row out


def test_nothing_fuses_across_a_matmul():
    g = _graph(lambda x, w: torch.relu((x * 2) @ w) + 1, (64, 64), (64, 64))
    plan = fuse_kernels(g)
    mm = next(n for n in g.nodes if is_matmul(n))
    assert mm not in plan.kernel_of
    before, after = (k for k in plan.kernels)
    assert [name_of(n) for n in before.nodes] == ["mul"] and [name_of(n) for n in after.nodes] == ["add"]
    assert [name_of(n) for n in plan.inlined] == ["relu"]  # inlined into the add, after the matmul


def test_a_merge_that_would_make_a_cycle_is_refused():
    """``d`` reads ``a`` and ``o``, which reads ``a`` and does not fit ``a``'s kernel: ``a`` and
    ``d`` in one kernel would both feed ``o`` and wait for it."""

    def detour(x):
        a = x.exp()
        o = a.repeat(2)
        return a + o[: x.numel()]

    plan = fuse_kernels(g := _graph(detour, (256,)))
    a, o, d = (n for n in _compute_nodes(g) if name_of(n) in ("exp", "repeat", "add"))
    assert plan.kernel_of[d] is not plan.kernel_of[a] and plan.kernel_of[o] is not plan.kernel_of[a]
    plan = fuse_kernels(g := _graph(lambda x: x.exp() + x, (256,)))
    assert len(plan.kernels) == 1  # without the detour the same two ops fuse


@pytest.mark.parametrize(
    ("producer", "consumer", "joined"),
    [
        (Iteration(4096), Iteration(4096), Iteration(4096)),
        (Iteration(4096), Iteration(2048), None),
        (Iteration(4096), Iteration(16, 256), Iteration(16, 256)),  # prologue
        (Iteration(16), Iteration(16, 256), Iteration(16, 256)),  # a per-row operand
        (Iteration(16, 256), Iteration(4096), Iteration(16, 256)),  # epilogue over the rows again
        (Iteration(16, 256), Iteration(16), Iteration(16, 256)),  # epilogue over the reduced values
        (Iteration(1, 4096), Iteration(4096), None),  # a split reduction: nothing of the size follows
        (Iteration(1, 4096), Iteration(1), Iteration(1, 4096)),  # scalar ops do
        (Iteration(16, 256), Iteration(16, 256), Iteration(16, 256)),
        (Iteration(16, 256), Iteration(256, 16), None),
    ],
)
def test_fits(producer, consumer, joined):
    assert fits(producer, consumer) == joined


def test_fused_simulation_costs_each_kernel_once():
    g = _graph(lambda x, w: _rowwise_cast(_rms_norm(x, w))[0], (8192, 4096), (4096,))
    op_by_op = simulate(g, H100_SXM, record_events=False)
    fused = simulate(g, H100_SXM, record_events=False, fused=True)
    plan = fuse_kernels(g)
    assert fused.compute_time == pytest.approx(sum(k.time(H100_SXM) for k in plan.kernels))
    assert fused.compute_time < op_by_op.compute_time / 2
    assert set(fused.compute_by_class) == {f"fused {k.kernel_class}" for k in plan.kernels}


def _table_rows():
    rows = json.loads(TABLE.read_text())["rows"]
    return [r for r in rows if r["model"].startswith("Llama3-8B") and r["status"] == "ok"]


_JOB_FLAGS = {
    "--job.config_file",
    "--model.n_layers",
    "--training.seq_len",
    "--training.local_batch_size",
    "--training.mixed_precision_param",
    "--training.loss_chunks",
    "--compile.backend",
    "--compile.inductor_scope",
    "--activation_checkpoint.mode",
}


@pytest.mark.parametrize("row", _table_rows(), ids=lambda r: r["name"])
def test_simulated_forward_backward_against_the_one_gpu_table(row):
    """Each Llama row of the H200 table (docs/performance.md; its JSON is ``TABLE``), simulated on the H200
    model as the analyze command would (op by op, or fused for an Inductor row), within 10% of
    the measured forward/backward. The fused model errs slow: it fuses less than Inductor (no
    horizontal fusion, no fusion across matmuls, the loss's gathers left alone)."""
    from graph_trainer.cli.analyze import analyze_job
    from graph_trainer.config_loading import load_config

    command = row["command"]  # train.py, then flag and value pairs
    flags = [
        x for flag, value in zip(command[1::2], command[2::2], strict=True) if flag in _JOB_FLAGS for x in (flag, value)
    ]
    _, result, _, _ = analyze_job(load_config(flags), 1, H200_SXM)
    measured = row["forward_backward_ms"]
    print(f"{row['name']}: simulated {result.step_time * 1e3:.1f} ms, measured {measured:.1f} ms")
    assert result.step_time * 1e3 == pytest.approx(measured, rel=0.10)


# The first H100 table (docs/performance.md, its first H100 run): tokens/s of the traced
# graph op by op and under Inductor, pure bf16 parameters, one process, commit 515ebdd.
MEASURED_GAINS = {
    ("llama3", "8B", 2, 8192, 1): (56_061, 69_436),
    ("llama3", "8B", 4, 8192, 1): (40_068, 47_654),
    ("llama3", "8B", 6, 8192, 1): (30_529, 36_951),
    ("deepseek_v3", "16B", 4, 4096, 2): (55_098, 70_522),
}
SPEEDUP_RTOL = 0.10
"""The simulated speed-up (op-by-op step / Inductor step) is held to the measured one within this,
the bound the project holds its simulated step times to (``test_calibration.py``, the H200 rows
above): +32% simulated where +19% was measured (1.32 / 1.19 = 1.11) fails."""


@pytest.mark.parametrize("row", list(MEASURED_GAINS), ids=lambda r: f"{r[0]}_{r[1]}x{r[2]}_{r[4]}x{r[3]}")
def test_simulated_fusion_gain_against_the_h100_table(row):
    """Inductor's gain over op by op on the whole step, as measured: both steps end with the same
    optimizer step, which Inductor does not touch (the traced graph was compiled, not the optimizer:
    single-tensor AdamW and the clipping over bf16 parameters, ``analysis.optimizer_step``)."""
    from graph_trainer.analysis.memory import parameter_tensors
    from graph_trainer.analysis.optimizer_step import OptimizerSettings, optimizer_step_cost
    from tests.analysis.test_calibration import Case, simulate_case

    model, flavor, layers, seq, batch = row
    op_tokens, inductor_tokens = MEASURED_GAINS[row]
    traced, op = simulate_case(Case("", model, flavor, layers, seq, batch, True, op_tokens, 0.0))
    fused = simulate(traced.gm.graph, H100_SXM, record_events=False, fused=True)
    params = parameter_tensors(traced.gm.graph, None)
    assert {p.dtype for p in params} == {torch.bfloat16}
    optim = optimizer_step_cost(params, H100_SXM, OptimizerSettings(foreach=False)).seconds
    measured = inductor_tokens / op_tokens - 1
    graph_only = op.step_time / fused.step_time - 1
    simulated = (op.step_time + optim) / (fused.step_time + optim) - 1
    step = seq * batch / op_tokens * 1e3, seq * batch / inductor_tokens * 1e3
    print(
        f"\n{row}: measured {step[0]:.1f} -> {step[1]:.1f} ms ({measured:+.1%}); simulated graph "
        f"{op.step_time * 1e3:.1f} -> {fused.step_time * 1e3:.1f} ms ({graph_only:+.1%}), with the optimizer "
        f"step's {optim * 1e3:.1f} ms {simulated:+.1%}"
    )
    assert 1 + simulated == pytest.approx(1 + measured, rel=SPEEDUP_RTOL)


def test_simulated_fusion_gain_against_the_h200_tables_selective_pair():
    """The H200 table's selective rows (fp32 master weights, 8 loss chunks), forward and backward as
    measured (no optimizer step in either figure): op by op and Inductor regional."""
    rows = {r["name"]: r for r in json.loads(TABLE.read_text())["rows"]}
    op, regional = rows["llama3_graph_ac_selective"], rows["llama3_regional_ac_selective"]
    from graph_trainer.cli.analyze import analyze_job
    from graph_trainer.config_loading import load_config

    command = op["command"]
    flags = [x for f, v in zip(command[1::2], command[2::2], strict=True) if f in _JOB_FLAGS for x in (f, v)]
    traced, simulated_op, _, _ = analyze_job(load_config(flags), 1, H200_SXM)
    fused = simulate(traced.gm.graph, H200_SXM, record_events=False, fused=True)
    measured = op["forward_backward_ms"] / regional["forward_backward_ms"] - 1
    simulated = simulated_op.step_time / fused.step_time - 1
    print(f"\nselective pair: measured {measured:+.1%}, simulated {simulated:+.1%}")
    assert 1 + simulated == pytest.approx(1 + measured, rel=SPEEDUP_RTOL)


def test_random_ops_stay_kernels_of_their_own():
    g = _graph(lambda x: torch.nn.functional.dropout(x * 2, 0.5, True) + 1, (64,), dtype=torch.float32)
    plan = fuse_kernels(g)
    random = [n for n in g.nodes if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]
    assert random and not any(n in plan.kernel_of or n in plan.inlined for n in random)
