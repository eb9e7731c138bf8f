"""graph_trainer.graph.ops: the named op sets every stage asks."""

import operator

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer.config import SELECTIVE_OPS
from graph_trainer.graph.ops import (
    ATTENTION_FORWARD_OP_NAMES,
    MATMUL_OP_NAMES,
    aliases_input,
    is_attention,
    is_matmul,
    is_view,
    matmul_count,
    mutated_args,
    name_of,
    named_args,
)


def _step(x, w, b):
    y = torch.addmm(b, x, w) + x @ w
    q = y.view(1, 1, 4, 4)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    counts = torch.zeros(4)
    counts.add_(out.flatten()[:4])
    return out.t() if out.dim() == 2 else out.transpose(2, 3), torch.split(y, [1, 3], dim=1), counts


def test_op_sets_classify_a_traced_graph():
    gm = make_fx(_step)(torch.randn(4, 4), torch.randn(4, 4), torch.randn(4))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert sorted(name_of(n) for n in calls if is_matmul(n)) == ["addmm", "mm"]
    assert matmul_count(gm.graph) == 2
    assert any(is_attention(n) for n in calls)
    views = {name_of(n) for n in calls if is_view(n)}
    assert {"view", "transpose"} <= views and "addmm" not in views
    getitems = [n for n in calls if n.target is operator.getitem]
    assert getitems and all(aliases_input(n) for n in getitems)
    (add_,) = (n for n in calls if name_of(n) == "add_")
    assert mutated_args(add_) == [add_.args[0]]
    assert all(not mutated_args(n) for n in calls if n is not add_ and n.target is not operator.getitem)
    (addmm,) = (n for n in calls if name_of(n) == "addmm")
    assert named_args(addmm)["beta"] == 1 and named_args(addmm)["mat1"] is addmm.args[1]


def test_every_named_op_exists_and_the_selective_default_saves_matmuls_and_attention():
    import models.float8  # noqa: F401  (registers graph_trainer::float8_grouped_mm)

    for name in (*MATMUL_OP_NAMES, *ATTENTION_FORWARD_OP_NAMES):
        assert hasattr(torch.ops.aten, name) or hasattr(torch.ops.graph_trainer, name), name
    assert SELECTIVE_OPS == [*MATMUL_OP_NAMES, *ATTENTION_FORWARD_OP_NAMES]
