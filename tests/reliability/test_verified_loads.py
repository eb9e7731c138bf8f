"""Verified loads: every checkpoint is verified against its manifest before a load; a damaged one is
named in one line and set aside, and the newest one that verifies resumes, bitwise. Checkpoints
without a manifest load only once sealed."""

from __future__ import annotations

import os

import pytest

from graph_trainer.checkpoint.checkpointer import complete_steps
from graph_trainer.cli import manifest
from graph_trainer.errors import ConfigError
from tests.reliability.helpers import copy_job, logged_warnings, make_trainer, seal


def _flip(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        data = f.read(4)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes(b ^ 0xFF for b in data))


def _edit_a_hash(path):
    text = open(path).read()
    at = text.index('"sha256": "') + len('"sha256": "')
    open(path, "w").write(text[:at] + ("0" if text[at] != "0" else "1") + text[at + 1 :])


CORRUPTIONS = {
    "flip": ("__0_0.distcp", _flip),
    "truncate": ("__0_0.distcp", lambda p: os.truncate(p, os.path.getsize(p) // 2)),
    "empty": ("__0_0.distcp", lambda p: os.truncate(p, 0)),
    "missing": ("__0_0.distcp", os.remove),
    "metadata": (".metadata", _flip),
    "manifest": ("manifest.json", _edit_a_hash),
}


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corrupt_checkpoint_is_named_and_the_newest_good_one_resumes_bitwise(tmp_path, three_steps, kind):
    job = copy_job(three_steps, tmp_path)
    name, damage = CORRUPTIONS[kind]
    damage(job / "checkpoint" / "step-3" / name)
    with pytest.raises(ConfigError) as info:  # asked for exactly that step: one line naming the file
        make_trainer(job, "--training.steps", "3", "--checkpoint.load_step", "3")
    message = str(info.value)
    assert (
        "\n" not in message
        and message.startswith(f"checkpoint {job / 'checkpoint' / 'step-3'} fails verification: ")
        and name in message
    ), message
    reference = (job / "losses.txt").read_text()
    with logged_warnings() as warned:
        trainer = make_trainer(job, "--training.steps", "3", "--checkpoint.interval", "1")
    assert trainer.step == 2
    assert any(
        w.startswith(f"checkpoint {job / 'checkpoint' / 'step-3'} fails verification: ") and name in w for w in warned
    ), warned
    assert f"resuming from {job / 'checkpoint' / 'step-2'}, the newest checkpoint that verifies" in warned
    trainer.train()
    assert (job / "losses.txt").read_text() == reference  # step 3 again, bitwise: nothing corrupt was loaded
    assert complete_steps(str(job / "checkpoint")) == [1, 2, 3]
    assert [p for p in os.listdir(job / "checkpoint") if p.startswith("step-3.corrupt-")]  # kept, renamed


def test_no_checkpoint_that_verifies_is_refused_and_nothing_moves(tmp_path, three_steps):
    job = copy_job(three_steps, tmp_path)
    for step in (1, 2, 3):
        _flip(job / "checkpoint" / f"step-{step}" / "__0_0.distcp")
    with pytest.raises(ConfigError, match=r"^no checkpoint in .* verifies \(step-3: __0_0.distcp differs"):
        make_trainer(job, "--training.steps", "4")
    assert sorted(os.listdir(job / "checkpoint")) == ["step-1", "step-2", "step-3"]


def test_checkpoints_without_a_manifest_are_not_loaded_until_sealed(tmp_path, three_steps):
    # Saved before manifests existed (or by something else): they cannot be verified, so never loaded
    # unverified; sealing one you trust makes it loadable.
    job = copy_job(three_steps, tmp_path)
    for step in (1, 2, 3):
        os.remove(job / "checkpoint" / f"step-{step}" / "manifest.json")
    with pytest.raises(ConfigError, match=r"holds checkpoints without manifest.json \(step-1, step-2, step-3\)"):
        make_trainer(job, "--training.steps", "4")
    seal(job / "checkpoint" / "step-3")
    assert make_trainer(job, "--training.steps", "4").step == 3


def test_manifest_cli_verifies_and_seals(tmp_path, three_steps, capsys):

    job = copy_job(three_steps, tmp_path)
    step = str(job / "checkpoint" / "step-3")
    assert manifest.main(["verify", step]) == 0
    _flip(os.path.join(step, "__0_0.distcp"))
    assert manifest.main(["verify", step]) == 1
    assert "__0_0.distcp differs from what was saved" in capsys.readouterr().out
