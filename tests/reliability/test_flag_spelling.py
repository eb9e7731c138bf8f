"""Every entry point reads flags with dashes or underscores alike (``--job.config-file`` is
``--job.config_file``, as ``--help`` shows it), and a torchtitan name is refused naming ours."""

from __future__ import annotations

import pytest

from graph_trainer.cli import analyze
from graph_trainer.config_loading import load_config, normalize_flags
from graph_trainer.errors import ConfigError
from tests.reliability.helpers import DEBUG_TOML


@pytest.mark.parametrize(
    "argv",
    [
        ["--job.config-file", DEBUG_TOML],
        [f"--job.config-file={DEBUG_TOML}"],
        ["--job.config_file", DEBUG_TOML],
    ],
)
def test_config_file_flag_in_either_spelling(argv):
    cfg = load_config([*argv, "--training.local-batch-size", "3"])
    assert (cfg.training.steps, cfg.training.seq_len, cfg.training.local_batch_size) == (40, 128, 3)


def test_every_entry_point_accepts_either_spelling(tmp_path, capsys):

    assert normalize_flags(["--a-b.c-d", "x-y", "--e-f=g-h", "-1", "--"]) == [
        "--a_b.c_d",
        "x-y",
        "--e_f=g-h",
        "-1",
        "--",
    ]

    assert analyze.main(["--device-memory-gib", "lots"]) == 2  # read as --device_memory_gib, before any tracing
    assert "--device_memory_gib 'lots' is not a number" in capsys.readouterr().err
    import integration_tests

    assert integration_tests.main([str(tmp_path), "--suite", "cpu", "--list", "--test-name", "single_graph"]) == 0
    assert capsys.readouterr().out.startswith("single_graph: 1 proc")


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--training.batch_size", "8"],
            "unknown flag --training.batch_size; torchtitan's training.batch_size is --training.local_batch_size here",
        ),
        (
            ["--parallelism.data-parallel-shard-degree", "2"],
            "unknown flag --parallelism.data_parallel_shard_degree; torchtitan's "
            "parallelism.data_parallel_shard_degree is --parallelism.dp_shard here",
        ),
        (
            ["--lr_scheduler.warmup_steps", "100"],
            "unknown flag --lr_scheduler.warmup_steps; torchtitan's lr_scheduler.warmup_steps is "
            "--training.warmup_steps here",
        ),
        (["--compile.enable"], "unknown flag --compile.enable; torchtitan's compile.enable is --compile.mode here"),
    ],
)
def test_a_torchtitan_flag_is_refused_naming_ours(flags, message):
    with pytest.raises(ConfigError) as info:
        load_config(flags)
    assert str(info.value) == f"{message} (python train.py --help lists every flag)"


@pytest.mark.parametrize(
    "toml, message",
    [
        (
            "[lr_scheduler]\nwarmup_steps = 100\n",
            "unknown section [lr_scheduler] in {path}; torchtitan's lr_scheduler.warmup_steps is "
            "[training] warmup_steps here",
        ),
        (
            "[validator.dataloader]\ndataset = 'c4'\n",
            "unknown section [validator] in {path}; torchtitan's validator.dataloader.dataset is "
            "[validation] dataset here",
        ),
        (
            "[training]\nbatch_size = 8\n",
            "unknown key 'batch_size' in section [training] of {path}; torchtitan's training.batch_size is "
            "[training] local_batch_size here",
        ),
    ],
)
def test_a_torchtitan_table_or_key_in_a_job_file_is_refused_naming_ours(tmp_path, toml, message):
    path = tmp_path / "job.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(["--job.config_file", str(path)])
    assert str(info.value) == message.format(path=path)


def test_a_torchtitan_table_without_a_setting_here_names_where_its_settings_are(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[lr_scheduler]\ntotal_steps = 100\n")
    with pytest.raises(ConfigError, match=r"; torchtitan's \[lr_scheduler\] settings are in \[training\] here$"):
        load_config(["--job.config_file", str(path)])
