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

==============  ========================  ===============================================
mode            data-parallel placements  backward collective
==============  ========================  ===============================================
fully_shard     (Shard(0),)               reduce_scatter over dp_shard
hybrid_shard    (Replicate(), Shard(0))   reduce_scatter over dp_shard, then all_reduce of
                                          the shard over dp_replicate (HSDP, as FSDP2)
replicate       (Replicate(),)            all_reduce over dp_replicate (DDP)
==============  ========================  ===============================================

Every collective of the chain, the all_reduce too, is made under the parametrization's
``fsdp_role`` tag, so on the traced graph the backward collectives are tagged ``reduce_grad``
with their ``fsdp_param`` (``graph_trainer.compiler.tracer``) and the bucketing passes find them.
Both backward collectives run in ``reduce_dtype``.

With tensor parallel, a parameter already sharded on ``tp`` by ``Shard(0)`` is sharded on
the data-parallel dim with ``_StridedShard(0, split_factor=tp)``: the tp split comes first,
then each tp piece is split over dp, so gathering over dp alone yields the tp piece.

Gradients come out summed over data-parallel ranks; the trainer scales the loss by
1/dp_size, so the update equals a single process on the concatenated batch.

The parametrization makes the parameter's FQN ``<module>.parametrizations.<name>.original``:
``clean_fqn`` maps it back to ``<module>.<name>`` (checkpoints, initialisation, records), and
``owner_fqn`` and ``is_parametrization`` say which module owns it and which modules are
parametrize's own; this module is the one home of that naming.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement
from torch.nn.utils import parametrize

from graph_trainer.distributed.float8_gather import WeightCast, cast_shard, float8_weight, weight_cast
from graph_trainer.distributed.parallel_dims import ParallelDims, dp_mesh_dims
from graph_trainer.graph import tags
from graph_trainer.graph.tags import FSDP_PARAM, FSDP_ROLE, REDUCE_GRAD, UNSHARD
from graph_trainer.torch_compat import StridedShard

MODES = ("fully_shard", "hybrid_shard", "replicate")


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype = torch.float32
    """Dtype of the gathered parameter the module computes with (cast before the all-gather)."""
    reduce_dtype: torch.dtype = torch.float32
    """Dtype gradients are reduced in."""
    float8_all_gather: bool = False
    """Gather the weights of tensorwise float8 linears in float8 (``float8_gather``), cast from
    ``param_dtype`` on each shard with the whole weight's scale."""
    float8_dispatch: bool = False
    """Send expert parallel's rows to the routed experts in float8 (``expert_parallel``)."""


