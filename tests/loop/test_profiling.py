"""[profiling] (graph_trainer/loop/profiling.py, graph_trainer/compiler/profiler_ranges.py): which
steps are traced, where the traces go, the graph's nodes as named ranges, and no value changed."""

from __future__ import annotations

import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.profiler import ProfilerAction, profile

from graph_trainer.compiler.profiler_ranges import add_profiler_ranges, range_name
from graph_trainer.graph import tags
from graph_trainer.graph.tags import MODULE_FQN
from graph_trainer.loop.profiling import WARMUP_STEPS, profiler_action
from tests.launch import read_losses, run_train

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
