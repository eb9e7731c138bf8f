"""The finite-loss guard: non-finite hyper-parameters are refused; a non-finite loss or gradient norm
stops the job with one line naming the step and the first non-finite parameter or gradient, and no
non-finite state is ever checkpointed."""

from __future__ import annotations

import re

import pytest
import torch

from graph_trainer.checkpoint.checkpointer import complete_steps
from graph_trainer.config_loading import load_config
from graph_trainer.errors import ConfigError, NonFiniteError
from graph_trainer.loop.guards import check_step
from graph_trainer.validation import validate_config
from tests.launch import read_losses
from tests.reliability.helpers import EAGER, error_lines, saved_tensors_finite, train_py


@pytest.mark.parametrize(
    "field, value",
    [
        ("training.weight_decay", "inf"),
        ("training.eps", "inf"),
        ("training.lr", "nan"),
        ("training.beta2", "nan"),
        ("training.max_norm", "inf"),
        ("training.min_lr_ratio", "nan"),
        ("metrics.peak_tflops", "inf"),
        ("comm.timeout_seconds", "inf"),
    ],
)
def test_non_finite_hyper_parameters_are_rejected(field, value):
    with pytest.raises(ConfigError) as info:
        validate_config(load_config([f"--{field}", value]))
    assert str(info.value) == f"{field} = {float(value)} must be a finite number"


def test_check_step_names_the_step_and_the_first_non_finite_parameter():

    good = torch.nn.Parameter(torch.ones(3))
    bad = torch.nn.Parameter(torch.tensor([1.0, float("inf")]))
    named = [("layers.0.parametrizations.weight.original", good), ("layers.1.weight", bad)]
    check_step(7, 2.5, 1.0, named)  # finite: nothing happens
    with pytest.raises(NonFiniteError) as info:
        check_step(7, float("nan"), 1.0, named)
    assert str(info.value).startswith("step 7: non-finite loss nan; first non-finite parameter: layers.1.weight ")
    bad.data.fill_(1.0)
    good.grad = torch.tensor([0.0, float("nan"), 0.0])
    with pytest.raises(
        NonFiniteError,
        match=r"^step 8: non-finite gradient norm nan; first non-finite gradient: "
        r"layers\.0\.weight;",
    ):
        check_step(8, 2.5, float("nan"), named)


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to load in a single process")
def test_huge_learning_rate_stops_the_job_before_any_non_finite_checkpoint(tmp_path):
    result = train_py(
        *EAGER,
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "6",
        "--checkpoint.interval",
        "1",
        "--training.lr",
        "1e6",
    )
    assert result.returncode == 1, result.stderr
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and result.stderr.rstrip().endswith(errors[0]), result.stderr
    match = re.match(
        r"error: step (\d+): (non-finite (loss|gradient norm) .*; first non-finite (parameter|gradient): "
        r"\S+|the state to checkpoint is not finite)",
        errors[0],
    )
    assert match, errors[0]
    step = int(match.group(1))
    saved = complete_steps(str(tmp_path / "checkpoint"))
    assert saved == list(range(1, step)) or saved == list(range(1, step + 1))[:-1]
    assert all(saved_tensors_finite(tmp_path / "checkpoint" / f"step-{s}") for s in saved)
    losses = read_losses(tmp_path)
    assert [s for s, _ in losses] == list(range(1, step + (0 if "non-finite" in errors[0] else 1)))
    assert all(torch.isfinite(torch.tensor(v)) for _, v in losses)
