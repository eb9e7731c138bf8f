"""The optimizer step: what the trainer runs after the graph, costed on a device model.

After a step's graph (after its last microbatch, with gradient accumulation) the trainer clips
the gradients (``graph_trainer.loop.optim.clip_grad_norm_``) and steps AdamW (``torch.optim.AdamW``:
``foreach`` on CUDA, single-tensor on CPU, as ``loop.optim.build_optimizer`` makes it) on each
rank's parameter shards. Neither is in the traced graph; ``optimizer_step_cost`` costs them from
the kernels they run, so that a simulated step (``cli.analyze``, ``pipelining.timeline``) holds them.

Contract
--------
Reads: one rank's parameters as the optimizer holds them (plain tensors or DTensors, whose local
shard counts; fake, meta or real; element count and dtype: their gradients and AdamW's ``exp_avg``
/ ``exp_avg_sq`` have the same, as torch requires of ``p.grad`` and makes the state; a DTensor's
mesh and placements for ``norm_reduce_groups``), ``OptimizerSettings`` (foreach or single-tensor,
weight decay on, clipping on: ``training.weight_decay`` != 0, ``training.max_norm`` > 0), the
sizes of the process groups the squared norm is summed over (``norm_groups``), the device model.
Writes nothing.

Kernels (``adamw_kernels``, ``clip_kernels``), each streaming every parameter's elements once and
moving a fixed number of bytes per element (p: the parameter's element size):

- AdamW with decoupled weight decay, the same ops in torch's single-tensor and foreach code
  (``tests/analysis/test_optimizer_step.py`` records them): ``param *= 1 - lr wd`` (2p),
  ``exp_avg`` lerped towards the gradient (3p), ``exp_avg_sq *= beta2`` (2p), ``exp_avg_sq +=
  (1 - beta2) grad * grad`` (3p: the gradient read once for both operands), ``denom = sqrt(exp_avg_sq)``
  (2p), ``denom /= sqrt(bias correction 2)`` (2p), ``denom += eps`` (2p), ``param -= step *
  exp_avg / denom`` (4p): 20p per element. The bias corrections are host numbers (the step
  counters stay on the CPU, AdamW's default without ``capturable``): no kernel.
- Clipping, per gradient: a widening copy to fp32 when it is not fp32 (p + 4), its square (8),
  its sum (4), the sum added into the running total (one number); the total's all-reduce over
  each of ``norm_groups``; its square root, + 1e-6, reciprocal, times ``max_norm``, clamp (one
  number each); then per gradient the coefficient cast to its dtype when not fp32 (one number)
  and ``grad *= coefficient`` (2p). One fill of the total (one number) first.

Time: a kernel's bytes over all parameters at the HBM bandwidth times its class's efficiency
(``KernelEfficiency``: ``elementwise`` for the pointwise ops, whose operands are contiguous and of
one size; ``dtype_cast``; ``reduction``), as ``cost_model.node_compute_time`` costs the same ops in
a graph, plus ``launch_overhead`` per launch; a one-number op is one launch. Single-tensor: one
launch per kernel per parameter; foreach: as ATen's ``multi_tensor_apply`` launches
(``foreach_launches``). The all-reduce of the 4-byte total is ``cost_model.traffic_time``. Host
time (Python, the launches' CPU side) is not modelled: the device is taken as kept busy.

``norm_groups``: ``clip_grad_norm_`` sums each (mesh, placements) group of DTensor gradients over
the mesh dimensions where they are not replicated (one all-reduce per dimension, as DTensor's
``full_tensor`` reduces a ``Partial`` dimension by dimension), then over the pipeline group;
``norm_reduce_groups`` reads those sizes from the parameters (a gradient has its parameter's layout).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from graph_trainer.analysis.cost_model import (
    CollectiveTraffic,
    inter_node_share,
    placed_group,
    ring_factor,
    traffic_time,
)
from graph_trainer.analysis.devices import DeviceModel
from graph_trainer.distributed.parallel_dims import local_tensor

# ATen's aten/src/ATen/native/cuda/MultiTensorApply.cuh (PyTorch 2.11): a foreach kernel gives each
# CUDA block one chunk of kChunkSize = 65536 elements of one tensor, and with 32 KB kernel
# arguments (CUDA >= 12.1, driver >= 530, sm >= 70: an H100 under torch 2.11+cu130,
# DepthToMaxConfig<true>) one launch holds at most 2240 blocks and, for 1..5 tensor lists, 770, 448,
# 336, 252, 210 tensors (672, 448, 336, 252, 210 for ops taking a list of scalars).
FOREACH_CHUNK = 65536
FOREACH_MAX_BLOCKS = 2240
FOREACH_MAX_TENSORS = (770, 448, 336, 252, 210)
FOREACH_MAX_TENSORS_SCALAR_LIST = (672, 448, 336, 252, 210)


def foreach_launches(numels: Iterable[int], lists: int, scalar_list: bool = False) -> int:
    """Kernel launches of one foreach op over tensors of ``numels`` elements given as ``lists``
    tensor lists (``scalar_list``: with a list of scalars), as ``multi_tensor_apply`` counts them:
    blocks of one chunk are added tensor by tensor, chunk by chunk; a launch goes when the blocks
    reach their limit (the tensor then continues into the next launch) or when a tensor's last
    chunk fills the tensor limit; what remains at the end is one more. Empty tensors are skipped."""
    max_tensors = (FOREACH_MAX_TENSORS_SCALAR_LIST if scalar_list else FOREACH_MAX_TENSORS)[lists - 1]
    launches = blocks = tensors = 0
    for numel in numels:
        if numel == 0:
            continue
        tensors += 1
        chunks = -(-numel // FOREACH_CHUNK)
        while chunks:
            taken = min(chunks, FOREACH_MAX_BLOCKS - blocks)
            blocks, chunks = blocks + taken, chunks - taken
            if blocks == FOREACH_MAX_BLOCKS or (chunks == 0 and tensors == max_tensors):
                launches += 1
                blocks, tensors = 0, 0 if chunks == 0 else 1
    return launches + (blocks > 0)


@dataclass(frozen=True)
class OptimizerKernel:
    """One op over every parameter's elements (module docstring)."""

    op: str
    """The aten op of the single-tensor code (overload-free name), e.g. ``lerp_``."""
    foreach_op: str
    """The foreach op the same update runs as, ``name.overload``; '' when it has none (clipping)."""
    read: int
    """Bytes read per element of the parameter."""
    written: int
    """Bytes written per element."""
    kernel_class: str = "elementwise"
    """The ``KernelEfficiency`` field its bytes move at."""
    lists: int = 1
    """Tensor lists the foreach op hands ``multi_tensor_apply`` (its in- and outputs)."""
    scalar_list: bool = False
    """The foreach op takes a list of scalars (one per tensor)."""

    @property
    def bytes_per_element(self) -> int:
        return self.read + self.written


