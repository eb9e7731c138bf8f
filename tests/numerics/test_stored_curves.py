"""Stored loss curves and run-to-run determinism (losses and final state).

Each curve's job (``tests.numerics.curves``) runs twice. The first run's ``losses.txt`` must be
the stored curve of this machine's set byte for byte, or, on a machine no set was recorded on,
within ``CURVE_RTOL`` of the reference set at every step (a warning says so, and how to record
this machine's set). The second run must repeat the first exactly: the same losses and the same
SHA-256 of every parameter, buffer and AdamW moment saved at the last step.
"""

from __future__ import annotations

import difflib
import warnings

import pytest

from tests.numerics.curves import (
    ASSETS,
    COMPARABLE_STEPS,
    CURVE_RTOL,
    CURVES,
    STEPS,
    curve_path,
    deviation,
    final_state_hashes,
    recorded_on,
    run_curve,
    set_for,
)
from tests.numerics.machine import fingerprint

# The curve run twice for the determinism test: the multi-process one (gloo's collectives are where
# run-to-run differences would come from). Every curve's losses are compared bit for bit with the
# stored curve on every run, which a run-to-run difference in the losses fails as well; the second
# run adds the final parameters and AdamW state (costs CI a run of 20 steps per curve).
TWICE = ("llama3_debug_fsdp2",)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> [(losses text, final state hashes)] of its runs (two for ``TWICE``), made on first use."""
    cache: dict[str, list] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = []
            for attempt in (1, 2) if name in TWICE else (1,):
                folder = tmp_path_factory.mktemp(f"{name}_run{attempt}")
                cache[name].append((run_curve(name, folder), final_state_hashes(folder)))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def machine():
    return fingerprint()


def _skip_unless_same_initial_weights(machine: dict) -> None:
    """The stored curves start from the weights the recording torch drew; a release that draws others
    from the same seed (torch 2.11 against 2.13: ``trunc_normal_``) is not comparable to them."""
    recorded = recorded_on(ASSETS)["init_draws"]
    if set_for(machine) is None and machine["init_draws"] != recorded:
        pytest.skip(
            f"torch {machine['torch']} draws other initial weights from the same seed (trunc_normal_: "
            f"{machine['init_draws']} vs {recorded}); record its set: python -m tests.numerics.regenerate --add-machine"
        )


@pytest.mark.parametrize("name", list(CURVES))
def test_losses_match_the_stored_curve(name, runs, machine):
    _skip_unless_same_initial_weights(machine)
    losses, _ = runs(name)[0]
    curve_set = set_for(machine)
    if curve_set is None:
        stored, steps = curve_path(name).read_text(), COMPARABLE_STEPS[name]
        worst, step = deviation(losses, stored, steps)
        differs = sorted(k for k in machine if machine[k] != recorded_on(ASSETS).get(k))
        assert worst <= CURVE_RTOL, (
            f"{name}: losses deviate {worst:.1e} (> {CURVE_RTOL:.0e}) from {curve_path(name)} at step {step}; "
            f"this machine differs from the recording one in {', '.join(differs)}, so only the bound applies "
            f"(over the first {steps} steps)"
        )
        warnings.warn(
            f"{name}: no stored curves for this machine (it differs in {', '.join(differs)}): its first "
            f"{steps} steps compared within {CURVE_RTOL:.0e} (largest deviation {worst:.1e}), not bitwise; "
            f"to record this machine's set: python -m tests.numerics.regenerate --add-machine",
            stacklevel=2,
        )
        return
    stored = curve_path(name, curve_set).read_text()
    if losses != stored:
        first = next(a for a, b in zip(stored.splitlines() + [""], losses.splitlines() + [""], strict=False) if a != b)
        diff = "\n".join(
            difflib.unified_diff(stored.splitlines(), losses.splitlines(), "stored", "this run", lineterm="", n=0)
        )
        pytest.fail(
            f"{name}: losses differ from {curve_path(name, curve_set)} (recorded on this machine's "
            f"fingerprint) from step {first.split(' ')[0] or '?'} (intended numeric change? regenerate: "
            f"python -m tests.numerics.regenerate {name})\n{diff}"
        )


def test_every_curve_says_how_many_steps_another_machine_reproduces():
    assert COMPARABLE_STEPS.keys() == CURVES.keys()
    assert all(1 <= steps <= STEPS for steps in COMPARABLE_STEPS.values())


@pytest.mark.parametrize("name", TWICE)
def test_same_command_twice_gives_identical_losses_and_final_state(name, runs):
    (losses1, state1), (losses2, state2) = runs(name)
    assert losses1 == losses2
    assert any(k.startswith("model.") for k in state1) and any(k.startswith("optim.") for k in state1), list(state1)[:5]
    differing = sorted(k for k in state1.keys() | state2.keys() if state1.get(k) != state2.get(k))
    assert not differing, f"{len(differing)} tensors differ between two runs, e.g. {differing[:5]}"


def test_a_machine_without_a_stored_set_is_held_to_the_bound(tmp_path, machine):
    """What another CPU does, done here: the same job with other kernels for the same math (ATen's
    widest build, MKL's own dispatch instead of the pinned COMPATIBLE branch) must not match the
    stored curve bitwise, must stay within CURVE_RTOL of it, and no stored set may claim a
    machine with another fingerprint."""
    import os

    from tests.launch import run_torchrun
    from tests.numerics import curves

    _skip_unless_same_initial_weights(machine)
    if machine["cpu_isa"] not in ("avx2", "avx512f"):
        pytest.skip("this CPU has no AVX2: ATen has no other kernel build to compare with")
    nproc, args = CURVES["llama3_debug"]
    unpinned = {"ATEN_CPU_CAPABILITY": "avx512" if machine["cpu_isa"] == "avx512f" else "avx2", "MKL_CBWR": ""}
    run_torchrun(
        nproc,
        os.path.join(curves.ROOT, "train.py"),
        *args,
        *curves._COMMON,
        "--job.dump_folder",
        str(tmp_path),
        env={**curves.PINNED_ENV, **unpinned},
    )
    losses, stored = (tmp_path / "losses.txt").read_text(), curve_path("llama3_debug").read_text()
    worst, step = deviation(losses, stored)
    assert losses != stored and worst > 0, "other kernels gave the same floats: this test shows nothing here"
    assert worst <= CURVE_RTOL, f"other kernels moved the curve by {worst:.1e} at step {step}"
    assert set_for({**machine, "cpu_vendor": "SomeOtherVendor"}) is None
