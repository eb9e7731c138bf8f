"""Refusing a job that cannot fit before it allocates (graph_trainer/loop/preflight.py, "Memory"), and the
largest shard every rank computes alike (``parallel.largest_local_numel``). The other preflight
checks (folders, threads, the logits of a batch) are in tests/reliability/test_one_line_errors.py."""

from __future__ import annotations

import resource

import pytest
import torch

from graph_trainer.config_loading import load_config
from graph_trainer.distributed.parallel_dims import largest_local_numel, local_tensor
from graph_trainer.errors import ConfigError
from graph_trainer.trainer import Trainer
from graph_trainer.validation import validate_config
from tests.launch import FAST_ARGS, read_losses, run_train

GIB = 1 << 30
LLAMA3_8B_PARAMETERS = 8_030_261_248


def test_a_model_state_that_cannot_fit_is_refused_before_it_is_allocated(tmp_path, capsys, monkeypatch):
    """Llama3-8B on a 24 GiB machine: 8.03e9 fp32 parameters, their gradients and two AdamW moments
    are 119.7 GiB; refused while the model is still on the meta device."""
    import train

    monkeypatch.setattr("graph_trainer.loop.preflight.host_memory_bytes", lambda: 24 * GIB)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    flags = ["--model.flavor", "8B", "--job.device", "cpu", "--training.seq_len", "128"]
    assert train.main([*flags, "--training.local_batch_size", "1", "--job.dump_folder", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    (line,) = [x for x in lines if x.startswith("error: ")]
    assert line == lines[-1] and not [x for x in lines if "Traceback" in x]
    need = 4 * 4 * LLAMA3_8B_PARAMETERS / GIB
    assert line == (
        f"error: the model state needs {need:,.1f} GiB per rank (parameters {need / 4:,.1f} GiB, gradients as "
        f"much, AdamW state 2x) but this machine has 24 GiB of memory for 1 process(es); it needs at least "
        f"5x more sharding (parallelism.dp_shard, parallelism.tp); --debug.skip_memory_check True goes on anyway"
    )
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 2 * GIB // 1024  # nothing of 30 GiB


def _graph_trainer(tmp_path, *flags: str) -> Trainer:
    cfg = load_config(
        [*FAST_ARGS, "--job.dump_folder", str(tmp_path), "--training.steps", "1", "--training.local_batch_size", "8"]
        + ["--training.seq_len", "128", "--model.n_layers", "6", *flags]
    )
    validate_config(cfg)
    return Trainer(cfg)


def test_a_step_that_cannot_fit_is_refused_after_tracing_before_it_runs(tmp_path, monkeypatch, caplog):
    """The debug model's state (6.2M parameters: 94 MiB with gradients and AdamW) fits in 150 MiB; its
    traced step at 8 x 128 tokens does not. Refused with the settings that would shrink it; with
    debug.skip_memory_check the step runs and a warning says why it was not refused."""
    monkeypatch.setattr("graph_trainer.loop.preflight.host_memory_bytes", lambda: 150 << 20)
    trainer = _graph_trainer(tmp_path / "refused")
    with pytest.raises(ConfigError) as info:
        trainer.train()
    (line,) = str(info.value).splitlines()
    assert line.startswith("a training step needs an estimated ") and "(graph, at node " in line
    assert "but this machine has 0.146 GiB of memory for 1 process(es); to fit: activation_checkpoint.mode " in line
    assert "selective or full; a smaller training.local_batch_size" in line and "training.loss_chunks > 1" in line
    assert line.endswith("; --debug.skip_memory_check True goes on anyway")
    assert not (tmp_path / "refused" / "losses.txt").exists() or not read_losses(tmp_path / "refused")

    skipping = _graph_trainer(tmp_path / "skipped", "--debug.skip_memory_check", "True")
    assert len(skipping.train()) == 1
    assert any("(going on: debug.skip_memory_check)" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_a_pipeline_whose_in_flight_microbatches_cannot_fit_is_refused_before_they_run(tmp_path, mode):
    """PP=2 with GPipe keeps all 32 microbatches of 64 x 2048 tokens in flight on each stage: far
    more than any CI machine holds. Every rank estimates its stages once traced (eager: traced on
    fake tensors for the estimate; ``pipelining.timeline.rank_memory``) and the job ends in one
    line naming the schedule."""
    flags = ["--parallelism.pp", "2", "--parallelism.pp_schedule", "GPipe", "--training.seq_len", "2048"]
    flags += ["--compile.mode", mode]
    flags += ["--training.local_batch_size", "64", "--training.global_batch_size", "2048", "--training.steps", "1"]
    result = run_train(2, tmp_path, *flags, check=False)
    assert result.returncode != 0
    (line,) = {x for x in result.stderr.splitlines() if x.startswith("error: ")}
    assert line.startswith("error: a training step needs an estimated ") and "(pipeline, during " in line
    assert "to fit: parallelism.pp_schedule 1F1B (the fewest microbatches in flight)" in line
    assert not (tmp_path / "losses.txt").exists() or not read_losses(tmp_path)


def test_largest_local_numel_is_the_first_ranks_piece_of_an_uneven_split():
    """FSDP over 3 ranks splits 256 rows as 86 / 85 / 85: every rank computes 86 rows, the rank at
    coordinate 0 (the fake world's rank) holds them."""
    from graph_trainer.build import build_job_model, build_layout
    from graph_trainer.fake_trace import fake_world

    cfg = load_config(FAST_ARGS)
    validate_config(cfg, 3)
    with fake_world(3):
        model = build_job_model(cfg, build_layout(cfg, 3, "cpu"), torch.device("meta"))
        params = list(model.parameters())
        uneven = [p for p in params if p.shape[0] % 3]
        assert uneven  # the check below is about them
        for p in params:
            assert largest_local_numel(p) == local_tensor(p).numel(), p.shape
            assert 3 * largest_local_numel(p) >= p.numel()
    assert largest_local_numel(torch.empty(4, 5, device="meta")) == 20


def test_weights_resident_per_step_are_part_of_the_model_state(monkeypatch):
    """Llama3-8B at FSDP=8: 3.7 GiB of fp32 shards per rank, 15 GiB of model state; kept for the
    step, every weight gathered in bf16 and its fp32 gradient sum add 6 bytes per parameter."""
    from graph_trainer.build import build_job_model, build_layout
    from graph_trainer.fake_trace import fake_world
    from graph_trainer.loop.preflight import check_model_state_fits

    monkeypatch.setattr("graph_trainer.loop.preflight.host_memory_bytes", lambda: 24 * GIB)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    flags = ["--model.flavor", "8B", "--training.mixed_precision_param", "bfloat16"]
    cfg = load_config([*flags, "--parallelism.fsdp_collectives", "per_step"])
    with fake_world(8):
        model = build_job_model(cfg, build_layout(cfg, 8, "cpu"), torch.device("meta"))
        check_model_state_fits(cfg, model, "cpu", weights_per_step=False)
        with pytest.raises(ConfigError) as info:
            check_model_state_fits(cfg, model, "cpu", weights_per_step=True)
    held = 6 * LLAMA3_8B_PARAMETERS / GIB
    assert f"+ {held:,.1f} GiB of weights gathered for the step and their gradient sums" in str(info.value)


def test_a_step_over_memory_with_resident_weights_names_gathering_per_microbatch(monkeypatch):
    from graph_trainer.analysis.memory import MemoryParts, StepMemoryEstimate
    from graph_trainer.loop.preflight import check_step_fits

    monkeypatch.setattr("graph_trainer.loop.preflight.host_memory_bytes", lambda: GIB)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = load_config(FAST_ARGS)
    for resident in (0, GIB):
        peak = MemoryParts("pipeline", GIB, 0, GIB, GIB, "B of stage 0", GIB, resident)
        estimate = StepMemoryEstimate((peak,), activations_estimated=True)
        with pytest.raises(ConfigError) as info:
            check_step_fits(cfg, estimate, peak.total, "cpu")
        assert ("to fit: parallelism.fsdp_collectives per_microbatch" in str(info.value)) == bool(resident)
