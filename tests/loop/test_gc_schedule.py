"""training.gc_freq: no automatic collection while training, one at the same steps on every rank."""

from __future__ import annotations

import gc

import pytest

from graph_trainer.config_loading import load_config
from graph_trainer.loop.gc_schedule import scheduled_collection
from graph_trainer.trainer import Trainer
from graph_trainer.validation import validate_config
from tests.launch import FAST_ARGS


def _collections_while_training(tmp_path, gc_freq: int) -> tuple[list[tuple[int, int]], bool]:
    """The (generation, step) of every collection while an eager 4-step job trains, and whether
    automatic collection was on at the first step."""
    args = [*FAST_ARGS, "--job.dump_folder", str(tmp_path), "--compile.mode", "eager", "--training.steps", "4"]
    cfg = load_config([*args, "--training.gc_freq", str(gc_freq)])
    validate_config(cfg)
    trainer = Trainer(cfg)
    seen, enabled = [], []

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append((info["generation"], trainer.step))

    step = trainer.train_step

    def train_step(microbatches):
        enabled.append(gc.isenabled())
        return step(microbatches)

    trainer.train_step = train_step
    gc.callbacks.append(on_collection)
    try:
        trainer.train()
    finally:
        gc.callbacks.remove(on_collection)
    return seen, enabled[0]


def test_collections_only_at_the_scheduled_steps(tmp_path):
    assert gc.isenabled()
    seen, enabled = _collections_while_training(tmp_path, gc_freq=2)
    assert not enabled
    assert seen == [(1, 0), (1, 2), (1, 4)]  # before the first step, after steps 2 and 4
    assert gc.isenabled()  # restored


def test_zero_leaves_automatic_collection_on():
    with scheduled_collection(0) as after_step:
        assert gc.isenabled()
        after_step(50)
        assert gc.isenabled()


def test_a_negative_frequency_is_one_line_error():
    from graph_trainer.errors import ConfigError

    cfg = load_config([*FAST_ARGS, "--training.gc_freq", "-1"])
    with pytest.raises(ConfigError, match=r"training.gc_freq = -1 must be >= 0"):
        validate_config(cfg)
