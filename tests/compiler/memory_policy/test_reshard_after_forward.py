"""reshard_after_forward: backward re-gathers every parameter it reads.

That values do not change is the cpu suite's case `fsdp2_per_step` (weights gathered once and kept
for backward, bitwise `fsdp2_graph`, which re-gathers them, on gloo)."""

import pytest

from graph_trainer.analysis.memory import estimate_peak_memory
from graph_trainer.compiler.memory_policy.reshard_after_forward import unshard_chains, with_forward_views
from graph_trainer.config_loading import load_config
from graph_trainer.fake_trace import fake_world, trace_job
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import collective_counts, collective_name
from suites import CPU_BLOCKS

SMALL = ["--training.local_batch_size", "2", "--training.seq_len", "32", *CPU_BLOCKS]


def _trace(mode: str, world_size: int = 4, *extra: str):
    cfg = load_config([*SMALL, "--parallelism.fsdp_reshard_after_forward", mode, *extra])
    with fake_world(world_size):
        return trace_job(cfg, world_size).gm


def _phase(node):
    return tags.get(node, "phase")


@pytest.mark.parametrize("extra", [[], ["--parallelism.tp", "2"]], ids=["fsdp4", "fsdp2xtp2"])
def test_backward_reads_only_its_own_gathers(extra):
    kept, resharded = _trace("never", 4, *extra), _trace("always", 4, *extra)
    chains = unshard_chains(kept.graph)
    position = {n: i for i, n in enumerate(kept.graph.nodes)}
    read_in_backward = {
        fqn
        for (fqn, _), chain in chains.items()
        if any(_phase(u) == "backward" for n in with_forward_views(chain, position) for u in n.users)
    }
    # Every weight but the embedding table is read again by its backward.
    assert "tok_embeddings.weight" not in read_in_backward
    assert len(read_in_backward) == len(chains) - 1
    before, after = collective_counts(kept.graph), collective_counts(resharded.graph)
    assert after["all_gather_into_tensor"] == before["all_gather_into_tensor"] + len(read_in_backward)
    assert after["reduce_scatter_tensor"] == before["reduce_scatter_tensor"]
    # No forward gather (or view of one) feeds a backward node any more.
    position = {n: i for i, n in enumerate(resharded.graph.nodes)}
    for chain in unshard_chains(resharded.graph).values():
        for node in with_forward_views(chain, position):
            assert all(_phase(u) != "backward" for u in node.users), node
    recomputed = [n for n in resharded.graph.nodes if tags.get(n, "recomputed")]
    assert recomputed and all(_phase(n) == "backward" for n in recomputed)
    # Unsharded weights no longer live from forward to backward.
    assert estimate_peak_memory(resharded.graph).peak_bytes < estimate_peak_memory(kept.graph).peak_bytes


def test_single_process_graph_is_left_alone():
    cfg = load_config(SMALL)
    gm = trace_job(cfg, 1).gm
    assert not unshard_chains(gm.graph)
    assert not any(tags.get(n, "recomputed") for n in gm.graph.nodes)


def test_default_keeps_the_heads_gathers_for_its_backward():
    """'default' re-gathers what 'always' does but the final norm's and output projection's weights,
    whose forward gathers the backward (which starts with them) reads instead."""
    default, always = _trace("default"), _trace("always")
    head = {"norm.weight", "output.weight"}

    def regathered(gm):
        return {
            tags.get(n, "fsdp_param") for n in gm.graph.nodes if tags.get(n, "recomputed") and tags.has(n, "fsdp_role")
        }

    assert head <= regathered(always)
    assert regathered(default) == regathered(always) - head
    position = {n: i for i, n in enumerate(default.graph.nodes)}
    for (param, _), chain in unshard_chains(default.graph).items():
        read_in_backward = any(_phase(u) == "backward" for n in with_forward_views(chain, position) for u in n.users)
        assert read_in_backward == (param in head), param
    gathers = collective_counts(default.graph)["all_gather_into_tensor"]
    assert gathers == collective_counts(always.graph)["all_gather_into_tensor"] - len(head)
    # Memory: at most the head's gathered weights more at the peak (the forward's copy lives from
    # the loss to the backward's start, where the re-gathered one lives instead under 'always').
    head_bytes = sum(
        n.meta["val"].untyped_storage().nbytes()
        for n in default.graph.nodes
        if collective_name(n) == "all_gather_into_tensor" and tags.get(n, "fsdp_param") in head
    )
    peak_default, peak_always = (estimate_peak_memory(gm.graph).peak_bytes for gm in (default, always))
    assert peak_always <= peak_default <= peak_always + head_bytes
