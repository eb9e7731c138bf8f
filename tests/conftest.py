"""Shared pytest setup: the repository root is importable and tests run on 2 CPU threads."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

os.environ.setdefault("OMP_NUM_THREADS", "2")


def _torch_version() -> tuple[int, int]:
    import torch

    return tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def _needs_torch_2_13():
    import pytest

    return pytest.mark.skipif(
        _torch_version() < (2, 13),
        reason="the user passes (transformer_block_bucketing, auto_bucketing, ep_overlap) need torch 2.13 and "
        "refuse older ones (graph_trainer.torch_compat.pass_needs_torch_2_13)",
    )


NEEDS_TORCH_2_13 = _needs_torch_2_13()
"""Marks a test of the user passes, which run only on torch 2.13 (tested there by CI)."""
