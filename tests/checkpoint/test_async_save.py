"""``checkpoint.async_mode async`` (graph_trainer/checkpoint/checkpointer.py, background.py): a
background save writes what a blocking one writes, holds the state as ``save`` saw it however the
training changes it meanwhile, reports its failure as the blocking save does, and a kill before
it is sealed leaves the previous checkpoint the one a restart resumes, losing nothing."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from graph_trainer.checkpoint import manifest
from graph_trainer.checkpoint.checkpointer import complete_steps
from graph_trainer.errors import JobError
from tests.conftest import ROOT
from tests.launch import read_losses, run_forked
from tests.reliability.helpers import EAGER, make_trainer

ASYNC = ["--checkpoint.async_mode", "async"]
FOUR_STEPS = ["--training.steps", "4", "--checkpoint.interval", "2"]


def _hashes(step_dir) -> dict[str, str]:
    """SHA-256 of every file of a checkpoint but DCP's index (``.metadata`` holds the temporary
    folder the save wrote into and a random save id: its own in every save)."""
    files = json.loads((step_dir / "manifest.json").read_text())["files"]
    return {name: entry["sha256"] for name, entry in files.items() if name != ".metadata"}


@pytest.fixture(scope="module")
def blocking(tmp_path_factory):
    folder = tmp_path_factory.mktemp("blocking")
    return folder, make_trainer(folder, *FOUR_STEPS).train()


def test_a_background_save_writes_what_a_blocking_save_writes(tmp_path, blocking):
    folder, losses = blocking
    trainer = make_trainer(tmp_path, *FOUR_STEPS, *ASYNC)
    assert trainer.train() == losses
    assert complete_steps(str(tmp_path / "checkpoint")) == [2, 4]
    for step in (2, 4):  # tensors, RNG states, train state and metadata, byte for byte
        assert _hashes(tmp_path / "checkpoint" / f"step-{step}") == _hashes(folder / "checkpoint" / f"step-{step}")


def test_a_background_save_holds_the_state_as_save_saw_it(tmp_path):
    trainer = make_trainer(tmp_path, "--training.steps", "1", "--checkpoint.interval", "1", *ASYNC)
    trainer.train()
    saved = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.checkpointer.save(1, trainer.model, trainer.optimizer, trainer.scheduler, trainer.dataloader)
    with torch.no_grad():  # training goes on while the files are written
        for p in trainer.model.parameters():
            p.add_(1.0)
    trainer.checkpointer.finish_pending()
    resumed = make_trainer(tmp_path, "--training.steps", "1", "--checkpoint.load_step", "1")
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, saved[name]), name


def test_a_failed_background_save_is_one_job_error_and_earlier_checkpoints_stay(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, "--training.steps", "4", "--checkpoint.interval", "2", *ASYNC)
    real_entry = manifest.file_entry

    def entry(path):  # the disk fills up while step-4 is hashed, on the background thread
        if "step-4.tmp-" in path:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_entry(path)

    monkeypatch.setattr(manifest, "file_entry", entry)
    with pytest.raises(JobError) as info:
        trainer.train()  # (raised where the job waits for its last save)
    root = tmp_path / "checkpoint"
    assert str(info.value).startswith(f"cannot save checkpoint {root / 'step-4'}: No space left on device")
    assert str(info.value).endswith("(earlier checkpoints are intact)")
    assert complete_steps(str(root)) == [2] and os.listdir(root) == ["step-2"]


def test_a_kill_during_a_background_save_resumes_from_the_previous_step_and_loses_nothing(tmp_path, blocking):
    _, losses = blocking
    script = os.path.join(ROOT, "tests", "faults", "killed_in_background_save.py")
    # a save every step: step 4 trains while step 3's save is being sealed, and is killed then;
    # the forked runs use this process's intra-op threads, as the in-process reference did (the
    # matmuls' sums, and so the losses, depend on the thread count)
    threads = ["--debug.num_threads", str(torch.get_num_threads())]
    flags = [
        *EAGER,
        *threads,
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "4",
        "--checkpoint.interval",
        "1",
    ]
    killed = run_forked(1, script, *flags, *ASYNC, check=False, env={"KILL_AT_STEP": "3"})
    assert killed.returncode != 0
    root = tmp_path / "checkpoint"
    assert complete_steps(str(root)) == [1, 2]
    assert [d for d in os.listdir(root) if d.startswith("step-3.tmp-")]  # written, never sealed
    run_forked(1, os.path.join(ROOT, "train.py"), *flags, *ASYNC)
    assert sorted(os.listdir(root)) == ["step-1", "step-2", "step-3", "step-4"]  # the leftover is gone
    assert [loss for _, loss in read_losses(tmp_path)] == losses
