"""ep_overlap: two-chunk MoE modules, each all_to_all issued by both chunks before either waits.

Schedule and errors on the fake process group (one process). The numerics run on real gloo
processes in the cpu suite (``integration_tests.py``, CI): each scheduled case is bitwise its
chunked graph in traced order, which is within float rounding of one process.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from graph_trainer.compiler.passes.ep_overlap import find_chunked_modules, verify_schedule
from graph_trainer.config_loading import load_config
from graph_trainer.errors import ConfigError
from graph_trainer.fake_trace import fake_world, trace_job, trace_pipeline
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import collective_counts, collective_name, group_name
from graph_trainer.graph.tags import CHUNK_ID, CHUNKED_MODULE, COMBINE, COUNT_EXCHANGE, DISPATCH, RECOMPUTED
from graph_trainer.validation import validate_config
from models.registry import MODEL_SPECS
from tests.conftest import ROOT
from tests.graph_compare import node_multiset, node_signatures

DEEPSEEK = [
    "--job.config_file",
    f"{ROOT}/configs/deepseek_v3_debug.toml",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
]
SMALL = dataclasses.replace(MODEL_SPECS["deepseek_v3"].flavors["debugmodel"], n_layers=3)
"""The debug flavor cut to 3 layers for the one-process traces: layer 0 dense, layers 1-2 MoE."""
MOE_LAYERS = ["layers.1", "layers.2"]
SELECTIONS = {
    "blocks_batch": ("layers.*", "batch"),
    "moe_batch": ("layers.*.moe", "batch"),
    "moe_seq": ("layers.*.moe", "seq"),
}


def _args(selection: str, reorder: bool = True, passes: str = "ep_overlap") -> list[str]:
    fqn, dim = SELECTIONS[selection]
    return [
        "--compile.passes",
        passes,
        "--compile.ep_overlap.module_fqn",
        fqn,
        "--compile.ep_overlap.chunk_dim",
        dim,
        "--compile.ep_overlap.reorder",
        str(reorder),
    ]


@functools.cache
def _graph(args: tuple[str, ...], world_size: int = 2):
    cfg = load_config([*DEEPSEEK, "--parallelism.ep", "2", *args])
    validate_config(cfg, world_size)
    with fake_world(world_size):
        return trace_job(cfg, world_size, model_args=SMALL).gm


def _position(gm) -> dict:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_schedule_on_the_debug_model(selection):
    gm = _graph(tuple(_args(selection)))
    assert verify_schedule(gm.graph) == []
    chunked = find_chunked_modules(gm.graph)
    suffix = "" if selection == "blocks_batch" else ".moe"
    assert sorted((r.fqn, r.phase) for r in chunked) == sorted(
        (f"{layer}{suffix}", phase) for layer in MOE_LAYERS for phase in ("forward", "backward")
    )
    pos = _position(gm)
    for module in chunked:
        waits = {chunk: [next(iter(a.users)) for a in module.launches[chunk]] for chunk in (0, 1)}
        if module.phase == "forward":
            assert module.roles(0) == [COUNT_EXCHANGE, DISPATCH, COMBINE]
            first, second = 0, 1
        else:
            assert module.roles(0) == [COMBINE, DISPATCH]
            first, second = 1, 0  # backward: chunk 1 first
        for round_ in range(len(module.roles(0))):
            a, b = module.launches[first][round_], module.launches[second][round_]
            assert pos[a] < pos[b] < min(pos[waits[0][round_]], pos[waits[1][round_]]), (module.name, round_)
        # While the first chunk's exchange is outstanding, compute of the other chunk runs.
        for round_ in range(len(module.roles(0))):
            between = [
                n for n in module.nodes if pos[module.launches[first][round_]] < pos[n] < pos[waits[first][round_]]
            ]
            assert any(
                tags.get(n, CHUNK_ID) == second and n.op == "call_function" and collective_name(n) is None
                for n in between
            ), (module.name, round_)


@pytest.mark.parametrize("selection", ["blocks_batch", "moe_batch"])
def test_schedule_with_tensor_parallel(selection):
    # TP=2 x EP=2: the shared experts' and attention's tp all-reduces are ordinary nodes of the
    # chunked modules; the schedule holds as without TP (values: the chunking only reorders).
    gm = _graph(tuple(_args(selection, passes="ep_overlap,transformer_block_bucketing")) + ("--parallelism.tp", "2"), 4)
    assert verify_schedule(gm.graph) == []
    chunked = find_chunked_modules(gm.graph)
    assert len(chunked) == 2 * len(MOE_LAYERS)
    tp_reduces = [n for r in chunked for n in r.nodes if collective_name(n) == "all_reduce"]
    assert tp_reduces, "no tensor-parallel all_reduce inside the chunked modules"


@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_every_node_kept_once(selection):
    traced_order = _graph(tuple(_args(selection, reorder=False)))
    scheduled = _graph(tuple(_args(selection)))
    # The same nodes with the same inputs, only in another order.
    assert node_multiset(scheduled.graph) == node_multiset(traced_order.graph)
    assert node_signatures(scheduled.graph) != node_signatures(traced_order.graph)
    scheduled.graph.lint()


def test_pipeline_stage_with_resident_weights_keeps_modules_in_block_order():
    """Under pp the weights are resident per step and each gradient is cast to the reduction dtype
    after the whole backward, at the end of the graph, with its module's tags. Those casts keep
    their place: were they planned with their module, its slots would reach the end of the graph
    and a wait (with every later block's backward after it) would land there, behind the
    recomputation of all the blocks below (each block's recomputed activations held at once)."""
    cfg = load_config(
        [*DEEPSEEK, "--model.n_layers", "4", "--parallelism.pp", "2", "--parallelism.ep", "2", *_args("moe_seq")]
        + ["--training.local_batch_size", "1", "--training.global_batch_size", "4"]
        + ["--activation_checkpoint.mode", "full", "--training.mixed_precision_param", "bfloat16"]
        + ["--training.mixed_precision_reduce", "float32"]
    )
    validate_config(cfg, 4)
    with fake_world(4):
        gm = trace_pipeline(cfg, 4).stages[1].gm  # (blocks 2 and 3: MoE)
    pos = _position(gm)
    modules = [m for m in find_chunked_modules(gm.graph) if m.phase == "backward"]
    assert sorted(m.fqn for m in modules) == ["layers.2.moe", "layers.3.moe"]
    last_of_later = max(pos[n] for m in modules if m.fqn == "layers.3.moe" for n in m.nodes)
    recomputed_earlier = [
        n for n in gm.graph.nodes if (tags.unit_of(n) or "").startswith("layers.2") and tags.get(n, RECOMPUTED)
    ]
    assert recomputed_earlier and last_of_later < min(pos[n] for n in recomputed_earlier)
    casts = [n for n in gm.graph.nodes if tags.get(n, CHUNKED_MODULE) and all(u.op == "output" for u in n.users)]
    assert casts and all(n not in m.nodes for m in modules for n in casts)


def test_chunking_keeps_fsdp_collectives_and_doubles_all_to_alls():
    plain = collective_counts(_graph(()).graph)
    chunked = collective_counts(_graph(tuple(_args("blocks_batch"))).graph)
    assert chunked["all_to_all_single"] == 2 * plain["all_to_all_single"] == 2 * 5 * len(MOE_LAYERS)
    for kind in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        assert chunked[kind] == plain[kind]  # parameters gathered once per module, not once per chunk


@pytest.mark.parametrize(
    "order",
    [
        "ep_overlap,transformer_block_bucketing",
        "transformer_block_bucketing,ep_overlap",
        "ep_overlap,transformer_block_bucketing,auto_bucketing",
    ],
)
def test_composes_with_fsdp_bucketing(order):
    world_size = 4  # FSDP=4 (dense), experts EP=2 x FSDP=2
    gm = _graph(tuple(_args("blocks_batch", passes=order)), world_size)
    assert verify_schedule(gm.graph) == []
    counts = collective_counts(gm.graph)
    assert counts["all_to_all_single"] == 2 * 5 * len(MOE_LAYERS)  # EP collectives are not bucketed
    fsdp_passes = ",".join(p for p in order.split(",") if p != "ep_overlap")
    bucketed = collective_counts(_graph(("--compile.passes", fsdp_passes), world_size).graph)
    for kind in ("all_gather_into_tensor", "all_gather_into_tensor_out", "reduce_scatter_tensor"):
        assert counts[kind] == bucketed[kind]  # chunking changes no FSDP collective
    # EP runs on its own process group, so hardware can overlap it with FSDP traffic.
    groups = {
        (collective_name(n), group_name(n)) for n in gm.graph.nodes if collective_name(n) not in (None, "wait_tensor")
    }
    ep_groups = {g for kind, g in groups if kind == "all_to_all_single"}
    fsdp_groups = {g for kind, g in groups if kind != "all_to_all_single"}
    assert ep_groups and not ep_groups & fsdp_groups


@pytest.mark.parametrize(
    "args, world_size, message",
    [
        (["--compile.passes", "ep_overlap"], 2, "needs a MoE model with parallelism.ep > 1 (got ep = 1"),
        (
            ["--parallelism.ep", "2", "--compile.passes", "ep_overlap", "--training.local_batch_size", "3"],
            2,
            "training.local_batch_size = 3 must be even and >= 2",
        ),
        (
            ["--parallelism.ep", "2", "--compile.passes", "ep_overlap", "--training.local_batch_size", "1"],
            2,
            "training.local_batch_size = 1 must be even and >= 2",
        ),
        (
            [
                "--parallelism.ep",
                "2",
                "--compile.passes",
                "ep_overlap",
                "--compile.ep_overlap.chunk_dim",
                "seq",
                "--training.seq_len",
                "33",
            ],
            2,
            "training.seq_len = 33 must be even",
        ),
        (
            ["--parallelism.ep", "2", "--compile.passes", "ep_overlap", "--compile.ep_overlap.chunk_dim", "hidden"],
            2,
            "chunk_dim = 'hidden' is not allowed; choose one of: batch, seq",
        ),
    ],
)
def test_rejected_at_config_validation(args, world_size, message):
    with pytest.raises(ConfigError) as info:
        validate_config(load_config([*DEEPSEEK, *args]), world_size)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_dense_model_rejected():
    with pytest.raises(ConfigError, match="needs a MoE model"):
        validate_config(load_config(["--compile.passes", "ep_overlap"]), 2)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--compile.ep_overlap.chunk_dim", "seq"], "chunk_dim = 'seq' needs MoE layers"),
        (["--compile.ep_overlap.module_fqn", "layers.*.attention"], "selects no module holding an expert-parallel"),
        (["--compile.ep_overlap.module_fqn", "blocks.*"], "selects no module holding an expert-parallel"),
    ],
)
def test_rejected_when_the_model_is_built(args, message):
    with pytest.raises(ConfigError, match=message):
        _graph(("--compile.passes", "ep_overlap", *args))