@dataclass(frozen=True)
class OptimizerSettings:
    """What decides which kernels an optimizer step runs."""

    foreach: bool = True
    """AdamW's multi-tensor update (``build_optimizer`` on CUDA); False: one parameter at a time."""
    weight_decay: bool = True
    """``training.weight_decay`` != 0: the parameters are decayed (one more kernel)."""
    clip: bool = True
    """``training.max_norm`` > 0: the gradients are scaled (the norm is computed either way)."""

    @classmethod
    def of(cls, training, foreach: bool) -> OptimizerSettings:
        """The settings of a job's ``Training`` section (None: its defaults) with ``foreach``."""
        if training is None:
            return cls(foreach)
        return cls(foreach, training.weight_decay != 0, training.max_norm > 0)


def adamw_kernels(itemsize: int, weight_decay: bool = True) -> list[OptimizerKernel]:
    """AdamW's kernels in the order torch runs them, for parameters of ``itemsize`` bytes."""
    p = itemsize
    kernels = [OptimizerKernel("mul_", "_foreach_mul_.Scalar", p, p)] if weight_decay else []
    return kernels + [
        OptimizerKernel("lerp_", "_foreach_lerp_.Scalar", 2 * p, p, lists=2),
        OptimizerKernel("mul_", "_foreach_mul_.Scalar", p, p),
        OptimizerKernel("addcmul_", "_foreach_addcmul_.Scalar", 2 * p, p, lists=3),
        OptimizerKernel("sqrt", "_foreach_sqrt.default", p, p, lists=2),
        OptimizerKernel("div", "_foreach_div_.ScalarList", p, p, scalar_list=True),
        OptimizerKernel("add_", "_foreach_add_.Scalar", p, p),
        OptimizerKernel("addcdiv_", "_foreach_addcdiv_.ScalarList", 3 * p, p, lists=3, scalar_list=True),
    ]


def clip_kernels(dtype: torch.dtype, clip: bool = True) -> tuple[list[OptimizerKernel], list[OptimizerKernel]]:
    """(The norm's kernels per gradient, the scaling's) for gradients of ``dtype``."""
    p = dtype.itemsize
    widen = [] if dtype == torch.float32 else [OptimizerKernel("_to_copy", "", p, 4, "dtype_cast")]
    norm = widen + [OptimizerKernel("pow", "", 4, 4), OptimizerKernel("sum", "", 4, 0, "reduction")]
    return norm, [OptimizerKernel("mul_", "", p, p)] if clip else []


def one_number_launches(dtype: torch.dtype, clip: bool = True) -> tuple[int, int]:
    """(Before the all-reduces, after them): the clip's one-number kernels per gradient of ``dtype``,
    the sum added into the total and, scaling a gradient that is not fp32, the coefficient's cast."""
    return 1, int(clip and dtype != torch.float32)


