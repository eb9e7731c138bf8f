"""Distributed checkpointing: bitwise resume, resharding FSDP=2 -> FSDP=4, clear errors.

The multi-process jobs (gloo, via ``tests.launch.run_train``) are shared through module-scoped
fixtures so the file runs four short torchrun jobs in all.
"""

import json
import logging
import os
import re
import resource
import shutil
import subprocess
import sys

import pytest
import torch

from graph_trainer.checkpoint import manifest
from graph_trainer.checkpoint.checkpointer import Checkpointer, complete_steps
from graph_trainer.config_loading import load_config
from graph_trainer.errors import ConfigError
from graph_trainer.trainer import Trainer
from graph_trainer.validation import validate_config
from tests.conftest import ROOT
from tests.launch import FAST_ARGS, read_losses, run_torchrun, run_train

# ------------------------------------------------------------------ multi-process jobs (graph mode)


# Two data shards: each rank tokenizes only its own documents, so a save gathers every shard's
# position from the ranks, and the resumes below read on at other data-parallel degrees.
SHARDS = ("--training.dataset_shards", "2")


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """FSDP=2, 10 steps, saving at steps 5 and 10: the reference, and the step-5 checkpoint."""
    folder = tmp_path_factory.mktemp("straight")
    run_train(2, folder, "--training.steps", "10", "--checkpoint.interval", "5", *SHARDS)
    return folder


@pytest.fixture(scope="module")
def straight(straight_run):
    """The reference losses of 10 uninterrupted steps."""
    return read_losses(straight_run)


@pytest.fixture(scope="module")
def first_half(straight_run, tmp_path_factory):
    """What the same job stopped after step 5 leaves: its step-5 checkpoint and 5 lines of losses.txt.

    (Steps 1-5 use the same learning rates whether the job runs 5 or 10 steps: 4 warmup steps,
    then the decay starts at the peak.)"""
    folder = tmp_path_factory.mktemp("resumed")
    shutil.copytree(straight_run / "checkpoint" / "step-5", folder / "checkpoint" / "step-5")
    lines = (straight_run / "losses.txt").read_text().splitlines(keepends=True)
    (folder / "losses.txt").write_text("".join(lines[:5]))
    return folder


def test_resume_is_bitwise_identical_and_ignores_half_written_saves(straight, first_half):
    root = first_half / "checkpoint"
    assert complete_steps(str(root)) == [5]
    assert (root / "step-5" / "metadata.json").is_file() and (root / "step-5" / ".metadata").is_file()
    assert not [p for p in os.listdir(root) if ".tmp-" in p]  # the tmp folder was renamed
    # A crash during a later save leaves a tmp folder (rank 0 writes metadata.json before the
    # rename, so it may even hold one) and maybe a folder without metadata.json: neither is latest.
    shutil.copytree(root / "step-5", root / "step-7.tmp-0badc0de")
    (root / "step-8").mkdir()
    assert complete_steps(str(root)) == [5]

    result = run_train(2, first_half, "--training.steps", "10", "--checkpoint.interval", "5", *SHARDS)
    assert f"resuming from checkpoint {root / 'step-5'} (step 5)" in result.stderr
    losses = read_losses(first_half)
    assert [s for s, _ in losses] == list(range(1, 11))  # losses.txt was appended to
    assert [repr(v) for _, v in losses] == [repr(v) for _, v in straight]
    assert complete_steps(str(root)) == [5, 10]  # saved again at the (new) last step
    # The interrupted save's leftover was removed at the start (a whole checkpoint's size each).
    assert "removed step-7.tmp-0badc0de (an interrupted save)" in result.stderr
    assert not (root / "step-7.tmp-0badc0de").exists()


