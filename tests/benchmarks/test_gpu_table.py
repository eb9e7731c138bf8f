"""The one-GPU table script (``scripts/gpu_table.sh`` -> ``benchmarks.gpu_table``): its smoke mode on
the CPU end to end, failures kept per row, every row's job valid, and its figures from records."""

import json
import os
import subprocess
import sys
from argparse import Namespace
from dataclasses import replace

import pytest
import torch

from benchmarks import gpu_table
from benchmarks.chunked_job import chunk_moe_modules
from benchmarks.gpu_table_report import classify, row_figures
from benchmarks.gpu_table_rows import table_rows
from graph_trainer.config import EpOverlap
from graph_trainer.errors import ConfigError
from tests.conftest import ROOT

SMOKE_ROWS = ["llama3_graph_ac_selective", "deepseek_v3_chunked_graph_ac_full"]
"""A train.py row through the memory policy, and the chunked row through benchmarks.chunked_job:
both entry points (the Inductor rows add a minute of compiling each on 2 cores; their flags are
checked by test_every_row_is_a_valid_job, their backend by tests/compiler/test_backend.py)."""


def _table(out) -> dict:
    with open(os.path.join(out, "gpu_table.json")) as f:
        return json.load(f)


def test_smoke_writes_the_table_from_the_jobs_records(tmp_path):
    out = tmp_path / "table"
    env = {**os.environ, "PYTHON": sys.executable}
    command = [
        "bash",
        os.path.join(ROOT, "scripts", "gpu_table.sh"),
        str(out),
        "--smoke",
        "--rows",
        ",".join(SMOKE_ROWS),
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = _table(out)
    assert table["mode"] == "smoke" and table["steps"] == 4 and table["machine"]["torch"] == torch.__version__
    assert [r["name"] for r in table["rows"]] == SMOKE_ROWS
    for row in table["rows"]:
        assert row["status"] == "ok" and row["problem"] is None, row
        assert (row["steps_recorded"], row["steady_steps"], len(row["losses"])) == (4, 2, 4)
        assert row["tokens_per_s"] > 0 and row["mfu_percent"] is None  # no known peak on a CPU
        assert row["simulated_device"] == "H100 SXM" and row["simulated_ms"] > 0
        assert 0 < row["forward_backward_ms"] < row["step_ms"]  # the graph is part of the step
        assert row["estimated_peak_gib"] > 0 and row["estimated_parts_gib"]["optimizer"] > 0
        assert row["peak_gib"] > 0 and row["estimate_error_percent"] is not None
        assert row["first_step_s"] > row["trace_s"] > 0 and row["compile_s"] is None  # op by op
    markdown = (out / "gpu_table.md").read_text()
    assert all(f"| {name} |" in markdown for name in SMOKE_ROWS) and markdown.count("| ok |") == 2
    log = (out / "deepseek_v3_chunked_graph_ac_full.log").read_text()
    assert "chunked_job: 1 modules run as 2 chunks along batch (layers.1 ...)" in log


def _smoke_row(name: str, **changes):
    (row,) = [r for r in table_rows(smoke=True, steps=4) if r.name == name]
    return replace(row, **changes)


def test_a_failing_row_is_recorded_and_the_next_rows_run(tmp_path):
    refused = _smoke_row(
        "llama3_graph_ac_none", args=(*_smoke_row("llama3_graph_ac_none").args, "--model.n_layers", "-1")
    )
    slow = _smoke_row("llama3_graph_ac_full", timeout_s=1.0)
    opts = Namespace(table_rows=[refused, slow], output_dir=str(tmp_path), mode="smoke", steps=4, budget=0.0)
    gpu_table.run_table(opts, gpu_table.table_header(opts, gpu_table.machine("smoke")))
    rows = _table(tmp_path)["rows"]
    assert [r["status"] for r in rows] == ["refused", "timed out"]
    assert rows[0]["problem"].startswith("error: model.n_layers = -1 must be >= 0")
    assert rows[1]["problem"] == "killed after 1 s, at step 0 of 4"
    assert "- llama3_graph_ac_none: refused: error: model.n_layers" in (tmp_path / "gpu_table.md").read_text()


def test_rows_beyond_the_budget_are_skipped_without_starting(tmp_path):
    opts = Namespace(table_rows=table_rows(True, 4)[:2], output_dir=str(tmp_path), mode="smoke", steps=4, budget=30.0)
    table = gpu_table.run_table(opts, gpu_table.table_header(opts, gpu_table.machine("smoke")))
    assert [r["status"] for r in table["rows"]] == ["skipped", "skipped"]
    assert "of the 30 s budget (a row needs 60 s)" in table["rows"][0]["problem"]
    assert not any(p.endswith(".log") for p in os.listdir(tmp_path))


@pytest.mark.parametrize("smoke", [False, True])
def test_every_row_is_a_valid_job(smoke, tmp_path, monkeypatch):
    from graph_trainer.config_loading import load_config
    from graph_trainer.validation import validate_config

    monkeypatch.chdir(ROOT)  # where the jobs run: their config files are relative to it

    rows = table_rows(smoke, steps=8)
    assert len({r.name for r in rows}) == len(rows) == 10
    for row in rows:
        command = gpu_table.job_command(row, str(tmp_path / row.name), "cpu" if smoke else "cuda")
        flags = command[command.index("--job.config_file") :]
        cfg = load_config(flags)
        validate_config(cfg, world_size=1)
        assert (cfg.metrics.json_lines, cfg.metrics.simulate_device, cfg.training.steps) == (True, "h100", 8)
        assert (cfg.compile.backend == "inductor") == (row.backend != "op by op") == ("--compile.cache_dir" in flags)
        assert cfg.activation_checkpoint.mode == row.ac and not cfg.compile.passes
        assert cfg.float8.recipe_name == row.float8


def test_chunking_selects_the_modules_holding_a_moe():
    from graph_trainer.config_loading import load_config
    from models.registry import MODEL_SPECS, model_args

    def model():
        cfg = load_config(["--model.name", "deepseek_v3", "--model.n_layers", "2"])
        with torch.device("meta"):
            return MODEL_SPECS["deepseek_v3"].build(model_args(cfg))

    assert chunk_moe_modules(model(), EpOverlap()) == ["layers.1"]  # layers.0 is dense
    assert chunk_moe_modules(model(), EpOverlap(module_fqn="layers.*.moe", chunk_dim="seq")) == ["layers.1.moe"]
    with pytest.raises(ConfigError, match="'seq' needs MoE layers .* selects layers.1"):
        chunk_moe_modules(model(), EpOverlap(chunk_dim="seq"))
    with pytest.raises(ConfigError, match="selects no module holding a MoE"):
        chunk_moe_modules(model(), EpOverlap(module_fqn="norm"))


def _records(tok_s: list[float], mfu: bool = True) -> list[dict]:
    records = [
        {"event": "trace", "trace_seconds": 2.0, "graph_nodes": 10},
        {"event": "memory estimate", "peak_bytes": 3 << 30, "peak_moment": "graph"}
        | {f"{p}_bytes": 1 << 29 for p in ("params", "grads", "optimizer", "transient")},
        {"event": "simulated step", "device": "H100 SXM", "step_ms": 110.0},
        {"event": "compile", "compile_seconds": 30.0},
    ]
    for step, rate in enumerate(tok_s, start=1):
        record = {"step": step, "loss": 9.0 - step, "tokens_per_sec_per_device": rate, "memory_gib": 2.5 + step / 4}
        record |= {"step_time_s": 0.2 * step, "forward_backward_s": 0.1}
        records.append(record | ({"mfu_percent": rate / 1000} if mfu else {}))
    return records


def test_figures_are_the_steady_steps_of_the_records():
    f = row_figures(_records([10.0, 50.0, 100.0, 300.0]), warmup=2)
    assert f["tokens_per_s"] == pytest.approx(150.0)  # 2 steps of equal tokens in 1/100 + 1/300 of the time
    assert f["mfu_percent"] == pytest.approx(0.15)
    assert f["step_ms"] == pytest.approx(700.0) and f["forward_backward_ms"] == pytest.approx(100.0)
    assert f["simulated_ms"] == 110.0 and f["simulation_error_percent"] == pytest.approx(10.0)
    assert f["peak_gib"] == 3.5 and f["estimated_peak_gib"] == 3.0
    assert f["estimate_error_percent"] == pytest.approx(-100 / 7)
    assert (f["first_step_s"], f["trace_s"], f["compile_s"]) == (0.2, 2.0, 30.0)
    assert f["estimated_parts_gib"] == {p: 0.5 for p in ("params", "grads", "optimizer", "transient")}
    assert row_figures(_records([10.0, 50.0, 100.0], mfu=False), warmup=2)["mfu_percent"] is None
    empty = row_figures([], warmup=2)
    assert empty["tokens_per_s"] is None and empty["estimate_error_percent"] is None and empty["steps_recorded"] == 0


def test_classify_names_the_jobs_own_error():
    assert classify(0, "", 8, 8) == ("ok", None)
    assert classify(None, "step 3 ...", 3, 8) == ("timed out", None)
    assert classify(2, "noise\nerror: compile.passes: ep_overlap needs ep > 1\n", 0, 8) == (
        "refused",
        "error: compile.passes: ep_overlap needs ep > 1",
    )
    oom = "Traceback\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\nmore"
    assert classify(1, oom, 1, 8) == ("out of memory", oom.splitlines()[1])
    assert classify(-9, "step 1\nRuntimeError: boom", 1, 8) == ("failed", "exit code -9: RuntimeError: boom")
    assert classify(0, "", 5, 8) == ("failed", "the job exited 0 but metrics.jsonl holds 5 of 8 steps")


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required: output_dir"),
        (["OUT", "--steps", "2"], "--steps 2 leaves no steady step"),
        (["OUT", "--budget", "-1"], "--budget -1.0 must be >= 0"),
        (["OUT", "--rows", "llama3_eager"], "unknown row 'llama3_eager'; rows: llama3_graph_ac_none,"),
        (["FILE"], "exists and is not a folder"),
    ],
)
def test_bad_command_lines_are_one_line_and_exit_2(argv, message, tmp_path, capsys):
    (tmp_path / "FILE").write_text("")
    argv = [str(tmp_path / a) if a in ("OUT", "FILE") else a for a in argv]
    with pytest.raises(SystemExit) as info:
        gpu_table.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_gpu_table_refuses_a_machine_without_cuda(tmp_path, capsys):
    assert gpu_table.main([str(tmp_path / "out")]) == 2
    assert "error: the table runs on CUDA, but" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(
    os.path.exists(os.path.join(ROOT, ".devicegpu", "install.sh")), reason="this checkout carries the GPU wheels"
)
def test_the_script_names_the_missing_wheels(tmp_path):
    no_site = tmp_path / "python"  # an interpreter that sees none of the installed packages
    no_site.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    no_site.chmod(0o755)
    env = {**os.environ, "PYTHON": str(no_site)}
    result = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_table.sh"), str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "lacks tomli tyro torchtitan datasets" in result.stderr
