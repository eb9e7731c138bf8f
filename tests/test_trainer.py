"""The trainer end to end in one process: graph mode is bitwise the eager baseline."""

import os

import torch

from graph_trainer.config import load_config, validate_config
from graph_trainer.trainer import Trainer
from tests.conftest import ROOT


def _run(tmp_path, mode: str, steps: int = 10):
    cfg = load_config([
        "--job.config_file", os.path.join(ROOT, "configs", "llama3_debug.toml"),
        "--job.dump_folder", str(tmp_path / mode),
        "--compile.mode", mode,
        "--training.steps", str(steps),
        "--training.local_batch_size", "2",
        "--training.seq_len", "64",
        "--metrics.enable_tensorboard", "False",
    ])
    validate_config(cfg)
    trainer = Trainer(cfg)
    losses = trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return losses, params, tmp_path / mode / "losses.txt"


def test_graph_equals_eager_bitwise_over_10_steps(tmp_path):
    graph_losses, graph_params, graph_file = _run(tmp_path, "graph")
    eager_losses, eager_params, eager_file = _run(tmp_path, "eager")
    assert len(graph_losses) == 10
    assert [repr(x) for x in graph_losses] == [repr(x) for x in eager_losses]
    # The loss files, which is how two runs are compared from their outputs, agree too.
    assert graph_file.read_text() == eager_file.read_text()
    assert graph_params.keys() == eager_params.keys()
    for name in graph_params:
        assert torch.equal(graph_params[name], eager_params[name]), name
    # Training did something: the loss fell and the parameters moved.
    assert graph_losses[-1] < graph_losses[0]
