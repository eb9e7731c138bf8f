"""Fails loudly when a PyTorch upgrade changes a private API graph_trainer relies on."""

import torch
import torch.fx.traceback as fx_traceback


def test_fx_traceback_apis():
    for name in ("annotate", "preserve_node_meta", "set_grad_fn_seq_nr", "reset_grad_fn_seq_nr"):
        assert callable(getattr(fx_traceback, name)), name


def test_autograd_node_sequence_numbers():
    x = torch.ones(2, requires_grad=True)
    y = (x * 2).sum()
    assert isinstance(y.grad_fn._sequence_nr(), int)
    assert hasattr(y.grad_fn, "register_prehook") and hasattr(y.grad_fn, "next_functions")
