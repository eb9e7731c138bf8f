"""graph_trainer.graph.collectives: kinds, groups, launch -> wait pairing, bytes and order."""

import pytest
import torch
import torch.distributed as dist

from graph_trainer.fake_trace import fake_world
from graph_trainer.graph import collectives
from graph_trainer.graph.collectives import (
    PairingError,
    collective_bytes,
    collective_counts,
    collective_order,
    group_name,
    group_size_arg,
    is_collective,
    is_wait,
    launch_of,
    max_in_flight,
    wait_of,
)
from graph_trainer.torch_compat import new_fake_mode


def _traced(world_size: int = 4):
    """A graph with one collective of each kind, traced on fake tensors at ``world_size``."""
    from torch.distributed import _functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    group = dist.group.WORLD

    def step(x):
        gathered = funcol.all_gather_tensor(x, 0, group)
        reduced = funcol.reduce_scatter_tensor(gathered * 2, "sum", 0, group)
        summed = funcol.all_reduce(reduced, "sum", group)
        return funcol.all_to_all_single(summed, None, None, group)

    with new_fake_mode() as mode:
        x = mode.from_tensor(torch.randn(8, 16))
    return make_fx(step)(x)


pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # funcol's older names, stable here


def test_kinds_groups_sizes_bytes_and_counts():
    with fake_world(4):
        gm = _traced()
        launches = [n for n in gm.graph.nodes if is_collective(n)]
        assert [collectives.kind(n) for n in launches] == ["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]
        assert len({group_name(n) for n in launches}) == 1 and group_name(launches[0]) != "?"
        assert [group_size_arg(n) for n in launches] == [4, 4, None, None]
        # fp32: gathered 32x16, reduce-scatter input 32x16, all-reduce input 8x16, all_to_all 8x16
        assert [collective_bytes(n) for n in launches] == [32 * 16 * 4, 32 * 16 * 4, 8 * 16 * 4, 8 * 16 * 4]
        counts = collective_counts(gm.graph)
        assert counts["wait_tensor"] == 4 and sum(counts.values()) == 8
        waits = [n for n in gm.graph.nodes if is_wait(n)]
        assert [collectives.kind(w) for w in waits] == [None] * 4


def test_every_launch_pairs_with_its_wait_and_back():
    with fake_world(4):
        gm = _traced()
        for launch in (n for n in gm.graph.nodes if is_collective(n)):
            wait = wait_of(launch)
            assert is_wait(wait) and launch_of(wait) is launch
        launch = next(n for n in gm.graph.nodes if is_collective(n))
        with gm.graph.inserting_after(launch):  # a second reader of the launch breaks the contract
            extra = gm.graph.call_function(torch.ops.aten.clone.default, (launch,))
        with pytest.raises(PairingError, match=f"collective {launch.name} must have exactly one user"):
            wait_of(launch)
        gm.graph.erase_node(extra)


def test_order_and_in_flight():
    with fake_world(4):
        gm = _traced()
        order = collective_order(gm.graph)
        assert [name for name, _, _ in order] == [
            "all_gather_into_tensor",
            "wait_tensor",
            "reduce_scatter_tensor",
            "wait_tensor",
            "all_reduce",
            "wait_tensor",
            "all_to_all_single",
            "wait_tensor",
        ]
        assert order[0][2][0] == 4  # scalar arguments: the group size, then the group name
    assert max_in_flight([n for n, _, _ in order]) == 1
    assert max_in_flight(["all_gather_into_tensor", "all_gather_into_tensor", "wait_tensor", "wait_tensor"]) == 2
