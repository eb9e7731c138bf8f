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
"""Torch releases graph_trainer runs on, everything included (training, every layout, the memory
policy, the user passes, checkpoints): 2.13 (the CPU build CI runs), 2.11 (the CUDA build of the
one-GPU H100 machine; its tests pass on CPU with that wheel), 2.14 (the CUDA build
``scripts/setup_env.sh`` installs with a GPU). Where these releases differ below the public API
(traced graphs, the overlap scheduler's estimates, what ``dcp.save`` returns), the difference is
handled in this package or beside its one use, and tested in ``tests/torch_compat/``."""

TORCH_VERSION = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


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
