"""DeepSeek-V3's routed experts in float8 (models/float8.py): expert by expert what torchao's
``Float8Linear`` of the rowwise_with_gw_hp recipe computes on that expert's rows, bitwise, forward
and both gradients; one graph node per grouped matmul when traced. (The training runs: the cpu
suite's deepseek float8 expert cases, graph == eager bitwise.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer.graph.ops import FLOAT8_GROUPED_MM, name_of
from models.float8 import EXPERTS_RECIPE, convert_routed_experts, float8_grouped_linear, torchao_float8

E, N, K = 4, 48, 64


def _matmul():
    class Holder(nn.Module):
        float8_matmul = None

    holder = Holder()
    assert convert_routed_experts(holder) == 1
    return holder.float8_matmul


def _torchao_per_expert(x, w, counts):
    """Each expert's rows through a ``Float8Linear`` of the recipe holding ``w[e]``."""
    ao = torchao_float8()
    linears = nn.ModuleList(nn.Linear(K, N, bias=False, dtype=x.dtype) for _ in range(E))
    for linear, weight in zip(linears, w.detach(), strict=True):
        linear.weight = nn.Parameter(weight.clone())
    ao.convert_to_float8_training(linears, config=ao.Float8LinearConfig.from_recipe_name(EXPERTS_RECIPE))
    assert all(type(m).__name__ == "Float8Linear" for m in linears)
    outs = [linear(rows) for linear, rows in zip(linears, x.split(counts.tolist()), strict=True)]
    return torch.cat(outs), [linear.weight for linear in linears]


@pytest.mark.parametrize("counts", [[10, 0, 25, 5], [1, 1, 38, 0]])
def test_each_expert_computes_what_a_float8_linear_of_the_recipe_computes(counts):
    counts = torch.tensor(counts)
    torch.manual_seed(0)
    x = torch.randn(int(counts.sum()), K, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(E, N, K, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(x.shape[0], N, dtype=torch.bfloat16)
    out = _matmul()(x, w, counts)
    out.backward(grad)
    x_ref = x.detach().clone().requires_grad_(True)
    ref, linears = _torchao_per_expert(x_ref, w, counts)
    ref.backward(grad)
    assert torch.equal(out, ref)
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(w.grad, torch.stack([p.grad for p in linears]))


def test_a_traced_grouped_matmul_is_one_node_forward_and_one_backward():
    counts = torch.tensor([10, 0, 25, 5])
    matmul = _matmul()

    def step(x, w):
        x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        return torch.autograd.grad(matmul(x, w, counts).sum(), [x, w])

    gm = make_fx(step)(torch.randn(40, K, dtype=torch.bfloat16), torch.randn(E, N, K, dtype=torch.bfloat16))
    assert [name_of(n) for n in gm.graph.nodes].count(FLOAT8_GROUPED_MM) == 2
    assert float8_grouped_linear.__module__ == "models.float8"