def test_manifest_lists_every_ranks_files(straight_run):
    # Rank 0 writes the manifest after every rank's files are in: both ranks' shards and RNG states.
    step = straight_run / "checkpoint" / "step-5"
    files = json.loads((step / "manifest.json").read_text())["files"]
    assert set(files) == {
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "rng-rank0.pt",
        "rng-rank1.pt",
        "metadata.json",
        "train_state.json",
    }
    assert manifest.verify_folder(str(step)) is None
    data = json.loads((step / "train_state.json").read_text())["dataloader"]
    assert data["shards"] == 2 and sorted(data["positions"]) == ["0", "1"]  # both ranks' shards


def test_fsdp2_checkpoint_resumes_at_fsdp4(tmp_path, straight, first_half):
    # Same global batch: 2 ranks x 2 sequences -> 4 ranks x 1 sequence (ranks 0, 1 read shard 0).
    assert FAST_ARGS[FAST_ARGS.index("--training.local_batch_size") + 1] == "2"
    result = run_train(
        4,
        tmp_path,
        "--training.steps",
        "10",
        "--training.local_batch_size",
        "1",
        "--checkpoint.folder",
        str(first_half / "checkpoint"),
        "--checkpoint.load_step",
        "5",
        "--checkpoint.interval",
        "0",
        *SHARDS,
    )
    assert "written by 2 ranks, this run has 4: RNG states not restored" in result.stderr
    losses = read_losses(tmp_path)
    assert [s for s, _ in losses] == list(range(6, 11))
    # Not bitwise in general: 4 ranks sum the gradients in another order than 2.
    for (step, got), (_, want) in zip(losses, straight[5:], strict=True):
        assert got == pytest.approx(want, rel=1e-4), step


def test_fsdp2_checkpoint_resumes_at_pp2xtp2_and_that_checkpoint_in_one_process(
    tmp_path, straight, first_half, straight_run
):
    """Across pp and tp both ways. FSDP=2's global batch of 4 (two rows of each data shard, one
    rank each) is 2 microbatches of 2 (a row of each shard) through PP=2 x TP=2 on 4 ranks: the
    same rows, their gradients summed in another grouping; TP's all-reduces sum partial products
    the one-process matmul sums in one, and the gradient norm adds the stages' sums of squares, so
    the bound is ACCUMULATION_RTOL's, not bitwise (docs/numerics.md, Pipeline parallel)."""
    from suites.cases import ACCUMULATION_RTOL

    # (a copy of step-5 alone: first_half's folder stays as the other tests leave it, step-10 included)
    checkpoints = tmp_path / "checkpoint"
    shutil.copytree(first_half / "checkpoint" / "step-5", checkpoints / "step-5")
    result = run_train(
        4,
        tmp_path,
        "--training.steps",
        "10",
        "--parallelism.pp",
        "2",
        "--parallelism.tp",
        "2",
        "--parallelism.pp_microbatches",
        "2",
        "--checkpoint.folder",
        str(checkpoints),
        "--checkpoint.load_step",
        "5",
        "--checkpoint.interval",
        "5",
        *SHARDS,
    )
    assert "loaded checkpoint" in result.stderr
    losses = read_losses(tmp_path)
    assert [s for s, _ in losses] == list(range(6, 11))
    for (step, got), (_, want) in zip(losses, straight[5:], strict=True):
        assert got == pytest.approx(want, rel=ACCUMULATION_RTOL), step
    # The step-10 checkpoint of PP=2 x TP=2 (each rank saved its tp shards of its stages) loads whole in one process.
    piped, plain = (
        _trainer(
            tmp_path / name,
            "--training.steps",
            "10",
            *SHARDS,
            "--checkpoint.folder",
            str(root),
            "--checkpoint.load_step",
            "10",
        )
        for name, root in (("piped", checkpoints), ("plain", straight_run / "checkpoint"))
    )
    for (name, a), b in zip(piped.model.named_parameters(), plain.model.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), name


