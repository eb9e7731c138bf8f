"""graph_trainer.cli.analyze_flags: analyze's own flags, ``--rank`` among them (which rank is traced)."""

from __future__ import annotations

import pytest

from graph_trainer.analysis.devices import H100_SXM
from graph_trainer.cli import analyze
from graph_trainer.cli.analyze_flags import parse_command_line
from graph_trainer.config_loading import load_config
from graph_trainer.graph.ops import name_of

CP4 = ["--training.local_batch_size", "1", "--training.seq_len", "64", "--parallelism.cp", "4"]


def test_rank_is_read_and_checked_against_the_world(capsys):
    assert parse_command_line(["--world_size", "4", *CP4]).rank == 0
    assert parse_command_line(["--world_size", "4", "--rank", "3", *CP4]).rank == 3
    for bad in ("4", "-1", "two"):
        assert analyze.main(["--world_size", "4", "--rank", bad, *CP4]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --rank") and err.count("\n") == 1


@pytest.mark.parametrize("rank", [0, 2])
def test_the_traced_rank_holds_its_own_context_parallel_chunks(rank):
    # rank r of cp 4 holds chunks r and 7 - r of 8: its queries read (r + 1) c and (8 - r) c keys
    traced, result, _, _ = analyze.analyze_job(load_config(CP4), 4, H100_SXM, rank=rank)
    keys = {
        n.args[1].meta["val"].shape[2]
        for n in traced.gm.graph.nodes
        if name_of(n) == "_scaled_dot_product_efficient_attention"
    }
    c = 64 // 8
    assert keys == {(rank + 1) * c, (8 - rank) * c}
    assert result.step_time > 0


def test_the_header_names_the_rank(capsys):
    assert analyze.main(["--world_size", "4", "--rank", "1", *CP4]) == 0
    assert "world size 4 (rank 1), per-rank batch 1x64" in capsys.readouterr().out.splitlines()[0]
