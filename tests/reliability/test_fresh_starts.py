"""A folder describes one run: starting fresh, or from an earlier step, beside another run's
checkpoints is refused, or moves them aside with ``checkpoint.move_aside``."""

from __future__ import annotations

import os

import pytest

from graph_trainer.checkpoint.checkpointer import complete_steps
from graph_trainer.errors import ConfigError
from tests.launch import read_losses
from tests.reliability.helpers import copy_job, make_trainer


def test_fresh_start_beside_checkpoints_is_refused_or_moves_them_aside(tmp_path, three_steps):
    job = copy_job(three_steps, tmp_path)
    root = job / "checkpoint"
    fresh = (
        "--training.steps",
        "2",
        "--checkpoint.interval",
        "1",
        "--checkpoint.load_step",
        "0",
        "--training.seed",
        "7",
    )
    earlier_config = (job / "config.toml").read_text()
    with pytest.raises(ConfigError) as info:
        make_trainer(job, *fresh)
    assert (job / "config.toml").read_text() == earlier_config  # the refused run left the earlier run's
    assert str(info.value).startswith(
        f"checkpoint.load_step = 0 starts fresh, but {root} holds checkpoints "
        f"(step-1, step-2, step-3) of an earlier run"
    )
    with pytest.raises(
        ConfigError,
        match=r"^checkpoint.load_step = 1 continues step-1, but .* later steps "
        r"\(step-2, step-3\)",
    ):
        make_trainer(job, "--training.steps", "2", "--checkpoint.interval", "1", "--checkpoint.load_step", "1")
    assert complete_steps(str(root)) == [1, 2, 3]
    old_losses = (job / "losses.txt").read_text()

    make_trainer(job, *fresh, "--checkpoint.move_aside", "True").train()
    assert complete_steps(str(root)) == [1, 2]
    (aside,) = [job / p for p in os.listdir(job) if p.startswith("checkpoint.aside-")]
    assert sorted(os.listdir(aside)) == ["losses.txt", "step-1", "step-2", "step-3"]
    assert (aside / "losses.txt").read_text() == old_losses  # nothing lost
    new_losses = read_losses(job)
    assert [s for s, _ in new_losses] == [1, 2]  # losses.txt describes this run only
    assert new_losses[1][1] != float(old_losses.splitlines()[1].split()[1])
    # The next default run continues this run (step 2), not the old run's step 3.
    assert make_trainer(job, "--training.steps", "3", "--training.seed", "7").step == 2