def test_missing_step_is_one_line_error_under_torchrun(tmp_path, first_half):
    root = first_half / "checkpoint"
    flags = ["--job.dump_folder", str(tmp_path), "--checkpoint.folder", str(root), "--checkpoint.load_step", "7"]
    result = run_torchrun(2, os.path.join(ROOT, "train.py"), *FAST_ARGS, *flags, check=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    available = ", ".join(map(str, complete_steps(str(root))))  # 5, or 5, 10 after the resume test
    assert errors == [
        f"error: checkpoint.load_step = 7: no complete checkpoint step-7 in {root}; available steps: {available}"
    ], result.stderr
    # Root cause: rank 0 exited with train.py's code 2. Rank 1 exits 2 too unless torchrun's
    # teardown after rank 0's exit reaches it first (SIGTERM, -15): both orders occur.
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", result.stderr)
    root_cause = result.stderr.split("Root Cause")[-1]
    assert re.findall(r"exitcode\s*:\s*(-?\d+)", root_cause) == ["2"], result.stderr
    assert set(codes) <= {"2", "-15"}, result.stderr


def _limit_memory():
    # If the flavor check ever ran after building, an 8B model would fill the machine's memory;
    # with this cap the build fails quickly instead (and so does the test).
    resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))


def test_checkpoint_of_another_flavor_is_one_line_error(tmp_path, first_half):
    root = first_half / "checkpoint"
    latest = root / f"step-{complete_steps(str(root))[-1]}"
    cfg = load_config(["--model.flavor", "8B", "--checkpoint.folder", str(root)])
    with pytest.raises(ConfigError):  # the cheap check that must run before anything is built
        Checkpointer(cfg, 0, 1, {}, torch.device("cpu")).resolve_load_step()
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            *FAST_ARGS,
            "--job.dump_folder",
            str(tmp_path),
            "--model.flavor",
            "8B",
            "--checkpoint.folder",
            str(root),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        preexec_fn=_limit_memory,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT},
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"error: checkpoint {latest} holds model llama3 flavor "
        f"debugmodel but this run builds llama3 flavor 8B; use checkpoint.load_step = 0 or "
        f"another checkpoint.folder to start fresh"
    ], result.stderr


# ------------------------------------------------------------------ one process, in-process (eager mode)


def _trainer(folder, *args) -> Trainer:
    cfg = load_config([*FAST_ARGS, "--job.dump_folder", str(folder), "--compile.mode", "eager", *args])
    validate_config(cfg)
    return Trainer(cfg)


def test_eager_resume_bitwise_restores_adamw_steps_lr_and_trims_losses(tmp_path):
    straight = _trainer(tmp_path, "--training.steps", "4", "--checkpoint.interval", "2")
    straight_losses = straight.train()
    lr_after_2 = straight.cfg.training.lr * 0.75  # warmup 4: multiplier (2+1)/4 at optimizer step 2
    reference = (tmp_path / "losses.txt").read_text()
    assert complete_steps(str(tmp_path / "checkpoint")) == [2, 4]

    # Rewinding to step 2 abandons step-4: it is moved aside (refused without move_aside, see
    # tests/reliability/test_fresh_starts.py), so the folder never holds two runs.
    resumed = _trainer(
        tmp_path,
        "--training.steps",
        "4",
        "--checkpoint.interval",
        "2",
        "--checkpoint.load_step",
        "2",
        "--checkpoint.move_aside",
        "True",
    )
    assert resumed.step == 2
    # AdamW state existed before any step here, with the restored counts (bias correction).
    assert {float(s["step"]) for s in resumed.optimizer.state.values()} == {2.0}
    assert len(resumed.optimizer.state) == len(resumed.params)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(lr_after_2, rel=1e-12)
    assert resumed.scheduler.get_last_lr() == [resumed.optimizer.param_groups[0]["lr"]]
    losses = resumed.train()
    assert [repr(x) for x in losses] == [repr(x) for x in straight_losses[2:]]
    assert resumed.scheduler.state_dict() == straight.scheduler.state_dict()  # its step count too
    # The step-3/4 lines of the first run were dropped before appending, not duplicated.
    assert (tmp_path / "losses.txt").read_text() == reference
    assert complete_steps(str(tmp_path / "checkpoint")) == [2, 4]  # step-4 saved again by this run
    assert not [p for p in os.listdir(tmp_path / "checkpoint") if not p.startswith("step-") or "." in p]
    (aside,) = [p for p in os.listdir(tmp_path) if p.startswith("checkpoint.aside-")]
    assert sorted(os.listdir(tmp_path / aside)) == ["losses.txt", "step-4"]  # the abandoned step, kept
    assert (tmp_path / aside / "losses.txt").read_text() == reference
    for (n, a), b in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), n