class ReplicateComputation(nn.Module):
    """The parametrization: gathered (and cast) parameter forward, reduced gradient backward.

    ``inner_mesh``/``inner_placements`` describe a split the parameter keeps while computing
    (tensor parallel on ``tp``, or experts on ``ep``); only the data-parallel dims are
    gathered. ``hand_local``: give the module the local tensor of that split instead of a
    DTensor (expert modules index their local experts; TP modules expect DTensors).
    """

    def __init__(
        self,
        param_fqn: str,
        dp_dims: int,
        inner_mesh: DeviceMesh | None,
        inner_placements: tuple[Placement, ...],
        mp: MixedPrecision,
        hand_local: bool = False,
        replicate_mesh: DeviceMesh | None = None,
    ):
        super().__init__()
        self.param_fqn = param_fqn
        self.dp_dims = dp_dims
        self.replicate_mesh = replicate_mesh
        self.inner_mesh = inner_mesh
        self.inner_placements = inner_placements
        self.mp = mp
        self.hand_local = hand_local

    float8: WeightCast | None = None
    """Set (``data_parallel`` with ``float8_all_gather``, for a tensorwise float8 linear's weight):
    the shard is cast to float8 before the gather, and the module gets torchao's float8 weight
    (``GatherInFloat8``)."""

    resident: torch.Tensor | None = None
    """Set (``use_gathered``): the gathered tensor to hand the module, instead of gathering
    ``param`` here (weights gathered once per step, ``graph_trainer.distributed.resident``)."""

    def forward(self, param: DTensor) -> torch.Tensor:
        full = self.gather(param) if self.resident is None else self.resident
        return self.compute_view(full)

    def gather(self, param: DTensor) -> torch.Tensor:
        """The local tensor the module computes with: ``param`` cast to ``param_dtype`` and gathered
        over the data-parallel dims (still split by the inner dim); its gradient is reduced back."""
        # The tag lets graph passes find this parameter's gather chain (and, through the
        # tracer, the gradient reduction that differentiates it) without pattern matching.
        with tags.annotate({FSDP_ROLE: UNSHARD, FSDP_PARAM: self.param_fqn}):
            if self.float8 is not None:  # its backward runs ``reduce``: the replicas' sum too
                return GatherInFloat8.apply(param, self)
            if self.replicate_mesh is not None:
                param = self._sum_gradient_over_replicas(param)
            return param.redistribute(
                placements=[Replicate()] * self.dp_dims + list(self.inner_placements),
                forward_dtype=self.mp.param_dtype,
                backward_dtype=self.mp.reduce_dtype,
            ).to_local(grad_placements=self._gathered_grad_placements())

    def compute_view(self, full: torch.Tensor) -> torch.Tensor:
        """What the module gets for the gathered local tensor ``full``: tensor-parallel modules the
        tp-sharded DTensor they were written for, others (and ``hand_local``) ``full`` itself."""
        if self.inner_mesh is None or self.hand_local:
            return full
        return DTensor.from_local(full, self.inner_mesh, self.inner_placements, run_check=False)

    def reduce(self, param: DTensor, gathered_grad: torch.Tensor) -> DTensor:
        """``param``'s gradient from ``gathered_grad``, a gradient of the gathered local tensor in
        ``reduce_dtype`` (summed over microbatches): the same collectives as the backward of
        ``gather`` (reduce-scatter over the sharded dim, then the sum over ``dp_replicate``), run
        outside autograd, in ``reduce_dtype``, cast to the parameter's dtype at the end."""
        with tags.annotate({FSDP_ROLE: REDUCE_GRAD, FSDP_PARAM: self.param_fqn}):
            partial = DTensor.from_local(
                gathered_grad,
                param.device_mesh,
                self._gathered_grad_placements(),
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
            reduced = partial.redistribute(param.device_mesh, param.placements).to_local()
            if self.replicate_mesh is not None:  # then over replicas, on the shard (as in backward)
                reduced = sum_over_mesh(reduced, self.replicate_mesh)
            return DTensor.from_local(
                reduced.to(param.dtype),
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )

    def _gathered_grad_placements(self) -> list[Placement]:
        """The gradient of the gathered parameter as the redistribute's backward sees it: a partial
        sum over the sharded data-parallel dim (reduced to Shard: the reduce-scatter), and over
        ``dp_replicate`` declared Replicate, because ``_sum_gradient_over_replicas`` sums it there
        afterwards, on the shard."""
        replicated = 1 if self.replicate_mesh is not None else 0
        partial = [Partial("sum")] * (self.dp_dims - replicated)
        return [Replicate()] * replicated + partial + list(self.inner_placements)

    def _sum_gradient_over_replicas(self, param: DTensor) -> DTensor:
        """``param`` unchanged; its gradient summed over ``dp_replicate`` (``SumGradientOverReplicas``)."""
        local = SumGradientOverReplicas.apply(
            param.to_local(), self.replicate_mesh, self.mp.reduce_dtype, self.param_fqn
        )
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )


