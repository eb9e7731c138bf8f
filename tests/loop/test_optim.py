"""The learning-rate schedule (graph_trainer/loop/optim.py) against torchtitan 0.3.0's, value for value."""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import pytest
import torch

from graph_trainer.config import Training
from graph_trainer.loop.optim import build_lr_scheduler, lr_phases, lr_plan, lr_replan
from tests.reliability.helpers import logged_warnings

SETTINGS = list(
    itertools.product(
        (10, 37),  # steps
        (0, 3, 10),  # warmup_steps (10 of 10: warmup only)
        (1.0, 0.3),  # decay_ratio (1.0: torchtitan's None)
        ("linear", "sqrt", "cosine"),
        (0.0, 0.1),  # min_lr_ratio
    )
)


def _torchtitan_lrs(steps, warmup, ratio, decay_type, min_ratio) -> list[float]:
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    config = LRSchedulersContainer.Config(
        warmup_steps=warmup,
        decay_ratio=None if ratio == 1.0 else ratio,
        decay_type=decay_type,
        min_lr_factor=min_ratio,
    )
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (its notes on clamped warmup and decay steps)
        (scheduler,) = list(config.build(optimizers=[optimizer], training_steps=steps))
    return _walk(scheduler, optimizer, steps)


def _walk(scheduler, optimizer, steps) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("steps, warmup, ratio, decay_type, min_ratio", SETTINGS)
def test_every_step_has_torchtitans_lr(steps, warmup, ratio, decay_type, min_ratio):
    t = dataclasses.replace(
        Training(), lr=1.0, steps=steps, warmup_steps=warmup, decay_ratio=ratio, decay_type=decay_type
    )
    t = dataclasses.replace(t, min_lr_ratio=min_ratio)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ours = _walk(build_lr_scheduler(optimizer, t), optimizer, steps)
    assert ours == _torchtitan_lrs(steps, warmup, ratio, decay_type, min_ratio)  # bit for bit


@pytest.mark.parametrize("steps, warmup, ratio, decay_type, min_ratio", SETTINGS)
def test_steps_past_the_job_keep_the_value_the_decay_ends_at(steps, warmup, ratio, decay_type, min_ratio):
    """A scheduler stepped beyond ``training.steps`` (a benchmark's extra steps) neither divides by
    zero (no decay steps) nor turns back up or below the floor: the decay's end, min_lr_ratio (1
    when the job has no decay steps)."""
    t = dataclasses.replace(
        Training(), lr=1.0, steps=steps, warmup_steps=warmup, decay_ratio=ratio, decay_type=decay_type
    )
    t = dataclasses.replace(t, min_lr_ratio=min_ratio)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    past = _walk(build_lr_scheduler(optimizer, t), optimizer, steps + 5)[steps:]
    end = min_ratio if lr_phases(t)[2] else 1.0
    assert past == pytest.approx([end] * 5, abs=1e-12)


def test_warmup_stable_decay_phases():
    t = dataclasses.replace(Training(), steps=100, warmup_steps=10, decay_ratio=0.2)
    assert lr_phases(t) == (10, 71, 20)  # 70 stable steps, counted as torchtitan counts them (+1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    lrs = _walk(build_lr_scheduler(optimizer, dataclasses.replace(t, lr=1.0)), optimizer, 100)
    assert lrs[9] == 1.0 and set(lrs[10:81]) == {1.0} and lrs[81] == 1 - 1 / 20 and lrs[99] == 1 - 19 / 20


def test_constant_keeps_the_peak_after_warmup():
    t = dataclasses.replace(Training(), lr=1.0, steps=20, warmup_steps=4, decay_type="constant")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    assert _walk(build_lr_scheduler(optimizer, t), optimizer, 20) == [0.25, 0.5, 0.75] + [1.0] * 17


def test_a_warmup_longer_than_the_job_is_cut_with_one_warning():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    for warmup, steps, expected in ((100, 3, 1), (3, 3, 0), (2, 3, 0)):
        t = dataclasses.replace(Training(), lr=1.0, steps=steps, warmup_steps=warmup)
        with logged_warnings() as warned:
            lrs = _walk(build_lr_scheduler(optimizer, t), optimizer, steps)
        assert len(warned) == expected, warned
        if expected:
            assert lrs == [1 / 3, 2 / 3, 1.0]  # cut to the 3 steps
            assert warned == [
                "training.warmup_steps = 100 is more than training.steps = 3: the warmup is cut to 3 steps "
                "(the lr reaches its peak at the last step and does not decay)"
            ]


def test_a_replan_is_reported_after_a_trained_step_only():
    t = dataclasses.replace(Training(), steps=40, warmup_steps=4)
    saved = lr_plan(dataclasses.replace(t, steps=0))  # a converted step-0: nothing trained yet
    assert lr_replan(saved, t, 0) is None
    assert lr_replan(lr_plan(t), t, 12) is None  # the same settings
    line = lr_replan(lr_plan(dataclasses.replace(t, steps=20)), t, 12)
    assert line.startswith("the LR schedule's settings differ from the checkpoint's (training.steps 20 -> 40)")
    # A checkpoint older than the plan record cannot say what schedule it trained under: said so.
    older = lr_replan({}, t, 12)
    assert older.startswith("the checkpoint records no LR schedule (it predates them): from step 13")
    assert older.endswith(f"{t.lr * (1 - (12 - 4) / 36):.4e} next")  # linear decay from the peak over 36 steps
