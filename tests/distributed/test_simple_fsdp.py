"""SimpleFSDP's gradient reductions as the tracer sees them: HSDP reduce-scatters over dp_shard
first, then all-reduces the shard over dp_replicate, both in the reduce dtype and tagged; DDP's
all-reduces are tagged. (The values: the cpu suite's hsdp2x2 / ddp2 cases, graph, eager and one
process.)"""

from __future__ import annotations

import functools

import pytest
import torch

from graph_trainer.config_loading import load_config
from graph_trainer.fake_trace import fake_world, trace_without_passes
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import ALL_REDUCE, REDUCE_SCATTER, WAIT, group_name, is_collective
from graph_trainer.graph.tags import FSDP_PARAM, FSDP_ROLE, REDUCE_GRAD

SMALL = ["--training.local_batch_size", "1", "--training.seq_len", "16"]
BF16_REDUCE = ["--training.mixed_precision_param", "bfloat16", "--training.mixed_precision_reduce", "bfloat16"]


@functools.cache
def _collectives(replicate: int, shard: int, tp: int = 1) -> list:
    world = replicate * shard * tp
    cfg = load_config(
        [*SMALL, *BF16_REDUCE, "--parallelism.dp_replicate", str(replicate), "--parallelism.dp_shard", str(shard)]
        + ["--parallelism.tp", str(tp)]
    )
    with fake_world(world):
        traced, _ = trace_without_passes(cfg, world)
    return [n for n in traced.gm.graph.nodes if is_collective(n)]


def _reduced_from(all_reduce) -> object:
    """The collective whose wait feeds ``all_reduce`` through single-input ops (casts, views)."""
    node = all_reduce.args[0]
    while node.target is not WAIT:
        (node,) = node.all_input_nodes
    return node.args[0]


@pytest.mark.parametrize("tp", [1, 2], ids=["hsdp2x2", "hsdp2x2xtp2"])
def test_hsdp_all_reduces_the_reduce_scattered_shard(tp):
    collectives = _collectives(2, 2, tp)
    grads = [n for n in collectives if tags.get(n, FSDP_ROLE) == REDUCE_GRAD]
    reduce_scatters = [n for n in grads if n.target is REDUCE_SCATTER]
    all_reduces = [n for n in grads if n.target is ALL_REDUCE]
    assert reduce_scatters and len(all_reduces) == len(reduce_scatters)
    for ar in all_reduces:
        rs = _reduced_from(ar)
        assert rs.target is REDUCE_SCATTER and tags.get(rs, FSDP_PARAM) == tags.get(ar, FSDP_PARAM)
        assert group_name(rs) != group_name(ar)
        # the shard, not the full gradient: half of what was reduce-scattered over dp_shard = 2
        assert ar.meta["val"].numel() * 2 == rs.args[0].meta["val"].numel()
        assert ar.meta["val"].dtype == rs.meta["val"].dtype == torch.bfloat16
    if tp > 1:  # tensor parallel's own all_reduces stay untagged
        assert any(n.target is ALL_REDUCE and not tags.get(n, FSDP_ROLE) for n in collectives)


def test_ddp_all_reduces_are_tagged_with_their_parameter():
    collectives = _collectives(2, 1)
    assert collectives and all(n.target is ALL_REDUCE for n in collectives)
    assert all(tags.get(n, FSDP_ROLE) == REDUCE_GRAD and tags.get(n, FSDP_PARAM) for n in collectives)
    assert len({tags.get(n, FSDP_PARAM) for n in collectives}) == len(collectives)
    assert all(n.meta["val"].dtype == torch.bfloat16 for n in collectives)


def test_parametrized_names_map_back_to_the_plain_model():
    """``clean_fqn``, ``owner_fqn`` and ``is_parametrization`` read the names torch's parametrize
    gives a wrapped parameter: a change of that naming fails here, not in a checkpoint."""
    from torch.nn.utils import parametrize

    from graph_trainer.distributed.simple_fsdp import CastForCompute, clean_fqn, is_parametrization, owner_fqn

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    plain = [name for name, _ in model.named_parameters()]
    parametrize.register_parametrization(model[1], "weight", CastForCompute(torch.bfloat16), unsafe=True)
    names = [name for name, _ in model.named_parameters()]
    assert "1.parametrizations.weight.original" in names
    assert sorted(clean_fqn(n) for n in names) == sorted(plain)
    assert [owner_fqn(n) for n in names] == [n.rpartition(".")[0] for n in plain]
    modules = [fqn for fqn, _ in model.named_modules() if fqn]
    assert [m for m in modules if not is_parametrization(m)] == ["0", "1"]
