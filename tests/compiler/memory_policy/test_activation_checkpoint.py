"""Activation checkpointing (memory_policy/activation_checkpoint.py) and the chunked loss, on traced graphs.

Graph structure on the fake process group (one process): what is recomputed per block, that no
collective is issued twice, that later passes keep the decisions, and that the memory estimate
falls with each mode. The bitwise-equal losses of every mode on gloo (FSDP=2 + bucketing,
FSDP=2 x TP=2, DeepSeek-V3 EP=2 + ep_overlap) are cases of the cpu suite (``integration_tests.py``);
those of ``selective_matmuls`` 'every_other' are run here (FSDP=2 + bucketing).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import pytest
import torch

from graph_trainer.analysis.memory import estimate_step_memory
from graph_trainer.compiler.memory_policy.activation_checkpoint import recompute_counts, region_modes
from graph_trainer.config_loading import load_config
from graph_trainer.errors import ConfigError
from graph_trainer.fake_trace import fake_world, trace_job, trace_pipeline
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import collective_counts, is_collective
from graph_trainer.graph.ops import is_attention, is_matmul, name_of
from graph_trainer.graph.tags import (
    ACTIVATION,
    FSDP_ROLE,
    LOSS_CHUNK,
    RECOMPUTE,
    RECOMPUTED,
    SAVE,
    SEQUENCE_GATHER,
    TP_ROLE,
)
from graph_trainer.validation import validate_config
from models.registry import MODEL_SPECS
from tests.conftest import ROOT
from tests.graph_compare import node_multiset
from tests.launch import read_losses, run_train

SMALL = ["--training.seq_len", "32", "--training.local_batch_size", "2"]
DEEPSEEK = ["--job.config_file", f"{ROOT}/configs/deepseek_v3_debug.toml", *SMALL]
LLAMA_BLOCKS = 2


@functools.cache
def _graph(args: tuple[str, ...], world_size: int = 2):
    cfg = load_config(list(args))
    validate_config(cfg, world_size)
    flavors = MODEL_SPECS[cfg.model.name].flavors
    model_args = dataclasses.replace(
        flavors[cfg.model.flavor], n_layers=LLAMA_BLOCKS if cfg.model.name == "llama3" else 3
    )  # DeepSeek: layer 0 dense, layers 1-2 MoE
    with fake_world(world_size) if world_size > 1 else _nothing():
        return trace_job(cfg, world_size, model_args=model_args).gm


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _ac(mode: str) -> tuple[str, ...]:
    return ("--activation_checkpoint.mode", mode)


def _launches(gm) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if is_collective(n))


@pytest.mark.parametrize(
    "layout, world_size",
    [
        ((*SMALL,), 2),
        ((*SMALL, "--parallelism.tp", "2"), 4),
        ((*SMALL, "--parallelism.tp", "2", "--parallelism.no_sequence_parallel"), 4),
        ((*DEEPSEEK, "--parallelism.ep", "2"), 2),
    ],
    ids=["fsdp2", "fsdp2xtp2", "fsdp2xtp2_no_sp", "deepseek_ep2"],
)
def test_recomputation_per_block_and_no_collective_issued_twice(layout, world_size):
    none = _graph(layout, world_size)
    sequence_parallel = "--parallelism.tp" in layout and "--parallelism.no_sequence_parallel" not in layout
    for mode in ("selective", "full"):
        gm = _graph((*layout, *_ac(mode)), world_size)
        counts = recompute_counts(gm.graph)
        blocks = sorted(b for b in counts if b.startswith("layers."))
        assert len(blocks) == (LLAMA_BLOCKS if "deepseek" not in str(layout) else 3), counts
        # Sequence parallel's gathers of a region's input (attention's, the feed-forward's: a
        # launch and its wait each) run again for backward; no other collective does.
        gathers = 4 if sequence_parallel else 0
        for block in blocks:
            assert counts[block]["nodes"] > 0 and counts[block]["collectives"] == gathers, (mode, block, counts[block])
            if mode == "selective":
                assert counts[block]["matmuls"] == 0, (block, counts[block])  # matmul outputs are saved
            else:
                assert counts[block]["matmuls"] >= 3, (block, counts[block])  # q/k/v projections at least
        # Every other collective (FSDP gathers and reductions, TP reductions, EP all_to_alls) as
        # many times as without the policy: recomputations read the backward re-gathers of
        # reshard_after_forward and the saved outputs of TP/EP exchanges.
        recomputed = [n for n in gm.graph.nodes if is_collective(n) and tags.get(n, RECOMPUTED)]
        policy_copies = [n for n in recomputed if not tags.get(n, FSDP_ROLE)]  # (not reshard's re-gathers)
        assert all(tags.get(n, TP_ROLE) == SEQUENCE_GATHER for n in policy_copies), policy_copies
        again = Counter(str(n.target) for n in policy_copies)
        assert _launches(gm) - again == _launches(none), mode
        # Each copy says what it recomputes; each original is recomputed at most once.
        copies = [n for n in gm.graph.nodes if tags.get(n, RECOMPUTED) and tags.has(n, "recompute_of")]
        of = Counter(tags.get(n, "recompute_of") for n in copies)
        assert copies and max(of.values()) == 1
        assert all(tags.get(n, "phase") == "backward" for n in copies)
        # Recomputation happens in backward: every copy comes after the loss.
        position = {n: i for i, n in enumerate(gm.graph.nodes)}
        last_loss = max(position[n] for n in gm.graph.nodes if tags.get(n, "phase") == "loss")
        assert min(position[n] for n in copies) > last_loss


def test_full_recomputes_more_than_selective_and_the_tags_are_the_decision():
    selective = recompute_counts(_graph((*SMALL, *_ac("selective"))).graph)
    full = recompute_counts(_graph((*SMALL, *_ac("full"))).graph)
    for block in ("layers.0", "layers.1"):
        assert full[block]["nodes"] > selective[block]["nodes"]
    gm = _graph((*SMALL, *_ac("full")))
    tagged = [n for n in gm.graph.nodes if tags.get(n, ACTIVATION) == RECOMPUTE]
    copies = {tags.get(n, "recompute_of") for n in gm.graph.nodes if tags.has(n, "recompute_of")}
    # exactly the tagged values were copied (an original only the backward read is gone: dead after the copy)
    names = {n.name for n in gm.graph.nodes}
    assert {n.name for n in tagged} == copies & names


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_a_float8_casts_amax_is_kept_in_every_mode(mode):
    """A tensorwise float8 cast's amax is one number: kept, it costs nothing; recomputed, one more
    pass over the whole input. Every mode keeps it."""
    gm = _graph((*SMALL, *_ac(mode), "--float8.recipe_name", "tensorwise"))
    amaxes = [n for n in gm.graph.nodes if name_of(n) == "max" and tags.phase(n) == tags.FORWARD]
    assert amaxes and all(tags.get(n, ACTIVATION) == SAVE for n in amaxes if tags.has(n, ACTIVATION))
    assert any(tags.has(n, ACTIVATION) for n in amaxes)  # the backward reads them
    assert not [n for n in gm.graph.nodes if name_of(n) == "max" and tags.get(n, RECOMPUTED)]


@pytest.mark.parametrize("gpu_attention", [False, True], ids=["cpu_flash", "cudnn"])
def test_full_recomputes_attention_without_dropout(gpu_attention):
    """Fused attention ops are tagged random (they can drop out); with dropout_p 0 they compute the
    same values every run, so ``full`` recomputes them and keeps only the blocks' inputs (selective
    saves them: they are in ``selective_ops``)."""
    cfg = load_config([*SMALL, *_ac("full")])
    model_args = dataclasses.replace(MODEL_SPECS["llama3"].flavors[cfg.model.flavor], n_layers=LLAMA_BLOCKS)
    with fake_world(2):
        gm = trace_job(cfg, 2, model_args=model_args, gpu_attention=gpu_attention).gm
    forward = [n for n in gm.graph.nodes if is_attention(n) and tags.get(n, "phase") == "forward"]
    assert len(forward) == LLAMA_BLOCKS
    assert all(tags.get(n, ACTIVATION) == RECOMPUTE for n in forward)
    copies = [n for n in gm.graph.nodes if is_attention(n) and tags.get(n, RECOMPUTED)]
    assert len(copies) == LLAMA_BLOCKS


@pytest.mark.parametrize("passes", ["transformer_block_bucketing", "transformer_block_bucketing,auto_bucketing"])
def test_later_passes_keep_the_recomputation_as_decided(passes):
    """Bucketing moves and merges collectives; it must neither drop nor repeat a recomputation."""
    plain = _graph((*SMALL, *_ac("full")))
    bucketed = _graph((*SMALL, *_ac("full"), "--compile.passes", passes))

    def copies(gm):
        return Counter(tags.get(n, "recompute_of") for n in gm.graph.nodes if tags.has(n, "recompute_of"))

    assert copies(bucketed) == copies(plain)
    assert recompute_counts(bucketed.graph) == recompute_counts(plain.graph)


def test_ep_overlap_schedules_the_recomputed_graph():
    from graph_trainer.compiler.passes.ep_overlap import verify_schedule

    overlap = ("--compile.passes", "ep_overlap", "--compile.ep_overlap.module_fqn", "layers.*.moe")
    chunked = _graph(
        (*DEEPSEEK, "--parallelism.ep", "2", *_ac("full"), *overlap, "--compile.ep_overlap.reorder", "False")
    )
    scheduled = _graph((*DEEPSEEK, "--parallelism.ep", "2", *_ac("full"), *overlap))
    assert verify_schedule(scheduled.graph) == []
    assert node_multiset(scheduled.graph) == node_multiset(chunked.graph)  # reordered, nothing added or lost
    assert recompute_counts(scheduled.graph) == recompute_counts(chunked.graph)


def test_each_mode_lowers_the_estimated_peak():
    longer = ["--training.seq_len", "256", "--training.local_batch_size", "4"]
    peaks = {}
    for mode in ("none", "selective", "full"):
        gm = _graph((*longer, *_ac(mode)))
        peaks[mode] = estimate_step_memory(gm.graph, None, load_config(longer).training).moments[0].activations
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks


EVERY_OTHER = ("--activation_checkpoint.selective_matmuls", "every_other")


def test_every_other_matmul_recomputes_each_blocks_even_matmuls():
    """torchtitan's op-level policy: a block's 2nd, 4th, ... matmul in forward order (wk, wo, w3 of a
    LLaMA block) is recomputed, the others saved; between 'all' and 'full' in memory."""
    gm = _graph((*SMALL, *_ac("selective"), *EVERY_OTHER))
    for block in ("layers.0", "layers.1"):
        forward = [
            n for n in gm.graph.nodes if is_matmul(n) and tags.phase(n) == "forward" and tags.unit_of(n) == block
        ]
        fqns = [tags.module_fqn(n).removeprefix(f"{block}.") for n in forward]
        assert fqns == [*(f"attention.{w}" for w in ("wq", "wk", "wv", "wo")), "feed_forward.w1", "feed_forward.w3"] + [
            "feed_forward.w2"
        ]
        decisions = [tags.get(n, ACTIVATION) for n in forward]
        assert decisions[1::2] == [RECOMPUTE] * 3  # wk, wo, w3
        assert all(d in (SAVE, None) for d in decisions[0::2])  # (w2's output: no backward reads it)
        assert recompute_counts(gm.graph)[block]["matmuls"] == 3
    longer = ["--training.seq_len", "256", "--training.local_batch_size", "4"]
    training = load_config(longer).training
    peak = lambda args: estimate_step_memory(_graph(args).graph, None, training).moments[0].activations  # noqa: E731
    every_other = peak((*longer, *_ac("selective"), *EVERY_OTHER))
    assert peak((*longer, *_ac("full"))) < every_other < peak((*longer, *_ac("selective")))


def test_every_other_matmul_trains_bitwise_as_without_recomputation(tmp_path):
    """Real 2-rank gloo jobs (FSDP=2, per-block bucketing, 3 steps): the losses of 'selective' with
    every other matmul recomputed are bitwise those of no checkpointing (a recomputation runs the
    same ops on the same inputs)."""
    losses = {}
    for name, flags in (("none", _ac("none")), ("every_other", (*_ac("selective"), *EVERY_OTHER))):
        folder = tmp_path / name
        run_train(2, folder, "--training.steps", "3", "--compile.passes", "transformer_block_bucketing", *flags)
        losses[name] = read_losses(folder)
    assert len(losses["none"]) == 3 and losses["every_other"] == losses["none"]


def test_chunked_loss_recomputes_each_chunk_and_lowers_the_peak():
    longer = ["--training.seq_len", "256", "--training.local_batch_size", "4"]
    one = _graph(tuple(longer))
    four = _graph((*longer, "--training.loss_chunks", "4"))
    counts = recompute_counts(four.graph)
    assert sorted(k for k in counts if k.startswith(LOSS_CHUNK)) == [f"{LOSS_CHUNK}.{k}" for k in range(4)]
    # each chunk's logits (its slice of the output matmul) are recomputed in backward, nothing else
    assert all(counts[f"{LOSS_CHUNK}.{k}"]["matmuls"] == 1 for k in range(4)), counts
    assert not any(k.startswith("layers.") for k in counts)  # mode none: the blocks keep everything
    assert collective_counts(four.graph) == collective_counts(one.graph)
    training = load_config(longer).training
    peak = lambda gm: estimate_step_memory(gm.graph, None, training).moments[0].activations  # noqa: E731
    assert peak(four) < peak(one)


def test_full_blocks_recompute_a_graphs_first_blocks_in_full_and_the_others_by_mode():
    selective = recompute_counts(_graph((*SMALL, *_ac("selective"))).graph)
    full = recompute_counts(_graph((*SMALL, *_ac("full"))).graph)
    mixed = recompute_counts(_graph((*SMALL, *_ac("selective"), "--activation_checkpoint.full_blocks", "1")).graph)
    assert mixed["layers.0"] == full["layers.0"] and mixed["layers.1"] == selective["layers.1"]
    assert full["layers.0"] != selective["layers.0"]
    # with mode none the other blocks keep everything, as without the policy
    first_only = recompute_counts(_graph((*SMALL, "--activation_checkpoint.full_blocks", "1")).graph)
    assert first_only == {"layers.0": full["layers.0"]}
    # more than the graph has: every block full
    assert recompute_counts(_graph((*SMALL, "--activation_checkpoint.full_blocks", "5")).graph) == full
    # by block index, not by name: layers.10 comes after layers.9
    assert region_modes({"layers.10", "layers.9", "layers.2", f"{LOSS_CHUNK}.0"}, "none", 2) == {
        "layers.2": "full",
        "layers.9": "full",
        "layers.10": "none",
        f"{LOSS_CHUNK}.0": "full",
    }


def test_full_blocks_counts_each_pipeline_stages_first_blocks():
    cfg = load_config(
        [*SMALL, "--parallelism.pp", "2", "--training.global_batch_size", "8", "--model.n_layers", "4"]
        + ["--activation_checkpoint.full_blocks", "1"]
    )
    validate_config(cfg, 2)
    with fake_world(2):
        traced = trace_pipeline(cfg, 2)
    recomputed = {s: sorted(recompute_counts(t.gm.graph)) for s, t in traced.stages.items()}
    assert recomputed == {0: ["layers.0"], 1: ["layers.2"]}


def test_config_errors():
    with pytest.raises(ConfigError, match="activation_checkpoint.mode = 'some' is not allowed"):
        validate_config(load_config(_ac("some")))
    with pytest.raises(ConfigError, match="needs compile.mode = 'graph'"):
        validate_config(load_config([*_ac("full"), "--compile.mode", "eager"]))
    with pytest.raises(ConfigError, match="matmull is not an aten op name"):
        validate_config(load_config([*_ac("selective"), "--activation_checkpoint.selective_ops", "mm,matmull"]))
    with pytest.raises(ConfigError, match="training.loss_chunks = 0 must be between 1"):
        validate_config(load_config(["--training.loss_chunks", "0"]))
    with pytest.raises(ConfigError, match="activation_checkpoint.full_blocks = -1 must be 0"):
        validate_config(load_config([*_ac("selective"), "--activation_checkpoint.full_blocks", "-1"]))
    for mode in (["--compile.mode", "eager"], _ac("full")):
        with pytest.raises(ConfigError, match="activation_checkpoint.full_blocks = 2 means something only with "):
            validate_config(load_config([*mode, "--activation_checkpoint.full_blocks", "2"]))
    cfg = load_config(["--activation_checkpoint.selective_ops", "mm, bmm"])
    assert cfg.activation_checkpoint.selective_ops == ["mm", "bmm"]
    assert load_config([*_ac("selective"), *EVERY_OTHER]).activation_checkpoint.selective_matmuls == "every_other"
    with pytest.raises(ConfigError, match="selective_matmuls"):
        load_config(["--activation_checkpoint.selective_matmuls", "odd"])
    for mode in ("none", "full"):
        with pytest.raises(ConfigError, match="selective_matmuls = 'every_other' means something only with "):
            validate_config(load_config([*_ac(mode), *EVERY_OTHER]))


def test_chunked_loss_value_is_the_unchunked_one_to_an_ulp():
    from graph_trainer.build import build_model
    from graph_trainer.compiler.tracer import eager_step

    spec = MODEL_SPECS["llama3"]
    model = build_model(
        spec.build, dataclasses.replace(spec.flavors["debugmodel"], n_layers=1), torch.device("cpu"), seed=3
    )
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 2048, (3, 40), generator=g) for _ in range(2))
    loss_1, grads_1 = eager_step(model, tokens, labels, 1)
    for chunks in (2, 7, 120):  # uneven splits, and one token per chunk (MKL's vector kernel)
        loss_k, grads_k = eager_step(model, tokens, labels, chunks)
        assert abs(loss_k.item() - loss_1.item()) <= 2.5e-7 * loss_1.item(), (chunks, loss_k, loss_1)
        for g1, gk in zip(grads_1, grads_k, strict=True):  # the output weight's gradient sums chunks in another order
            torch.testing.assert_close(gk, g1, rtol=1e-5, atol=1e-7)
