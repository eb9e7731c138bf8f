"""auto_bucketing: PyTorch's overlap scheduler + bucketer on our cost model, on fake and real process groups."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

from graph_trainer.compiler.passes import PASS_REGISTRY
from graph_trainer.compiler.passes.auto_bucketing import gradient_reduction_counts
from graph_trainer.config_loading import load_config
from graph_trainer.errors import ConfigError
from graph_trainer.fake_trace import fake_world, trace_job
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import collective_counts
from graph_trainer.torch_compat import overlap_scheduling_module
from graph_trainer.validation import validate_config
from suites import CPU_BLOCKS
from tests.conftest import ROOT

AUTO = "auto_bucketing"
SMALL = ["--training.local_batch_size", "2", "--training.seq_len", "32", *CPU_BLOCKS]


@functools.cache
def _trace(passes: str, world_size: int = 4, extra: tuple[str, ...] = ()):
    cfg = load_config([*SMALL, "--compile.passes", passes, *extra] if passes else [*SMALL, *extra])
    with fake_world(world_size):
        return trace_job(cfg, world_size).gm


def _gathers_and_reduces(gm) -> tuple[int, int]:
    counts = collective_counts(gm.graph)
    return (
        counts.get("all_gather_into_tensor", 0) + counts.get("all_gather_into_tensor_out", 0),
        counts.get("reduce_scatter_tensor", 0),
    )


def _scheduler_attributes() -> dict:
    module = overlap_scheduling_module()
    return {**vars(module), **{f"OverlapScheduler.{k}": v for k, v in vars(module.OverlapScheduler).items()}}


def test_fewer_collectives_on_fake_fsdp4_and_graph_lints():
    original = _scheduler_attributes()
    gm, plain = _trace(AUTO), _trace("")
    gm.graph.lint()
    (gathers, reduces), (plain_gathers, plain_reduces) = _gathers_and_reduces(gm), _gathers_and_reduces(plain)
    assert gathers < plain_gathers and reduces <= plain_reduces, (gathers, plain_gathers, reduces, plain_reduces)
    assert _scheduler_attributes() == original  # the estimate swapped in for the pass is gone
    assert all(tags.get(n, "phase") is not None for n in gm.graph.nodes if n.op == "call_function")


def test_hsdp_gradient_reductions_keep_their_tags_through_the_bucketer():
    hsdp = ("--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2")
    gm, plain = _trace(AUTO, extra=hsdp), _trace("", extra=hsdp)
    before, after = gradient_reduction_counts(plain.graph), gradient_reduction_counts(gm.graph)
    # one reduce-scatter (dp_shard) and one all-reduce of its shard (dp_replicate) per parameter
    assert before["reduce_scatter"] == before["all_reduce"] > 0
    # merged buckets keep the role of their first member: every reduction is still counted
    assert 0 < after["all_reduce"] <= before["all_reduce"] and after["reduce_scatter"] == before["reduce_scatter"]
    assert sum(after.values()) == sum(collective_counts(gm.graph)[k] for k in ("all_reduce", "reduce_scatter_tensor"))


def test_rejected_at_config_validation():
    with pytest.raises(ConfigError) as info:
        validate_config(load_config(["--compile.passes", AUTO]), world_size=1)
    assert "\n" not in str(info.value) and "multi-process layout" in str(info.value)
    with pytest.raises(ConfigError) as order:  # auto_bucketing leaves out= mutations: it must run last
        validate_config(
            load_config(["--compile.passes", f"{AUTO},transformer_block_bucketing", "--parallelism.dp_shard", "2"]),
            world_size=2,
        )
    assert "must be the last pass" in str(order.value)
    validate_config(
        load_config(["--compile.passes", f"transformer_block_bucketing,{AUTO}", "--parallelism.dp_shard", "2"]),
        world_size=2,
    )
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), "--compile.passes", AUTO],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {info.value}"]
    assert AUTO in PASS_REGISTRY
