"""graph_trainer.pipelining.timeline: the replayed schedule against the closed forms of uniform
stages, the in-flight activations each schedule holds, and a real estimate on the fake process group."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graph_trainer.analysis.devices import DEVICES
from graph_trainer.analysis.memory import adamw_memory
from graph_trainer.analysis.optimizer_step import OptimizerStepCost
from graph_trainer.config_loading import load_config
from graph_trainer.fake_trace import fake_world, trace_pipeline
from graph_trainer.pipelining.schedule import PipelinePlan, plan_pipeline
from graph_trainer.pipelining.timeline import StageCost, estimate_pipeline, rank_memory, replay_pipeline

F, B = 1.0, 2.0


def _uniform(plan: PipelinePlan, saved: int = 0, kept: int = 0, peak: int = 0) -> dict[int, StageCost]:
    cost = StageCost({"F": F, "B": B, "I": B / 2, "W": B / 2}, dict.fromkeys("FBIW", peak), saved, kept, [])
    return dict.fromkeys(range(plan.num_stages), cost)


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
@pytest.mark.parametrize("pp, m", [(2, 1), (2, 4), (4, 8), (4, 3)])
def test_one_stage_per_rank_matches_the_closed_form(schedule, pp, m):
    # uniform stages, no transfer time: (M + pp - 1) x (F + B), bubble (pp - 1) / (M + pp - 1)
    plan = plan_pipeline(schedule, pp, m)
    timeline = replay_pipeline(plan, _uniform(plan))
    assert timeline.step_seconds == (m + pp - 1) * (F + B)
    assert timeline.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))


def test_transfers_between_ranks_add_to_the_critical_path():
    # pp = 2, one microbatch: F0, send, F1, B1, send back, B0
    plan = plan_pipeline("1F1B", 2, 1)
    assert replay_pipeline(plan, _uniform(plan), 0.25).step_seconds == 2 * F + 2 * B + 2 * 0.25
    # the V schedule's two middle stages share a rank: no transfer between them
    plan = plan_pipeline("ZBVZeroBubble", 2, 4)
    with_p2p = replay_pipeline(plan, _uniform(plan), {0: 0.25, 1: 10.0, 2: 0.25}).step_seconds
    assert with_p2p == replay_pipeline(plan, _uniform(plan), {0: 0.25, 1: 0.0, 2: 0.25}).step_seconds


def test_zero_bubble_schedules_fill_more_of_the_step():
    bubbles = {}
    for schedule in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble"):
        plan = plan_pipeline(schedule, 4, 16)
        per_stage = 4 / plan.num_stages  # the same work per rank whatever the stage count
        cost = StageCost(
            {"F": F * per_stage, "B": B * per_stage, "I": B * per_stage / 2, "W": B * per_stage / 2},
            dict.fromkeys("FBIW", 0),
            0,
            0,
            [],
        )
        bubbles[schedule] = replay_pipeline(plan, dict.fromkeys(range(plan.num_stages), cost)).bubble_fraction
    assert bubbles["ZBVZeroBubble"] < bubbles["Interleaved1F1B"] < bubbles["1F1B"]


def test_a_plan_that_cannot_proceed_is_refused():
    # rank 0 waits for stage 1's gradient before stage 1 ever got its forward
    plan = PipelinePlan("1F1B", 2, 1, {0: 0, 1: 1}, {0: [("B", 0, 0), ("F", 0, 0)], 1: [("F", 1, 0), ("B", 1, 0)]})
    with pytest.raises(ValueError, match="cannot proceed"):
        replay_pipeline(plan, _uniform(plan))


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8)])
def test_in_flight_activations_per_schedule(pp, m):
    saved, peak = 1 << 20, 1 << 10
    one_f_one_b, gpipe = plan_pipeline("1F1B", pp, m), plan_pipeline("GPipe", pp, m)
    for rank in range(pp):
        # 1F1B: rank r holds min(M, pp - r) microbatches before its first backward; GPipe all M
        held = rank_memory(one_f_one_b, rank, _uniform(one_f_one_b, saved, peak=peak)).moments[0].activations
        assert held == min(m, pp - rank) * saved + peak
        held = rank_memory(gpipe, rank, _uniform(gpipe, saved, peak=peak)).moments[0].activations
        assert held == m * saved + peak


def test_split_backward_holds_what_dw_needs_until_dw():
    plan = plan_pipeline("ZBVZeroBubble", 2, 4)
    for rank in range(2):
        held, most = 0, 0
        for kind, _, _ in plan.actions[rank]:  # saved from F to W, kept from I to W
            most = max(most, held)  # (the pieces' own peaks are 0 here)
            held += {"F": 10, "B": -10, "I": 3, "W": -13}[kind]
        assert held == 0
        assert rank_memory(plan, rank, _uniform(plan, saved=10, kept=3)).moments[0].activations == most


def test_estimate_of_a_traced_pipeline_splits_the_model_over_its_ranks():
    cfg = load_config(
        ["--parallelism.pp", "2", "--training.local_batch_size", "2", "--training.seq_len", "32"]
        + ["--training.global_batch_size", "8", "--parallelism.pp_schedule", "Interleaved1F1B"]
    )
    with fake_world(2):
        traced = trace_pipeline(cfg, 2)
        plan = traced.layout.pipeline.plan
        estimate = estimate_pipeline(plan, traced.stages, DEVICES["cpu"], 2, 8, adamw_memory("cpu"))
    # every stage costed; the ranks' parameters are the whole model's (dp = 1)
    assert set(estimate.costs) == set(range(4))
    assert all(c.seconds["F"] > 0 and c.seconds["B"] > 0 and c.saved_bytes > 0 for c in estimate.costs.values())
    from models.registry import MODEL_SPECS, model_args

    with torch.device("meta"):
        model = MODEL_SPECS["llama3"].build(model_args(cfg))
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    assert whole <= sum(m.moments[0].params for m in estimate.memory.values()) < 1.05 * whole  # (+ buffers)
    assert 0 < estimate.timeline.bubble_fraction < 1
    # each rank steps its own stages' parameters (the model's, dp = 1; CPU: single-tensor AdamW)
    stepped = [p for s in range(4) for p in estimate.costs[s].optimizer_params]
    assert sum(p.numel() for p in stepped) == sum(p.numel() for p in model.parameters())
    assert set(estimate.optimizer) == {0, 1} and all(o.seconds > 0 for o in estimate.optimizer.values())
    assert estimate.optimizer[0].reduce_seconds > 0  # the norm summed over the pipeline
    assert estimate.timeline.step_seconds > replay_pipeline(plan, estimate.costs).step_seconds
    # the first stage holds no stage input to differentiate; its dI is empty
    assert estimate.costs[0].seconds["I"] == 0 and estimate.costs[1].seconds["I"] > 0


def test_the_optimizer_step_ends_the_step_once_every_ranks_norm_is_summed():
    """Each rank's squared norm after its last action; the all-reduce over the pipeline starts once
    the last of them is ready; then each rank clips and updates its own parameters."""
    plan = plan_pipeline("1F1B", 2, 4)
    without = replay_pipeline(plan, _uniform(plan))
    steps = {0: OptimizerStepCost(0.5, 0.25, 1.0), 1: OptimizerStepCost(4.0, 0.25, 0.125)}
    timeline = replay_pipeline(plan, _uniform(plan), optimizer=steps)
    last = {r: max(end for rank, _, _, end in without.events if rank == r) for r in steps}
    assert last[0] > last[1]  # (1F1B: the first rank runs the last backward)
    summed = max(last[r] + steps[r].norm_seconds for r in steps) + 0.25
    assert summed == last[1] + 4.25  # the second rank's norm is the later one here
    assert timeline.step_seconds == pytest.approx(summed + 1.0)
    for rank, step in steps.items():
        assert timeline.busy_seconds[rank] == pytest.approx(
            without.busy_seconds[rank] + step.norm_seconds + step.update_seconds
        )


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_weights_resident_per_step_gather_at_the_step_start_and_reduce_after_the_last(schedule):
    # one stage per rank: every rank gathers at the step's start (the trainer's pipeline step
    # gathers before its schedule), so only the first stage's gather delays the first forward and a
    # later stage's is hidden in its wait for its first input; each rank's reductions come after
    # its last action; closed form with uniform stages
    pp, m, gather, reduce = 2, 4, 0.25, 0.5
    plan = plan_pipeline(schedule, pp, m)
    base = _uniform(plan)[0]
    resident = dataclasses.replace(base, once_seconds={"gather": gather, "reduce": reduce})
    timeline = replay_pipeline(plan, dict.fromkeys(range(pp), resident))
    assert gather <= F  # (the second rank's gather ends before its first input arrives)
    assert timeline.step_seconds == pytest.approx((m + pp - 1) * (F + B) + gather + reduce)
    assert all(busy == pytest.approx(m * (F + B) + gather + reduce) for busy in timeline.busy_seconds.values())
    first = {rank: min(start for r, _, start, _ in timeline.events if r == rank) for rank in range(pp)}
    assert first == pytest.approx({0: gather, 1: gather + F})


def test_a_stage_backward_is_costed_with_the_sizes_its_forward_made():
    """Expert parallel's token counts are data (unbacked sizes) that the forward's all_to_all
    defines; the backward piece reads them as saved values, so only the joint graph says what they
    are: the pieces are costed with its hints, not with the fallback of a graph that lacks them."""
    from graph_trainer.analysis.simulator import simulate
    from graph_trainer.graph.sizes import SizeHints, tensors_in, value_of
    from graph_trainer.pipelining.split import split_stage
    from graph_trainer.pipelining.timeline import stage_cost

    cfg = load_config(
        ["--job.config_file", "configs/deepseek_v3_debug.toml", "--model.n_layers", "3", "--parallelism.pp", "2"]
        + ["--parallelism.ep", "2", "--training.local_batch_size", "1", "--training.global_batch_size", "4"]
    )
    device = DEVICES["h100"]
    with fake_world(4):
        traced = trace_pipeline(cfg, 4).stages[1]  # (MoE blocks)
        graphs = split_stage(traced.gm, traced.num_flat_param_grads, grads_into_sums=True)
        joint, alone = SizeHints.from_graph(traced.gm.graph), SizeHints.from_graph(graphs.backward.graph)
        sizes = [s for n in graphs.backward.graph.nodes for t in tensors_in(value_of(n)) for s in t.shape]
        symbolic = [s for s in sizes if isinstance(s, torch.SymInt)]
        assert any(not alone.resolved(s) for s in symbolic) and all(joint.resolved(s) for s in symbolic)
        cost = stage_cost(graphs, traced, device)
        with_joint = simulate(graphs.backward.graph, device, record_events=False, hints=joint).step_time
        without = simulate(graphs.backward.graph, device, record_events=False).step_time
    assert cost.seconds["B"] == pytest.approx(with_joint) and with_joint > without
