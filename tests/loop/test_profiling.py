"""[profiling] (graph_trainer/loop/profiling.py, graph_trainer/compiler/profiler_ranges.py): which
steps are traced, where the traces go, the graph's nodes as named ranges, and no value changed."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.profiler import ProfilerAction, profile

from graph_trainer.compiler.profiler_ranges import add_profiler_ranges, range_name
from graph_trainer.config_loading import load_config
from graph_trainer.graph import tags
from graph_trainer.graph.tags import MODULE_FQN
from graph_trainer.loop.profiling import WARMUP_STEPS, profiler_action, step_profiling, write_step_file
from tests.launch import FAST_ARGS, read_losses, run_train
from tests.reliability.helpers import immutable, logged_warnings, train_py

NONE, WARMUP, RECORD = ProfilerAction.NONE, ProfilerAction.WARMUP, ProfilerAction.RECORD_AND_SAVE


@pytest.mark.parametrize(
    "freq, actions",
    [
        (10, [NONE] * 6 + [WARMUP] * 3 + [RECORD] + [NONE] * 6 + [WARMUP] * 3 + [RECORD]),
        (2, [WARMUP, RECORD] * 10),
        (1, [RECORD] * 20),
    ],
)
def test_every_freq_th_step_is_recorded_after_its_warm_up(freq, actions):
    assert WARMUP_STEPS == 3
    assert [profiler_action(step, freq) for step in range(1, 21)] == actions


def test_ranges_name_each_node_by_module_and_change_no_value():
    def step(x, w):
        return ((x @ w).relu().sum(),)

    x, w = torch.randn(8, 16), torch.randn(16, 4)
    gm = make_fx(step)(x, w)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    tags.replace(nodes[0], {MODULE_FQN: "layers.0.attention"})
    names = [range_name(n) for n in nodes]
    assert names[0] == f"layers.0.attention: {nodes[0].name}" and names[1:] == [n.name for n in nodes[1:]]
    expected = gm(x, w)[0]
    ranged = add_profiler_ranges(gm)
    with profile() as prof:
        got = ranged(x, w)[0]
    assert torch.equal(got, expected)
    assert [e.name for e in prof.events() if e.name in names] == names  # one range per node, in order


def test_a_profiled_job_writes_a_trace_per_rank_and_trains_bitwise_as_without(tmp_path):
    """2 ranks, FSDP, 4 steps, every second one traced; the memory snapshot, CUDA only, is one warning on CPU."""
    flags = ["--training.steps", "4"]
    profiled = run_train(
        2,
        tmp_path / "profiled",
        *flags,
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "2",
        "--profiling.save_traces_folder",
        str(tmp_path / "traces"),
        "--profiling.enable_memory_snapshot",
    )
    plain = run_train(2, tmp_path / "plain", *flags)
    assert read_losses(tmp_path / "profiled") == read_losses(tmp_path / "plain")
    written = sorted(p.relative_to(tmp_path / "traces").as_posix() for p in (tmp_path / "traces").rglob("*.json"))
    assert written == [f"iteration_{s}/rank{r}_trace.json" for s in (2, 4) for r in (0, 1)]
    events = json.loads((tmp_path / "traces/iteration_4/rank1_trace.json").read_text())["traceEvents"]
    ranges = {e["name"] for e in events if e.get("ph") == "X" and ": " in e["name"]}
    assert any(name.startswith("layers.0.attention: ") for name in ranges), sorted(ranges)[:20]
    assert any("all_gather_into_tensor" in name for name in ranges)  # SimpleFSDP's gathers, named by module
    assert profiled.stderr.count("memory snapshots need CUDA; none on cpu") == 2  # one line per rank
    assert "memory snapshots" not in plain.stderr
    assert not (tmp_path / "profiled/memory_snapshot").exists()


def _profiled_steps(folder, steps: int) -> list[str]:
    """``steps`` small steps in this process under ``step_profiling`` (every second one traced, into
    ``folder/traces``); the warnings logged."""
    profiling = [
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "2",
        "--profiling.save_traces_folder",
        "traces",
    ]
    cfg = load_config(["--job.dump_folder", str(folder), *profiling])
    with logged_warnings() as warned, step_profiling(cfg, 0, torch.device("cpu"), 0) as after_step:
        for step in range(1, steps + 1):
            torch.randn(64, 64).matmul(torch.randn(64, 64)).sum()
            after_step(step)
    return warned


def test_a_trace_into_a_folder_that_cannot_be_written_is_one_warning_and_the_next_is_written(tmp_path):
    """The profiler's own writer only prints that it cannot open the file, and returns as if it wrote it."""
    locked = tmp_path / "traces" / "iteration_2"
    locked.mkdir(parents=True)
    with immutable(locked):
        warned = _profiled_steps(tmp_path, 4)
    assert len(warned) == 1 and warned[0].startswith("profiler trace of step 2 not written (the job goes on): "), warned
    assert "Operation not permitted" in warned[0]
    assert os.listdir(locked) == []
    assert json.loads((tmp_path / "traces/iteration_4/rank0_trace.json").read_text())["traceEvents"]


@pytest.mark.parametrize("in_the_way", ["file", "immutable folder"])
def test_a_step_file_that_cannot_be_written_is_one_warning_not_an_exception(tmp_path, in_the_way):
    """The writer of traces and memory snapshots: neither creating the iteration folder nor writing
    into it may raise (an exception out of the profiler's callback crashes the process at its exit)."""
    cfg = load_config(["--job.dump_folder", str(tmp_path)])
    parent = tmp_path / "snapshots"
    parent.mkdir()

    def write(path):
        with open(path, "wb") as f:
            f.write(b"snapshot")

    if in_the_way == "file":
        (parent / "iteration_3").touch()
        context = contextlib.nullcontext()
    else:
        context = immutable(parent)
    with context, logged_warnings() as warned:
        written = write_step_file(cfg, "snapshots", 3, "rank0.pickle", "memory snapshot", write)
    assert not written and len(warned) == 1, warned
    assert warned[0].startswith("memory snapshot of step 3 not written (the job goes on): "), warned
    assert write_step_file(cfg, "snapshots", 4, "rank0.pickle", "memory snapshot", write)
    assert (parent / "iteration_4/rank0.pickle").read_bytes() == b"snapshot"


def test_a_job_whose_trace_folder_is_in_the_way_warns_once_and_ends_normally(tmp_path):
    """A file named like the step's trace folder: the job ends with exit 0 (it was a segmentation fault)."""
    (tmp_path / "profile_traces").mkdir()
    (tmp_path / "profile_traces/iteration_2").touch()
    flags = ["--training.steps", "4", "--profiling.enable_profiling", "--profiling.profile_freq", "2"]
    job = train_py(*FAST_ARGS, "--job.dump_folder", str(tmp_path), *flags)
    assert job.returncode == 0, job.stderr[-3000:]
    warnings_logged = [line for line in job.stderr.splitlines() if " WARNING " in line]
    assert len(warnings_logged) == 1 and "profiler trace of step 2 not written" in warnings_logged[0], warnings_logged
    assert "Traceback" not in job.stderr
    assert (tmp_path / "profile_traces/iteration_4/rank0_trace.json").is_file()
    assert [step for step, _ in read_losses(tmp_path)] == [1, 2, 3, 4]
