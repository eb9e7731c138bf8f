"""Validation of the parallel layout (graph_trainer/validation.py, distributed/parallel_dims.py):
degrees against the world size and the model, the global batch's microbatches, the pipeline's
settings and plan, the data's shards, weights resident per step. One ``ConfigError`` line each."""

import pytest

from graph_trainer.config import JobConfig
from graph_trainer.config_loading import load_config
from graph_trainer.distributed.parallel_dims import ParallelDims, microbatches_per_step, resolve_parallel_degrees
from graph_trainer.errors import ConfigError
from graph_trainer.validation import validate_config


def test_degrees_must_match_world_size():
    cfg = JobConfig()
    cfg.parallelism.tp = 3
    with pytest.raises(ConfigError, match="not divisible"):
        validate_config(cfg, world_size=4)


@pytest.mark.parametrize(
    "degrees, world_size, message",
    [
        ({"dp_shard": 3}, 4, "dp_shard=3 x tp=1 = 3 do not match the world size 4"),
        ({"tp": 3}, 3, "parallelism.tp = 3 does not divide the model's n_heads (16)"),
        ({"ep": 2}, 2, "llama3 is dense"),
        ({"dp_replicate": 0}, 2, "parallelism.dp_replicate = 0 must be >= 1"),
    ],
)
def test_degrees_that_do_not_fit(degrees, world_size, message):
    cfg = JobConfig()
    for name, value in degrees.items():
        setattr(cfg.parallelism, name, value)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, world_size=world_size)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "global_batch, world_size, degrees, microbatches",
    [
        (0, 1, {}, 1),  # 0: one pass over the data-parallel ranks
        (32, 1, {}, 4),
        (32, 2, {}, 2),  # FSDP2: 2 ranks x 8
        (16, 4, {"tp": 2}, 1),  # tensor-parallel ranks share a batch: dp 2 x 8
        (48, 4, {"dp_replicate": 2, "dp_shard": 2}, None),  # not a multiple of 4 x 8
        (16, 4, {}, None),  # less than one pass (32)
        (-32, 1, {}, None),
    ],
)
def test_global_batch_size_gives_whole_microbatches_or_one_line(global_batch, world_size, degrees, microbatches):
    from graph_trainer.build import build_layout

    cfg = JobConfig()  # local batch 8
    cfg.training.global_batch_size = global_batch
    for name, value in degrees.items():
        setattr(cfg.parallelism, name, value)
    if microbatches is None:
        with pytest.raises(ConfigError) as info:
            validate_config(cfg, world_size=world_size)
        (line,) = str(info.value).splitlines()
        assert line.startswith(f"training.global_batch_size = {global_batch} must be a positive multiple of")
        assert "(or 0:" in line
        return
    validate_config(cfg, world_size=world_size)
    dims = ParallelDims.from_degrees(resolve_parallel_degrees(cfg.parallelism, world_size))
    assert microbatches_per_step(global_batch, 8, dims.dp_size) == microbatches
    if world_size == 1:  # the layout the trainer and fake traces build (no process group needed)
        layout = build_layout(cfg, 1, "cpu")
        assert layout.microbatches == microbatches
        assert layout.loss_scale == 1.0 / microbatches


