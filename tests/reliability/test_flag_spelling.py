"""Every entry point reads flags with dashes or underscores alike (``--job.config-file`` is
``--job.config_file``, as ``--help`` shows it)."""

from __future__ import annotations

import pytest

from graph_trainer.cli import analyze
from graph_trainer.config_loading import load_config, normalize_flags
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
