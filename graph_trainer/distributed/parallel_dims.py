"""Parallel degrees -> a named DeviceMesh, and the questions the trainer asks about it.

The world is laid out as a mesh with dims ``("dp_replicate", "dp_shard", "tp")`` (row-major,
so tp neighbours are adjacent ranks). Data-parallel ranks are the (dp_replicate, dp_shard)
coordinates; ranks that differ only in tp see the same batch. With context parallelism
(``cp > 1``) a ``"cp"`` dim sits between ``"dp_shard"`` and ``"tp"``: ranks that differ only in cp see
the same batch and each computes on its own chunks of every sequence (``models.sequence``); they hold
different tokens, so SimpleFSDP shards (and sums gradients) over ``("dp_shard", "cp")``, flattened
into ``"dp_shard_cp"``. With pipeline parallelism
(``pp > 1``) a ``"pp"`` dim comes first (outermost): ranks that differ only in pp hold different
stages of the same model replica and see the same batch.

With expert parallelism (``ep > 1``) the data-parallel shard dim is split in two,
``dp_shard = efsdp x ep``: the world mesh is ``("dp_replicate", "efsdp", "ep", "tp")`` and
``("efsdp", "ep")`` is flattened back into ``"dp_shard"``. Dense parameters are sharded over
``dp_shard`` as without EP; routed experts are split over ``ep`` and sharded by SimpleFSDP
over what is left of the data-parallel ranks (``dp_replicate`` x ``efsdp``).

Under sequence parallel with ``tp > 1`` each tp rank routes its own piece of the sequence, so the
tp ranks are expert-parallel ranks too: ``ep = ep_dp x tp`` (``ep`` a multiple of ``tp``), the
world mesh is ``("dp_replicate", "efsdp", "ep_dp", "tp")``, ``("efsdp", "ep_dp")`` is flattened
into ``"dp_shard"`` and ``("ep_dp", "tp")`` into ``"ep"`` (``ParallelDims.experts_span_tp``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from graph_trainer.config import Parallelism
from graph_trainer.errors import require
from graph_trainer.torch_compat import flatten_mesh_dims


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard, any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def largest_local_numel(t: torch.Tensor) -> int:
    """Elements of the largest local piece of ``t`` on any rank (a plain tensor: its own): every
    ``Shard(d)`` over a mesh dim of size n splits dim d as ``torch.chunk`` does, the first piece
    the largest (ceil), so the rank at coordinate 0 of every mesh dim holds the largest piece.
    The same number on every rank, where ``local_tensor(t).numel()`` may differ between ranks."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return t.numel()
    shape = list(t.shape)
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, Shard):
            n = t.device_mesh.size(mesh_dim)
            shape[placement.dim] = -(-shape[placement.dim] // n)
    numel = 1
    for size in shape:
        numel *= size
    return numel


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    """The residual stream is split over ``tp`` along the sequence (``parallelism.sequence_parallel``
    with tp > 1; ``from_degrees`` drops it where tp is 1)."""

    @classmethod
    def from_degrees(cls, degrees: dict[str, int], sequence_parallel: bool = False) -> ParallelDims:
        named = {k: degrees.get(k, 1) for k in ("dp_replicate", "dp_shard", "tp", "ep", "pp", "cp")}
        return cls(**named, sequence_parallel=sequence_parallel and named["tp"] > 1)

    @property
    def sequence_shards(self) -> int:
        """Pieces the sequence of the residual stream is split into on each rank (cp, times tp under
        sequence parallel): a stage's hidden state is [batch, seq / sequence_shards, dim]."""
        return self.cp * (self.tp if self.sequence_parallel else 1)

    @property
    def experts_span_tp(self) -> bool:
        """The expert-parallel ranks include the tp ranks (sequence parallel with ep > 1: every tp
        rank routes its own tokens, and ``ep = ep_dp x tp``)."""
        return self.sequence_parallel and self.ep > 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp_size(self) -> int:
        """Number of distinct batches per step (data-parallel ranks)."""
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """Shards of each expert over the data-parallel shard ranks not used by ep (with
        ``experts_span_tp``: the ranks of dp_shard x tp that ep leaves)."""
        return self.dp_shard * self.tp // self.ep if self.experts_span_tp else self.dp_shard // self.ep

    @property
    def fsdp_mode(self) -> str | None:
        """SimpleFSDP mode for dense parameters, or None without data or context parallelism (the
        context-parallel ranks are shard ranks: module docstring)."""
        return _fsdp_mode(self.dp_replicate, self.dp_shard * self.cp)

    @property
    def expert_fsdp_mode(self) -> str | None:
        """SimpleFSDP mode for expert parameters (over dp_replicate x efsdp), or None."""
        return _fsdp_mode(self.dp_replicate, self.efsdp)

    def as_dict(self) -> dict[str, int]:
        """The degrees by name (``pp`` and ``cp`` only when > 1, so other jobs read as before)."""
        degrees = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp, "ep": self.ep}
        return {**degrees, **{k: v for k, v in (("pp", self.pp), ("cp", self.cp)) if v > 1}}


