"""Pipeline schedules: which stage runs which action on which microbatch, in what order, per rank.

``plan_pipeline(schedule, pp, microbatches)`` gives every pipeline rank its list of compute
actions ``(kind, stage, microbatch)``: F (forward), B (full backward), I (backward of the stage's
input, dI) and W (backward of its weights, dW). The executor (``graph_trainer.pipelining.executor``)
adds the sends and receives between stages.

Where the order comes from:

- ``Interleaved1F1B`` (two stages per rank, stage s on rank s % pp) and ``ZBVZeroBubble`` (two
  stages per rank in a V: rank r holds stages r and 2 pp - 1 - r; backward split into I and W,
  W filling the bubbles) are PyTorch's schedules (``torch.distributed.pipelining``), read through
  ``torch_compat.schedule_compute_order``.
- ``1F1B`` (one stage per rank) is written here: PyTorch's ``Schedule1F1B`` runs its order in
  code and the order it exposes for inspection (``pipeline_order``) numbers the microbatches of
  later ranks from 1, so it cannot be executed as it stands. The order is the one that code runs:
  stage s first runs min(M, pp - s) forwards, then alternates one backward and one forward, then
  the remaining backwards.
- ``GPipe``: every forward, then every backward (the simplest; most activation memory).

Fails: an unknown schedule, too few blocks for the stages, or a microbatch count a schedule
refuses raise ``ValueError`` (``graph_trainer.validation`` turns them into one-line errors).
"""

from __future__ import annotations

from dataclasses import dataclass

from graph_trainer.torch_compat import schedule_compute_order

Action = tuple[str, int, int]
"""(kind, stage, microbatch): kind F, B, I or W."""


@dataclass(frozen=True)
class ScheduleSpec:
    stages_per_rank: int
    style: str
    """Stage-to-rank layout: "loop" (stage s on rank s % pp) or "v"."""
    source: str
    """"torch": PyTorch's schedule of that name; "ours": generated here (module docstring)."""


SCHEDULES: dict[str, ScheduleSpec] = {
    "GPipe": ScheduleSpec(1, "loop", "ours"),
    "1F1B": ScheduleSpec(1, "loop", "ours"),
    "Interleaved1F1B": ScheduleSpec(2, "loop", "torch"),
    "ZBVZeroBubble": ScheduleSpec(2, "v", "torch"),
}


@dataclass(frozen=True)
class PipelinePlan:
    """One step of a pipeline schedule: every rank's actions and where each stage lives."""

    schedule: str
    pp: int
    microbatches: int
    stage_to_rank: dict[int, int]
    actions: dict[int, list[Action]]

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def local_stages(self, rank: int) -> list[int]:
        """The stages ``rank`` holds, in stage order."""
        return [s for s in range(self.num_stages) if self.stage_to_rank[s] == rank]

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs backwards as dI and dW halves."""
        return any(kind in ("I", "W") for actions in self.actions.values() for kind, _, _ in actions)


def _gpipe(pp: int, m: int) -> dict[int, list[Action]]:
    return {s: [("F", s, i) for i in range(m)] + [("B", s, i) for i in range(m)] for s in range(pp)}


def _one_f_one_b(pp: int, m: int) -> dict[int, list[Action]]:
    order: dict[int, list[Action]] = {}
    for s in range(pp):
        warmup = min(m, pp - s)
        actions: list[Action] = [("F", s, i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [("B", s, i), ("F", s, warmup + i)]
        actions += [("B", s, i) for i in range(m - warmup, m)]
        order[s] = actions
    return order


def plan_pipeline(schedule: str, pp: int, microbatches: int) -> PipelinePlan:
    """The plan of ``schedule`` over ``pp`` ranks with ``microbatches`` per step (module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if pp < 2 or microbatches < 1:
        raise ValueError(f"a pipeline needs pp >= 2 and microbatches >= 1, got pp={pp}, microbatches={microbatches}")
    spec = SCHEDULES[schedule]
    if spec.source == "ours":
        actions = (_gpipe if schedule == "GPipe" else _one_f_one_b)(pp, microbatches)
        stage_to_rank = {s: s for s in range(pp)}
    else:
        actions, stage_to_rank = schedule_compute_order(schedule, pp, spec.stages_per_rank, microbatches, spec.style)
    return PipelinePlan(schedule, pp, microbatches, stage_to_rank, actions)


@dataclass(frozen=True)
class RankPipeline:
    """A job's pipeline as one rank sees it: the plan, every stage's blocks, this rank's place."""

    plan: PipelinePlan
    stage_blocks: list[range]
    """The transformer blocks of every stage, in stage order."""
    rank: int
    """This rank's pipeline coordinate."""
    block_costs: tuple[float, ...] = ()
    """Each block's cost (``models.common.block_costs``): what the stages were balanced by, and what
    makes two stages' graphs alike."""

    @property
    def local_stages(self) -> list[int]:
        return self.plan.local_stages(self.rank)

    @property
    def last_stage(self) -> int:
        return self.plan.num_stages - 1

    def rank_blocks(self) -> list[int]:
        """Every block this rank's stages hold."""
        return sorted(b for s in self.local_stages for b in self.stage_blocks[s])

    def holds_first(self) -> bool:
        return 0 in self.local_stages

    def holds_last(self) -> bool:
        return self.last_stage in self.local_stages


__all__ = ["SCHEDULES", "Action", "RankPipeline", "PipelinePlan", "ScheduleSpec", "plan_pipeline"]