def test_a_resume_with_other_lr_settings_says_what_changes(tmp_path, caplog):
    """Raising training.steps re-plans the decay: the resumed run says so, with the lr both ways."""
    warmup = ["--training.warmup_steps", "2", "--checkpoint.interval", "4"]
    _trainer(tmp_path, "--training.steps", "4", *warmup).train()
    log = logging.getLogger("graph_trainer")  # (it does not propagate to the root logger caplog watches)
    log.addHandler(caplog.handler)
    try:
        _trainer(tmp_path, "--training.steps", "8", *warmup)
    finally:
        log.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "LR schedule" in r.getMessage()]
    t = load_config(FAST_ARGS).training
    # warmup 2, 1 stable step, then linear decay towards min_lr_ratio: over 2 steps when training 4, 6 when 8
    lr = lambda remaining: t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * remaining)  # noqa: E731
    next_lr, last_lr, last_lr_now = lr(1 - 2 / 6), lr(1 - 1 / 2), lr(1 - 1 / 6)
    assert lines == [
        "resuming step-4: the LR schedule's settings differ from the checkpoint's (training.steps 4 -> 8): "
        f"re-planned from step 5, which trains at lr {next_lr:.4e}; step 4 trained at {last_lr:.4e} "
        f"(under the new settings: {last_lr_now:.4e})"
    ]


def test_resume_with_gradient_accumulation_continues_at_the_next_microbatch_bitwise(tmp_path):
    """A step takes all its microbatches before a save, so the saved data position is the next
    step's first microbatch: resuming repeats the straight run bitwise. A resume that takes the
    same global batch in other microbatches (local 4 x 2 instead of 2 x 4) reads the same tokens."""
    accumulate = ["--training.global_batch_size", "8", "--checkpoint.interval", "2"]  # local 2: 4 microbatches
    resume = ["--checkpoint.load_step", "2", "--checkpoint.move_aside", "True"]
    straight = _trainer(tmp_path, "--training.steps", "4", *accumulate)
    straight_losses = straight.train()
    assert straight.dataloader.state_dict()["step"] == 4 * 4  # microbatches read

    resumed = _trainer(tmp_path, "--training.steps", "4", *accumulate, *resume)
    position = resumed.dataloader.state_dict()
    assert position["step"] == 2 * 4
    assert [repr(x) for x in resumed.train()] == [repr(x) for x in straight_losses[2:]]
    for (n, a), b in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), n

    regrouped = _trainer(tmp_path, "--training.steps", "4", *accumulate, "--training.local_batch_size", "4", *resume)
    assert regrouped.microbatches == 2
    resumed.dataloader.load_state_dict(position)
    as_saved = torch.cat([next(resumed.dataloader)[0] for _ in range(4)])
    assert torch.equal(torch.cat([next(regrouped.dataloader)[0] for _ in range(2)]), as_saved)


def test_keep_latest_k_deletes_older_checkpoints_and_a_kept_one_resumes_bitwise(tmp_path, caplog):
    kept = ["--training.steps", "5", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2"]
    straight = _trainer(tmp_path, *kept)
    log = logging.getLogger("graph_trainer")  # (it does not propagate to caplog's root handler)
    log.addHandler(caplog.handler)
    try:
        straight_losses = straight.train()
    finally:
        log.removeHandler(caplog.handler)
    root = tmp_path / "checkpoint"
    assert sorted(os.listdir(root)) == ["step-4", "step-5"]
    deleted = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint.keep_latest_k")]
    assert deleted == [f"checkpoint.keep_latest_k 2: deleted step-{s}" for s in (1, 2, 3)]

    resumed = _trainer(tmp_path, *kept, "--checkpoint.load_step", "4", "--checkpoint.move_aside", "True")
    assert [repr(x) for x in resumed.train()] == [repr(straight_losses[4])]
    for (n, a), b in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), n
    assert sorted(os.listdir(root)) == ["step-4", "step-5"]


