"""Weights resident per step as graphs (graph_trainer/compiler/resident.py), traced on the fake
process group: every SimpleFSDP collective leaves the microbatch's graph for the once-per-step
gather and reduce graphs, one for one; the memory estimate counts the gathered weights as resident.
(The values: the cpu suite's fsdp2_per_step, fsdp2_accum2_per_step and pp2xfsdp2_zbv cases, and
tests/loop/test_grad_record.py against one process.)"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

from graph_trainer.analysis.memory import estimate_step_memory
from graph_trainer.build import build_job_model, build_layout
from graph_trainer.compiler.resident import trace_resident
from graph_trainer.compiler.tracer import trace_train_step
from graph_trainer.config_loading import load_config
from graph_trainer.fake_trace import fake_world
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import collective_name, is_collective
from graph_trainer.graph.tags import FSDP_PARAM, FSDP_ROLE, GATHERED, REDUCE_GRAD, UNSHARD

SMALL = ["--training.local_batch_size", "1", "--training.seq_len", "16", "--model.n_layers", "2"]
BF16 = ["--training.mixed_precision_param", "bfloat16"]
LAYOUTS = {
    "fsdp2": (2, []),
    "hsdp2x2": (4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"]),
    "ddp2": (2, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1"]),
    "fsdp2xtp2": (4, ["--parallelism.tp", "2"]),
}


@functools.cache
def _traces(layout: str):
    """(the per-step trace, the per-microbatch joint graph, the model's parameters) of a layout."""
    world, flags = LAYOUTS[layout]
    cfg = load_config([*SMALL, *BF16, *flags])
    tokens = torch.empty(1, 16, dtype=torch.long, device="meta")
    with fake_world(world):
        job = build_layout(cfg, world, "cpu")
        model = build_job_model(cfg, job, torch.device("meta"))
        cpu = torch.device("cpu")
        per_step = trace_resident(model, tokens, tokens, grad_scale=job.loss_scale, fake_device=cpu)
        per_microbatch = trace_train_step(model, tokens, tokens, grad_scale=job.loss_scale, fake_device=cpu)
    return per_step, per_microbatch.gm, list(model.parameters())


def _fsdp_collectives(gm, role: str) -> Counter:
    return Counter(
        (collective_name(n), tags.get(n, FSDP_PARAM))
        for n in gm.graph.nodes
        if is_collective(n) and tags.get(n, FSDP_ROLE) == role
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_data_parallel_collective_moves_to_the_once_per_step_graphs(layout):
    trace, per_microbatch, _ = _traces(layout)
    step = trace.step.gm
    assert not [n for n in step.graph.nodes if is_collective(n) and tags.has(n, FSDP_ROLE)]
    for role, once in ((UNSHARD, trace.gather), (REDUCE_GRAD, trace.reduce)):
        moved = _fsdp_collectives(once, role)
        assert moved == _fsdp_collectives(per_microbatch, role), role
        if role == REDUCE_GRAD or layout != "ddp2":  # (DDP gathers nothing: replicated weights)
            assert len({p for _, p in moved}) == len(trace.weights.gathered_index)
    kept = Counter(collective_name(n) for n in step.graph.nodes if is_collective(n))
    assert bool(kept) == (layout == "fsdp2xtp2")  # tensor parallel's all-reduces stay per microbatch


@pytest.mark.parametrize("layout", ["fsdp2", "fsdp2xtp2"])
def test_the_microbatch_graph_computes_with_the_gathered_weights_and_sums_in_the_reduce_dtype(layout):
    trace, _, _ = _traces(layout)
    placeholders = [n for n in trace.step.gm.graph.nodes if n.op == "placeholder"]
    gathered = [n for n in placeholders if tags.get(n, FSDP_ROLE) == GATHERED]
    n = len(trace.weights.gathered_index)
    assert gathered == placeholders[:n]
    gather_outputs = next(x for x in trace.gather.graph.nodes if x.op == "output").args[0]
    assert [g.meta["val"].shape for g in gathered] == [o.meta["val"].shape for o in gather_outputs]
    assert {g.meta["val"].dtype for g in gathered} == {torch.bfloat16}
    outputs = next(x for x in trace.step.gm.graph.nodes if x.op == "output").args[0]
    sums = outputs[1 : 1 + n]  # (after the loss)
    assert [s.meta["val"].shape for s in sums] == [g.meta["val"].shape for g in gathered]
    assert {s.meta["val"].dtype for s in sums} == {torch.float32}  # mixed_precision_reduce


def test_the_memory_estimate_holds_the_gathered_weights_for_the_step():
    trace, _, params = _traces("fsdp2")
    estimate = estimate_step_memory(trace.step.gm.graph, params, microbatches=2)
    moments = {m.moment: m for m in estimate.moments}
    gathered = sum(n.meta["val"].numel() * 2 for n in trace.step.gm.graph.nodes if tags.get(n, FSDP_ROLE) == GATHERED)
    param_bytes = sum(p.to_local().numel() * 4 for p in params)
    assert moments["graph"].resident_weights == gathered == moments["gradient reduction"].resident_weights
    # the gathered weights' fp32 sums, then the reduced gradients in the parameters' layout
    assert moments["gradient reduction"].accumulated_grads == 2 * gathered
    assert moments["gradient reduction"].grads == moments["optimizer step"].grads == param_bytes


def test_a_model_with_nothing_gathered_is_refused():
    cfg = load_config(SMALL)
    model = build_job_model(cfg, build_layout(cfg, 1, "cpu"), torch.device("meta"))
    tokens = torch.empty(1, 16, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="nothing to keep resident"):
        trace_resident(model, tokens, tokens, fake_device=torch.device("cpu"))
