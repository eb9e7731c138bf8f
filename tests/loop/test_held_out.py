"""Validation (graph_trainer/loop/held_out.py): the held-out loss equals an offline eager forward of
the same weights on the same batches, bitwise on one process and through a pipeline; it leaves
training untouched and records no autograd graph (one process and the forward-only pipeline);
the forward-only pipeline plan and the held-out synthetic split; held-out data that is training
data refused by default and one warning when chosen; errors naming the setting at fault."""

from __future__ import annotations

import json

import pytest
import torch

from graph_trainer.checkpoint.checkpointer import complete_steps
from graph_trainer.compiler.tracer import eager_step
from graph_trainer.config_loading import load_config
from graph_trainer.data.loader import build_dataloader
from graph_trainer.data.tokenizer import build_tokenizer
from graph_trainer.errors import ConfigError
from graph_trainer.pipelining.executor import run_pipeline
from graph_trainer.pipelining.forward_only import ForwardOnlyRunner, forward_only_plan
from graph_trainer.pipelining.schedule import PipelinePlan, plan_pipeline
from graph_trainer.trainer import Trainer
from graph_trainer.validation import validate_config
from models.common import stage_view
from suites import debug_job
from suites.cases import DEEPSEEK_DEBUG
from tests.launch import FAST_ARGS, read_losses, run_train
from tests.reliability.helpers import logged_warnings, make_trainer

VALIDATION = ["--validation.enable", "True", "--validation.steps", "2", "--metrics.json_lines", "True"]


def _trainer(folder, *args, base=FAST_ARGS) -> Trainer:
    cfg = load_config([*base, "--job.dump_folder", str(folder), *args])
    validate_config(cfg)
    return Trainer(cfg)


def _validations(folder) -> dict[int, float]:
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if r.get("event") == "validation"}


def _offline_loss(folder, step: int, steps: int = 2, model: tuple[str, ...] = ()) -> float:
    """The step's checkpoint loaded on one process in eager mode, its forward (with autograd, as an
    eager training step computes it) on the first ``steps`` held-out batches, summed in order;
    ``model``: the job's model flags besides ``FAST_ARGS``."""
    trainer = _trainer(
        folder / f"offline{step}",
        *model,
        *("--compile.mode", "eager", "--checkpoint.folder", str(folder / "checkpoint")),
        *("--checkpoint.load_step", str(step), "--training.steps", str(step)),
    )
    t = trainer.cfg.training
    loader = build_dataloader(
        dataset=t.dataset,
        tokenizer=build_tokenizer(t.tokenizer_path),
        seq_len=t.seq_len,
        local_batch_size=t.local_batch_size,
        dp_rank=0,
        dp_degree=1,
        seed=t.seed,
        vocab_size=trainer.model_args.vocab_size,
        dataset_split="validation",
    )
    total = None
    for _ in range(steps):
        tokens, labels = next(loader)
        loss, _ = eager_step(trainer.model, tokens, labels, t.loss_chunks)
        total = loss if total is None else total + loss
    return (total / steps).item()


def test_one_process_graph_job_validates_as_an_offline_eager_forward(tmp_path):
    steps = ["--training.steps", "4", "--checkpoint.interval", "4"]
    _trainer(tmp_path, *VALIDATION, "--validation.freq", "2", *steps).train()
    measured = _validations(tmp_path)
    assert sorted(measured) == [1, 2, 4]
    assert measured[4] < measured[1]  # the model learns the held-out text too
    assert complete_steps(str(tmp_path / "checkpoint")) == [4]
    assert measured[4] == _offline_loss(tmp_path, 4)


def test_a_pipeline_validates_as_an_offline_forward_on_one_process(tmp_path):
    """ZBV on 2 ranks (two stages each, one hand-over on a rank), 2 microbatches of 2 per step; the
    held-out microbatches are what one process takes as batches (no data parallelism), and a
    stage split computes what the whole model does, so bitwise."""
    four_blocks = ("--model.n_layers", "4")  # (a stage each)
    pipeline = [*four_blocks, "--parallelism.pp", "2", "--parallelism.pp_schedule", "ZBVZeroBubble"]
    pipeline += ["--parallelism.pp_microbatches", "2", "--training.steps", "2", "--checkpoint.interval", "2"]
    run_train(2, tmp_path, *pipeline, *VALIDATION, "--validation.freq", "2")
    measured = _validations(tmp_path)
    assert sorted(measured) == [1, 2] and len(read_losses(tmp_path)) == 2
    assert measured[2] == _offline_loss(tmp_path, 2, model=four_blocks)


