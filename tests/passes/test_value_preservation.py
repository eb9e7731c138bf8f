"""Every optimisation pass keeps the training bitwise: same per-step losses as the graph without it.

Real gloo processes, 10 steps of the debug LLaMA-3; each layout's run without passes is made
once and shared by every pass list compared with it.
"""

import pytest

from tests.launch import read_losses, run_train

STEPS = ["--training.steps", "10"]
LAYOUTS = {"fsdp2": (2, []), "fsdp2xtp2": (4, ["--parallelism.tp", "2"])}
PASS_LISTS = ["transformer_block_bucketing", "auto_bucketing", "transformer_block_bucketing,auto_bucketing"]


@pytest.fixture(scope="module")
def without_passes(tmp_path_factory):
    losses = {}
    for layout, (nproc, extra) in LAYOUTS.items():
        folder = tmp_path_factory.mktemp(f"{layout}_plain")
        run_train(nproc, folder, *STEPS, *extra)
        losses[layout] = read_losses(folder)
    return losses


@pytest.mark.parametrize("passes", PASS_LISTS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_bitwise_with_and_without(layout, passes, tmp_path, without_passes):
    nproc, extra = LAYOUTS[layout]
    run_train(nproc, tmp_path, *STEPS, *extra, "--compile.passes", passes)
    plain, optimised = without_passes[layout], read_losses(tmp_path)
    assert len(plain) == 10
    assert [repr(v) for _, v in optimised] == [repr(v) for _, v in plain]
