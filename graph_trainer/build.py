"""Build a model: construct on the meta device, then materialise and initialise.

Initial weights depend only on the seed and each parameter's FQN, never on how the
parameter is later sharded: every parameter's FULL tensor is drawn from its own generator
(seeded from ``(seed, fqn)``) and each rank keeps its piece. So every parallel layout
starts from the same model.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from models.init_rules import draw_parameter


def clean_fqn(name: str) -> str:
    """The parameter's name in the plain model ('a.parametrizations.weight.original' -> 'a.weight')."""
    if ".parametrizations." in name:
        owner, rest = name.split(".parametrizations.")
        return f"{owner}.{rest.split('.')[0]}"
    return name


@torch.no_grad()
def init_parameters(model: nn.Module, rules: dict, seed: int) -> None:
    """Fill every parameter (plain or DTensor) from its init rule; identical across layouts."""
    for name, param in model.named_parameters():
        fqn = clean_fqn(name)
        if fqn not in rules:
            raise KeyError(f"parameter {fqn} has no init rule")
        device = param.device if not isinstance(param, DTensor) else param.to_local().device
        full = draw_parameter(rules[fqn], fqn, tuple(param.shape), seed, device)
        if isinstance(param, DTensor):
            # Every rank drew the same full tensor: keep the local piece without communicating.
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)


def build_model(build_fn, args, device: torch.device, seed: int,
                parallelize=None) -> nn.Module:
    """Construct on meta, apply ``parallelize(model)`` (may be None), materialise on ``device``, init.

    ``device`` meta stops before materialising: the model is then only good for tracing on
    fake tensors (``graph_trainer.analysis.fake_trace``), at any size, with no memory.
    """
    with torch.device("meta"):
        model = build_fn(args)
    rules = model.init_rules()
    if parallelize is not None:
        model = parallelize(model)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    init_parameters(model, rules, seed)
    model.init_buffers(device)
    return model