def test_validation_leaves_deepseek_expert_counts_and_training_untouched(tmp_path):
    """DeepSeek-V3's forward counts routed tokens per expert, which steer the next update's expert
    bias: a validation after every step must not add its own."""
    deepseek = [*debug_job(DEEPSEEK_DEBUG), "--model.n_layers", "2", "--training.steps", "3"]
    plain = _trainer(tmp_path / "plain", base=deepseek).train()
    validated = _trainer(tmp_path / "validated", *VALIDATION, "--validation.freq", "1", base=deepseek)
    assert validated.train() == plain
    assert sorted(_validations(tmp_path / "validated")) == [1, 2, 3]
    # between two updates the counts hold the step's routing; a validation leaves every buffer as it was
    (moe, *_) = validated.model.moe_layers()
    moe.tokens_per_expert.copy_(torch.arange(moe.tokens_per_expert.numel(), dtype=torch.float32))
    before = {name: b.clone() for name, b in validated.model.named_buffers()}
    validated.held_out()  # (what validate() records; the run has ended, its metrics closed)
    assert all(torch.equal(b, before[name]) for name, b in validated.model.named_buffers())


def _grad_modes_seen(model: torch.nn.Module) -> list[bool]:
    """Filled as the model runs: whether autograd records, as each transformer block's forward starts."""
    seen: list[bool] = []
    for block in model.layers.values():
        block.register_forward_pre_hook(lambda module, args: seen.append(torch.is_grad_enabled()))
    return seen


def test_a_validation_records_no_autograd_graph(tmp_path):
    """A forward under autograd keeps every activation for a backward that never comes: the loss
    is the same, the memory is not, so the blocks themselves are asked."""
    trainer = _trainer(tmp_path, *VALIDATION)
    seen = _grad_modes_seen(trainer.model)
    tokens, labels = next(trainer.dataloader)
    eager_step(trainer.model, tokens, labels, trainer.cfg.training.loss_chunks)
    assert seen == [True] * len(trainer.model.layers)  # (the hooks see a training forward's autograd)
    seen.clear()
    trainer.held_out()
    assert seen == [False] * (len(trainer.model.layers) * trainer.cfg.validation.steps)


def test_the_forward_only_pipeline_records_no_autograd_graph(tmp_path):
    """Validation's pipeline path (``ForwardOnlyRunner`` through ``run_pipeline``), in one process:
    the model's two blocks as two stages on one rank, handed over in memory."""
    trainer = _trainer(tmp_path, *VALIDATION)
    model, chunks = trainer.model, trainer.cfg.training.loss_chunks
    assert len(model.layers) == 2
    stages = [stage_view(model, range(0, 1), True, False), stage_view(model, range(1, 2), False, True)]
    runners = {s: ForwardOnlyRunner(module, s == 1, chunks) for s, module in enumerate(stages)}
    plan = forward_only_plan(PipelinePlan("two stages on one rank", 1, 2, {0: 0, 1: 0}, {0: []}), 2)
    batches = [next(trainer.dataloader) for _ in range(2)]
    tokens, labels = [t for t, _ in batches], [lab for _, lab in batches]
    seen = _grad_modes_seen(model)

    def make_hidden() -> torch.Tensor:
        return torch.empty(*tokens[0].shape, trainer.model_args.dim)

    losses = run_pipeline(plan, 0, runners, tokens, labels, None, make_hidden)
    assert len(losses) == 2 and not any(loss.requires_grad for loss in losses)
    assert seen == [False] * 4  # two microbatches through two blocks