def weights_per_step(p: Parallelism, dp_size: int) -> bool:
    """Whether SimpleFSDP gathers weights and reduces gradients once per step (``fsdp_collectives``)
    at data-parallel degree ``dp_size`` (without data parallelism nothing is gathered or reduced)."""
    chosen = p.fsdp_collectives == "per_step" or (p.fsdp_collectives == "default" and p.pp > 1)
    return chosen and dp_size > 1


def microbatches_per_step(global_batch_size: int, local_batch_size: int, dp_size: int, pp_microbatches: int = 0) -> int:
    """Microbatches each data-parallel rank runs per optimizer step: ``global_batch_size`` /
    (``local_batch_size`` x ``dp_size``); a ``global_batch_size`` of 0 means one, or
    ``pp_microbatches`` when that is set (``parallelism.pp_microbatches``). Anything that is not a
    positive multiple of one pass over the data-parallel ranks, or that disagrees with a set
    ``pp_microbatches``, is a ``ConfigError``."""
    per_microbatch = local_batch_size * dp_size
    require(pp_microbatches >= 0, f"parallelism.pp_microbatches = {pp_microbatches} must be >= 0 (0: from the batch)")
    if pp_microbatches and global_batch_size:
        require(
            global_batch_size == per_microbatch * pp_microbatches,
            f"training.global_batch_size = {global_batch_size} disagrees with parallelism.pp_microbatches = "
            f"{pp_microbatches} x local_batch_size x data-parallel degree = {per_microbatch * pp_microbatches}; "
            f"set one of them",
        )
    if global_batch_size == 0:
        return pp_microbatches or 1
    require(
        global_batch_size > 0 and global_batch_size % per_microbatch == 0,
        f"training.global_batch_size = {global_batch_size} must be a positive multiple of "
        f"training.local_batch_size x data-parallel degree = {local_batch_size} x {dp_size} = "
        f"{per_microbatch} (or 0: {per_microbatch}, no accumulation)",
    )
    return global_batch_size // per_microbatch


def job_microbatches(parallelism: Parallelism, global_batch_size: int, local_batch_size: int, world_size: int) -> int:
    """``microbatches_per_step`` of a job at ``world_size`` (its degrees resolved first)."""
    dims = ParallelDims.from_degrees(resolve_parallel_degrees(parallelism, world_size))
    return microbatches_per_step(global_batch_size, local_batch_size, dims.dp_size, parallelism.pp_microbatches)


def loss_scale(dp_size: int, microbatches: int, cp: int = 1) -> float:
    """What each rank scales its microbatch loss by before backward: every rank's loss is the mean
    over its microbatch's tokens (under context parallel, its 1/cp of them) and the gradients are
    summed over ranks and microbatches, so 1 / (dp_size x cp x microbatches) makes the update that
    of the mean over the global batch's tokens (every microbatch, and every rank's share of one,
    holds the same number of tokens, all of them counted)."""
    return 1.0 / (dp_size * cp * microbatches)


