"""Parallel degrees -> a named DeviceMesh, and the questions the trainer asks about it.

The world is laid out as a mesh with dims ``("dp_replicate", "dp_shard", "tp")`` (row-major,
so tp neighbours are adjacent ranks). Data-parallel ranks are the (dp_replicate, dp_shard)
coordinates; ranks that differ only in tp see the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1

    @classmethod
    def from_degrees(cls, degrees: dict[str, int]) -> "ParallelDims":
        return cls(**{k: degrees[k] for k in ("dp_replicate", "dp_shard", "tp", "ep")})

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_size(self) -> int:
        """Number of distinct batches per step (data-parallel ranks)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_mode(self) -> str | None:
        """SimpleFSDP mode for these degrees, or None without data parallelism."""
        if self.dp_replicate > 1 and self.dp_shard > 1:
            return "hybrid_shard"
        if self.dp_replicate > 1:
            return "replicate"
        if self.dp_shard > 1:
            return "fully_shard"
        return None

    def as_dict(self) -> dict[str, int]:
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp, "ep": self.ep}


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh | None:
    """The world mesh (None for a single process)."""
    if dims.world_size == 1:
        return None
    if not dist.is_initialized() or dist.get_world_size() != dims.world_size:
        raise RuntimeError(f"the process group must be initialised with {dims.world_size} ranks")
    return init_device_mesh(
        device_type,
        (dims.dp_replicate, dims.dp_shard, dims.tp),
        mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
    )


def dp_mesh_dims(dims: ParallelDims) -> tuple[str, ...]:
    """Names of the mesh dims SimpleFSDP lays parameters over."""
    mode = dims.fsdp_mode
    return {"hybrid_shard": ("dp_replicate", "dp_shard"), "replicate": ("dp_replicate",),
            "fully_shard": ("dp_shard",), None: ()}[mode]


def dp_rank(mesh: DeviceMesh | None, dims: ParallelDims) -> int:
    """This rank's data-parallel index in [0, dp_size): replicate-major, then shard."""
    if mesh is None:
        return 0
    r = mesh["dp_replicate"].get_local_rank()
    s = mesh["dp_shard"].get_local_rank()
    return r * dims.dp_shard + s


def average_over_dp(value: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """Mean of a scalar over the data-parallel ranks (for logging the global loss).

    Ranks that differ only in tp hold the same value, so the mean over the whole world is
    the mean over data-parallel ranks.
    """
    if dims.world_size == 1:
        return value
    out = value.detach().clone()
    dist.all_reduce(out)
    return out / dims.world_size
