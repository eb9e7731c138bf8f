"""What a microbatch computes from the resident weights alone moves to the once-per-step gather graph
(graph_trainer/compiler/hoist.py): on small graphs (what moves, what stays, the values bitwise),
and on float8 traces of the debug model on the fake process group. (The training runs: the cpu
suite's float8 cases with weights resident per step, graph == eager bitwise.)"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer.analysis.memory import estimate_peak_memory
from graph_trainer.build import build_job_model, build_layout
from graph_trainer.compiler.hoist import hoist_invariants
from graph_trainer.compiler.resident import trace_resident
from graph_trainer.config_loading import load_config
from graph_trainer.fake_trace import fake_world
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import collective_name, is_collective
from graph_trainer.graph.ops import is_view, name_of
from graph_trainer.graph.tags import FSDP_ROLE, GATHERED, INPUT_FQN, PHASE

FP8 = torch.float8_e4m3fn


def _cast(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensorwise float8 cast as torchao's: (the float8 tensor, the inverse scale)."""
    scale = 448.0 / w.abs().max().float().clamp(min=1e-12)
    return (w.float() * scale).clamp(-448.0, 448.0).to(FP8), scale.reciprocal()


def _float8_linear(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A forward matmul on the cast weight, and a backward-like one on it cast again and laid out
    column-major (what the backward's matmul reads)."""
    xq, xs = _cast(x)
    wq, ws = _cast(w)
    y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
    wq2, ws2 = _cast(w)
    yq, ys = _cast(y)
    return torch._scaled_mm(yq, wq2.t().contiguous().t(), scale_a=ys, scale_b=ws2, out_dtype=torch.bfloat16)


def _graphs(step_fn, weights: list[torch.Tensor], x: torch.Tensor) -> tuple[fx.GraphModule, fx.GraphModule]:
    """(a gather graph returning a copy of each weight, ``step_fn``'s graph with its weights tagged
    gathered)."""
    gather = make_fx(lambda *ws: [w.clone() for w in ws])(*weights)
    step = make_fx(step_fn)(*weights, x)
    placeholders = [n for n in step.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders[: len(weights)]):
        tags.update(node, {PHASE: "input", FSDP_ROLE: GATHERED, INPUT_FQN: f"w{i}"})
    return gather, step


def _run(gather: fx.GraphModule, step: fx.GraphModule, weights: list[torch.Tensor], x: torch.Tensor):
    return step(*gather(*weights), x)


def _hoisted(step_fn, *weights: torch.Tensor, x: torch.Tensor):
    """(how many inputs hoisting added, the step graph after it); the outputs bitwise those before."""
    gather, step = _graphs(step_fn, list(weights), x)
    before = _run(gather, step, list(weights), x)
    added = hoist_invariants(gather, step)
    after = _run(gather, step, list(weights), x)
    for b, a in zip(before if isinstance(before, (list, tuple)) else [before], after, strict=True):
        assert b.dtype == a.dtype and torch.equal(b.view(torch.uint8), a.view(torch.uint8))
    return added, step, gather


def _ops(gm: fx.GraphModule) -> Counter:
    return Counter(name_of(n) for n in gm.graph.nodes if n.op == "call_function")


def test_a_weights_float8_casts_move_to_the_gather_graph_once():
    w, x = torch.randn(48, 32, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    added, step, gather = _hoisted(lambda w, x: [_float8_linear(w, x)], w, x=x)
    # the float8 weight in either layout and its inverse scale (the two casts' are one value)
    assert added == 3
    placeholders = [n for n in step.graph.nodes if n.op == "placeholder"]
    assert [tags.get(n, INPUT_FQN) for n in placeholders[:3]] == ["w0"] * 3  # (the weight's gone)
    assert {n.meta["val"].dtype for n in placeholders[:3]} == {FP8, torch.float32}
    assert _ops(step)["abs"] == 2 and _ops(step)["_to_copy"] == 6  # (x's and y's casts only)
    assert _ops(gather)["abs"] == 1 and _ops(gather)["clone"] == 2  # (the gather's copy, the layout)
    assert [tags.phase(n) for n in placeholders[:3]] == ["input"] * 3


@pytest.mark.parametrize(
    "name, step_fn",
    [
        ("read as itself too", lambda w, x: [x @ w.t(), _float8_linear(w, x)]),
        ("a wider copy", lambda w, x: [x.float() @ w.float().t()]),
        ("random", lambda w, x: [x @ (w * torch.rand_like(w)).t()]),
        ("only views", lambda w, x: [x @ w.t()]),
    ],
)
def test_what_stays_per_microbatch(name, step_fn):
    w, x = torch.randn(48, 32, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    gather, step = _graphs(step_fn, [w], x)
    nodes = [n.format_node() for n in step.graph.nodes]
    assert hoist_invariants(gather, step) == 0, name
    assert [n.format_node() for n in step.graph.nodes] == nodes


def test_a_value_of_two_weights_stays():
    w1, w2 = torch.randn(48, 32, dtype=torch.bfloat16), torch.randn(48, 32, dtype=torch.bfloat16)
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    added, step, _ = _hoisted(lambda w1, w2, x: [x @ (w1 * w2.abs().max()).t()], w1, w2, x=x)
    assert added == 0


def test_a_copy_no_larger_than_its_weight_moves_in_its_place():
    w, x = torch.randn(48, 32, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    added, step, _ = _hoisted(lambda w, x: [x @ w.t().contiguous()], w, x=x)
    assert added == 1
    (held, _) = [n for n in step.graph.nodes if n.op == "placeholder"]
    assert held.meta["val"].shape == (32, 48) and held.meta["val"].is_contiguous()
    assert _ops(step)["clone"] == 0


# --- the debug model, float8, weights resident per step, on the fake process group -----------

SMALL = ["--training.local_batch_size", "1", "--training.seq_len", "16", "--model.n_layers", "2"]
FLAGS = [*SMALL, "--training.mixed_precision_param", "bfloat16", "--parallelism.tp", "2"]


@functools.cache
def _trace(recipe: str):
    cfg = load_config([*FLAGS, "--float8.recipe_name", recipe])
    tokens = torch.empty(1, 16, dtype=torch.long, device="meta")
    with fake_world(4):
        job = build_layout(cfg, 4, "cpu")
        model = build_job_model(cfg, job, torch.device("meta"))
        return trace_resident(model, tokens, tokens, grad_scale=job.loss_scale, fake_device=torch.device("cpu"))


def _computed_from_weights_alone(gm: fx.GraphModule) -> list[str]:
    """The non-view nodes of ``gm`` computed from its gathered inputs alone."""
    inputs = {n for n in gm.graph.nodes if n.op == "placeholder" and tags.get(n, FSDP_ROLE) == GATHERED}
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.all_input_nodes and set(node.all_input_nodes) <= inputs:
            inputs.add(node)
            if not is_view(node):
                found.append(node.name)
    return found


@pytest.mark.parametrize("recipe", ["none", "tensorwise", "rowwise"])
def test_no_microbatch_computes_from_the_weights_alone(recipe):
    trace = _trace(recipe)
    step, gather = trace.step.gm, trace.gather
    assert _computed_from_weights_alone(step) == []
    n_float8 = 2 * 7  # (two blocks of seven float8 linears; the output projection stays bf16)
    placeholders = [n for n in step.graph.nodes if n.op == "placeholder"]
    gathered = [n for n in placeholders if tags.get(n, FSDP_ROLE) == GATHERED]
    float8_inputs = [n for n in gathered if n.meta["val"].dtype == FP8]
    assert len(float8_inputs) == (0 if recipe == "none" else 2 * n_float8)  # (two layouts each)
    amax_reduces = [n for n in gather.graph.nodes if is_collective(n) and collective_name(n) == "all_reduce"]
    # each weight's amax over the dimension tensor parallel splits (tensorwise: its only one; rowwise:
    # that of one of its two layouts) is all-reduced once a step, not once or twice a microbatch
    assert len(amax_reduces) == (0 if recipe == "none" else n_float8)
    weights = len(trace.weights.gathered_index)
    assert len({tags.get(n, INPUT_FQN) for n in gathered}) == weights


def test_the_memory_estimate_holds_the_float8_weights_in_place_of_the_bf16_ones():
    def resident(trace):
        return estimate_peak_memory(trace.step.gm.graph).resident_bytes

    trace = _trace("tensorwise")
    placeholders = [n for n in trace.step.gm.graph.nodes if n.op == "placeholder"]
    names = set(trace.step.param_names)
    parameter_inputs = [n for n in placeholders if tags.get(n, INPUT_FQN) in names]
    estimate = estimate_peak_memory(trace.step.gm.graph)
    assert estimate.param_bytes == sum(n.meta["val"].nbytes for n in parameter_inputs)
    # two float8 layouts of a weight hold what its bf16 copy held; one fp32 scale each beside them
    assert resident(trace) == resident(_trace("none")) + 4 * 2 * 7
