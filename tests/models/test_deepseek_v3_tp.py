"""Tensor parallel for DeepSeek-V3 (models/deepseek_v3/parallelize.py), alone and with FSDP and EP.

- ``validate_parallelism``: one ``ConfigError`` line per shape the plan splits over tp, and
  train.py's exit code 2 for one of them;
- the plan: which parameters tp splits (and how), which stay whole, on which mesh dims each
  lives, on a model built on meta in a fake world;

The real gloo jobs are the cpu suite's ``deepseek_2l_*`` cases (suites/cpu.py): TP=2, FSDP=2 x
TP=2 and TP=2 x EP=2 on the debug model cut to 2 layers (1 dense + 1 MoE), graph bitwise eager
(losses and step-1 gradients) and within float rounding of one process on the same global
batch. The gradient record is what catches a wrong tp reduction: without ``SumGradOverTP`` the
step-1 gradients deviate by about 3e-2, the losses far less (AdamW and clipping).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from graph_trainer.build import build_job_model, build_layout
from graph_trainer.config_loading import load_config
from graph_trainer.distributed.simple_fsdp import clean_fqn
from graph_trainer.errors import ConfigError
from graph_trainer.fake_trace import fake_world
from graph_trainer.validation import validate_config
from models.deepseek_v3.flavors import FLAVORS
from models.deepseek_v3.parallelize import SumGradOverTP, validate_parallelism
from tests.conftest import ROOT
from tests.deepseek_v3_tiny import TINY_V3
from tests.reliability.helpers import train_py

DEEPSEEK = ["--job.config_file", f"{ROOT}/configs/deepseek_v3_debug.toml"]
DEGREES = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "ep": 1}

# --------------------------------------------------------------------------------------
# validate_parallelism: one line per shape tp splits


@pytest.mark.parametrize(
    "change, tp, message",
    [
        ({}, 3, "parallelism.tp = 3 does not divide the model's n_heads (16)"),
        ({"vocab_size": 2050}, 4, "parallelism.tp = 4 does not divide the model's vocab_size (2050)"),
        ({"inter_dim": 1026}, 4, "parallelism.tp = 4 does not divide the model's inter_dim (1026)"),
        (
            {"moe_inter_dim": 258},
            8,
            "parallelism.tp = 8 does not divide the model's n_shared_experts * moe_inter_dim (516)",
        ),
    ],
    ids=["n_heads", "vocab_size", "inter_dim", "shared_experts"],
)
def test_tp_that_does_not_divide_a_split_shape_is_one_line(change, tp, message):
    args = dataclasses.replace(FLAVORS["debugmodel"], **change)
    with pytest.raises(ConfigError) as info:
        validate_parallelism(args, {**DEGREES, "tp": tp})
    assert str(info.value) == message


def test_shapes_tp_does_not_split_are_not_checked():
    debug = FLAVORS["debugmodel"]
    # the routed experts' width (not split: experts are whole on every tp rank)
    validate_parallelism(dataclasses.replace(debug, moe_inter_dim=258, n_shared_experts=0), {**DEGREES, "tp": 8})
    # no dense layer, no dense width to split
    validate_parallelism(dataclasses.replace(debug, n_dense_layers=0, inter_dim=1026), {**DEGREES, "tp": 4})
    validate_parallelism(debug, {**DEGREES, "dp_shard": 2, "tp": 2, "ep": 2})


def test_train_py_rejects_tp_not_dividing_the_heads_with_exit_2(tmp_path, monkeypatch):
    # Config validation runs before any process group exists, on the WORLD_SIZE torchrun sets:
    # one process with that environment does what every rank of a 3-process job does first.
    monkeypatch.setenv("WORLD_SIZE", "3")
    result = train_py(*DEEPSEEK, "--job.dump_folder", str(tmp_path), "--parallelism.tp", "3")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: parallelism.tp = 3 does not divide the model's n_heads (16)"
    ], result.stderr


# --------------------------------------------------------------------------------------
# The plan, on a model built on meta in a fake world


def _built(world_size: int, *flags: str, args=None) -> tuple[dict[str, tuple[tuple[str, ...], tuple]], torch.nn.Module]:
    """(parameter FQN in the plain model -> (its mesh dims, its placements); () for a plain
    tensor), and the model, of a job built on meta at ``world_size``."""
    cfg = load_config([*DEEPSEEK, *flags])
    validate_config(cfg, world_size=world_size)
    with fake_world(world_size):
        model = build_job_model(cfg, build_layout(cfg, world_size, "cpu", args), torch.device("meta"))
    layout = {
        clean_fqn(name): (p.device_mesh.mesh_dim_names, tuple(p.placements)) if isinstance(p, DTensor) else ((), ())
        for name, p in model.named_parameters()
    }
    return layout, model


def _on_tp(layout, fqn) -> object:
    """The placement of ``fqn`` on ``tp``, or None if it does not live on ``tp``."""
    dims, placements = layout[fqn]
    return placements[dims.index("tp")] if "tp" in dims else None


COLWISE = ["attention.wq", "attention.wkv_b", "{ffn}.w1", "{ffn}.w3"]
ROWWISE = ["attention.wo", "{ffn}.w2"]
WHOLE = ["attention.wkv_a", "attention.kv_norm"]
SEQUENCE_NORMS = ["attention_norm", "ffn_norm"]
"""Under sequence parallel: computed on the rank's piece of the sequence, their weights replicated
over tp (their gradients summed there); without it, whole like ``WHOLE``."""


@pytest.mark.parametrize(
    "world_size, flags, dp_dims, expert_dims",
    [
        (2, ["--parallelism.tp", "2"], (), ()),
        (4, ["--parallelism.tp", "2"], ("dp_shard",), ("dp_shard",)),
        (4, ["--parallelism.tp", "2", "--parallelism.no_sequence_parallel"], ("dp_shard",), ("dp_shard",)),
        # ep = 2 over the tp ranks under sequence parallel: the experts shard over the 2 dp_shard ranks
        (4, ["--parallelism.tp", "2", "--parallelism.ep", "2"], ("dp_shard",), ("efsdp", "ep")),
        (
            4,
            ["--parallelism.tp", "2", "--parallelism.ep", "2", "--parallelism.no_sequence_parallel"],
            ("dp_shard",),
            ("ep",),
        ),
        (
            8,
            ["--parallelism.tp", "2", "--parallelism.ep", "2", "--parallelism.dp_replicate", "2"],
            ("dp_replicate", "dp_shard"),
            ("dp_replicate", "efsdp", "ep"),
        ),
    ],
    ids=["tp2", "fsdp2xtp2", "fsdp2xtp2_no_sp", "tp2xep2", "tp2xep2_no_sp", "hsdp2x2xtp2xep2"],
)
def test_the_plan_places_each_parameter(world_size, flags, dp_dims, expert_dims):
    layout, model = _built(world_size, *flags)
    sequence_parallel = "--parallelism.no_sequence_parallel" not in flags
    assert model.sequence_shards == (2 if sequence_parallel else 1)
    for block, ffn in (("0", "feed_forward"), ("1", "moe.shared_experts")):  # debugmodel: 1 dense, then MoE
        for names, on_tp in ((COLWISE, Shard(0)), (ROWWISE, Shard(1))):
            for name in names:
                fqn = f"layers.{block}.{name.format(ffn=ffn)}.weight"
                assert layout[fqn][0] == (*dp_dims, "tp") and _on_tp(layout, fqn) == on_tp, fqn
        for name in WHOLE:
            assert layout[f"layers.{block}.{name}.weight"][0] == dp_dims, name
        for name in SEQUENCE_NORMS:
            fqn = f"layers.{block}.{name}.weight"
            if sequence_parallel:
                assert layout[fqn][0] == (*dp_dims, "tp") and _on_tp(layout, fqn) == Replicate(), fqn
            else:
                assert layout[fqn][0] == dp_dims, fqn
        assert isinstance(model.layers[block].attention.k_rope_grad_reduce, SumGradOverTP)
    # Routed experts and the router are whole (not split over tp). Where each tp rank routes its own
    # tokens (sequence parallel with ep) the gate's weight is replicated over tp (its gradient summed
    # there) and the experts' ep ranks include the tp ranks; otherwise neither lives on tp.
    gate = "layers.1.moe.router.gate.weight"
    if sequence_parallel and "--parallelism.ep" in flags:
        assert layout[gate][0] == (*dp_dims, "tp") and _on_tp(layout, gate) == Replicate()
    else:
        assert layout[gate][0] == dp_dims
    for w in ("w1", "w2", "w3"):
        assert layout[f"layers.1.moe.experts.{w}"][0] == expert_dims
    assert _on_tp(layout, "tok_embeddings.weight") == Shard(0)  # rows: the vocabulary
    assert _on_tp(layout, "output.weight") == Shard(0)  # output features: the vocabulary
    if sequence_parallel:  # the final norm computes on this rank's piece of the sequence, as the block norms
        assert layout["norm.weight"][0] == (*dp_dims, "tp") and _on_tp(layout, "norm.weight") == Replicate()
    else:
        assert layout["norm.weight"][0] == dp_dims


def test_the_plan_with_a_low_rank_query_and_no_shared_experts():
    layout, _ = _built(4, "--parallelism.tp", "2", args=TINY_V3)
    for block in ("layers.0.", "layers.1."):
        assert _on_tp(layout, f"{block}attention.wq_b.weight") == Shard(0)
        assert _on_tp(layout, f"{block}attention.wq_a.weight") is None
        assert _on_tp(layout, f"{block}attention.q_norm.weight") is None
    assert not any("shared_experts" in fqn for fqn in layout)
