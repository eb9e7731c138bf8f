"""Common subexpressions computed once (``compiler.cse``): what is shared, what is kept apart, and
a float8 step that computes each shared input's cast once, bitwise the eager step."""

import dataclasses
from collections import Counter

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer.compiler.cse import eliminate_common_subexpressions
from graph_trainer.compiler.tracer import eager_step, trace_train_step
from graph_trainer.config import Float8
from graph_trainer.graph import tags
from graph_trainer.graph.ops import name_of
from models import float8
from models.llama3.flavors import FLAVORS
from models.llama3.model import Transformer

wait = torch.ops._c10d_functional.wait_tensor.default
F8_MAX = torch.finfo(torch.float8_e4m3fn).max


def _cast(x):
    scale = F8_MAX / x.abs().max().float().clamp(min=1e-12)
    return (x.float() * scale).clamp(-F8_MAX, F8_MAX).to(torch.float8_e4m3fn), scale


def _names(gm):
    return [name_of(n) for n in gm.graph.nodes if n.op == "call_function"]


def _check_same_outputs(f, *inputs):
    """CSE of ``f``'s graph: the outputs bitwise before and after; returns the graph and the count."""
    gm = make_fx(f)(*inputs)
    before = gm(*inputs)
    erased = eliminate_common_subexpressions(gm)
    for a, b in zip(before, gm(*inputs), strict=True):
        assert torch.equal(a.float(), b.float())
    return gm, erased


def test_two_casts_of_one_input_become_one():
    def two_linears(x, w1, w2):
        x1, s1 = _cast(x)
        x2, s2 = _cast(x)
        return (x1.float() / s1) @ w1, (x2.float() / s2) @ w2

    x, w1, w2 = torch.randn(16, 32), torch.randn(32, 8), torch.randn(32, 8)
    gm, erased = _check_same_outputs(two_linears, x, w1, w2)
    names = _names(gm)
    assert erased > 0 and names.count("max") == 1 and names.count("clamp") == 2  # one per cast: amax and values
    assert names.count("mm") == 2


def test_a_cheap_copy_is_not_shared_across_a_wait_unless_it_is_written_anyway():
    """``abs(x)`` read only by reductions, once before a wait and once after: each region computes
    its own (sharing would write it and read it back). The reductions, not cheap, are shared."""

    def across(x, y):
        a = x.abs().amax(dim=0)
        y = wait(y)
        return a * 2, x.abs().amax(dim=0) + y, x.abs().sum(dim=1)

    gm, _ = _check_same_outputs(across, torch.randn(8, 4), torch.randn(4))
    assert _names(gm).count("abs") == 2 and _names(gm).count("amax") == 1

    def written(x, y, w):
        a = (x.abs() @ w).sum()
        y = wait(y)
        return a, (x.abs() @ w).sum() + y

    gm, _ = _check_same_outputs(written, torch.randn(8, 4), torch.randn(()), torch.randn(4, 4))
    assert _names(gm).count("abs") == 1 and _names(gm).count("mm") == 1  # read by a matmul: written anyway


