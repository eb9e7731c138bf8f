"""DeepSeek-V3's routed experts in float8 (models/float8.py): expert by expert what torchao's
``Float8Linear`` of the rowwise_with_gw_hp recipe computes on that expert's rows, bitwise, forward
and both gradients; one graph node per grouped matmul when traced. (The training runs: the cpu
suite's deepseek float8 expert cases, graph == eager bitwise.) The float8 dispatch's wire format
casts rows as the experts do."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer.graph.ops import FLOAT8_GROUPED_MM, name_of
from models.float8 import (
    EXPERTS_FLOAT8_DTYPE,
    EXPERTS_RECIPE,
    ROW_SCALE_BYTES,
    _cast_rows,
    convert_routed_experts,
    float8_bytes_to_rows,
    float8_grouped_linear,
    rows_to_float8_bytes,
    torchao_float8,
)

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


def test_rows_sent_in_float8_are_cast_by_the_experts_to_the_values_sent():
    """The float8 dispatch's wire: the rows arrive as the float8 values times their scales, the
    experts' cast of them gives those products again (a row whose largest value rounded down to
    224, half e4m3's range, comes back doubled with half the inverse scale), so the forward is
    bitwise the one without the wire; the weight gradient is the arrived rows' product."""
    torch.manual_seed(0)
    x = (torch.randn(6, K) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0, 0.0])[:, None]).bfloat16()
    x[3] = x[3].clamp(-0.5, 0.5)
    x[3, 0] = 0.890625  # scale 256: 228 rounds to e4m3's 224
    packed = rows_to_float8_bytes(x, EXPERTS_FLOAT8_DTYPE)
    assert packed.dtype == torch.uint8 and packed.shape == (6, K + ROW_SCALE_BYTES)
    arrived = float8_bytes_to_rows(packed, EXPERTS_FLOAT8_DTYPE, torch.bfloat16)
    sent, sent_inverse = _cast_rows(x, EXPERTS_FLOAT8_DTYPE)
    assert torch.equal(arrived, (sent.float() * sent_inverse).bfloat16())
    again, again_inverse = _cast_rows(arrived, EXPERTS_FLOAT8_DTYPE)
    assert torch.equal(again.float() * again_inverse, sent.float() * sent_inverse)
    assert again_inverse[3] == sent_inverse[3] / 2 and torch.equal(again_inverse[:3], sent_inverse[:3])

    counts, matmul = torch.tensor([2, 1, 3, 0]), _matmul()
    w = torch.randn(E, N, K, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(6, N, dtype=torch.bfloat16)
    assert torch.equal(matmul(x, w, counts), matmul(arrived, w, counts))
    matmul(arrived, w, counts).backward(grad)
    blocks = zip(grad.split(counts.tolist()), arrived.split(counts.tolist()), strict=True)
    assert torch.equal(w.grad, torch.stack([g.t() @ rows for g, rows in blocks]))


def test_the_experts_recipe_casts_every_operand_to_the_float8_dtype_sent():
    config = torchao_float8().Float8LinearConfig.from_recipe_name(EXPERTS_RECIPE)
    casts = (config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output)
    assert {c.target_dtype for c in casts} == {EXPERTS_FLOAT8_DTYPE}
