"""The model families the trainer knows, by ``model.name``.

A ``ModelSpec`` tells the trainer how to build a family's model from a flavor, how many
FLOPs a token costs (for MFU), and which parallel layouts the model admits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn

from graph_trainer.errors import ConfigError
from models import llama3


@dataclass(frozen=True)
class ModelSpec:
    name: str
    flavors: dict[str, Any]
    """Flavor name -> model args (a frozen dataclass with at least ``max_seq_len`` and ``vocab_size``)."""
    build: Callable[[Any], nn.Module]
    """Construct the model from its args (called under ``torch.device('meta')``)."""
    flops_per_token: Callable[[Any, int], int]
    """Training FLOPs per token (forward + backward) at a sequence length."""
    validate_parallelism: Callable[[Any, dict[str, int]], None]
    """Raise ConfigError if the resolved degrees do not fit the model."""


def _llama3_parallelism(args: llama3.Llama3Args, degrees: dict[str, int]) -> None:
    if degrees["ep"] > 1:
        raise ConfigError("parallelism.ep > 1 needs a model with experts; llama3 is dense")
    if any(degrees[k] > 1 for k in ("dp_replicate", "dp_shard", "tp")):
        raise ConfigError(
            "llama3 runs on one process only in this version (parallelism degrees must all be 1, "
            f"got {degrees})"
        )


MODEL_SPECS: dict[str, ModelSpec] = {
    "llama3": ModelSpec(
        name="llama3",
        flavors=llama3.FLAVORS,
        build=llama3.Transformer,
        flops_per_token=llama3.flops_per_token,
        validate_parallelism=_llama3_parallelism,
    ),
}