def test_outputs_random_ops_and_other_phases_stay_apart():
    gm, erased = _check_same_outputs(lambda x: (x * 2, x * 2), torch.randn(4))
    assert erased == 0  # two outputs must stay two tensors
    gm = make_fx(lambda x: (torch.rand_like(x) + x, torch.rand_like(x) + x))(torch.randn(4))
    assert eliminate_common_subexpressions(gm) == 0
    gm = make_fx(lambda x: ((x * 2).sum() + 1, (x * 2).sum() + 2))(torch.randn(4))
    muls = [n for n in gm.graph.nodes if name_of(n) == "mul"]
    tags.update(muls[0], {tags.PHASE: tags.FORWARD})
    tags.update(muls[1], {tags.PHASE: tags.BACKWARD})
    assert eliminate_common_subexpressions(gm) == 0
    tags.update(muls[1], {tags.PHASE: tags.FORWARD, tags.MODULE_FQN: "other"})
    assert eliminate_common_subexpressions(gm) == 2  # the mul and its sum: module_fqn alone does not matter


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_float8_step_casts_each_shared_input_once_bitwise_eager(recipe):
    args = dataclasses.replace(FLAVORS["debugmodel"], dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=128)
    model = Transformer(args)
    model.init_weights(0)
    float8.convert_linears(model, Float8(recipe_name=recipe))
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    tokens, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    traced = trace_train_step(model, tokens, labels)
    casts = [n for n in traced.gm.graph.nodes if n.op == "call_function" and _to_float8(n)]
    forward = Counter(tags.module_fqn(n).rsplit(".", 1)[-1] for n in casts if tags.phase(n) == tags.FORWARD)
    # wq, wk and wv share their input, w1 and w3 theirs: one cast per distinct input (those two,
    # wo's, w2's) and one per weight; 7 + 7 without sharing
    assert forward == {"wq": 2, "wk": 1, "wv": 1, "wo": 2, "w1": 2, "w3": 1, "w2": 2}
    if recipe == "tensorwise":
        # The backward computes the amax of each output gradient (7) and reads the forward's for
        # the inputs and weights it casts again, transposed (11 more without).
        maxes = Counter(tags.phase(n) for n in traced.gm.graph.nodes if name_of(n) == "max")
        assert maxes == {tags.FORWARD: 11, tags.BACKWARD: 7}
    loss, grads = traced(list(model.parameters()), list(model.buffers()), tokens, labels)
    ref_loss, ref_grads = eager_step(model, tokens, labels)
    assert torch.equal(loss, ref_loss)
    assert all(map(torch.equal, grads, ref_grads))


def _to_float8(node) -> bool:
    val = node.meta.get("val")
    return name_of(node) == "_to_copy" and isinstance(val, torch.Tensor) and val.dtype == torch.float8_e4m3fn


def _two_all_reduces(return_waits: bool) -> fx.GraphModule:
    """``amax(x)`` all-reduced twice (as two float8 linears under tensor parallel do), each wait
    scaling ``x``; the two products added, or (``return_waits``) the waits returned as they are."""
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    g = fx.Graph()
    x = g.placeholder("x")
    amax = g.call_function(aten.amax.default, (x, [0]))
    waits = [g.call_function(wait, (g.call_function(c10d.all_reduce.default, (amax, "max", "tp")),)) for _ in "ab"]
    scaled = [g.call_function(aten.mul.Tensor, (x, w)) for w in waits]
    g.output(tuple(waits) if return_waits else g.call_function(aten.add.Tensor, tuple(scaled)))
    return fx.GraphModule(torch.nn.Module(), g)


def test_a_whole_tensor_max_is_shared_across_phases_and_views():
    """``max(abs(x))`` in the forward and ``max(abs(x.view(..)))`` / of ``x.t()`` in the backward
    are one value (one number: the backward reads the forward's); a per-row ``amax`` or a sum is not."""

    def step(x):
        return x.abs().max() * 2, x.view(-1).abs().max() + 1, x.t().abs().max() + 3, x.view(-1).abs().amax(dim=0)

    gm = make_fx(step)(torch.randn(4, 8))
    phases = [tags.FORWARD, tags.BACKWARD, tags.BACKWARD]
    for node, phase in zip((n for n in gm.graph.nodes if name_of(n) == "max"), phases, strict=True):
        tags.update(node, {tags.PHASE: phase})
    x = torch.randn(4, 8)
    before = gm(x)
    assert eliminate_common_subexpressions(gm) > 0
    assert _names(gm).count("max") == 1 and _names(gm).count("amax") == 1
    assert all(torch.equal(a, b) for a, b in zip(before, gm(x), strict=True))
    gm = make_fx(lambda x: ((x * 2).sum() + 1, (x * 2).view(-1).sum() + 2))(torch.randn(4, 2))
    eliminate_common_subexpressions(gm)
    assert _names(gm).count("sum") == 2  # a sum rounds in its order: not shared through a view


def test_a_collective_is_merged_with_its_wait_or_not_at_all():
    gm = _two_all_reduces(return_waits=False)
    assert eliminate_common_subexpressions(gm) == 3  # the second all_reduce, its wait, its product
    assert _names(gm) == ["amax", "all_reduce", "wait_tensor", "mul", "add"]
    gm = _two_all_reduces(return_waits=True)
    assert eliminate_common_subexpressions(gm) == 0  # waits returned: neither they nor their collectives merge
    assert _names(gm).count("all_reduce") == 2
