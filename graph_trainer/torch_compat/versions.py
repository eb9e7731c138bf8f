"""Which torch this is, and turning a missing private API into one clear line.

``private_api(name)`` wraps every lookup of a private PyTorch API in this package: an
ImportError or AttributeError becomes one ``TorchCompatError`` naming the API, the installed
torch and the supported range ``SUPPORTED_TORCH``, instead of a traceback deep in a run.
"""

from __future__ import annotations

import contextlib

import torch

from graph_trainer.errors import TorchCompatError

SUPPORTED_TORCH = "2.11 to 2.14"
"""Torch releases graph_trainer runs on: 2.13 (CPU, where CI runs), 2.14 (the CUDA build
``scripts/setup_env.sh`` installs with a GPU; its tests pass on CPU), 2.11 (CUDA, as on the H100
machine). The user passes need 2.13 or later (``pass_needs_torch_2_13``)."""

TORCH_VERSION = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def pass_needs_torch_2_13(name: str) -> str | None:
    """Why pass ``name`` cannot run on this torch (None: it can). ``auto_bucketing`` drives 2.13's
    overlap scheduler, whose API 2.11 lacks; on torch 2.11 (CPU) the schedule checks of
    ``transformer_block_bucketing`` and ``ep_overlap`` fail on the traced graphs (its traces differ;
    not investigated yet), so they are refused there rather than run untested."""
    if TORCH_VERSION >= (2, 13):
        return None
    return (
        f"{name} is supported with torch 2.13 (this is torch {torch.__version__}: its traced graphs and "
        f"overlap scheduler differ, and the pass's checks fail there)"
    )


@contextlib.contextmanager
def private_api(name: str):
    """Turn an ImportError/AttributeError raised while looking ``name`` up into one
    ``TorchCompatError`` naming the API and the installed torch, instead of a traceback."""
    try:
        yield
    except (ImportError, AttributeError) as e:
        raise TorchCompatError(
            f"PyTorch private API {name} is not available in torch {torch.__version__} ({e}); "
            f"graph_trainer supports torch {SUPPORTED_TORCH}"
        ) from None