@pytest.mark.parametrize("schedule, pp", [("1F1B", 2), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2), ("GPipe", 3)])
def test_forward_only_plan_runs_each_stage_forward_once_on_its_rank(schedule, pp):
    plan = forward_only_plan(plan_pipeline(schedule, pp, 4), 3)
    assert plan.microbatches == 3 and plan.stage_to_rank == plan_pipeline(schedule, pp, 4).stage_to_rank
    every = [a for rank in range(pp) for a in plan.actions[rank]]
    assert sorted(every) == sorted(("F", s, m) for s in range(plan.num_stages) for m in range(3))
    for rank, actions in plan.actions.items():
        assert all(plan.stage_to_rank[s] == rank for _, s, _ in actions)
        assert [(s, m) for _, s, m in actions] == sorted((s, m) for _, s, m in actions)  # stage by stage
    with pytest.raises(ValueError, match="at least one microbatch"):
        forward_only_plan(plan, 0)


def test_the_synthetic_held_out_split_is_other_text_and_the_same_every_time():
    def first_batch(split: str) -> torch.Tensor:
        loader = build_dataloader(
            dataset="synthetic",
            tokenizer=build_tokenizer(""),
            seq_len=64,
            local_batch_size=2,
            dp_rank=0,
            dp_degree=1,
            seed=42,
            vocab_size=2048,
            dataset_split=split,
        )
        return next(loader)[0]

    train, held_out = first_batch("train"), first_batch("validation")
    assert torch.equal(held_out, first_batch("validation")) and not torch.equal(train, held_out)
    assert not torch.equal(held_out, first_batch("test"))


def test_a_missing_held_out_dataset_is_one_error_naming_its_setting(tmp_path, capsys):
    import train

    flags = ["--job.dump_folder", str(tmp_path), "--validation.enable", "True"]
    assert train.main([*FAST_ARGS, *flags, "--validation.dataset", "/no/such/file.jsonl"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: validation.dataset path '/no/such/file.jsonl' does not")


@pytest.fixture
def local_data(tmp_path, monkeypatch):
    """A small local .jsonl file (datasets' Arrow cache kept inside tmp_path)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} of the file"}) + "\n" for i in range(40)))
    return str(path)


SPLIT = ("--validation.split", "train[95%:]")


def _held_out_job(*flags: str):
    cfg = load_config([*FAST_ARGS, "--validation.enable", "True", *flags])
    validate_config(cfg)
    return cfg


def test_held_out_data_that_is_training_data_by_default_is_refused_naming_both(local_data):
    with pytest.raises(ConfigError) as info:
        _held_out_job("--training.dataset", local_data)
    assert str(info.value) == (
        f"validation.enable: the held-out data would be training data: validation.split 'validation' (the default) "
        f"of training.dataset {local_data!r} reads rows that training.dataset_split 'train' of training.dataset "
        f"{local_data!r} trains on (a local path has no splits: every split name reads all its rows); give "
        "validation.dataset held-out data, or split the rows: training.dataset_split 'train[:95%]' and "
        "validation.split 'train[95%:]'"
    )
    with pytest.raises(ConfigError, match=r"^validation.enable: the held-out data would be training data: "):
        _held_out_job("--training.dataset_split", "validation")  # the synthetic corpus's held-out split
    # held out: two slices of the file, another file, the synthetic corpus's other documents
    _held_out_job("--training.dataset", local_data, "--training.dataset_split", "train[:95%]", *SPLIT)
    _held_out_job("--training.dataset", local_data, "--validation.dataset", local_data.replace("d.jsonl", "v.jsonl"))
    _held_out_job()


def test_training_data_chosen_as_held_out_data_is_one_warning_at_start(tmp_path):
    with logged_warnings() as warned:
        make_trainer(tmp_path, "--validation.enable", "True", "--validation.split", "train")
    assert [w for w in warned if w.startswith("validation")] == [
        "validation reads training data: validation.split 'train' of training.dataset 'synthetic' reads rows that "
        "training.dataset_split 'train' of training.dataset 'synthetic' trains on (the same documents of the "
        "synthetic corpus); its loss is no held-out loss"
    ]


def test_a_split_the_held_out_data_does_not_have_is_one_error_naming_validation_split(tmp_path, local_data, capsys):
    import train

    flags = ["--job.dump_folder", str(tmp_path / "out"), "--validation.enable", "True", "--training.dataset"]
    assert train.main([*FAST_ARGS, *flags, local_data, "--validation.split", "train[abc"]) == 2
    (error,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert error.startswith(f"error: cannot load training.dataset {local_data!r} with validation.split 'train[abc': ")