def test_keep_latest_k_never_deletes_the_step_just_saved(tmp_path):
    """Even when the folder holds later steps (a rewind that kept them: move_aside refuses that in a
    run, so the checkpointer is called directly here), the save just made stays."""
    trainer = _trainer(tmp_path, "--training.steps", "1", "--checkpoint.interval", "1")
    trainer.train()
    save = trainer.checkpointer.save
    for step in (7, 8):
        save(step, trainer.model, trainer.optimizer, trainer.scheduler, trainer.dataloader)
    trainer.cfg.checkpoint.keep_latest_k = 1
    save(3, trainer.model, trainer.optimizer, trainer.scheduler, trainer.dataloader)
    assert complete_steps(str(tmp_path / "checkpoint")) == [3, 8]


@pytest.fixture(scope="module")
def one_step_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("one_step")
    _trainer(folder, "--training.steps", "1", "--checkpoint.interval", "1").train()
    return folder / "checkpoint"


def test_shape_and_name_mismatch_in_metadata_names_the_parameters(tmp_path, one_step_checkpoint):
    root = tmp_path / "checkpoint"
    shutil.copytree(one_step_checkpoint, root)
    path = root / "step-1" / "metadata.json"
    meta = json.loads(path.read_text())
    meta["params"]["output.weight"] = [4096, 256]
    meta["params"]["layers.2.attention.wq.weight"] = meta["params"].pop("layers.1.attention.wq.weight")
    path.write_text(json.dumps(meta))
    manifest.seal(str(root / "step-1"))  # as if saved so: this is about shapes, not damage
    with pytest.raises(ConfigError) as info:
        _trainer(tmp_path, "--training.steps", "2")
    message = str(info.value)
    assert "\n" not in message
    assert "missing layers.1.attention.wq.weight" in message
    assert "unexpected layers.2.attention.wq.weight" in message
    assert "output.weight [4096, 256] vs [2048, 256]" in message


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_weights_only_checkpoint_names_the_missing_optimizer_state(tmp_path, one_step_checkpoint):
    # A checkpoint holding parameters but no AdamW state (e.g. exported weights) cannot resume
    # training: the DCP index check names what is missing before dcp.load is attempted.
    import torch.distributed.checkpoint as dcp

    step = tmp_path / "checkpoint" / "step-1"
    step.mkdir(parents=True)
    for name in ("metadata.json", "train_state.json", "rng-rank0.pt"):
        shutil.copy(one_step_checkpoint / "step-1" / name, step / name)
    source = _trainer(tmp_path / "fresh", "--training.steps", "1", "--checkpoint.load_step", "0")
    weights = {f"model.{n}": p.detach() for n, p in source.model.named_parameters()}
    dcp.save(weights, storage_writer=dcp.FileSystemWriter(str(step)), no_dist=True)
    manifest.seal(str(step))
    with pytest.raises(ConfigError, match=r"missing optim\.layers\.0\.attention\.wk\.weight\.exp_avg"):
        _trainer(tmp_path, "--training.steps", "2")


def test_load_step_zero_starts_fresh_and_interval_rule(tmp_path, one_step_checkpoint):
    shutil.copytree(one_step_checkpoint, tmp_path / "checkpoint")
    trainer = _trainer(
        tmp_path,
        "--training.steps",
        "3",
        "--checkpoint.load_step",
        "0",
        "--checkpoint.interval",
        "2",
        "--checkpoint.move_aside",
        "True",
    )
    assert trainer.step == 0 and not trainer.optimizer.state
    assert complete_steps(str(tmp_path / "checkpoint")) == []  # the earlier run's step-1 was moved aside
    assert [s for s in range(1, 4) if trainer.checkpointer.should_save(s, 3)] == [2, 3]
