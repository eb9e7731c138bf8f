"""scripts/run_train.sh: the job checked in one process (``graph_trainer.cli.check``: its configuration
and every path it reads), then torchrun."""

from __future__ import annotations

import os
import subprocess

import pytest

from graph_trainer.cli.check import main
from tests.conftest import ROOT
from tests.launch import FAST_ARGS, read_losses

RUN_TRAIN = os.path.join(ROOT, "scripts", "run_train.sh")


def _run_train(ngpu: int, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NGPU": str(ngpu), "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", RUN_TRAIN, *flags], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


def test_a_mistake_is_one_line_and_exit_2_before_any_rank_starts(tmp_path):
    result = _run_train(2, *FAST_ARGS, "--job.dump_folder", str(tmp_path), "--parallelism.pp", "-2")
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: parallelism.pp = -2 must be >= 1"]
    assert not os.listdir(tmp_path)  # no rank ran


def test_a_job_that_passes_is_started_under_torchrun(tmp_path):
    flags = [*FAST_ARGS, "--job.dump_folder", str(tmp_path), "--compile.mode", "eager", "--training.steps", "2"]
    result = _run_train(2, *flags)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("checked: llama3 debugmodel on 2 processes (1 node(s) of 2), 2 steps")
    assert [step for step, _ in read_losses(tmp_path)] == [1, 2]


def test_a_missing_dataset_is_one_line_before_torchrun(tmp_path):
    missing = str(tmp_path / "missing.jsonl")
    result = _run_train(2, *FAST_ARGS, "--job.dump_folder", str(tmp_path / "out"), "--training.dataset", missing)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: training.dataset path {missing!r} does not exist; give 'synthetic', an existing .json, .jsonl, "
        ".parquet, .txt file or folder of them, or a Hugging Face hub dataset name"
    ]
    assert not os.path.exists(tmp_path / "out" / "losses.txt")  # no rank ran


@pytest.mark.parametrize(
    "setting, flags, message",
    [
        ("validation.dataset", ["--validation.enable"], "error: validation.dataset path '{path}' does not exist; "),
        ("training.tokenizer_path", [], "error: training.tokenizer_path '{path}' does not exist; "),
        (
            "checkpoint.initial_load_hf",
            [],
            "error: Hugging Face folder {path} does not exist (checkpoint.initial_load_hf)",
        ),
        ("job.config_file", [], "error: --job.config_file '{path}' does not exist"),
    ],
)
def test_the_check_covers_every_path_the_job_reads(tmp_path, capsys, setting, flags, message):
    path = str(tmp_path / "missing")
    job = [*FAST_ARGS, "--job.dump_folder", str(tmp_path / "out"), *flags, f"--{setting}", path]
    assert main([*job, "--nproc_per_node", "2"]) == 2
    assert capsys.readouterr().err.startswith(message.format(path=path))


def test_the_check_counts_every_node_and_refuses_a_bad_count(tmp_path, capsys):
    job = [*FAST_ARGS, "--job.dump_folder", str(tmp_path), "--parallelism.dp_shard", "4"]
    assert main([*job, "--nproc_per_node", "2", "--nnodes", "2"]) == 0  # FSDP over 2 nodes of 2
    assert capsys.readouterr().out.startswith("checked: llama3 debugmodel on 4 processes (2 node(s) of 2)")
    assert main([*job, "--nproc_per_node", "2"]) == 2  # one node of 2 cannot shard 4 ways
    assert capsys.readouterr().err.startswith("error: ")
    assert main([*FAST_ARGS, "--nproc_per_node", "0"]) == 2
    assert capsys.readouterr().err == "error: --nproc_per_node 0 and --nnodes 1 must be >= 1\n"
    assert "WORLD_SIZE" not in os.environ  # (the check's view of the job is not left to this process)


def test_the_slurm_script_starts_one_run_train_per_node_meeting_at_the_first(tmp_path):
    """scripts/slurm_train.sh with Slurm's environment and stand-ins for scontrol and srun (this
    machine has no Slurm): srun gets run_train.sh once per node, every node the same rendezvous."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[07-08]" ] && printf "gpu07\\ngpu08\\n"\n'
    )
    record = tmp_path / "srun.txt"
    (bin_dir / "srun").write_text(
        f'#!/bin/sh\necho "$NNODES|$NGPU|$TORCHRUN_ARGS" > {record}\nfor a in "$@"; do echo "$a" >> {record}; done\n'
    )
    for stub in ("scontrol", "srun"):
        os.chmod(bin_dir / stub, 0o755)
    slurm = {"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242", "SLURM_GPUS_ON_NODE": "8"}
    env = {**os.environ, **slurm, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    script = os.path.join(ROOT, "scripts", "slurm_train.sh")
    result = subprocess.run(
        ["bash", script, "--training.steps", "2"], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "graph_trainer: 2 node(s) x 8 process(es), rendezvous at gpu07:29500\n"
    lines = record.read_text().splitlines()
    assert lines[0] == "2|8|--rdzv_backend c10d --rdzv_endpoint gpu07:29500 --rdzv_id 4242"
    assert lines[1:] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1", RUN_TRAIN, "--training.steps", "2"]
