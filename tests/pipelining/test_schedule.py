"""Pipeline plans: every stage runs every microbatch's forward and backward once, and the ranks,
each running its actions in order and waiting where a tensor from another stage is needed (as the
executor does), all finish: no schedule deadlocks."""

import pytest

from graph_trainer.pipelining.schedule import SCHEDULES, plan_pipeline


def _needs(kind, stage, mb, last):
    """What must have run before this action (the executor's receives, and the stage's own state)."""
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind in ("B", "I"):
        own = [("F", stage, mb)]
        later = [] if stage == last else [(("B", stage + 1, mb), ("I", stage + 1, mb))]
        return own + later
    return [("I", stage, mb)]  # W


def _run(plan):
    """Simulate the ranks; the order in which actions finished."""
    done, finished = set(), []
    position = dict.fromkeys(plan.actions, 0)
    last = plan.num_stages - 1
    while any(position[r] < len(plan.actions[r]) for r in plan.actions):
        progressed = False
        for rank, actions in plan.actions.items():
            while position[rank] < len(actions):
                action = actions[position[rank]]
                needs = _needs(*action, last)
                if not all((n in done) if isinstance(n[0], str) else any(m in done for m in n) for n in needs):
                    break
                done.add(action)
                finished.append(action)
                position[rank] += 1
                progressed = True
        assert progressed, (
            f"deadlock: ranks wait at {[plan.actions[r][position[r] : position[r] + 1] for r in plan.actions]}"
        )
    return finished


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("pp, microbatches", [(2, 1), (2, 4), (3, 5), (4, 8)])
def test_every_action_once_on_the_stages_rank_and_no_deadlock(schedule, pp, microbatches):
    plan = plan_pipeline(schedule, pp, microbatches)
    assert plan.num_stages == pp * SCHEDULES[schedule].stages_per_rank
    backward = {"I", "W"} if plan.splits_backward else {"B"}
    for rank, actions in plan.actions.items():
        assert all(plan.stage_to_rank[stage] == rank for _, stage, _ in actions)
        expected = {(k, s, m) for s in plan.local_stages(rank) for m in range(microbatches) for k in {"F", *backward}}
        assert sorted(actions) == sorted(expected)
    assert len(_run(plan)) == sum(len(a) for a in plan.actions.values())


def test_1f1b_warms_up_with_one_forward_per_later_stage():
    plan = plan_pipeline("1F1B", 3, 4)
    assert plan.actions[0] == [
        ("F", 0, 0),
        ("F", 0, 1),
        ("F", 0, 2),
        ("B", 0, 0),
        ("F", 0, 3),
        ("B", 0, 1),
        ("B", 0, 2),
        ("B", 0, 3),
    ]
    assert plan.actions[2] == [
        ("F", 2, 0),
        ("B", 2, 0),
        ("F", 2, 1),
        ("B", 2, 1),
        ("F", 2, 2),
        ("B", 2, 2),
        ("F", 2, 3),
        ("B", 2, 3),
    ]


def test_unknown_schedule_and_bad_degrees_are_refused():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'Nope'; choose one of GPipe, 1F1B"):
        plan_pipeline("Nope", 2, 4)
    with pytest.raises(ValueError, match="pp >= 2"):
        plan_pipeline("1F1B", 1, 4)
