"""graph_trainer.torch_compat.pipelining: PyTorch's multi-stage schedules still compute their action
order from stand-in stages, in the form graph_trainer reads.

Fails loudly when a PyTorch upgrade changes ``pipeline_order``, ``_Action`` or the stage mapping."""

import pytest

from graph_trainer.torch_compat import schedule_compute_order


@pytest.mark.parametrize(
    "schedule, style, kinds, mapping",
    [
        ("Interleaved1F1B", "loop", {"F", "B"}, {0: 0, 1: 1, 2: 0, 3: 1}),
        ("ZBVZeroBubble", "v", {"F", "I", "W"}, {0: 0, 1: 1, 2: 1, 3: 0}),
    ],
)
def test_two_stages_per_rank_every_action_once(schedule, style, kinds, mapping):
    order, stage_to_rank = schedule_compute_order(schedule, 2, 2, 4, style)
    assert stage_to_rank == mapping
    assert sorted(order) == [0, 1]
    for rank, actions in order.items():
        assert {kind for kind, _, _ in actions} == kinds
        assert len(set(actions)) == len(actions)
        assert {stage for _, stage, _ in actions} == {s for s, r in mapping.items() if r == rank}
        expected = {
            (kind, stage, mb) for kind in kinds for stage in (1, 2, 0, 3) if mapping[stage] == rank for mb in range(4)
        }
        assert set(actions) == expected


def test_an_unknown_schedule_is_pytorchs_error():
    with pytest.raises(ValueError):
        schedule_compute_order("NoSuchSchedule", 2, 2, 4, "loop")
