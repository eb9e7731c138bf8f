"""Optimizer, learning-rate schedule and gradient clipping.

The same code runs after the traced step and after the eager step, so graph and eager
runs differ only in how the gradients were computed. A warmup longer than the job
(``training.warmup_steps`` > ``training.steps``) is cut to the job's steps, with one warning when
the schedule is built.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict

import torch
import torch.distributed
from torch.distributed.tensor import DTensor, Partial, Replicate

from graph_trainer.config import Training
from graph_trainer.distributed.parallel_dims import local_tensor

logger = logging.getLogger("graph_trainer")


def build_optimizer(params: list[torch.nn.Parameter], t: Training) -> torch.optim.AdamW:
    """AdamW with the job's hyper-parameters.

    On CUDA the multi-tensor (``foreach``) implementation: a handful of kernels over all
    parameters instead of ~10 per parameter (the single-tensor loop was a large share of an
    8B-shaped step on an H100; measured: docs/performance.md, profiles in docs/h100_profiles/).
    On CPU the single-tensor one: the stored loss curves were recorded with it, and launch
    overhead does not matter there. Graph and eager mode build it the same way, so they stay
    bitwise."""
    cuda = bool(params) and params[0].device.type == "cuda"
    return torch.optim.AdamW(
        params,
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
        weight_decay=t.weight_decay,
        foreach=cuda,
    )


def lr_phases(t: Training) -> tuple[int, int, int]:
    """(warmup, stable, decay) step counts of the schedule, as torchtitan 0.3.0 counts them: the
    stable phase holds one step more than the steps left between warmup and decay."""
    warmup = min(t.warmup_steps, t.steps)
    decay = min(round(t.steps * t.decay_ratio), t.steps - warmup)
    return warmup, t.steps + 1 - warmup - decay, decay


def lr_multiplier(step: int, t: Training) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based count of steps taken).

    Linear warmup ((step + 1) / warmup), the peak while stable, then ``decay_type`` from 1 towards
    ``min_lr_ratio`` over the decay steps. The same arithmetic as torchtitan's
    ``linear_warmup_stable_decay``, so the values are equal bit for bit (tests/loop/test_optim.py).
    A step past ``training.steps`` (code stepping beyond the job, as a benchmark) keeps the value the
    decay ends at (1 with no decay steps)."""
    warmup, stable, decay = lr_phases(t)
    if step < warmup:
        return float((step + 1) / warmup)
    if step < warmup + stable or t.decay_type == "constant" or decay == 0:
        return 1.0
    progress = min(float(step + 1 - (warmup + stable)) / decay, 1.0)
    if t.decay_type == "linear":
        remaining = 1 - progress
    elif t.decay_type == "sqrt":
        remaining = 1 - math.sqrt(progress)
    else:  # cosine
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * remaining


LR_PLAN = ("lr", "steps", "warmup_steps", "decay_ratio", "decay_type", "min_lr_ratio")
"""The ``training`` fields the learning rate of a step depends on (checkpoints record them)."""


def lr_plan(t: Training) -> dict[str, object]:
    return {name: getattr(t, name) for name in LR_PLAN}


def lr_replan(saved: dict[str, object], t: Training, step: int) -> str | None:
    """What changes when a run saved after ``step`` under the plan ``saved`` resumes with ``t``
    (None: nothing, or nothing trained yet: a step-0 conversion plans no schedule): the fields
    that differ, the next step's lr, and the last step's under both; or, for a checkpoint that
    records no plan (``saved`` empty), that the schedule from here is this build's."""
    if not saved and step > 0:  # written before checkpoints recorded their plan
        return (
            f"the checkpoint records no LR schedule (it predates them): from step {step + 1} the lr "
            f"follows this build's schedule of this run's settings, {t.lr * lr_multiplier(step, t):.4e} next"
        )
    changed = {k: (saved[k], v) for k, v in lr_plan(t).items() if k in saved and saved[k] != v}
    if not changed or step == 0:
        return None
    before = dataclasses.replace(t, **{k: old for k, (old, _) in changed.items()})
    fields = ", ".join(f"training.{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
    last_before, last_now = before.lr * lr_multiplier(step - 1, before), t.lr * lr_multiplier(step - 1, t)
    return (
        f"the LR schedule's settings differ from the checkpoint's ({fields}): re-planned from step "
        f"{step + 1}, which trains at lr {t.lr * lr_multiplier(step, t):.4e}; step {step} trained at "
        f"{last_before:.4e} (under the new settings: {last_now:.4e})"
    )


def build_lr_scheduler(optimizer: torch.optim.Optimizer, t: Training) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule of ``lr_multiplier``; a warning when its warmup is cut to ``training.steps``."""
    if t.warmup_steps > t.steps > 0:
        logger.warning(
            "training.warmup_steps = %d is more than training.steps = %d: the warmup is cut to %d steps "
            "(the lr reaches its peak at the last step and does not decay)",
            *(t.warmup_steps, t.steps, t.steps),
        )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, t))


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Global sum of squared gradient entries, over every rank holding a piece.

    Plain tensors count as they are. DTensor gradients are grouped by (mesh, placements);
    each group's local sums are added, then reduced once over the mesh dimensions where the
    gradient is sharded (replicated dimensions already hold the full value).
    """
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        if isinstance(g, DTensor):
            groups[(g.device_mesh, tuple(g.placements))].append(g.to_local())
        else:
            total = total + g.detach().float().pow(2).sum()
    for (mesh, placements), locals_ in groups.items():
        if any(isinstance(p, Partial) for p in placements):
            raise RuntimeError(f"gradient with unreduced placement {placements}: reduce it before clipping")
        local_sum = sum(t.detach().float().pow(2).sum() for t in locals_)
        # Every non-replicated dim holds a different piece (Shard and _StridedShard, which is
        # not a Shard subclass): the local sums add up over it.
        partial = [Replicate() if p.is_replicate() else Partial("sum") for p in placements]
        summed = DTensor.from_local(local_sum, mesh, partial, run_check=False).full_tensor()
        total = total + summed.to(total.device)
    return total


def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float, pp_group=None) -> torch.Tensor:
    """Scale gradients in place so their global L2 norm is at most ``max_norm`` (0: no clipping).

    ``pp_group``: the pipeline's process group, whose ranks hold different parameters (their sums
    of squares add up). Returns the norm before clipping (a 0-d float32 tensor).
    """
    grads = [p.grad for p in params if p.grad is not None]
    squares = _sum_of_squares(grads)
    if pp_group is not None:
        torch.distributed.all_reduce(squares, group=pp_group)
    norm = squares.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            local = local_tensor(g)
            local.mul_(coef.to(local.device, local.dtype))
    return norm
