"""``checkpoint.async_mode async`` (graph_trainer/checkpoint/checkpointer.py, background.py): a
background save writes what a blocking one writes, holds the state as ``save`` saw it however the
training changes it meanwhile, reports its failure as the blocking save does, and a kill before
it is sealed leaves the previous checkpoint the one a restart resumes, losing nothing. A job that
ends while a save is in flight (a one-line error, SIGTERM, its last step) waits a bounded time for
it to be sealed; a save waits for the one before it."""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time

import pytest
import torch

from graph_trainer.checkpoint import manifest
from graph_trainer.checkpoint.checkpointer import complete_steps
from graph_trainer.errors import JobError
from tests.conftest import ROOT
from tests.launch import read_losses, run_forked
from tests.reliability.helpers import EAGER, error_lines, make_trainer

ASYNC = ["--checkpoint.async_mode", "async"]
FOUR_STEPS = ["--training.steps", "4", "--checkpoint.interval", "2"]


def _hashes(step_dir) -> dict[str, str]:
    """SHA-256 of every file of a checkpoint, as its manifest records them."""
    files = json.loads((step_dir / "manifest.json").read_text())["files"]
    return {name: entry["sha256"] for name, entry in files.items()}


@pytest.fixture(scope="module")
def blocking(tmp_path_factory):
    folder = tmp_path_factory.mktemp("blocking")
    return folder, make_trainer(folder, *FOUR_STEPS).train()


def test_a_background_save_writes_what_a_blocking_save_writes(tmp_path, blocking):
    folder, losses = blocking
    trainer = make_trainer(tmp_path, *FOUR_STEPS, *ASYNC)
    assert trainer.train() == losses
    assert complete_steps(str(tmp_path / "checkpoint")) == [2, 4]
    for step in (2, 4):  # tensors, RNG states, train state, metadata and DCP's index, byte for byte
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


ENDED = os.path.join(ROOT, "tests", "faults", "ended_during_background_save.py")


def _ended_during_the_save_of_step_1(tmp_path, nproc: int, end_by: str, *flags: str):
    """``train.py`` saving every step in the background, ended while step 1's save is in flight
    (``tests/faults/ended_during_background_save.py``)."""
    args = [*EAGER, "--job.dump_folder", str(tmp_path), "--training.steps", "3", "--checkpoint.interval", "1"]
    return run_forked(nproc, ENDED, *args, *ASYNC, *flags, check=False, env={"SEAL_STEP": "1", "END_BY": end_by})


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_one_line_error_waits_for_the_save_in_flight_and_seals_it(tmp_path, nproc):
    # step 2's loss is taken as NaN: the job stops with one line while step 1 is still being saved
    result = _ended_during_the_save_of_step_1(tmp_path, nproc, "failure")
    assert result.returncode == 1, result.stderr[-3000:]
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and errors[0].startswith("error: step 2: non-finite"), result.stderr[-3000:]
    assert "waiting up to 1800s for checkpoint" in result.stderr
    root = tmp_path / "checkpoint"
    assert complete_steps(str(root)) == [1] and os.listdir(root) == ["step-1"]


def test_sigterm_waits_for_the_save_in_flight_and_seals_it(tmp_path):
    result = _ended_during_the_save_of_step_1(tmp_path, 1, "SIGTERM")
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-3000:]
    assert error_lines(result.stderr) == ["error: stopped by SIGTERM"], result.stderr[-3000:]
    root = tmp_path / "checkpoint"
    assert complete_steps(str(root)) == [1] and os.listdir(root) == ["step-1"]


def test_a_save_not_sealed_in_time_at_the_end_is_one_job_error_and_never_a_checkpoint(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, "--training.steps", "2", "--checkpoint.interval", "1", *ASYNC)
    trainer.cfg.checkpoint.finish_timeout_seconds = 0.2
    release, write = threading.Event(), manifest.write

    def held(folder, data):  # the storage stalls while step 2 is sealed
        if os.path.basename(folder).startswith("step-2.tmp-"):
            release.wait(60)
        write(folder, data)

    monkeypatch.setattr(manifest, "write", held)
    with pytest.raises(JobError, match=r"^checkpoint .*step-2 was not sealed within checkpoint\.finish_timeout_"):
        trainer.train()
    assert trainer.checkpointer.pending is None  # given up: nothing waits for it again
    assert complete_steps(str(tmp_path / "checkpoint")) == [1]
    release.set()  # (this process goes on; a job's process would end here, the save with it)
    for thread in threading.enumerate():
        if thread.name.startswith("checkpoint "):
            thread.join()


def test_a_save_waits_for_the_previous_one_before_it_starts(tmp_path, monkeypatch):
    import graph_trainer.checkpoint.checkpointer as checkpointer

    write, start, root = manifest.write, checkpointer.start_saving_tensors, tmp_path / "checkpoint"
    started: list[list[int]] = []  # the complete checkpoints when each save starts writing tensors

    def slow(folder, data):
        if os.path.basename(folder).startswith("step-1.tmp-"):
            time.sleep(1.5)  # step 2 is trained meanwhile
        write(folder, data)

    def noting(*args, **kwargs):
        started.append(complete_steps(str(root)))
        return start(*args, **kwargs)

    monkeypatch.setattr(manifest, "write", slow)
    monkeypatch.setattr(checkpointer, "start_saving_tensors", noting)
    make_trainer(tmp_path, "--training.steps", "2", "--checkpoint.interval", "1", *ASYNC).train()
    assert started == [[], [1]]
