"""Bitwise comparisons of the cpu integration suite, a representative sample run by pytest.

The full set (every layout: graph vs eager; FSDP, HSDP, FSDPxTP and EP layouts: graph vs graph
with each bucketing pass) is ``python integration_tests.py OUT --suite cpu``, which CI runs once
after pytest. Running all of it here too would double CI's longest step, so pytest runs a few
cases through the suite's own Python API (same table, same checks), with the cases they are
compared with: LLaMA-3 FSDP=2 and DeepSeek-V3 EP=2, each with both bucketing passes, and
LLaMA-3 FSDP=2 x TP=2 eager vs graph (graph close to one process on the same global batch).
"""

from __future__ import annotations

import pytest

import integration_tests as suite

SAMPLE = ["fsdp2_tbb_auto", "deepseek_ep2_tbb_auto", "fsdp2xtp2_eager"]
CASES = [c.name for c in suite.select(suite.SUITES["cpu"].cases, SAMPLE, ngpu=4)[0]]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ran = suite.run_suite("cpu", str(tmp_path_factory.mktemp("cpu_suite")), SAMPLE, echo=False)
    return {r.case.name: r for r in ran}


@pytest.mark.parametrize("name", CASES)
def test_cpu_suite_case(name, results):
    result = results[name]
    assert result.problem is None and not result.skipped, f"{name}: {result.problem or result.skipped}"
    reference = result.case.same_as
    if reference:
        assert f"bitwise {reference}" in result.note
