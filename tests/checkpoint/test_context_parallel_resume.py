"""A context-parallel job's checkpoint resumes on FSDP, and an FSDP job's on context parallel: real
2-process gloo jobs of the debug LLaMA-3 cut to 2 blocks, 4 steps, against the same 4 steps run
straight. cp2 (dp_shard 1, 2 sequences a rank, both ranks the same rows) and fsdp2 (dp_shard 2, a
sequence a rank) train the same global batch of 2 sequences a step, so each step of either layout
is the same step to float rounding: the bound is ``CLOSE_RTOL``, the cpu suite's for context
parallel against one process.

What it holds. The losses of steps 3 and 4 after the resume show the weights, AdamW's state, the
learning-rate schedule and the data position came back. They do not show the gradients' scale:
AdamW's update divides it out (and clipping to ``max_norm`` with it), so a gradient twice too
large under one layout leaves the losses as they are. The gradient norms before clipping
(``metrics.jsonl``) do show it, and are held to the same bound.

Each straight run trains 4 steps and saves at step 2 (the resumes start from that checkpoint): a
job of 2 steps would cut the 4 warmup steps to 2 and train its steps at other learning rates.
"""

import json
import shutil

import pytest

from suites.cases import CLOSE_RTOL
from tests.launch import FAST_ARGS, read_losses, run_train

STEPS = ["--training.steps", "4", "--metrics.log_freq", "1", "--metrics.json_lines", "True"]
FSDP2 = ["--parallelism.dp_shard", "2", "--training.local_batch_size", "1"]
CP2 = ["--parallelism.cp", "2", "--parallelism.dp_shard", "1", "--training.local_batch_size", "2"]


def _grad_norms(folder) -> list[tuple[int, float]]:
    """The ``(step, grad_norm)`` pairs of ``metrics.jsonl`` (every step: ``log_freq`` 1)."""
    records = map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["grad_norm"]) for r in records if "step" in r]


def _straight(tmp_path_factory, name: str, layout: list[str]):
    folder = tmp_path_factory.mktemp(name)
    run_train(2, folder, *STEPS, "--checkpoint.interval", "2", *layout)
    return folder


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    """fsdp2, 4 steps, saving at steps 2 and 4: the reference, and the checkpoint cp2 resumes."""
    assert "--training.seq_len" in FAST_ARGS  # 64 tokens: 4 chunks of 16 under cp2
    return _straight(tmp_path_factory, "fsdp2", FSDP2)


@pytest.fixture(scope="module")
def cp2_run(tmp_path_factory):
    """cp2, 4 steps, saving at steps 2 and 4: the checkpoint fsdp2 resumes."""
    return _straight(tmp_path_factory, "cp2", CP2)


def _resume(folder, saved, layout: list[str]) -> str:
    """Steps 3 and 4 on ``layout`` from ``saved``'s step-2 checkpoint, in ``folder``: its stderr."""
    shutil.copytree(saved / "checkpoint" / "step-2", folder / "checkpoint" / "step-2")
    result = run_train(2, folder, *STEPS, "--checkpoint.load_step", "2", "--checkpoint.interval", "0", *layout)
    return result.stderr


def _assert_close(got: list[tuple[int, float]], want: list[tuple[int, float]], what: str) -> None:
    assert [s for s, _ in got] == [s for s, _ in want], what
    for (step, a), (_, b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, rel=CLOSE_RTOL), (what, step)


def test_cp2_trains_the_steps_fsdp2_trains(fsdp2_run, cp2_run):
    assert [s for s, _ in read_losses(fsdp2_run)] == [1, 2, 3, 4]
    _assert_close(read_losses(cp2_run), read_losses(fsdp2_run), "loss")
    _assert_close(_grad_norms(cp2_run), _grad_norms(fsdp2_run), "grad_norm")


@pytest.mark.parametrize(("saved_on", "resumed_on"), [("cp2", "fsdp2"), ("fsdp2", "cp2")])
def test_checkpoint_resumes_on_the_other_layout(tmp_path, fsdp2_run, cp2_run, saved_on, resumed_on):
    saved = {"cp2": cp2_run, "fsdp2": fsdp2_run}[saved_on]
    stderr = _resume(tmp_path, saved, {"cp2": CP2, "fsdp2": FSDP2}[resumed_on])
    assert f"resuming from checkpoint {tmp_path / 'checkpoint' / 'step-2'} (step 2)" in stderr
    _assert_close(read_losses(tmp_path), read_losses(fsdp2_run)[2:], "loss")
    _assert_close(_grad_norms(tmp_path), _grad_norms(fsdp2_run)[2:], "grad_norm")
    # the steps a resume from the wrong place would train differ from these by far more than the bound
    first, resumed = read_losses(fsdp2_run)[1][1], read_losses(tmp_path)[0][1]
    assert abs(resumed - first) > 100 * CLOSE_RTOL * first
