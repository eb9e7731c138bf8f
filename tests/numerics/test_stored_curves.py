"""Stored loss curves (bitwise) and run-to-run determinism (losses and final state).

Each curve's job (``tests.numerics.curves``) runs twice. The first run's ``losses.txt`` must be
the stored file byte for byte; the second run must repeat the first: the same losses and the
same SHA-256 of every parameter, buffer and AdamW moment saved at the last step.
"""

from __future__ import annotations

import difflib

import pytest

from tests.numerics.curves import CURVES, curve_path, final_state_hashes, run_curve


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> [(losses text, final state hashes)] of two runs, made on first use."""
    cache: dict[str, list] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = []
            for attempt in (1, 2):
                folder = tmp_path_factory.mktemp(f"{name}_run{attempt}")
                cache[name].append((run_curve(name, folder), final_state_hashes(folder)))
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(CURVES))
def test_losses_match_the_stored_curve(name, runs):
    losses, _ = runs(name)[0]
    stored = curve_path(name).read_text()
    if losses != stored:
        first = next(a for a, b in zip(stored.splitlines() + [""], losses.splitlines() + [""]) if a != b)
        diff = "\n".join(difflib.unified_diff(stored.splitlines(), losses.splitlines(), "stored", "this run",
                                              lineterm="", n=0))
        pytest.fail(f"{name}: losses differ from {curve_path(name)} from step {first.split(' ')[0] or '?'} "
                    f"(intended numeric change? regenerate: python -m tests.numerics.regenerate {name})\n{diff}")


@pytest.mark.parametrize("name", list(CURVES))
def test_same_command_twice_gives_identical_losses_and_final_state(name, runs):
    (losses1, state1), (losses2, state2) = runs(name)
    assert losses1 == losses2
    assert state1 and any(k.startswith("model.") for k in state1)
    differing = sorted(k for k in state1.keys() | state2.keys() if state1.get(k) != state2.get(k))
    assert not differing, f"{len(differing)} tensors differ between two runs, e.g. {differing[:5]}"
