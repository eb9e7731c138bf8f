"""models.common's routed-row helpers: ``sorted_copies`` has ``index_select``'s values and its
gradient, computed by a gather (and a sum over the copies) instead of an accumulating scatter."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from models.common import inverse_permutation, sorted_copies
from tests.deepseek_v3_tiny import TINY, tiny_model


def _inputs(rows: int, copies: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # Small integers: every sum is exact, whatever order its terms are added in.
    x = torch.randint(-8, 8, (rows, 5), generator=g).double().requires_grad_()
    order = torch.randperm(rows * copies, generator=g)
    grad = torch.randint(-8, 8, (rows * copies, 5), generator=g).double()
    return x, order, grad


def test_inverse_permutation_undoes_the_order():
    order = torch.randperm(37, generator=torch.Generator().manual_seed(1))
    inverse = inverse_permutation(order)
    assert torch.equal(order[inverse], torch.arange(37)) and torch.equal(inverse, torch.argsort(order))


@pytest.mark.parametrize("copies", [1, 3])
@pytest.mark.parametrize("given_inverse", [False, True])
def test_sorted_copies_is_index_select_forward_and_backward(copies, given_inverse):
    x, order, grad = _inputs(7, copies)
    inverse = inverse_permutation(order) if given_inverse else None
    out = sorted_copies(x, order, copies, inverse)
    (got,) = torch.autograd.grad(out, [x], grad)
    reference = x.index_select(0, order // copies)
    (expected,) = torch.autograd.grad(reference, [x], grad)
    assert torch.equal(out, reference) and torch.equal(got, expected)


def test_sorted_copies_with_no_rows():
    x, order, grad = _inputs(0, 2)
    (got,) = torch.autograd.grad(sorted_copies(x, order, 2), [x], grad)
    assert got.shape == x.shape


def test_the_moe_backward_has_no_accumulating_scatter():
    """Sorting the tokens' copies by expert is differentiated by gathers: no ``index_add`` (a
    GPU atomics kernel) anywhere in a MoE layer's forward and backward."""
    moe = tiny_model().layers["1"].moe

    def forward_backward(x):
        return torch.autograd.grad(moe(x).square().sum(), [x])

    gm = make_fx(forward_backward)(torch.randn(2, 8, TINY.dim, requires_grad=True))
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "aten.index_select.default" in targets
    assert not {t for t in targets if "index_add" in t or "index_put" in t}