@pytest.mark.parametrize(
    "flags, world_size, message",
    [
        ({"pp": 2}, 3, "world size 3 is not divisible by pp*dp_replicate*tp = 2"),
        ({"pp": 4, "pp_schedule": "1F1B"}, 4, "4 pipeline stages need at least 4 blocks; the model has 3"),
        ({"pp": 2, "pp_schedule": "ZBVZeroBubble"}, 2, "4 pipeline stages need at least 4 blocks; the model has 3"),
        (
            {"pp": 2, "pp_stage_blocks": "2,2"},
            2,
            "must give 2 positive block counts (one per pipeline stage) adding up",
        ),
        ({"pp": 2, "pp_stage_blocks": "two,one"}, 2, "'two,one' is not a comma-separated list of block counts"),
        ({"pp": 2, "tp": 3}, 6, "parallelism.tp = 3 does not divide the model's n_heads"),
        ({"pp": 2, "pp_microbatches": 3, "global": 32}, 2, "disagrees with parallelism.pp_microbatches = 3"),
        ({"pp": 2, "full_scope": True}, 2, "compile.inductor_scope = 'full' compiles a stage's forward and backward"),
    ],
)
def test_pipeline_settings_that_do_not_fit_are_one_line(flags, world_size, message):
    cfg = JobConfig()
    cfg.model.n_layers = 3
    if flags.pop("full_scope", False):
        cfg.compile.backend, cfg.compile.inductor_scope = "inductor", "full"
    cfg.training.global_batch_size = flags.pop("global", 0)
    for name, value in flags.items():
        setattr(cfg.parallelism, name, value)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, world_size=world_size)
    (line,) = str(info.value).splitlines()
    assert message in line


def test_a_rank_pipeline_is_planned_from_the_settings():
    from graph_trainer.build import rank_pipeline
    from models.registry import model_args

    cfg = JobConfig()  # llama3 debugmodel: 6 blocks
    cfg.parallelism.pp, cfg.parallelism.pp_schedule, cfg.parallelism.pp_microbatches = 2, "ZBVZeroBubble", 4
    validate_config(cfg, world_size=4)
    pipeline = rank_pipeline(cfg, model_args(cfg), 2, 4, rank=1)
    assert pipeline.plan.num_stages == 4 and pipeline.local_stages == [1, 2]
    assert [b for r in pipeline.stage_blocks for b in r] == list(range(6))
    assert pipeline.rank_blocks() == [*pipeline.stage_blocks[1], *pipeline.stage_blocks[2]]
    assert not pipeline.holds_first() and not pipeline.holds_last()
    cfg.parallelism.pp_stage_blocks = "1,2,2,1"
    assert rank_pipeline(cfg, model_args(cfg), 2, 4, rank=0).stage_blocks == [
        range(0, 1),
        range(1, 3),
        range(3, 5),
        range(5, 6),
    ]


def test_a_pipeline_is_traced_stage_by_stage_not_as_one_graph():
    from graph_trainer.fake_trace import trace_without_passes

    cfg = JobConfig()
    cfg.parallelism.pp = 2
    with pytest.raises(ConfigError, match="a pipeline is traced stage by stage"):
        trace_without_passes(cfg, 2)


def test_data_shards_must_divide_the_batch_of_all_data_parallel_ranks():
    flags = ["--training.local_batch_size", "3", "--training.dataset_shards", "4"]
    with pytest.raises(ConfigError, match=r"dataset_shards = 4 must divide .* = 3 x 2\)"):
        validate_config(load_config(flags), world_size=2)
    validate_config(load_config([*flags[:3], "2"]), world_size=2)


def test_weights_resident_per_step_need_data_parallelism_and_leave_resharding_nothing_to_do():
    per_step = ["--parallelism.fsdp_collectives", "per_step"]
    with pytest.raises(ConfigError, match=r"'per_step' needs data parallelism \(dp_shard or dp_replicate > 1\)"):
        validate_config(load_config([*per_step, "--parallelism.tp", "2"]), world_size=2)
    never = ["--parallelism.fsdp_reshard_after_forward", "never"]
    with pytest.raises(ConfigError, match=r"= 'never' means something only with weights gathered per microbatch"):
        validate_config(load_config([*never, "--parallelism.pp", "2"]), world_size=4)  # (default: per step)
    validate_config(
        load_config([*never, "--parallelism.pp", "2", "--parallelism.fsdp_collectives", "per_microbatch"]), 4
    )
    validate_config(load_config([*never, "--parallelism.pp", "2"]), world_size=2)  # (no data parallelism)
    validate_config(load_config(per_step), world_size=2)
