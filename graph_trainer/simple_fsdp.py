"""SimpleFSDP: data parallelism expressed as DTensor redistributions the tracer can see.

Each parameter is stored as a DTensor laid out over the data-parallel mesh dimensions
(and over ``tp`` when tensor parallel already sharded it). A parametrization
(``torch.nn.utils.parametrize``) hands the module the *gathered* tensor instead:

- forward: cast to ``param_dtype``, then redistribute to Replicate over the data-parallel
  dims (an ``all_gather_into_tensor`` for sharded dims, nothing for replicated ones);
- backward (automatic, from the gradient placement Partial): the gradient is reduced in
  ``reduce_dtype`` back to the parameter's layout (a ``reduce_scatter_tensor`` for sharded
  dims, an ``all_reduce`` for replicated ones).

Modes, chosen from the degrees:

==============  ========================  =====================================
mode            data-parallel placements  backward collective
==============  ========================  =====================================
fully_shard     (Shard(0),)               reduce_scatter
hybrid_shard    (Replicate(), Shard(0))   reduce_scatter, then all_reduce
replicate       (Replicate(),)            all_reduce (DDP)
==============  ========================  =====================================

With tensor parallel, a parameter already sharded on ``tp`` by ``Shard(0)`` is sharded on
the data-parallel dim with ``_StridedShard(0, split_factor=tp)``: the tp split comes first,
then each tp piece is split over dp, so gathering over dp alone yields the tp piece.

Gradients come out summed over data-parallel ranks; the trainer scales the loss by
1/dp_size, so the update equals a single process on the concatenated batch.

The parametrization makes the parameter's FQN ``<module>.parametrizations.<name>.original``;
``graph_trainer.build.clean_fqn`` maps it back to ``<module>.<name>`` for checkpoints and
initialisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from graph_trainer.torch_compat import StridedShard
from torch.nn.utils import parametrize

MODES = ("fully_shard", "hybrid_shard", "replicate")

UNSHARD = "unshard"
"""``node.meta["custom"]["fsdp_role"]`` of the forward nodes that cast and gather a parameter."""
REDUCE_GRAD = "reduce_grad"
"""``fsdp_role`` of the backward nodes that reduce (and cast) that parameter's gradient."""


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype = torch.float32
    """Dtype of the gathered parameter the module computes with (cast before the all-gather)."""
    reduce_dtype: torch.dtype = torch.float32
    """Dtype gradients are reduced in."""


class ReplicateComputation(nn.Module):
    """The parametrization: gathered (and cast) parameter forward, reduced gradient backward."""

    def __init__(self, param_fqn: str, dp_dims: int, tp_mesh: DeviceMesh | None,
                 tp_placements: tuple[Placement, ...], mp: MixedPrecision):
        super().__init__()
        self.param_fqn = param_fqn
        self.dp_dims = dp_dims
        self.tp_mesh = tp_mesh
        self.tp_placements = tp_placements
        self.mp = mp

    def forward(self, param: DTensor) -> torch.Tensor:
        gathered = [Replicate()] * self.dp_dims + list(self.tp_placements)
        grad_placements = [Partial("sum")] * self.dp_dims + list(self.tp_placements)
        # The tag lets graph passes find this parameter's gather chain (and, through the
        # tracer, the gradient reduction that differentiates it) without pattern matching.
        with torch.fx.traceback.annotate({"fsdp_role": UNSHARD, "fsdp_param": self.param_fqn}):
            full = param.redistribute(
                placements=gathered,
                forward_dtype=self.mp.param_dtype,
                backward_dtype=self.mp.reduce_dtype,
            ).to_local(grad_placements=grad_placements)
        if self.tp_mesh is None:
            return full
        # Hand tensor-parallel modules the tp-sharded DTensor they were written for.
        return DTensor.from_local(full, self.tp_mesh, self.tp_placements, run_check=False)


def data_parallel_placements(mode: str, tp_placement: Placement | None, tp_degree: int) -> list[Placement]:
    """Placements over the data-parallel mesh dims for one parameter."""
    if mode == "replicate":
        return [Replicate()]
    shard: Placement = Shard(0)
    if isinstance(tp_placement, Shard) and tp_placement.dim == 0:
        shard = StridedShard(0, split_factor=tp_degree)
    return [Replicate(), shard] if mode == "hybrid_shard" else [shard]


def data_parallel(model: nn.Module, dp_mesh: DeviceMesh, mode: str, mp: MixedPrecision,
                  full_mesh: DeviceMesh | None = None) -> nn.Module:
    """Store every parameter of ``model`` as a data-parallel DTensor behind a gathering parametrization.

    ``dp_mesh`` holds the data-parallel dims (1-D, or 2-D ``(replicate, shard)`` for
    hybrid_shard). Parameters that tensor parallel already made DTensors on a ``tp`` mesh
    are laid out on ``full_mesh`` (dp dims + tp). Works on the meta device.
    """
    if mode not in MODES:
        raise ValueError(f"unknown data-parallel mode {mode!r}; choose one of {MODES}")
    dp_dims = dp_mesh.ndim
    for module_fqn, module in list(model.named_modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):  # already sharded by tensor parallel
                tp_mesh, tp_placements = param.device_mesh, tuple(param.placements)
                if full_mesh is None or tp_mesh.ndim != 1:
                    raise ValueError("tensor-parallel parameters need full_mesh with one tp dim")
                dp = data_parallel_placements(mode, tp_placements[0], tp_mesh.size())
                mesh, placements = full_mesh, dp + list(tp_placements)
            else:
                tp_mesh, tp_placements = None, ()
                mesh, placements = dp_mesh, data_parallel_placements(mode, None, 1)
            local_device = param.to_local().device if isinstance(param, DTensor) else param.device
            if local_device.type != "meta":
                raise ValueError("data_parallel expects a model built on the meta device (see graph_trainer.build)")
            # Lay out an uninitialised global tensor; graph_trainer.build fills in the values.
            full = torch.empty(param.shape, dtype=param.dtype, device="meta")
            new = distribute_tensor(full, mesh, placements, src_data_rank=None)
            module.register_parameter(name, nn.Parameter(new, requires_grad=param.requires_grad))
            param_fqn = f"{module_fqn}.{name}" if module_fqn else name
            parametrize.register_parametrization(
                module, name, ReplicateComputation(param_fqn, dp_dims, tp_mesh, tp_placements, mp), unsafe=True
            )
    return model

