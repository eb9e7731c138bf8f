"""Interrupted saves: what they leave is cleaned at the next start, re-saving a step is atomic, an
interrupted deletion of old checkpoints leaves none half deleted, and ``losses.txt`` is trimmed
atomically."""

from __future__ import annotations

import builtins
import os
import shutil

import pytest
import torch

from graph_trainer.checkpoint.atomic_files import clean_leftovers, remove_steps, replace_dir, trim_step_lines
from graph_trainer.checkpoint.checkpointer import complete_steps
from graph_trainer.errors import JobError
from tests.reliability.helpers import copy_job, make_trainer


def test_leftovers_of_interrupted_saves_are_cleaned_at_the_next_start(tmp_path, three_steps):
    job = copy_job(three_steps, tmp_path)
    root = job / "checkpoint"
    shutil.copytree(root / "step-3", root / "step-4.tmp-0badc0de")  # a save killed before its rename
    os.rename(root / "step-3", root / "step-3.old-cafe0123")  # a replacement killed between its renames
    trainer = make_trainer(job, "--training.steps", "3")
    assert sorted(os.listdir(root)) == ["step-1", "step-2", "step-3"]
    assert trainer.step == 3


class _Killed(Exception):
    """The process dies here (raised by a patched file-system call)."""


def test_resaving_a_step_is_atomic(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, "--training.steps", "1", "--checkpoint.interval", "1")
    trainer.train()
    final = tmp_path / "checkpoint" / "step-1"
    renames = []
    real_rename = os.rename

    def rename(src, dst):  # the process is killed at the third rename of the run
        renames.append((src, dst))
        if len(renames) == 3:
            raise _Killed
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    for _ in range(2):  # save the same step again, twice: step-1 is never missing, and always complete
        trainer.checkpointer.save(1, trainer.model, trainer.optimizer, trainer.scheduler, trainer.dataloader)
        assert complete_steps(str(final.parent)) == [1]
    assert sorted(os.listdir(final.parent)) == ["step-1"]


def test_replace_dir_fallback_is_recovered_at_the_next_start(tmp_path, monkeypatch):

    root = tmp_path / "checkpoint"
    (root / "step-1").mkdir(parents=True)
    (root / "step-1" / "f").write_text("old")
    (root / "step-1.tmp-1234abcd").mkdir()
    (root / "step-1.tmp-1234abcd" / "f").write_text("new")
    real_rename = os.rename

    def rename(src, dst):
        real_rename(src, dst)
        if ".old-" in str(dst):
            raise _Killed("between the two renames")

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(_Killed):  # a file system without RENAME_EXCHANGE: two renames
        replace_dir(str(root / "step-1.tmp-1234abcd"), str(root / "step-1"), exchange=lambda a, b: False)
    monkeypatch.setattr(os, "rename", real_rename)
    assert not (root / "step-1").exists()
    done = clean_leftovers(str(root))
    assert sorted(os.listdir(root)) == ["step-1"] and (root / "step-1" / "f").read_text() == "old"
    assert any(d.startswith("restored step-1 from step-1.old-") for d in done)


def test_losses_are_trimmed_atomically(tmp_path, three_steps, monkeypatch):
    job = copy_job(three_steps, tmp_path)
    losses = str(job / "losses.txt")
    before = (job / "losses.txt").read_text()
    real_open = builtins.open

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, _):
            raise OSError(28, "No space left on device")

        writelines = write

    def open_(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FullDisk(f) if "w" in mode and str(path).startswith(str(job)) else f

    monkeypatch.setattr(builtins, "open", open_)
    with pytest.raises(OSError):
        trim_step_lines(losses, 1)
    monkeypatch.setattr(builtins, "open", real_open)
    assert (job / "losses.txt").read_text() == before  # the old file, whole
    assert sorted(p for p in os.listdir(job) if p.startswith("losses")) == ["losses.txt"]
    trim_step_lines(losses, 1)
    assert (job / "losses.txt").read_text() == before.splitlines(keepends=True)[0]


def test_an_interrupted_deletion_leaves_no_half_deleted_checkpoint(tmp_path, monkeypatch):
    """``checkpoint.keep_latest_k`` deletes with ``remove_steps``: killed while deleting, the old
    step is already no checkpoint, and the next start deletes what is left of it."""
    root = tmp_path / "checkpoint"
    for step in (1, 2):
        (root / f"step-{step}").mkdir(parents=True)
        (root / f"step-{step}" / "manifest.json").write_text("{}")
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        raise _Killed(f"while deleting {path}")

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(_Killed):
        remove_steps(str(root), ["step-1"])
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    assert complete_steps(str(root)) == [2]
    (leftover,) = [name for name in os.listdir(root) if name != "step-2"]
    assert leftover.startswith("step-1.removing-")
    assert clean_leftovers(str(root)) == [f"removed {leftover} (an old checkpoint whose removal was interrupted)"]
    assert sorted(os.listdir(root)) == ["step-2"]


@pytest.mark.parametrize("free_mib", [1, 4096])
def test_a_save_failing_on_a_full_disk_names_the_disk(tmp_path, monkeypatch, free_mib):
    """torch's zip writer reports a full disk only as a short file ("unexpected pos"): the error
    adds the disk's free space when it is nearly full, and only then."""
    trainer = make_trainer(tmp_path, "--training.steps", "2", "--checkpoint.interval", "1")
    real_save = torch.save

    def save(obj, f, *args, **kwargs):  # the disk fills while step 2's RNG state is written
        if "step-2" in getattr(f, "name", "") and "rng-rank" in f.name:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 40, 0, free_mib << 20))
    with pytest.raises(JobError) as info:
        trainer.train()
    root = tmp_path / "checkpoint"
    full = f"; the disk holding {root} has 1.0 MiB free: it is full" if free_mib == 1 else ""
    message = str(info.value)
    assert message.startswith(f"cannot save checkpoint {root / 'step-2'}: ") and "unexpected pos 704 vs 598" in message
    assert message.endswith(f"rng-rank0.pt){full} (earlier checkpoints are intact)")
    assert complete_steps(str(root)) == [1]
