"""The pass runner: graph dumps (one folder per rank in multi-process jobs) and broken graphs named."""

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

from graph_trainer.compiler.chain import transform_graph
from graph_trainer.compiler.passes import PASS_REGISTRY, PassContext, PassError, PassSpec
from graph_trainer.torch_compat import fake_store


def _graph() -> fx.GraphModule:
    def step(x, w):
        return (x @ w).relu().sum()

    return fx.symbolic_trace(step)


def _dumped(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_dump_graphs_writes_code_before_and_after_every_pass(tmp_path):
    transform_graph(_graph(), PassContext(), [], str(tmp_path))
    assert _dumped(tmp_path) == [
        "00_remove_dead_code_after.py",
        "00_remove_dead_code_before.py",
        "01_reshard_after_forward_after.py",
        "01_reshard_after_forward_before.py",
    ]
    assert "relu" in (tmp_path / "00_remove_dead_code_before.py").read_text()


def test_dump_graphs_of_a_multi_process_job_go_to_one_folder_per_rank(tmp_path):
    dist.init_process_group("fake", store=fake_store(), rank=1, world_size=2)
    try:
        transform_graph(_graph(), PassContext(), [], str(tmp_path))
    finally:
        dist.destroy_process_group()
    assert _dumped(tmp_path) == ["rank1"]  # rank 0 writes rank0/: no rank overwrites another's files
    assert len(_dumped(tmp_path / "rank1")) == 4


def test_a_pass_that_breaks_the_graph_is_named(monkeypatch):
    def use_before_definition(gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
        relu = next(n for n in gm.graph.nodes if n.target == "relu")
        first = next(iter(gm.graph.nodes))
        with gm.graph.inserting_before(first):
            gm.graph.call_function(torch.neg, (relu,))
        return gm

    monkeypatch.setitem(PASS_REGISTRY, "breaker", PassSpec("breaker", use_before_definition, "breaks the graph"))
    with pytest.raises(PassError, match="pass 'breaker' left an invalid graph"):
        transform_graph(_graph(), PassContext(), ["breaker"])
