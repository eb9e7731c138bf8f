"""Expert parallelism for DeepSeek-V3: tagged all_to_alls in the graph, degree errors.

EP=2 and FSDP2xEP2 training (graph vs eager bitwise, close to one process, gradients checked)
are cases of the cpu suite (``integration_tests.py``).
"""

import functools
from collections import Counter

import pytest
import torch

from graph_trainer.config_loading import load_config
from graph_trainer.errors import ConfigError
from graph_trainer.fake_trace import fake_world, trace_job
from graph_trainer.graph import tags
from graph_trainer.graph.tags import COMBINE, COUNT_EXCHANGE, DISPATCH
from graph_trainer.validation import validate_config
from models.float8 import ROW_SCALE_BYTES
from tests.conftest import ROOT

DEEPSEEK = [
    "--job.config_file",
    f"{ROOT}/configs/deepseek_v3_debug.toml",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    # 3 of the debug model's 6 layers, 1 dense + 2 MoE: what is checked is per MoE layer
    "--model.n_layers",
    "3",
]


FLOAT8_DISPATCH = [
    *["--float8.recipe_name", "rowwise_with_gw_hp"],
    *["--float8.convert_routed_experts", "--float8.dispatch_in_float8"],
]


@functools.cache
def _traced_all_to_alls(*flags: str) -> list:
    """The all_to_all nodes of the debug model's step on EP=2 (traced once per flag set)."""
    cfg = load_config([*DEEPSEEK, "--parallelism.ep", "2", *flags])
    with fake_world(4):
        gm = trace_job(cfg, 4).gm
    return [
        n
        for n in gm.graph.nodes
        if n.target.__class__.__name__ == "OpOverload" and n.target.name() == "_c10d_functional::all_to_all_single"
    ]


def test_every_all_to_all_is_tagged_per_moe_layer():
    a2a = _traced_all_to_alls()
    launches = [tags.tags(n) for n in a2a]
    assert all(t.get("ep_role") in (COUNT_EXCHANGE, DISPATCH, COMBINE) and t.get("moe_fqn") for t in launches)
    moe_layers = sorted({t["moe_fqn"] for t in launches})
    assert moe_layers == ["layers.1.moe", "layers.2.moe"]  # (layer 0 dense)
    per_layer = Counter((t["moe_fqn"], t["phase"], t["ep_role"]) for t in launches)
    for layer in moe_layers:
        # forward: counts, tokens out, tokens back; backward: the two token exchanges reversed.
        assert per_layer[(layer, "forward", COUNT_EXCHANGE)] == 1
        assert per_layer[(layer, "forward", DISPATCH)] == 1
        assert per_layer[(layer, "forward", COMBINE)] == 1
        assert per_layer[(layer, "backward", DISPATCH)] == 1
        assert per_layer[(layer, "backward", COMBINE)] == 1
    assert len(a2a) == 5 * len(moe_layers)
    # Their waits carry the same tags (passes move a collective together with its wait).
    for node in a2a:
        (wait,) = node.users
        assert tags.get(wait, "ep_role") == tags.get(node, "ep_role")


def test_float8_dispatch_sends_the_rows_to_the_experts_as_bytes():
    """The forward's dispatch carries float8 values with a float32 scale per row; the combine and
    the backward's exchanges keep the rows' dtype."""
    plain = [n.args[0].meta["val"] for n in _traced_all_to_alls() if tags.get(n, "ep_role") == DISPATCH]
    (dim,), (dtype,) = {t.shape[1] for t in plain}, {t.dtype for t in plain}
    to_experts = {("forward", DISPATCH)}
    for node in _traced_all_to_alls(*FLOAT8_DISPATCH):
        where = (tags.get(node, "phase"), tags.get(node, "ep_role"))
        rows = node.args[0].meta["val"]
        if where in to_experts:
            assert rows.dtype == torch.uint8 and rows.shape[1] == dim + ROW_SCALE_BYTES, where
        elif where[1] != COUNT_EXCHANGE:
            assert rows.dtype == dtype and rows.shape[1] == dim, where


@pytest.mark.parametrize(
    "args, world_size, message",
    [
        (["--parallelism.ep", "3"], 3, "parallelism.ep = 3 does not divide the model's n_routed_experts (8)"),
        (
            ["--parallelism.ep", "2", "--parallelism.dp_replicate", "2"],
            2,
            "parallelism.ep = 2 must divide parallelism.dp_shard = 1",
        ),
        (  # under sequence parallel each tp rank routes its own tokens: ep spans the tp ranks
            ["--parallelism.ep", "2", "--parallelism.tp", "4"],
            8,
            "parallelism.ep = 2 must be parallelism.tp = 4 times a divisor of parallelism.dp_shard = 2 under "
            "sequence parallel (each tp rank routes its own tokens, so the experts are split over the tp ranks "
            "too); change one, or set parallelism.sequence_parallel false",
        ),
        (["--parallelism.ep", "8", "--parallelism.tp", "2"], 4, "parallelism.ep = 8 must be parallelism.tp = 2 times"),
    ],
)
def test_bad_expert_parallel_degrees(args, world_size, message):
    cfg = load_config([*DEEPSEEK, *args])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, world_size=world_size)
    assert message in str(info.value)


def test_ep_over_the_tp_ranks_needs_no_data_parallel_shards_of_its_own():
    # ep = tp = 2 on 2 ranks: under sequence parallel the experts split over the tp ranks alone
    validate_config(load_config([*DEEPSEEK, "--parallelism.ep", "2", "--parallelism.tp", "2"]), world_size=2)
    # without it ep borrows from dp_shard, which is 1 here
    with pytest.raises(ConfigError, match="parallelism.ep = 2 must divide parallelism.dp_shard = 1"):
        validate_config(
            load_config(
                [*DEEPSEEK, "--parallelism.ep", "2", "--parallelism.tp", "2", "--parallelism.no_sequence_parallel"]
            ),
            world_size=2,
        )


def test_ep_on_a_dense_model_is_rejected():
    cfg = load_config(["--parallelism.ep", "2"])
    with pytest.raises(ConfigError, match="llama3 is dense"):
        validate_config(cfg, world_size=2)
