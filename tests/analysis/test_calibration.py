"""The calibrated H100 cost model against the step times measured on one H100.

Each case traces the measured configuration in this process on the fake process group (world
size 1, fake tensors; ``fake_trace`` with ``param_dtype=bfloat16`` for "pure bf16" and
``gpu_attention=True`` for the fused attention kernels the GPU ran) and simulates the graph on
``H100_SXM``. The simulated graph compute must match the measured time of the graph:

    measured graph = step time - AdamW step - gradient clipping

The step time is tokens per step over the measured tok/s. AdamW and clipping run outside the
graph (``Trainer.train_step``); their GPU time comes from the two profiles and is scaled to the
other cases by parameter count, since every one of their kernels streams parameter-sized
tensors (``_optimizer_ms``). Sources: ``docs/performance.md`` (its first H100 table: H100
80GB HBM3, torch 2.11.0+cu130, project commit 515ebdd, mode "graph") and
``docs/h100_profiles/{l8b4,d16b4}_shapes.txt`` (torch.profiler, 2 steady steps, so every
profiled number below is halved).

Held to: 10% for the bf16 llama3 8B-shaped cases (the calibration target). 15% for the 16B
DeepSeek case: its step has 7.7 ms (5%) of GPU time outside any kernel (148.68 ms step vs
141.01 ms of profiled kernels; host-bound stretches the simulator does not model, only the
pooled per-launch overhead covers part of it), and its MLA attention (d_qk 192) runs 9-10%
slower than the pooled attention efficiencies predict. 15% for the fp32 case: there is no fp32
profile, so its kernels use the bf16-derived efficiencies unverified (its fp32
memory-efficient attention most of all) and its AdamW/clip time is scaled from bf16 by bytes,
not measured.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from graph_trainer.analysis.devices import H100_SXM
from graph_trainer.analysis.simulator import simulate
from graph_trainer.build import cast_parameters
from graph_trainer.config_loading import load_config
from graph_trainer.fake_trace import fake_world, trace_without_passes
from models.registry import MODEL_SPECS

# --- Measurement data (docs/performance.md, H100 table, mode "graph") ----------------------


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    flavor: str
    layers: int
    seq: int
    batch: int
    pure_bf16: bool
    tok_s: float
    """Measured tokens/s (steady steps of a 10-step run)."""
    tolerance: float


CASES = [
    Case("llama3 8B x2, 8192x1, bf16", "llama3", "8B", 2, 8192, 1, True, 56_061, 0.10),
    Case("llama3 8B x4, 8192x1, bf16", "llama3", "8B", 4, 8192, 1, True, 40_068, 0.10),
    Case("llama3 8B x6, 8192x1, bf16", "llama3", "8B", 6, 8192, 1, True, 30_529, 0.10),
    Case("deepseek_v3 16B x4, 4096x2, bf16", "deepseek_v3", "16B", 4, 4096, 2, True, 55_098, 0.15),
    Case("llama3 8B x4, 4096x1, fp32", "llama3", "8B", 4, 4096, 1, False, 5_073, 0.15),
]

# --- AdamW and clipping from the profiles (ms per step) ------------------------------------
# AdamW: the GPU annotation "Optimizer.step#AdamW.step" (self CUDA over 2 steps).
ADAMW_MS = {"l8b4": 51.921 / 2, "d16b4": 60.700 / 2}
# Clipping (``optim.clip_grad_norm_``): per gradient a bf16->fp32 copy_, pow, sum and one of the
# three in-place mul_ per parameter-shaped tensor (AdamW issues the other two: weight decay and
# exp_avg_sq). Rows of the parameter shapes listed in full in the tables, over 2 steps:
# (copy_, pow, sum, mul_ total, tensors of that shape).
CLIP_ROWS = {
    "l8b4": [
        ((6.939, 5.564, 2.760, 11.565), 2, 128256 * 4096),  # tok_embeddings, output
        ((3.095, 2.510, 1.464, 5.224), 8, 14336 * 4096),
    ],  # w1, w3 x 4 layers
    "d16b4": [
        ((6.944, 5.881, 3.050, 11.988), 6, 64 * 1408 * 2048),  # expert w1, w3 x 3 MoE layers
        ((3.461, 2.940, 1.522, 5.985), 3, 64 * 2048 * 1408),  # expert w2
        ((2.626, 2.224, 1.226, 4.531), 2, 102400 * 2048),
    ],  # tok_embeddings, output
}
PROFILED = {"l8b4": ("llama3", "8B", 4), "d16b4": ("deepseek_v3", "16B", 4)}


def _param_count(model: str, flavor: str, layers: int) -> int:
    spec = MODEL_SPECS[model]
    with torch.device("meta"):
        m = spec.build(dataclasses.replace(spec.flavors[flavor], n_layers=layers))
    return sum(p.numel() for p in m.parameters())


def _clip_ms(profile: str, fp32: bool = False) -> float:
    """Clipping per step, scaled from the listed parameter shapes to all parameters.

    fp32 (no profile): ``.float()`` of an fp32 gradient is no copy and the in-place scale moves
    twice the bytes: pow + sum + 2 x mul_ of the bf16 rows.
    """
    total = covered = 0.0
    for (copy, pow_, sum_, mul_all), tensors, numel in CLIP_ROWS[profile]:
        mul = mul_all / 3
        total += (pow_ + sum_ + 2 * mul) if fp32 else (copy + pow_ + sum_ + mul)
        covered += tensors * numel
    return total / 2 * _param_count(*PROFILED[profile]) / covered


def _optimizer_ms(case: Case) -> float:
    """AdamW + clipping of ``case``: its profiled model's, scaled by parameter count (fp32:
    AdamW moves twice the bytes of pure bf16)."""
    profile = "d16b4" if case.model == "deepseek_v3" else "l8b4"
    adamw = ADAMW_MS[profile] * (1 if case.pure_bf16 else 2)
    scale = _param_count(case.model, case.flavor, case.layers) / _param_count(*PROFILED[profile])
    return (adamw + _clip_ms(profile, fp32=not case.pure_bf16)) * scale


def measured_graph_ms(case: Case) -> float:
    step_ms = case.seq * case.batch / case.tok_s * 1e3
    return step_ms - _optimizer_ms(case)


# --- Prediction ---------------------------------------------------------------------------


def simulate_case(case: Case):
    cfg = load_config(
        [
            "--model.name",
            case.model,
            "--model.flavor",
            case.flavor,
            "--training.seq_len",
            str(case.seq),
            "--training.local_batch_size",
            str(case.batch),
        ]
    )
    args = dataclasses.replace(MODEL_SPECS[case.model].flavors[case.flavor], n_layers=case.layers)
    with fake_world(1):
        traced, _ = trace_without_passes(
            cfg, 1, model_args=args, gpu_attention=True, param_dtype=torch.bfloat16 if case.pure_bf16 else None
        )
        return traced, simulate(traced.gm.graph, H100_SXM, record_events=False)


def test_optimizer_and_clip_times_from_the_profiles():
    # docs/performance.md (H100 profile): "single-tensor AdamW 26 ms" of the 204 ms 8B x 4 step. Clipping
    # adds ~18 ms more outside the graph (its "AdamW and clip roughly 10-15 ms" is too low).
    assert ADAMW_MS["l8b4"] == pytest.approx(26.0, abs=0.1)
    assert _clip_ms("l8b4") == pytest.approx(17.7, abs=0.1)
    assert _clip_ms("d16b4") == pytest.approx(20.3, abs=0.1)
    assert _param_count("llama3", "8B", 4) == 2 * 128256 * 4096 + 4096 + 4 * 218_112_000


def test_cast_parameters_keeps_shared_parameters_shared():
    with torch.device("meta"):
        a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    b.weight = a.weight
    model = torch.nn.Sequential(a, b)
    cast_parameters(model, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model[0].weight is model[1].weight and len(list(model.parameters())) == 3


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_simulated_graph_compute_matches_measured_step(case):
    traced, result = simulate_case(case)
    graph = traced.gm.graph
    # The traced configuration is the measured one: pure bf16 parameters, fused GPU attention.
    params = [n.meta["val"] for n in graph.nodes if n.op == "placeholder"][: len(traced.param_names)]
    assert {p.dtype for p in params} == {torch.bfloat16 if case.pure_bf16 else torch.float32}
    fused = "cudnn" if case.pure_bf16 else "efficient"
    assert any(f"_scaled_dot_product_{fused}_attention_backward" in str(n.target) for n in graph.nodes)

    predicted = result.compute_time * 1e3
    measured = measured_graph_ms(case)
    error = predicted / measured - 1
    by_class = ", ".join(
        f"{k} {v * 1e3:.1f}" for k, v in sorted(result.compute_by_class.items(), key=lambda kv: -kv[1])
    )
    print(
        f"\n{case.name}: predicted {predicted:.1f} ms, measured {measured:.1f} ms "
        f"(step {case.seq * case.batch / case.tok_s * 1e3:.1f} - optimizer {_optimizer_ms(case):.1f}), "
        f"error {error:+.1%}\n  by class (ms): {by_class}"
    )
    assert abs(error) <= case.tolerance, f"{case.name}: {predicted:.1f} ms vs {measured:.1f} ms ({error:+.1%})"
    assert result.step_time == pytest.approx(result.compute_time)  # one rank: no communication
    assert sum(result.compute_by_class.values()) == pytest.approx(result.compute_time)
