"""The fixture the reliability tests share: one short run with a checkpoint at every step, made once
for the whole package (each test changes a copy of it: ``helpers.copy_job``)."""

import pytest

from tests.reliability.helpers import make_trainer


@pytest.fixture(scope="package")
def three_steps(tmp_path_factory):
    """An eager one-process run of 3 steps saving every step: step-1..3 and its losses.txt."""
    folder = tmp_path_factory.mktemp("three_steps")
    make_trainer(folder, "--training.steps", "3", "--checkpoint.interval", "1").train()
    return folder
