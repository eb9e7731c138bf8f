"""The trainer end to end in one process: graph mode is bitwise the eager baseline."""

import contextlib
import logging
import os

import pytest
import torch

from graph_trainer.config_loading import load_config
from graph_trainer.trainer import Trainer
from graph_trainer.validation import validate_config
from suites import CPU_BLOCKS
from tests.conftest import ROOT


def _config(tmp_path, mode: str, steps: int, *extra: str, name: str = ""):
    cfg = load_config(
        [
            "--job.config_file",
            os.path.join(ROOT, "configs", "llama3_debug.toml"),
            "--job.device",
            "cpu",
            "--job.dump_folder",
            str(tmp_path / (name or mode)),
            "--compile.mode",
            mode,
            "--training.steps",
            str(steps),
            "--training.local_batch_size",
            "2",
            "--training.seq_len",
            "64",
            "--metrics.enable_tensorboard",
            "False",
            *CPU_BLOCKS,
            *extra,
        ]
    )
    validate_config(cfg)
    return cfg


def _run(tmp_path, mode: str, steps: int = 10, *extra: str, name: str = ""):
    trainer = Trainer(_config(tmp_path, mode, steps, *extra, name=name))
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    losses = trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return losses, initial, params, tmp_path / (name or mode) / "losses.txt"


def test_graph_equals_eager_bitwise_over_10_steps(tmp_path):
    graph_losses, initial, graph_params, graph_file = _run(tmp_path, "graph")
    eager_losses, _, eager_params, eager_file = _run(tmp_path, "eager")
    assert len(graph_losses) == 10
    assert [repr(x) for x in graph_losses] == [repr(x) for x in eager_losses]
    # The loss files, which is how two runs are compared from their outputs, agree too.
    assert graph_file.read_text() == eager_file.read_text()
    assert graph_params.keys() == eager_params.keys()
    for name in graph_params:
        assert torch.equal(graph_params[name], eager_params[name]), name
    # Training did something: the loss fell and every parameter moved (AdamW updates each one,
    # so one left unchanged would mean its gradient or update never reached it).
    assert graph_losses[-1] < graph_losses[0]
    assert initial.keys() == graph_params.keys()
    unchanged = [name for name in initial if torch.equal(initial[name], graph_params[name])]
    assert not unchanged, unchanged


def test_bf16_on_one_process_is_applied_and_graph_equals_eager(tmp_path):
    bf16 = ("--training.mixed_precision_param", "bfloat16")
    graph_losses, _, graph_params, _ = _run(tmp_path, "graph", 4, *bf16, name="graph_bf16")
    eager_losses, _, eager_params, _ = _run(tmp_path, "eager", 4, *bf16, name="eager_bf16")
    fp32_losses, *_ = _run(tmp_path, "graph", 4, name="graph_fp32")
    assert [repr(x) for x in graph_losses] == [repr(x) for x in eager_losses]
    assert all(torch.equal(graph_params[n], eager_params[n]) for n in graph_params)
    # bf16 compute really happened (from step 1: the forward already rounds differently) ...
    assert graph_losses[0] != fp32_losses[0] and abs(graph_losses[0] - fp32_losses[0]) < 1e-2
    # ... on float32 master weights, which the optimizer updates.
    assert {p.dtype for p in graph_params.values()} == {torch.float32}
    assert any(".parametrizations." in n for n in graph_params)


@pytest.mark.parametrize("world_size, layout", [(1, []), (2, ["--parallelism.tp", "2"])], ids=["one_process", "tp2"])
def test_bf16_compute_where_no_data_parallel_dim_exists(world_size, layout):
    """Matmuls run in bf16 on float32 parameters on one process and under tensor parallel alone
    (layouts where SimpleFSDP, which used to do the cast, is not applied)."""
    from graph_trainer.fake_trace import fake_world, trace_job

    def matmul_dtypes(dtype: str) -> set:
        cfg = load_config(
            [
                "--training.seq_len",
                "32",
                "--training.local_batch_size",
                "2",
                *layout,
                "--training.mixed_precision_param",
                dtype,
            ]
        )
        validate_config(cfg, world_size)
        with fake_world(world_size) if world_size > 1 else contextlib.nullcontext():
            gm = trace_job(cfg, world_size).gm
        inputs = {
            n.meta["val"].dtype
            for n in gm.graph.nodes
            if n.op == "placeholder" and "val" in n.meta and n.meta["val"].is_floating_point()
        }
        assert inputs == {torch.float32}, inputs  # master weights stay float32
        return {n.meta["val"].dtype for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default}

    assert matmul_dtypes("bfloat16") == {torch.bfloat16}
    assert matmul_dtypes("float32") == {torch.float32}


def test_a_step_takes_exactly_the_jobs_microbatches(tmp_path):
    """The traced loss scale is 1 / (dp x microbatches): a step given another count is refused."""
    cfg = _config(tmp_path, "eager", 1, "--training.global_batch_size", "6")  # local 2: 3 microbatches
    trainer = Trainer(cfg)
    assert trainer.microbatches == 3 and trainer.grad_scale == 1 / 3
    with pytest.raises(ValueError, match="train_step got 2 microbatches; this job runs 3 per step"):
        trainer.train_step([next(trainer.dataloader) for _ in range(2)])


def test_a_job_logs_what_it_sets_and_writes_every_field_to_its_dump_folder(tmp_path, caplog):
    cfg = _config(tmp_path, "eager", 1, "--training.lr", "0.001")
    log = logging.getLogger("graph_trainer")  # (it does not propagate to caplog's root handler)
    log.addHandler(caplog.handler)
    try:
        Trainer(cfg)
    finally:
        log.removeHandler(caplog.handler)
    path = tmp_path / "eager" / "config.toml"
    again = load_config(["--job.config_file", str(path)])
    again.job.config_file = cfg.job.config_file
    assert again == cfg
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("config (what differs")]
    assert " training.lr=0.001 " in f"{line} " and " compile.mode=" in line and "training.beta1" not in line
