"""One line, not a traceback: bad input, unwritable folders, a full disk and a non-finite loss end the
job with one ``error:`` line and its exit code, also under torchrun."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time

import pytest

from graph_trainer.checkpoint.checkpointer import complete_steps
from graph_trainer.errors import JobError
from tests.conftest import ROOT
from tests.launch import read_losses, run_torchrun
from tests.reliability.helpers import EAGER, error_lines, immutable, make_trainer, saved_tensors_finite, train_py


def _bad_input(case: str, tmp) -> tuple[list[str], str]:
    """(train.py arguments, expected start of the error line) for one bad input."""
    out = ["--job.dump_folder", str(tmp / "out")]
    a_file = tmp / "a_file"
    a_file.write_text("x")
    if case == "non_utf8_config":
        (tmp / "job.toml").write_bytes(b"[training]\nsteps = 3 # caf\xe9\n")
        return ["--job.config_file", str(tmp / "job.toml"), *out], f"error: {tmp / 'job.toml'} is not UTF-8 text"
    if case == "dump_folder_is_a_file":
        return [
            *EAGER,
            "--job.dump_folder",
            str(a_file),
        ], f"error: job.dump_folder = '{a_file}' is a file, not a folder"
    if case == "checkpoint_folder_is_a_file":
        return (
            [*EAGER, *out, "--checkpoint.folder", str(a_file), "--checkpoint.interval", "1"],
            f"error: checkpoint.folder = '{a_file}' is a file, not a folder",
        )
    if case == "graph_dump_folder_is_a_file":
        return (
            [*EAGER, *out, "--compile.dump_graphs", str(a_file)],
            f"error: compile.dump_graphs = '{a_file}' is a file, not a folder",
        )
    if case == "huge_num_threads":
        return [*EAGER, *out, "--debug.num_threads", "1000000000"], "error: debug.num_threads = 1000000000 is more than"
    if case == "huge_batch":
        return (
            [*EAGER, *out, "--training.local_batch_size", "1000000000"],
            "error: training.local_batch_size = 1000000000 with seq_len 64 needs at least",
        )
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "non_utf8_config",
        "dump_folder_is_a_file",
        "checkpoint_folder_is_a_file",
        "graph_dump_folder_is_a_file",
        "huge_num_threads",
        "huge_batch",
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, case):
    import train

    args, expected = _bad_input(case, tmp_path)
    assert train.main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), lines


def test_folder_that_is_not_writable_is_one_line_exit_2(tmp_path, capsys):
    import train

    locked = tmp_path / "locked"
    locked.mkdir()
    with immutable(locked):
        assert train.main([*EAGER, "--job.dump_folder", str(locked / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: cannot create job.dump_folder = '{locked / 'out'}': Operation not permitted"]


def test_read_only_checkpoint_folder_during_a_save_is_one_job_error(tmp_path):

    trainer = make_trainer(tmp_path, "--training.steps", "2", "--checkpoint.interval", "1")
    root = tmp_path / "checkpoint"
    root.mkdir(exist_ok=True)
    with immutable(root), pytest.raises(JobError) as info:
        trainer.train()
    message = str(info.value)
    assert "\n" not in message and message.startswith(
        f"cannot save checkpoint {root / 'step-1'}: Operation not permitted"
    ), message
    assert message.endswith("(earlier checkpoints are intact)")
    assert os.listdir(root) == [] and [s for s, _ in read_losses(tmp_path)] == [1]


def _small_files():
    # A full disk, as far as this process can tell: any file grows to 4 MiB at most (EFBIG, not SIGXFSZ).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))


def test_disk_full_during_a_save_is_one_line_exit_1_and_nothing_is_lost(tmp_path):
    result = train_py(
        *EAGER,
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "2",
        "--checkpoint.interval",
        "1",
        preexec_fn=_small_files,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    errors = error_lines(result.stderr)
    assert errors == [result.stderr.strip().splitlines()[-1]]
    assert errors[0].startswith(f"error: cannot save checkpoint {tmp_path / 'checkpoint' / 'step-1'}: File too large")
    assert os.listdir(tmp_path / "checkpoint") == []  # the half-written save is gone
    assert [s for s, _ in read_losses(tmp_path)] == [1]  # what the job did is kept


def _timed_stderr(cmd) -> tuple[list[tuple[float, str]], float, int]:
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT},
    )
    lines = [(time.monotonic(), line.rstrip("\n")) for line in proc.stderr]
    proc.wait(timeout=120)
    return lines, time.monotonic(), proc.returncode


def test_config_error_under_torchrun_is_the_first_line_and_the_reports_cause(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        os.path.join(ROOT, "train.py"),
        *EAGER,
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "-1",
    ]
    lines, ended, code = _timed_stderr(cmd)
    text = "\n".join(line for _, line in lines)
    assert code == 1
    assert lines[0][1].startswith("error: training.steps = -1 must be >= 1 (0 only converts"), text
    assert [line for _, line in lines if line.startswith("error: ")] == [lines[0][1]]  # one process reported it
    root_cause = text.split("Root Cause")[-1]
    assert re.findall(r"exitcode\s*:\s*(-?\d+)", root_cause) == ["2"], text
    assert "traceback : error: training.steps = -1 must be >= 1 (0 only converts" in root_cause, text
    assert ended - lines[0][0] < 5, text  # torchrun's report follows at once


@pytest.mark.filterwarnings("ignore:.*assuming the intent")
def test_nan_under_torchrun_stops_every_rank_with_one_line(tmp_path):
    result = run_torchrun(
        2,
        os.path.join(ROOT, "train.py"),
        *EAGER,
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "6",
        "--checkpoint.interval",
        "1",
        "--training.lr",
        "1e6",
        check=False,
    )
    assert result.returncode == 1
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and re.match(r"error: step \d+: (non-finite|the state to checkpoint)", errors[0]), errors
    # The only traceback is torchrun's own (its failure report), after our line.
    assert result.stderr.count("Traceback") == 1 and result.stderr.index(errors[0]) < result.stderr.index("Traceback")
    root_cause = result.stderr.split("Root Cause")[-1]
    assert re.findall(r"exitcode\s*:\s*(-?\d+)", root_cause) == ["1"]
    assert all(
        saved_tensors_finite(tmp_path / "checkpoint" / f"step-{s}")
        for s in complete_steps(str(tmp_path / "checkpoint"))
    )
