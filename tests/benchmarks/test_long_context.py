"""benchmarks/long_context.py: every row is a job ``analyze`` accepts, and the cheapest row's printed
fields are computed from its analyses (at 2 blocks, to run in seconds): the peak and the step grow with
the sequence at a fixed layout, tokens/s/GPU is the global batch over the slowest traced rank's step."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks import long_context as bench
from graph_trainer.cli import analyze


@pytest.mark.parametrize("row", bench.ROWS, ids=lambda r: r.name)
def test_every_row_is_a_valid_job(row):
    command = analyze.parse_command_line(row.argv())
    cfg = command.configs[0]
    p, t = cfg.parallelism, cfg.training
    assert command.world_size == row.world_size == p.dp_shard * p.cp * p.tp
    assert (p.cp, p.tp, t.seq_len) == (row.cp, row.tp, row.seq_len)
    assert t.local_batch_size * t.seq_len * p.dp_shard == row.tokens_per_step
    assert cfg.activation_checkpoint.mode == "full" and cfg.float8.recipe_name == "tensorwise"
    assert (command.device_name, command.memory_limit) == (bench.DEVICE, round(bench.MEMORY_LIMIT_GIB * (1 << 30)))
    assert (cfg.model.flavor, cfg.model.max_seq_len) == (row.flavor, max(bench.CONTEXT, row.seq_len))
    assert [r // row.tp for r in row.cp_ranks("all")] == list(range(row.cp))


def test_the_cheapest_rows_fields_are_computed(capsys):
    row = next(r for r in bench.ROWS if r.name == bench.CHEAPEST)
    short = bench.simulate_row(row, "all", n_layers=2)
    longer = bench.simulate_row(dataclasses.replace(row, seq_len=2 * row.seq_len), "first", n_layers=2)
    assert short["ranks traced"] == row.cp and longer["ranks traced"] == 1
    assert short["at rank"] in row.cp_ranks("all") and short["lowest peak GiB"] <= short["peak GiB"]
    assert longer["peak GiB"] > short["peak GiB"] and longer["activ GiB"] > short["activ GiB"]
    assert longer["step ms"] > short["step ms"]
    for r, out in ((row, short), (dataclasses.replace(row, seq_len=2 * row.seq_len), longer)):
        assert out["tokens/s/GPU"] == pytest.approx(r.tokens_per_step / (out["step ms"] / 1e3) / r.world_size)
        assert 0 <= out["exposed ms"] < out["step ms"]
        assert out["fits"] == (out["peak GiB"] <= bench.MEMORY_LIMIT_GIB)
    printed = capsys.readouterr().out
    assert printed.count("# .venv/bin/python -m graph_trainer.cli.analyze ") == row.cp + 1


def test_an_unknown_row_or_a_negative_block_count_is_one_line_exit_2(capsys):
    assert bench.main(["--rows", "8B-1M"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown rows ['8B-1M']")
    assert bench.main(["--n_layers", "-1"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_best_is_the_fastest_split_that_fits_per_model_and_length():
    def row(tokens, fits, seq=65536):
        return {"model": "Llama3-8B", "seq": seq, "tokens/s/GPU": tokens, "fits": fits}

    table = [row(1000.0, True), row(1200.0, True), row(1500.0, False), row(900.0, True, seq=131072)]
    bench.mark_best(table)
    assert [r["best"] for r in table] == [False, True, False, True]