def resolve_parallel_degrees(p: Parallelism, world_size: int) -> dict[str, int]:
    """Fill in dp_shard=-1 and check that the degrees multiply to the world size."""
    for name in ("dp_replicate", "tp", "ep", "pp", "cp"):
        require(getattr(p, name) >= 1, f"parallelism.{name} = {getattr(p, name)} must be >= 1")
    require(p.dp_shard == -1 or p.dp_shard >= 1, f"parallelism.dp_shard = {p.dp_shard} must be >= 1 or -1")
    others = p.pp * p.dp_replicate * p.cp * p.tp
    dp_shard = p.dp_shard
    if dp_shard == -1:
        named = "*".join(
            n for n in ("pp", "dp_replicate", "cp", "tp") if n in ("dp_replicate", "tp") or getattr(p, n) > 1
        )
        require(world_size % others == 0, f"world size {world_size} is not divisible by {named} = {others}")
        dp_shard = world_size // others
    product = p.pp * p.dp_replicate * dp_shard * p.cp * p.tp
    pp = f"pp={p.pp} x " if p.pp > 1 else ""
    cp = f"cp={p.cp} x " if p.cp > 1 else ""
    require(
        product == world_size,
        f"parallelism degrees {pp}dp_replicate={p.dp_replicate} x dp_shard={dp_shard} x {cp}tp={p.tp} = "
        f"{product} do not match the world size {world_size}",
    )
    # Experts are split over a sub-group of the data-parallel shard ranks, with the tp ranks under
    # sequence parallel (see the module docstring).
    if ParallelDims.from_degrees({"tp": p.tp, "ep": p.ep}, p.sequence_parallel).experts_span_tp:
        require(
            p.ep % p.tp == 0 and dp_shard % (p.ep // p.tp) == 0,
            f"parallelism.ep = {p.ep} must be parallelism.tp = {p.tp} times a divisor of parallelism.dp_shard = "
            f"{dp_shard} under sequence parallel (each tp rank routes its own tokens, so the experts are split "
            "over the tp ranks too); change one, or set parallelism.sequence_parallel false",
        )
    else:
        require(
            dp_shard % p.ep == 0,
            f"parallelism.ep = {p.ep} must divide parallelism.dp_shard = {dp_shard} (experts are split over "
            f"data-parallel shard ranks)",
        )
    return {"dp_replicate": p.dp_replicate, "dp_shard": dp_shard, "tp": p.tp, "ep": p.ep, "pp": p.pp, "cp": p.cp}


def _fsdp_mode(replicate: int, shard: int) -> str | None:
    if replicate > 1 and shard > 1:
        return "hybrid_shard"
    if replicate > 1:
        return "replicate"
    if shard > 1:
        return "fully_shard"
    return None


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh | None:
    """The world mesh (None for a single process)."""
    if dims.world_size == 1:
        return None
    if not dist.is_initialized() or dist.get_world_size() != dims.world_size:
        raise RuntimeError(f"the process group must be initialised with {dims.world_size} ranks")
    outer = (("pp", dims.pp),) if dims.pp > 1 else ()
    replicate, tp = ("dp_replicate", dims.dp_replicate), ("tp", dims.tp)
    if dims.ep == 1:
        inner = (replicate, ("dp_shard", dims.dp_shard), *((("cp", dims.cp),) if dims.cp > 1 else ()), tp)
    elif dims.experts_span_tp:
        inner = (replicate, ("efsdp", dims.efsdp), ("ep_dp", dims.ep // dims.tp), tp)
    else:
        inner = (replicate, ("efsdp", dims.efsdp), ("ep", dims.ep), tp)
    named = (*outer, *inner)
    mesh = init_device_mesh(
        device_type, tuple(size for _, size in named), mesh_dim_names=tuple(name for name, _ in named)
    )
    if dims.experts_span_tp:
        flatten_mesh_dims(mesh, ("efsdp", "ep_dp"), "dp_shard")
        flatten_mesh_dims(mesh, ("ep_dp", "tp"), "ep")
    elif dims.ep > 1:
        flatten_mesh_dims(mesh, ("efsdp", "ep"), "dp_shard")
    if dims.cp > 1:
        flatten_mesh_dims(mesh, ("dp_shard", "cp"), DP_SHARD_CP)
    if dims.pp > 1:  # the ranks of one pipeline stage: what sums over "every rank but the pipeline" use
        flatten_mesh_dims(mesh, tuple(name for name, _ in inner), STAGE_RANKS)
    return mesh


DP_SHARD_CP = "dp_shard_cp"
"""Mesh dim (cp > 1 only) flattening ``("dp_shard", "cp")``: the ranks SimpleFSDP shards over."""
STAGE_RANKS = "stage_ranks"
"""Mesh dim (pp > 1 only) flattening every dim but ``pp``: the ranks that hold the same stages."""


def pp_group(mesh: DeviceMesh | None, dims: ParallelDims):
    """The pipeline's process group (None without pipeline parallelism)."""
    return mesh["pp"].get_group() if dims.pp > 1 else None


def pp_rank(mesh: DeviceMesh | None, dims: ParallelDims) -> int:
    """This rank's pipeline coordinate (0 without pipeline parallelism)."""
    return mesh["pp"].get_local_rank() if dims.pp > 1 else 0


def _mode_dims(mode: str | None, shard_dim: str) -> tuple[str, ...]:
    return {
        "hybrid_shard": ("dp_replicate", shard_dim),
        "replicate": ("dp_replicate",),
        "fully_shard": (shard_dim,),
        None: (),
    }[mode]


def dp_mesh_dims(dims: ParallelDims) -> tuple[str, ...]:
    """Names of the mesh dims SimpleFSDP lays dense parameters over."""
    return _mode_dims(dims.fsdp_mode, DP_SHARD_CP if dims.cp > 1 else "dp_shard")


def expert_dp_mesh_dims(dims: ParallelDims) -> tuple[str, ...]:
    """Names of the mesh dims SimpleFSDP lays expert parameters over (besides ``ep``)."""
    return _mode_dims(dims.expert_fsdp_mode, "efsdp")


def dp_rank(mesh: DeviceMesh | None, dims: ParallelDims) -> int:
    """This rank's data-parallel index in [0, dp_size): replicate-major, then shard."""
    if mesh is None:
        return 0
    r = mesh["dp_replicate"].get_local_rank()
    s = mesh["dp_shard"].get_local_rank()
    return r * dims.dp_shard + s


def average_over_dp(value: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """Mean of a scalar over the data-parallel ranks (for logging the global loss).

    Ranks that differ only in tp (or pp, once the pipeline has shared the last stage's loss) hold
    the same value, and ranks that differ only in cp the mean over equal shares of the same tokens,
    so the mean over the whole world is the mean over data-parallel ranks.
    """
    if dims.world_size == 1:
        return value
    out = value.detach().clone()
    dist.all_reduce(out)
    return out / dims.world_size


def sum_of_routing_counts(value: torch.Tensor, dims: ParallelDims, mesh: DeviceMesh | None = None) -> torch.Tensor:
    """Sum of MoE routing counts over the ranks that routed different tokens: the data-parallel
    ranks, and the tp ranks when each routes its own piece of the sequence (``experts_span_tp``);
    otherwise ranks that differ only in tp routed the same tokens, so the sum over the ranks of this
    pipeline stage is divided by tp (exact for integer-valued counts). ``mesh`` is needed when
    pp > 1: each stage sums its own tensors."""
    if dims.world_size == 1 or dims.world_size == dims.pp:
        return value
    out = value.detach().clone()
    dist.all_reduce(out, group=mesh[STAGE_RANKS].get_group() if dims.pp > 1 else None)
    return out / dims.tp if dims.tp > 1 and not dims.experts_span_tp else out
