"""Gradient records (graph_trainer/loop/grad_record.py) and the check against one process that uses them.

The cpu suite compares every layout's step-1 gradients with one process on the same global
batch (``suites.GRAD_RTOL``). Here: the comparison itself; a real gloo job showing that the check
FAILS when a layout's gradients are doubled (tests/faults/doubled_grads.py), on FSDP=2 (the
doubling is the trainer's, after any layout's sums: one layout shows the comparison catches it);
and the check on the paths where gradients are summed in ways of their own,
each against one process on the same global batch, so that a wrong sum there fails the test
command and not only the cpu suite: FSDP=2, gradient accumulation on one process (4 microbatches),
weights resident per step on FSDP=2 (2 microbatches summed, then reduced once: the same parts
a pipeline stage runs with them), the pipeline runners' accumulation with tensor parallel inside
the stages (PP=2 x TP=2 with sequence parallel, interleaved, 4 microbatches), and DeepSeek-V3's
tensor-parallel gradient reductions (TP=2 x EP=2 with sequence parallel: the rotary key's sum, the
norms' and the router gate's sums over the tp ranks that each routed their own tokens; without
the gate's sum its step-1 gradient norm is 0.0014 against 0.0024).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import integration_tests as it
import suites
from graph_trainer.cli.grad_record import main as grad_record_cli
from graph_trainer.loop.grad_record import compare_records, sample_positions, save_record
from tests.conftest import ROOT


def _record(scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, generator=g, dtype=torch.float32)
    b = torch.randn(5, generator=g)
    params = {
        name: {"shape": [t.numel()], "norm": float(t.double().norm()), "sample": t[sample_positions(t.numel())].clone()}
        for name, t in (("w", w * scale), ("b", b * scale))
    }
    norm = float(torch.cat([w, b]).double().norm()) * scale
    return {"norm": norm, "params": params}


def test_sample_positions_are_fixed_and_cover_both_ends():
    assert sample_positions(5).tolist() == [0, 1, 2, 3, 4]
    pos = sample_positions(10_000)
    assert len(pos) == 64 and pos[0] == 0 and pos[-1] == 9_999 and bool((pos[1:] > pos[:-1]).all())


def test_compare_records_bitwise_tolerance_and_each_kind_of_difference():
    ref = _record()
    assert compare_records(_record(), ref, rtol=0.0) == ([], 0.0)

    doubled, worst = compare_records(_record(2.0), ref, rtol=1e-5)
    assert worst == pytest.approx(1.0)
    assert any(p.startswith("global gradient norm") for p in doubled)
    assert any(p.startswith("w: gradient norm") for p in doubled) and any(p.startswith("b:") for p in doubled)

    nudged = _record()
    nudged["params"]["w"]["sample"][3] *= 1 + 1e-6  # a rounding-sized change
    assert compare_records(nudged, ref, rtol=1e-5)[0] == []
    assert "w: sampled gradient entries differ" in compare_records(nudged, ref, rtol=0.0)[0][0]

    permuted = _record()  # same norms, entries in the wrong places (a sharding mix-up)
    permuted["params"]["w"]["sample"] = permuted["params"]["w"]["sample"].flip(0)
    problems, _ = compare_records(permuted, ref, rtol=1e-5)
    assert len(problems) == 1 and problems[0].startswith("w: sampled gradient entries differ"), problems

    missing = _record()
    del missing["params"]["b"]
    assert "b: only in the reference" in compare_records(missing, ref, rtol=1.0)[0]
    reshaped = _record()
    reshaped["params"]["b"]["shape"] = [1, 5]
    assert "b: shape [1, 5] vs [5]" in compare_records(reshaped, ref, rtol=1.0)[0]


def test_cli_exit_codes(tmp_path, capsys):
    save_record(_record(), str(tmp_path / "a.pt"))
    save_record(_record(2.0), str(tmp_path / "b.pt"))
    assert grad_record_cli([str(tmp_path / "a.pt"), str(tmp_path / "a.pt")]) == 0
    assert "bitwise equal" in capsys.readouterr().out
    assert grad_record_cli([str(tmp_path / "b.pt"), str(tmp_path / "a.pt"), "--rtol", "1e-5"]) == 1
    assert "DIFFER" in capsys.readouterr().out
    assert grad_record_cli([str(tmp_path / "missing.pt"), str(tmp_path / "a.pt")]) == 2


# ---- real jobs: the suite's own cases, 2 steps each

DOUBLED_GRADS = os.path.join(ROOT, "tests", "faults", "doubled_grads.py")
SUITE = dataclasses.replace(
    suites.SUITES["cpu"], steps=2, overrides=[*suites.SUITES["cpu"].overrides, "--metrics.log_freq", "1"]
)
CASES = {c.name: c for c in SUITE.cases}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The one-process reference runs, each made on first use."""
    out = str(tmp_path_factory.mktemp("references"))
    done: dict[str, it.Finished] = {}

    def get(name: str) -> dict[str, it.Finished]:
        if name not in done:
            result = it.run_case(SUITE, CASES[name], out, done)
            assert result.problem is None, result.problem
        return done

    return get


@pytest.mark.parametrize("layout", ["fsdp2_graph"])
def test_gradient_check_fails_when_a_layout_doubles_its_gradients(layout, references, tmp_path):
    case = CASES[layout]
    done = dict(references(case.close_to))
    result = it.run_case(SUITE, case, str(tmp_path), done, script=DOUBLED_GRADS)
    print(f"{layout} with doubled gradients: {result.problem}")
    assert result.problem is not None and result.problem.startswith("step-1 gradients deviate from"), result.problem
    assert "global gradient norm" in result.problem and "(rel 1.0e+00 > 1e-05)" in result.problem
    # The losses alone would have passed: doubled gradients barely move them.
    assert "losses deviate" not in result.problem


@pytest.mark.parametrize(
    "layout",
    [
        "fsdp2_graph",
        "single_accum4_graph",
        "fsdp2_accum2_per_step",
        "pp2xtp2_interleaved_graph",
        "deepseek_2l_tp2xep2_graph",
    ],
)
def test_gradient_check_passes_each_summing_path_unchanged(layout, references, tmp_path):
    case = CASES[layout]
    done = dict(references(case.close_to))
    result = it.run_case(SUITE, case, str(tmp_path), done)
    assert result.problem is None, result.problem
    assert "grads " in result.note
