"""integration_tests.py itself: its case table, command line, job checks and dry-run graph checks."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

import integration_dry_run as dry
import integration_graph_checks as checks
import integration_tests as it
import suites
from graph_trainer.compiler.chain import transform_graph
from graph_trainer.compiler.passes import PASS_REGISTRY
from graph_trainer.config_loading import load_config
from graph_trainer.distributed.parallel_dims import resolve_parallel_degrees
from graph_trainer.fake_trace import fake_world, trace_job, trace_pipeline, trace_without_passes
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import collective_counts, collective_name
from graph_trainer.validation import validate_config
from tests.conftest import ROOT
from tests.graph_compare import node_signatures


@pytest.mark.parametrize("suite_name", list(suites.SUITES))
def test_case_table_is_consistent_and_every_case_validates(suite_name):
    suite = suites.SUITES[suite_name]
    names = [c.name for c in suite.cases]
    assert len(names) == len(set(names))
    configs = []
    for i, case in enumerate(suite.cases):
        for ref in case.references:  # a reference runs earlier, on the same model
            assert ref in names[:i], (case.name, ref)
            assert suite.cases[names.index(ref)].config == case.config
        configs.append(load_config(suites.job_args(suite, case)))
        validate_config(configs[-1], case.nproc)
    if suite_name == "cpu":
        assert max(c.nproc for c in suite.cases) <= 4
        passes = {p for cfg in configs for p in cfg.compile.passes}
        assert passes == set(PASS_REGISTRY)  # every pass runs somewhere in the cpu suite


def test_select_adds_references_and_skips_what_does_not_fit():
    cases, skipped = it.select(suites.SUITES["cpu"].cases, ["fsdp2xtp2_tbb", "fsdp2_auto"], ngpu=2)
    assert [c.name for c in cases] == ["single_b4", "fsdp2_graph", "fsdp2xtp2_graph", "fsdp2_auto", "fsdp2xtp2_tbb"]
    assert set(skipped) == {"fsdp2xtp2_graph", "fsdp2xtp2_tbb"}
    with pytest.raises(ValueError, match="unknown case"):
        it.select(suites.SUITES["cpu"].cases, ["nope"], ngpu=4)


GPUS = torch.cuda.device_count()


@pytest.mark.parametrize(
    "args, message",
    [
        (["out", "--suite", "tpu"], "invalid choice: 'tpu'"),
        (["out", "--suite", "cpu", "--test_name", "fsdp2_graph,nope"], "unknown case(s) nope"),
        (["out", "--suite", "cpu", "--ngpu", "0"], "--ngpu must be >= 1"),
        pytest.param(
            ["out", "--suite", "h100"],
            f"suite h100 needs 8 CUDA devices, this machine has {GPUS}",
            marks=pytest.mark.skipif(GPUS >= 8, reason="this machine has 8 GPUs"),
        ),
        pytest.param(
            ["out", "--suite", "gpu"],
            "suite gpu needs 1 CUDA devices, this machine has 0",
            marks=pytest.mark.skipif(GPUS >= 1, reason="this machine has a GPU"),
        ),
    ],
)
def test_bad_command_lines_fail_with_one_line(args, message):
    result = subprocess.run([sys.executable, "integration_tests.py", *args], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_list_names_the_cases_and_their_references():
    result = subprocess.run(
        [sys.executable, "integration_tests.py", "out", "--suite", "cpu", "--test_name", "deepseek_ep2_tbb", "--list"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    assert result.stdout.splitlines()[-1].startswith("deepseek_ep2_tbb: 2 proc")
    assert "(same_as deepseek_ep2_graph)" in result.stdout and len(result.stdout.splitlines()) == 3


def _log(step: int, loss: float, tokens_per_s: str = "1,234") -> str:
    return (
        f"[rank0] 10:00:00 INFO step {step} | loss {loss:.6f} | grad_norm 1.0 | lr 1e-3 | tok/s/dev {tokens_per_s} | "
        f"mfu n/a | mem 0.50 GiB (rss) | step 0.100s\n"
    )


def test_check_job_accepts_a_good_run_and_names_each_problem():
    losses = [(1, "8.25"), (2, "7.5"), (3, "6.125")]
    good = _log(1, 8.25) + _log(3, 6.125)
    assert it.check_job(good, losses, 3) is None
    assert "not 1..4" in it.check_job(good, losses, 4)
    assert "did not fall" in it.check_job(_log(1, 8.25) + _log(3, 9.0), [(1, "8.25"), (2, "7.5"), (3, "9.0")], 3)
    assert "non-finite loss at step 2" in it.check_job(good, [(1, "8.25"), (2, "nan"), (3, "6.125")], 3)
    assert "no metrics line" in it.check_job(_log(1, 8.25), losses, 3)
    assert "the log says loss 6.200000" in it.check_job(_log(1, 8.25) + _log(3, 6.2), losses, 3)
    # a first step that compiled for minutes: under one token a second, still more than none
    assert it.check_job(_log(1, 8.25, "0.427") + _log(3, 6.125), losses, 3) is None
    assert "tok/s/dev 0 and" in it.check_job(_log(1, 8.25, "0") + _log(3, 6.125), losses, 3)


def test_steady_metrics_reads_the_last_logged_step():
    log = _log(1, 8.25).replace("1,234", "17") + _log(3, 6.125).replace("mfu n/a", "mfu 40.5%")
    assert it.steady_metrics(log) == "tok/s 1,234, mfu 40.5%, mem 0.50 GiB, first step ? s"
    log = "first step (including trace, passes and compile) took 61.25s\n" + log
    assert it.steady_metrics(log).endswith("first step 61.25 s")


def test_compare_is_bitwise_for_same_as_and_relative_for_close_to():
    done = {"ref": it.Finished(["8.25", "7.5"])}
    run = it.Finished
    assert it.compare(suites.Case("a", 1, [], same_as="ref"), run(["8.25", "7.5"]), done) == (None, "bitwise ref")
    problem, _ = it.compare(suites.Case("a", 1, [], same_as="ref"), run(["8.25", "7.500000000000001"]), done)
    assert "differ from ref from step 2" in problem
    assert it.compare(suites.Case("a", 1, [], close_to="ref"), run(["8.2500001", "7.5"]), done)[0] is None
    assert "deviate" in it.compare(suites.Case("a", 1, [], close_to="ref"), run(["8.26", "7.5"]), done)[0]
    # a case's own bound (Inductor vs op by op): 2e-6 passes 5e-6 and fails 1e-6
    inductor = run(["8.250016", "7.5"])
    assert it.compare(suites.Case("a", 1, [], close_to="ref", rtol=suites.INDUCTOR_RTOL), inductor, done)[0] is None
    assert "(> 1e-06)" in it.compare(suites.Case("a", 1, [], close_to="ref", rtol=1e-6), inductor, done)[0]


def _grads(scale: float = 1.0, nudge: float = 0.0) -> dict:
    sample = torch.tensor([1.0, -2.0, 3.0]) * scale
    sample[0] += nudge
    return {
        "norm": float(sample.norm()),
        "params": {"w": {"shape": [3], "norm": float(sample.double().norm()), "sample": sample}},
    }


def test_compare_checks_gradient_records_bitwise_or_within_grad_rtol():
    done = {"ref": it.Finished(["8.25", "7.5"], _grads())}
    same, close = suites.Case("a", 1, [], same_as="ref"), suites.Case("a", 1, [], close_to="ref")
    assert it.compare(same, it.Finished(["8.25", "7.5"], _grads()), done) == (None, "bitwise ref (losses, grads)")
    problem, _ = it.compare(same, it.Finished(["8.25", "7.5"], _grads(nudge=1e-6)), done)
    assert problem.startswith("step-1 gradients differ from ref: global gradient norm"), problem
    problem, note = it.compare(close, it.Finished(["8.25", "7.5"], _grads(nudge=1e-6)), done)
    # float32 1 + 1e-6 is 1 + 9.5e-7: the sample moved by 9.5e-7 / |(1, -2, 3)| = 2.5e-7
    assert problem is None and "grads 2.5e-07" in note, note
    problem, _ = it.compare(close, it.Finished(["8.25", "7.5"], _grads(scale=2.0)), done)
    assert problem.startswith("step-1 gradients deviate from ref") and "global gradient norm" in problem, problem
    problem, _ = it.compare(close, it.Finished(["8.25", "7.5"]), done)
    assert problem == "only one of a and ref wrote a gradient record"


# (2 blocks of each model: a dense and a MoE one for DeepSeek-V3; the checks below are per block)
DEEPSEEK_EP = [
    "--job.config_file",
    f"{ROOT}/configs/deepseek_v3_debug.toml",
    "--model.n_layers",
    "2",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--parallelism.ep",
    "2",
]
TP = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--parallelism.tp", "2", *suites.CPU_BLOCKS]


@pytest.mark.parametrize(
    "layout, passes",
    [(TP, "transformer_block_bucketing,auto_bucketing"), (DEEPSEEK_EP, "auto_bucketing")],
    ids=["fsdp2xtp2", "ep2"],
)
def test_dry_run_copy_of_one_trace_gives_the_graph_of_a_fresh_trace(layout, passes):
    cfg = load_config([*layout, "--compile.passes", passes])
    # Each trace in a fresh fake world: every trace makes new process groups, and in a fresh
    # world they get the same names, so the graphs can be compared argument for argument.
    with fake_world(4):
        fresh = trace_job(cfg, 4).gm
    with fake_world(4):
        traced, context = trace_without_passes(load_config(layout), 4)
        copied = transform_graph(copy.deepcopy(traced.gm), context, cfg.compile.passes)
    assert collective_counts(copied.graph) == collective_counts(fresh.graph)
    # Same nodes in the same order, each fed by the same inputs (names alone miss rewiring).
    assert node_signatures(copied.graph) == node_signatures(fresh.graph)


def test_check_graph_finds_missing_buckets_and_untagged_all_to_all():
    cfg = load_config([*DEEPSEEK_EP, "--compile.passes", "transformer_block_bucketing"])
    with fake_world(4):
        traced, context = trace_without_passes(load_config(DEEPSEEK_EP), 4)
        reference = transform_graph(copy.deepcopy(traced.gm), context, [])
        bucketed = transform_graph(copy.deepcopy(traced.gm), context, cfg.compile.passes)
    degrees, plan = resolve_parallel_degrees(cfg.parallelism, 4), context.extras["bucket_plan"]
    assert checks.check_graph(bucketed, reference, cfg, degrees, plan) == []
    # the graph without the pass, checked as if it had run
    problems = checks.check_graph(reference, reference, cfg, degrees, plan)
    assert any("outside a block bucket" in p for p in problems), problems
    a2a = next(n for n in bucketed.graph.nodes if collective_name(n) == "all_to_all_single")
    tags.remove(a2a, "ep_role")
    assert any("without ep_role" in p for p in checks.check_graph(bucketed, reference, cfg, degrees, plan))


def test_dry_run_flags_an_hsdp_all_reduce_of_the_full_gradient():
    cfg = load_config(
        ["--training.local_batch_size", "1", "--training.seq_len", "16"]
        + ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"]
    )
    with fake_world(4):
        traced, _ = trace_without_passes(cfg, 4)
    launches = checks.collective_launches(traced.gm)
    assert checks._full_gradient_all_reduces(launches) == []
    # the order this project had before: the all-reduce summing the full (not reduce-scattered) gradient
    all_reduce = next(n for n in launches if collective_name(n) == "all_reduce")
    all_reduce.meta["val"] = torch.empty(2 * all_reduce.meta["val"].numel())
    assert checks._full_gradient_all_reduces(launches) == [all_reduce.name]


def test_cluster_layouts_are_dry_run_only():
    cases = suites.SUITES["h100"].cases
    cluster = [c.name for c in cases if c.dry_run_only]
    assert cluster and it.default_ngpu(cases) == 8
    _, skipped = it.select(cases, cluster, ngpu=8)
    assert set(skipped) == set(cluster) and "dry-run only" in skipped[cluster[0]]
    assert it.select(cases, cluster, ngpu=8, dry_run=True)[1] == {}


def test_pipeline_dry_run_checks_every_stage_graph_and_estimates_the_step(capsys):
    suite = suites.SUITES["cpu"]
    names = ["pp2xfsdp2_zbv_tbb", "deepseek_pp2xep2_graph"]
    rows = dry.dry_run(suite, [c for c in suite.cases if c.name in names])
    assert sorted((r["case"], r["status"]) for r in rows) == sorted((n, "PASS") for n in names), rows
    out = capsys.readouterr().out
    assert "ZBVZeroBubble, 4 stages x 2 microbatches: simulated step" in out and "bubble" in out
    # the stage check sees what a stage lacks: the DeepSeek stage graph without its ep tags
    case = next(c for c in suite.cases if c.name == "deepseek_pp2xep2_graph")
    cfg = load_config(suites.job_args(suite, case))
    with fake_world(4):
        traced = trace_pipeline(cfg, 4)
    degrees = resolve_parallel_degrees(cfg.parallelism, 4)
    last = traced.layout.pipeline.last_stage
    gm, resident, blocks = traced.stages[last].gm, traced.resident[last], traced.traced_blocks[last]
    assert checks.check_stage_graph(gm, cfg, degrees, blocks, False, True, resident) == []
    # (weights resident per step: the data-parallel collectives are in the gather and reduce graphs)
    assert "dp_shard=2 but 0 FSDP all-gathers" in checks.check_stage_graph(gm, cfg, degrees, blocks, False, True)[0]
    for n in gm.graph.nodes:
        if collective_name(n) == "all_to_all_single":
            tags.remove(n, "moe_fqn")
    problems = checks.check_stage_graph(gm, cfg, degrees, blocks, False, True, resident)
    assert any("MoE layers" in p for p in problems), problems


def test_a_layout_the_fake_process_group_does_not_trace_is_said_and_the_dry_run_goes_on(capsys):
    """Weights resident per step without a pipeline run in the job but are not fake-traced: their
    rows say so, the cases after them are still checked, and none of it counts as a failure."""
    suite = suites.SUITES["cpu"]
    names = ["fsdp2_accum2_per_step", "fsdp2_graph"]
    rows = {r["case"]: str(r["status"]) for r in dry.dry_run(suite, [c for c in suite.cases if c.name in names])}
    assert rows["fsdp2_graph"] == "PASS", rows
    assert rows["fsdp2_accum2_per_step"].startswith(f"{dry.NOT_TRACED}: parallelism.fsdp_collectives = per_step")
    assert f"[dry-run] {'fsdp2_accum2_per_step':34s} {dry.NOT_TRACED}: " in capsys.readouterr().out


def test_dry_run_shards_split_the_trace_groups_between_them():
    suite = suites.SUITES["cpu"]
    pipelines = [c for c in suite.cases if c.name in ("pp2_1f1b_graph", "pp2_gpipe")]
    shards = [{r["case"] for r in dry.dry_run(suite, pipelines, (k, 2))} for k in range(2)]
    # the two share one trace key (they differ in the schedule alone): one shard takes both
    assert sorted(map(len, shards)) == [0, 2] and set.union(*shards) == {c.name for c in pipelines}
    for bad in ("2/2", "a/b", "1"):
        result = subprocess.run(
            [sys.executable, "integration_tests.py", "out", "--suite", "cpu", "--dry-run", "--shard", bad],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert result.returncode == 2 and result.stderr.startswith(f"error: --shard '{bad}' must be K/N")


@pytest.mark.parametrize("measured", [False, True], ids=["by_processes", "by_measured_seconds"])
def test_run_shards_keep_compared_cases_together_and_cover_the_suite(measured):
    cases = suites.SUITES["cpu"].cases
    seconds = it.recorded_seconds("cpu") if measured else None
    chosen = [it.select(cases, it.shard_names(cases, (k, 2), seconds), ngpu=4) for k in range(2)]
    assert all(skipped == {} for _, skipped in chosen)
    names = [{c.name for c in shard} for shard, _ in chosen]
    assert names[0] | names[1] == {c.name for c in cases}
    # only one-process references that compare with nothing run in both shards
    assert all(c.nproc == 1 and not c.references for c in cases if c.name in names[0] & names[1])
    assert it.shard_names(cases, (0, 1), seconds) == [c.name for c in cases]
    result = subprocess.run(
        [
            sys.executable,
            "integration_tests.py",
            "out",
            "--suite",
            "cpu",
            "--shard",
            "0/2",
            "--test_name",
            "fsdp2_graph",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 2 and "--shard splits a whole suite" in result.stderr


def test_shards_balance_the_measured_seconds_and_weigh_unmeasured_cases_by_processes(tmp_path, monkeypatch):
    cases = suites.SUITES["cpu"].cases
    seconds = it.recorded_seconds("cpu")
    assert seconds and set(seconds) <= {c.name for c in cases}, "suites/case_seconds.json names a case that is gone"
    weight = it.case_weights(cases, seconds)
    loads = [sum(weight[n] for n in it.shard_names(cases, (k, 2), seconds)) for k in range(2)]
    longest_group = max(sum(weight[c.name] for c in g) for g in it.compared_groups(cases))
    assert abs(loads[0] - loads[1]) <= longest_group  # what greedy longest-first guarantees
    four = [suites.Case(name, 2, []) for name in ("long", "b", "c", "d")]
    timed = {"long": 100.0, "b": 10.0, "c": 10.0, "d": 10.0}
    assert [it.shard_names(four, (k, 2), timed) for k in range(2)] == [["long"], ["b", "c", "d"]]
    assert [it.shard_names(four, (k, 2)) for k in range(2)] == [["long", "c"], ["b", "d"]]
    (one, two) = [c for c in cases if c.nproc == 2][:2]
    assert it.case_weights([one, two], {one.name: 30.0}) == {one.name: 30.0, two.name: 30.0}
    assert it.case_weights([one], {}) == {one.name: 2.0}
    ran = [it.Result(one, seconds=12.34), it.Result(two, skipped="needs 4 processes")]
    it.write_seconds(str(tmp_path / "case_seconds.json"), "cpu", ran)
    monkeypatch.setattr(it, "CASE_SECONDS", str(tmp_path / "case_seconds.json"))
    assert it.recorded_seconds("cpu") == {one.name: 12.3} and it.recorded_seconds("h100") == {}