CLIP_ONE_NUMBER_OPS = (1, 5)
"""The clip's one-number kernels once per step, before the all-reduces (the total's fill) and
after them (square root, + 1e-6, reciprocal, times ``max_norm``, clamp)."""


@dataclass(frozen=True)
class OptimizerStepCost:
    """One rank's optimizer step on a device model, in the order it runs."""

    norm_seconds: float
    """The gradients' squares and sums, before the squared norm is all-reduced."""
    reduce_seconds: float
    """The squared norm's all-reduces (one fp32 number each)."""
    update_seconds: float
    """The clip coefficient, the gradients' scaling and the AdamW update."""

    @property
    def seconds(self) -> float:
        return self.norm_seconds + self.reduce_seconds + self.update_seconds


def _kernel_seconds(kernel: OptimizerKernel, elements: int, device: DeviceModel) -> float:
    """Seconds ``kernel`` moves its bytes over ``elements`` at its class's share of the bandwidth."""
    eff = device.kernel_efficiency
    share = device.bandwidth_efficiency if eff is None else getattr(eff, kernel.kernel_class)
    return elements * kernel.bytes_per_element / (device.hbm_bandwidth * share)


def _streaming_cost(
    kernels: list[OptimizerKernel], numels: list[int], device: DeviceModel, foreach: bool = False
) -> float:
    """Seconds of ``kernels`` over parameters of ``numels`` elements (one dtype), launches included."""
    seconds = 0.0
    for kernel in kernels:
        foreach_op = foreach and kernel.foreach_op
        launches = foreach_launches(numels, kernel.lists, kernel.scalar_list) if foreach_op else len(numels)
        seconds += _kernel_seconds(kernel, sum(numels), device) + launches * device.launch_overhead
    return seconds


def optimizer_step_cost(
    params: Sequence[torch.Tensor],
    device: DeviceModel,
    settings: OptimizerSettings = OptimizerSettings(),
    norm_groups: Sequence[int] = (),
    ranks_per_node: int = 8,
) -> OptimizerStepCost:
    """The clip and AdamW step over one rank's ``params`` on ``device`` (module docstring);
    ``norm_groups``: the sizes of the groups the squared norm is all-reduced over, in order
    (``norm_reduce_groups``); a group of more than ``ranks_per_node`` ranks spans nodes."""
    by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)  # (torch's foreach groups tensors by dtype)
    for p in map(local_tensor, params):
        if p.numel():
            by_dtype[p.dtype].append(p.numel())
    before, after = CLIP_ONE_NUMBER_OPS
    norm, update = before * device.launch_overhead, after * device.launch_overhead
    for dtype, numels in by_dtype.items():
        norm_kernels, scale_kernels = clip_kernels(dtype, settings.clip)
        adding, casting = one_number_launches(dtype, settings.clip)
        norm += _streaming_cost(norm_kernels, numels, device) + adding * len(numels) * device.launch_overhead
        update += _streaming_cost(scale_kernels, numels, device) + casting * len(numels) * device.launch_overhead
        update += _streaming_cost(
            adamw_kernels(dtype.itemsize, settings.weight_decay), numels, device, settings.foreach
        )
    reduce = sum(_norm_all_reduce(size, device, ranks_per_node) for size in norm_groups if size > 1)
    return OptimizerStepCost(norm, reduce, update)


def _norm_all_reduce(size: int, device: DeviceModel, ranks_per_node: int) -> float:
    """Seconds of one all-reduce of the 4-byte squared norm over ``size`` ranks."""
    group = placed_group(range(size), ranks_per_node)
    sent = ring_factor("all_reduce", size) * 4
    return traffic_time(
        CollectiveTraffic("all_reduce", size, sent, sent * inter_node_share("all_reduce", group)), device
    )


def norm_reduce_groups(params: Iterable[torch.Tensor], pp: int = 1) -> list[int]:
    """The sizes of the groups ``clip_grad_norm_`` all-reduces the squared norm over for these
    parameters (module docstring): for each distinct (mesh, placements) of the DTensors among them,
    each mesh dimension not replicated; then the pipeline group when ``pp`` > 1."""
    groups: dict[tuple, list[int]] = {}
    for p in params:
        mesh, placements = getattr(p, "device_mesh", None), getattr(p, "placements", None)
        if mesh is None or placements is None:
            continue  # a plain tensor: its sum is added as it is
        key = (tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), tuple(map(str, placements)))
        groups.setdefault(key, [mesh.size(d) for d, place in enumerate(placements) if not place.is_replicate()])
    return [size for sizes in groups.values() for size in sizes] + ([pp] if pp > 1 else [])


__all__ = [
    "FOREACH_CHUNK",
    "FOREACH_MAX_BLOCKS",
    "OptimizerKernel",
    "OptimizerSettings",
    "OptimizerStepCost",
    "adamw_kernels",
    "clip_kernels",
    "foreach_launches",
    "one_number_launches",
    "norm_reduce_groups",
    "optimizer_step_cost",
]