class GatherInFloat8(torch.autograd.Function):
    """``rc.gather`` for a float8 linear's weight (``rc.float8``): forward casts the shard to the
    parameter dtype, then to float8 with the whole weight's scale (``float8_gather.cast_shard``),
    gathers the float8 bytes over the data-parallel dims (still split by the inner dim) and hands
    back torchao's float8 weight; backward reduces the gathered weight's gradient as any gathered
    parameter's (``rc.reduce``: reduce-scatter, then the sum over replicas, in ``reduce_dtype``).
    The gather moves bytes (``uint8``): float8 is not a dtype every backend's collectives take."""

    @staticmethod
    def forward(ctx, param: DTensor, rc: ReplicateComputation) -> torch.Tensor:
        ctx.param, ctx.rc = param, rc
        mesh, placements = param.device_mesh, tuple(param.placements)
        data, scale = cast_shard(param.to_local().to(rc.mp.param_dtype), rc.float8, mesh, placements)
        shards = DTensor.from_local(
            data.view(torch.uint8), mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
        )
        gathered = shards.redistribute(placements=[Replicate()] * rc.dp_dims + list(rc.inner_placements))
        return float8_weight(gathered.to_local().view(data.dtype), scale, rc.float8, rc.mp.param_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.rc.reduce(ctx.param, grad.to(ctx.rc.mp.reduce_dtype)), None


class SumGradientOverReplicas(torch.autograd.Function):
    """Identity in forward; in backward the gradient is summed over the 1-D ``dp_replicate`` mesh
    in ``reduce_dtype`` (an all_reduce) and cast back.

    It sits between the parameter's local shard and the gather, so under HSDP the gradient it
    sums is the shard the reduce-scatter over ``dp_shard`` produced: only 1/dp_shard of the bytes
    crosses the replicate groups (nodes), as in FSDP2. DTensor alone, given a gradient partial
    over both dims, reduces in mesh order: replicate first, an all_reduce of the full gradient.

    The tracer tags a backward node from the forward op it pairs with by ``seq_nr``; an identity
    forward may trace to no op to pair with (DTensor's own replicate-to-replicate redistribute
    did not, which left DDP's all-reduces untagged), so the backward tags its own collective
    ``reduce_grad`` with the parameter's FQN."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, mesh: DeviceMesh, reduce_dtype: torch.dtype, param_fqn: str):
        ctx.mesh, ctx.reduce_dtype, ctx.param_fqn = mesh, reduce_dtype, param_fqn
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with tags.annotate({FSDP_ROLE: REDUCE_GRAD, FSDP_PARAM: ctx.param_fqn}):
            summed = sum_over_mesh(grad.to(ctx.reduce_dtype), ctx.mesh).to(grad.dtype)
        return summed, None, None, None


def sum_over_mesh(local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``local`` summed over the ranks of the 1-D ``mesh`` (an all_reduce, in ``local``'s dtype)."""
    return (
        DTensor.from_local(local, mesh, [Partial("sum")], run_check=False)
        .redistribute(placements=[Replicate()])
        .to_local()
    )


class CastForCompute(nn.Module):
    """The parametrization for mixed precision where nothing is gathered (one process, or tensor
    parallel alone): the module computes with the parameter cast to ``param_dtype``; autograd casts
    the gradient back to the parameter's own dtype, so the optimizer updates the fp32 master
    weights, as under SimpleFSDP. The same module runs in graph and eager mode.

    A parameter replicated over tp (a sequence-parallel norm's weight) is handed to the module as a
    fresh DTensor of the same placement: the module's gradient for it is partial over tp (each rank
    saw its piece of the sequence), and that DTensor's backward sums it there (an all_reduce), as
    SimpleFSDP's ``compute_view`` does, so the parameter's gradient is whole."""

    def __init__(self, param_dtype: torch.dtype):
        super().__init__()
        self.param_dtype = param_dtype

    def forward(self, param: torch.Tensor) -> torch.Tensor:
        cast = param.to(self.param_dtype)
        if not _replicated(param):
            return cast
        return DTensor.from_local(cast.to_local(), cast.device_mesh, cast.placements, run_check=False)


def _replicated(param: torch.Tensor) -> bool:
    return isinstance(param, DTensor) and any(isinstance(p, Replicate) for p in param.placements)


def cast_for_compute(model: nn.Module, mp: MixedPrecision) -> nn.Module:
    """Mixed precision without data parallelism: every parameter not already behind a
    parametrization (SimpleFSDP's casts itself), and not already in ``mp.param_dtype`` or
    replicated over tp (``CastForCompute``), gets ``CastForCompute``. ``mp.reduce_dtype`` has
    nothing to act on (no data-parallel gradient is reduced)."""
    for module_fqn, module in list(model.named_modules()):
        if is_parametrization(module_fqn):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if parametrize.is_parametrized(module, name):
                continue
            if param.dtype != mp.param_dtype or _replicated(param):
                parametrize.register_parametrization(module, name, CastForCompute(mp.param_dtype), unsafe=True)
    return model


def data_parallel_placements(mode: str | None, inner_placement: Placement | None, inner_degree: int) -> list[Placement]:
    """Placements over the data-parallel mesh dims for one parameter ([] without data parallelism)."""
    if mode is None:
        return []
    if mode == "replicate":
        return [Replicate()]
    shard: Placement = Shard(0)
    if isinstance(inner_placement, Shard) and inner_placement.dim == 0:
        # The inner split (tp or ep) owns dim 0 first; dp splits each inner piece further.
        shard = StridedShard(0, split_factor=inner_degree)
    return [Replicate(), shard] if mode == "hybrid_shard" else [shard]


def _replicate_mesh(mesh: DeviceMesh, mode: str | None) -> DeviceMesh | None:
    """The 1-D mesh of the replicated data-parallel dim (the first one), for modes that have one."""
    if mode not in ("hybrid_shard", "replicate"):
        return None
    return mesh[mesh.mesh_dim_names[0]]


_PARAMETRIZATIONS = "parametrizations"


def is_parametrization(fqn: str) -> bool:
    """Whether module ``fqn`` is parametrize's own (``a.parametrizations.weight``), not the model's."""
    return _PARAMETRIZATIONS in fqn.split(".")


def clean_fqn(name: str) -> str:
    """A parameter's name in the plain model ('a.parametrizations.weight.original' -> 'a.weight')."""
    owner, found, rest = name.partition(f".{_PARAMETRIZATIONS}.")
    return f"{owner}.{rest.split('.')[0]}" if found else name


def owner_fqn(name: str) -> str:
    """The FQN of the module owning a parameter or buffer ('a.b.weight' -> 'a.b', also when parametrized)."""
    return clean_fqn(name).rpartition(".")[0]


def data_parallel(
    model: nn.Module,
    dp_mesh: DeviceMesh | None,
    mode: str | None,
    mp: MixedPrecision,
    full_mesh: DeviceMesh | None = None,
    hand_local: bool = False,
    fqn_prefix: str = "",
) -> nn.Module:
    """Store every parameter of ``model`` as a data-parallel DTensor behind a gathering parametrization.

    ``dp_mesh`` holds the data-parallel dims (1-D, or 2-D ``(replicate, shard)`` for
    hybrid_shard; None with ``mode`` None when the parameters are only split by an inner
    dim). Parameters already made DTensors on a 1-D mesh (tensor parallel's ``tp``, expert
    parallel's ``ep``) are laid out on ``full_mesh`` (dp dims + that dim). Parameters that
    already have a parametrization (an earlier call) are left alone. ``fqn_prefix``: FQN of
    ``model`` in the whole model, so the ``fsdp_param`` tags name parameters in full when a
    submodule is passed. Works on the meta device.
    """
    if mode is not None and mode not in MODES:
        raise ValueError(f"unknown data-parallel mode {mode!r}; choose one of {MODES}")
    if (mode is None) != (dp_mesh is None):
        raise ValueError("data_parallel needs a dp_mesh exactly when it has a mode")
    dp_dims = 0 if dp_mesh is None else dp_mesh.ndim
    for module_fqn, module in list(model.named_modules()):
        if is_parametrization(module_fqn):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):  # already split by tensor or expert parallel
                inner_mesh, inner_placements = param.device_mesh, tuple(param.placements)
                if full_mesh is None or inner_mesh.ndim != 1:
                    raise ValueError("parameters split by tp/ep need full_mesh (dp dims + that one dim)")
                dp = data_parallel_placements(mode, inner_placements[0], inner_mesh.size())
                mesh, placements = full_mesh, dp + list(inner_placements)
            else:
                if dp_mesh is None:
                    continue  # nothing to do for a plain parameter without data parallelism
                inner_mesh, inner_placements = None, ()
                mesh, placements = dp_mesh, data_parallel_placements(mode, None, 1)
            local_device = param.to_local().device if isinstance(param, DTensor) else param.device
            if local_device.type != "meta":
                raise ValueError("data_parallel expects a model built on the meta device (see graph_trainer.build)")
            # Lay out an uninitialised global tensor; graph_trainer.build fills in the values.
            full = torch.empty(param.shape, dtype=param.dtype, device="meta")
            new = distribute_tensor(full, mesh, placements, src_data_rank=None)
            module.register_parameter(name, nn.Parameter(new, requires_grad=param.requires_grad))
            param_fqn = ".".join(part for part in (fqn_prefix, module_fqn, name) if part)
            rc = ReplicateComputation(
                param_fqn, dp_dims, inner_mesh, inner_placements, mp, hand_local, _replicate_mesh(mesh, mode)
            )
            if mp.float8_all_gather and name == "weight" and mode in ("fully_shard", "hybrid_shard"):
                rc.float8 = weight_cast(module)
            parametrize.register_parametrization(module, name, rc, unsafe=True)
    return model


def data_parallel_for_job(
    model: nn.Module, mesh: DeviceMesh | None, dims: ParallelDims, mp: MixedPrecision
) -> nn.Module:
    """What every family's parallel plan ends with: SimpleFSDP over the job's data-parallel dims
    (``parallel_dims.dp_mesh_dims``) for every parameter not laid out yet (expert parallel's
    experts are), a tensor-parallel one over those dims and ``tp``; with no data-parallel dim (or
    no mesh), the plain mixed-precision cast (``cast_for_compute``)."""
    dp_dims = dp_mesh_dims(dims) if mesh is not None else ()
    if not dp_dims:
        return cast_for_compute(model, mp)
    full = mesh[(*dp_dims, "tp")] if dims.tp > 1 else None
    return data_parallel(model, mesh[dp_dims], dims.fsdp_mode, mp, full_mesh=full)
