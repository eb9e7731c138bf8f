"""The action order of ``torch.distributed.pipelining``'s multi-stage schedules.

PyTorch's schedule classes compute, in their constructor, the compute actions of every rank for
one step (``pipeline_order``: ``_Action(stage_index, computation_type, microbatch_index)``, None
for an idle slot). They take ``PipelineStage`` objects, which own a module and communication
buffers; the order itself reads only each stage's index, the number of stages and the pipeline
group's size and rank. ``schedule_compute_order`` builds the schedule over stand-in stages that
carry just those, and hands back the order in plain tuples. ``pipeline_order``, ``_Action`` and
``_ComputationType`` are private: a change fails ``tests/torch_compat/test_compat_pipelining.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch.nn as nn

from graph_trainer.torch_compat.versions import private_api

COMPUTE_KINDS = ("F", "B", "I", "W")
"""Action kinds: forward, full backward, backward of the input only (dI), of the weights only (dW)."""


def _stand_in_stage(index: int, num_stages: int, pp: int, rank: int) -> SimpleNamespace:
    return SimpleNamespace(
        stage_index=index,
        num_stages=num_stages,
        group_size=pp,
        group_rank=rank,
        is_first=index == 0,
        is_last=index == num_stages - 1,
        submod=nn.Module(),  # (read by a check that refuses torch.compile'd stages)
        stage_index_to_group_rank=None,
    )


def schedule_compute_order(
    schedule: str, pp: int, stages_per_rank: int, n_microbatches: int, style: str
) -> tuple[dict[int, list[tuple[str, int, int]]], dict[int, int]]:
    """(every pp rank's compute actions ``(kind, stage, microbatch)`` in order, stage -> pp rank)
    for ``torch.distributed.pipelining``'s schedule named ``schedule`` (``get_schedule_class``),
    ``style`` "loop" (stage s on rank s % pp) or "v" (rank r holds r and 2 pp - 1 - r). The
    schedule's own checks (e.g. too few microbatches) raise ``ValueError`` as PyTorch words them."""
    with private_api("torch.distributed.pipelining schedule pipeline_order"):
        from torch.distributed.pipelining import schedules
        from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

        num_stages = pp * stages_per_rank
        stage_to_rank = generate_stage_to_rank_mapping(pp, num_stages, style=style)
        local = [s for s in range(num_stages) if stage_to_rank[s] == 0]
        cls = schedules.get_schedule_class(schedule)
        order = cls([_stand_in_stage(s, num_stages, pp, 0) for s in local], n_microbatches).pipeline_order
        out: dict[int, list[tuple[str, int, int]]] = {}
        for rank, actions in order.items():
            out[rank] = []
            for action in actions:
                if action is None:
                    continue
                kind = action.computation_type.value
                if kind not in COMPUTE_KINDS or action.sub_actions is not None:
                    raise ValueError(f"schedule {schedule} has action {action}, which graph_trainer does not run")
                out[rank].append((kind, action.stage_index, action.microbatch_index))
    return out, dict(stage_to_rank)


__all__ = ["COMPUTE_KINDS", "schedule_compute_order"]
