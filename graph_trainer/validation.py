"""Validation of a whole job before anything is built, and the device checks of this machine.

``validate_config(cfg, world_size)`` checks what the types of ``graph_trainer.config`` cannot:
every ``Literal`` field against its choices (for configs built in code; ``config_loading``
already refused other values from a file or the command line), every float finite, ranges,
fields that depend on each other, the flavor of the model, parallel degrees against the world
size and the model's shapes (``models.<name>.parallelize.validate_parallelism``), and each pass
listed against the layout (``PassSpec.check_config``), and held-out data that is training data
the user did not choose (``held_out_training_data``). The first problem raises ``ConfigError``
with one line naming the field, the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch

from graph_trainer.build import rank_pipeline
from graph_trainer.compiler.passes import PASS_REGISTRY, unknown_pass
from graph_trainer.config import JobConfig, Parallelism, Validation
from graph_trainer.config_loading import choices, field_types, not_allowed
from graph_trainer.config_paths import is_local_dataset
from graph_trainer.distributed.parallel_dims import job_microbatches, resolve_parallel_degrees, weights_per_step
from graph_trainer.errors import ConfigError, require
from graph_trainer.validation_float8 import check_float8
from models.registry import HF_FLAVOR, MODEL_SPECS, model_args


def _check_fields(obj: Any, prefix: str) -> None:
    """Every ``Literal`` field holds one of its choices and every float field is a finite number
    (TOML and the command line both accept inf and nan, and an inf weight decay or eps trains
    nothing, or NaN, without any error)."""
    for name, typ in field_types(type(obj)).items():
        value = getattr(obj, name)
        if dataclasses.is_dataclass(value):
            _check_fields(value, f"{prefix}{name}.")
        elif (allowed := choices(typ)) is not None and value not in allowed:
            raise not_allowed(f"{prefix}{name}", value, allowed)
        elif isinstance(value, float):
            require(math.isfinite(value), f"{prefix}{name} = {value} must be a finite number")


def resolve_device(requested: str) -> str:
    """``job.device`` as the job will run it: 'auto' is 'cuda' when CUDA is available, else 'cpu'."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def check_device(requested: str) -> None:
    """Whether THIS machine can run the job on ``job.device`` (a check of the machine, not of the
    config: ``analyze`` and the dry run trace CUDA jobs on a CPU): CUDA at all when it is asked
    for, and one CUDA device per process of this node (torchrun's ``LOCAL_WORLD_SIZE``)."""
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        reason = "this PyTorch has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(f"job.device = 'cuda' but {reason} (torch {torch.__version__}); use --job.device cpu")
    if resolve_device(requested) == "cuda":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        visible = torch.cuda.device_count()
        if local > visible:
            raise ConfigError(
                f"{local} processes on this node need {local} CUDA devices, {visible} visible; "
                f"use --job.device cpu or fewer processes"
            )


def _check_pipeline(cfg: JobConfig, degrees: dict[str, int], microbatches: int, args) -> None:
    """Pipeline parallelism (``parallelism.pp`` > 1): the schedule, the stages' blocks, and what
    cannot run per stage."""
    p, c = cfg.parallelism, cfg.compile
    require(
        not (c.backend == "inductor" and c.inductor_scope == "full"),
        f"compile.inductor_scope = 'full' compiles a stage's forward and backward as one graph, which a "
        f"pipeline schedule (parallelism.pp = {p.pp}) runs apart; use compile.inductor_scope regional",
    )
    try:
        rank_pipeline(cfg, args, degrees["pp"], microbatches, rank=0)
    except ValueError as e:
        where = "parallelism.pp_stage_blocks" if p.pp_stage_blocks.strip() else "parallelism.pp"
        plan = f"pp = {p.pp}, schedule {p.pp_schedule}, {microbatches} microbatches"
        raise ConfigError(f"{where} ({plan}): {e}") from None


def _check_model(cfg: JobConfig):
    """The model: a flavor of its family, a block count that fits it; the model's arguments."""
    spec = MODEL_SPECS[cfg.model.name]
    if cfg.model.flavor not in (*spec.flavors, HF_FLAVOR):
        raise not_allowed(f"model.flavor (for {cfg.model.name})", cfg.model.flavor, (*spec.flavors, HF_FLAVOR))
    require(cfg.model.n_layers >= 0, f"model.n_layers = {cfg.model.n_layers} must be >= 0 (0: the flavor's)")
    require(cfg.model.max_seq_len >= 0, f"model.max_seq_len = {cfg.model.max_seq_len} must be >= 0 (0: the flavor's)")
    try:
        return model_args(cfg)
    except ValueError as e:  # the flavor's own shape checks (e.g. DeepSeek-V3's dense layers)
        raise ConfigError(
            f"model.n_layers = {cfg.model.n_layers} / model.max_seq_len = {cfg.model.max_seq_len} does not fit "
            f"flavor {cfg.model.flavor}: {e}"
        ) from None


def _check_training(cfg: JobConfig, args) -> None:
    """Steps, batch and sequence against the model, the optimizer's and schedule's numbers."""
    t, ck = cfg.training, cfg.checkpoint
    converting = t.steps == 0 and bool(ck.initial_load_hf) and ck.interval > 0
    require(
        t.steps >= 1 or converting,
        f"training.steps = {t.steps} must be >= 1 (0 only converts: with checkpoint.initial_load_hf and "
        "checkpoint.interval > 0)",
    )
    require(t.local_batch_size >= 1, f"training.local_batch_size = {t.local_batch_size} must be >= 1")
    require(
        1 <= t.seq_len <= args.max_seq_len,
        f"training.seq_len = {t.seq_len} must be between 1 and the model's max_seq_len {args.max_seq_len} (the "
        "flavor's, or model.max_seq_len: the positions its rotary table covers)",
    )
    require(t.lr > 0 and math.isfinite(t.lr), f"training.lr = {t.lr} must be a positive number")
    require(t.weight_decay >= 0, f"training.weight_decay = {t.weight_decay} must be >= 0")
    require(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "training.beta1 and training.beta2 must be in [0, 1)")
    require(t.eps > 0, f"training.eps = {t.eps} must be > 0")
    require(t.warmup_steps >= 0, f"training.warmup_steps = {t.warmup_steps} must be >= 0")
    require(0 <= t.min_lr_ratio <= 1, f"training.min_lr_ratio = {t.min_lr_ratio} must be in [0, 1]")
    require(0 < t.decay_ratio <= 1, f"training.decay_ratio = {t.decay_ratio} must be in (0, 1]")
    require(t.max_norm >= 0, f"training.max_norm = {t.max_norm} must be >= 0 (0 disables clipping)")
    require(t.gc_freq >= 0, f"training.gc_freq = {t.gc_freq} must be >= 0 (0 leaves automatic collection on)")


def _check_parallelism(cfg: JobConfig, world_size: int, args) -> dict[str, int]:
    """Degrees against the world size and the model's shapes, the pipeline, the data's shards; the
    resolved degrees."""
    t = cfg.training
    degrees = resolve_parallel_degrees(cfg.parallelism, world_size)
    MODEL_SPECS[cfg.model.name].validate_parallelism(args, degrees)
    microbatches = job_microbatches(cfg.parallelism, t.global_batch_size, t.local_batch_size, world_size)
    if degrees["pp"] > 1:
        _check_pipeline(cfg, degrees, microbatches, args)
    dp, shards = degrees["dp_replicate"] * degrees["dp_shard"], t.dataset_shards
    _check_fsdp_collectives(cfg.parallelism, dp)
    tp = degrees["tp"]
    require(
        not cfg.parallelism.sequence_parallel or t.seq_len % tp == 0,
        f"training.seq_len = {t.seq_len} must be a multiple of parallelism.tp = {tp} under sequence parallel "
        "(each tp rank holds an equal piece of the sequence); change one, or set "
        "parallelism.sequence_parallel false",
    )
    _check_sequence(cfg, degrees)
    require(shards >= 1, f"training.dataset_shards = {shards} must be >= 1")
    require(
        t.local_batch_size * dp % shards == 0,
        f"training.dataset_shards = {shards} must divide the sequences of a batch over all data-parallel "
        f"ranks (training.local_batch_size x data-parallel degree = {t.local_batch_size} x {dp})",
    )
    return degrees


def _check_sequence(cfg: JobConfig, degrees: dict[str, int]) -> None:
    """Context parallel's chunks against the sequence, and document masking against the layout."""
    t, cp, tp = cfg.training, degrees["cp"], degrees["tp"]
    require(
        cp == 1 or t.seq_len % (2 * cp) == 0,
        f"training.seq_len = {t.seq_len} must be a multiple of 2 x parallelism.cp = {2 * cp} (each context-parallel "
        "rank holds two equal chunks of every sequence)",
    )
    pieces = tp if cfg.parallelism.sequence_parallel else 1
    require(
        (t.seq_len // cp) % pieces == 0,
        f"training.seq_len / parallelism.cp = {t.seq_len // cp} tokens per context-parallel rank must be a multiple "
        f"of parallelism.tp = {tp} under sequence parallel; change one, or set parallelism.sequence_parallel false",
    )
    require(
        1 <= t.loss_chunks <= t.local_batch_size * t.seq_len // cp,
        f"training.loss_chunks = {t.loss_chunks} must be between 1 and the tokens per batch of a rank "
        f"({t.local_batch_size * t.seq_len // cp})",
    )
    require(
        t.attention_mask == "block_causal" or not t.positions_per_document,
        "training.positions_per_document restarts the positions at each document: it needs training.attention_mask "
        "'block_causal' (it is 'causal'); leave it out or set that too",
    )
    require(
        t.attention_mask == "causal" or degrees["pp"] == 1,
        f"training.attention_mask {t.attention_mask!r} with parallelism.pp = {degrees['pp']}: the stages after the "
        "first do not see the tokens that mark the documents; use pp = 1 or the causal mask",
    )
    require(
        t.attention_mask == "causal" or "ep_overlap" not in cfg.compile.passes,
        f"training.attention_mask {t.attention_mask!r} with the ep_overlap pass: its chunks of a block's tokens do "
        "not split the documents' masks; use one or the other",
    )


def _check_fsdp_collectives(p: Parallelism, dp: int) -> None:
    """Weights resident per step need data parallelism, and leave reshard_after_forward nothing to do."""
    require(
        p.fsdp_collectives != "per_step" or dp > 1,
        "parallelism.fsdp_collectives = 'per_step' needs data parallelism (dp_shard or dp_replicate > 1): "
        "without it no weight is gathered and no gradient reduced",
    )
    if weights_per_step(p, dp):
        chosen = "'per_step'" if p.fsdp_collectives == "per_step" else "'default' (per step under pp > 1)"
        require(
            p.fsdp_reshard_after_forward == Parallelism.fsdp_reshard_after_forward,
            f"parallelism.fsdp_reshard_after_forward = {p.fsdp_reshard_after_forward!r} means something only "
            f"with weights gathered per microbatch: parallelism.fsdp_collectives = {chosen} gathers them once "
            "per step and keeps them; leave it out or set parallelism.fsdp_collectives per_microbatch",
        )


def _check_compile(cfg: JobConfig, degrees: dict[str, int]) -> None:
    """The passes (known, once each, against the layout), the mode, backend and memory policy."""
    c, ac = cfg.compile, cfg.activation_checkpoint
    for name in c.passes:
        require(name in PASS_REGISTRY, unknown_pass(name))
    require(len(set(c.passes)) == len(c.passes), f"compile.passes lists a pass more than once: {','.join(c.passes)}")
    require(not (c.passes and c.mode == "eager"), "compile.passes needs compile.mode = 'graph'")
    require(
        c.backend == "none" or c.mode == "graph",
        f"compile.backend = {c.backend!r} needs compile.mode = 'graph' (it compiles the traced graph)",
    )
    require(
        c.inductor_scope == "regional" or c.backend == "inductor",
        f"compile.inductor_scope = {c.inductor_scope!r} needs compile.backend = 'inductor'",
    )
    for name in c.passes:
        PASS_REGISTRY[name].check_config(cfg, degrees)
    require(
        ac.mode == "none" or c.mode == "graph",
        f"activation_checkpoint.mode = {ac.mode!r} needs compile.mode = 'graph' (the policy rewrites the "
        f"traced graph; eager mode keeps every activation)",
    )
    require(
        ac.full_blocks >= 0,
        f"activation_checkpoint.full_blocks = {ac.full_blocks} must be 0 (every block follows "
        f"activation_checkpoint.mode) or the number of each stage's first blocks recomputed in full",
    )
    # (our own ops, such as models.float8's float8_grouped_mm, live in the graph_trainer namespace)
    unknown = [
        op for op in ac.selective_ops if not hasattr(torch.ops.aten, op) and not hasattr(torch.ops.graph_trainer, op)
    ]
    require(
        not unknown,
        f"activation_checkpoint.selective_ops: {', '.join(unknown)} is not an aten op name (e.g. mm, addmm, bmm)",
    )


def _check_around_the_loop(cfg: JobConfig) -> None:
    """Metrics, checkpoints, collective timeouts and the debug settings."""
    require(cfg.metrics.log_freq >= 1, f"metrics.log_freq = {cfg.metrics.log_freq} must be >= 1")
    require(cfg.metrics.peak_tflops >= 0, f"metrics.peak_tflops = {cfg.metrics.peak_tflops} must be >= 0")
    require(cfg.checkpoint.interval >= 0, f"checkpoint.interval = {cfg.checkpoint.interval} must be >= 0")
    require(cfg.checkpoint.load_step >= -1, f"checkpoint.load_step = {cfg.checkpoint.load_step} must be >= -1")
    k = cfg.checkpoint.keep_latest_k
    require(k >= 0, f"checkpoint.keep_latest_k = {k} must be >= 0 (0 keeps every checkpoint)")
    for name in ("init_timeout_seconds", "timeout_seconds"):
        require(getattr(cfg.comm, name) > 0, f"comm.{name} = {getattr(cfg.comm, name)} must be > 0")
    finish = cfg.checkpoint.finish_timeout_seconds
    require(finish > 0, f"checkpoint.finish_timeout_seconds = {finish} must be > 0")
    step = cfg.debug.grad_record_step
    require(step >= 0, f"debug.grad_record_step = {step} must be >= 0 (0: off)")
    require(cfg.debug.num_threads >= 0, f"debug.num_threads = {cfg.debug.num_threads} must be >= 0")
    freq, steps = cfg.profiling.profile_freq, cfg.training.steps
    require(freq >= 1, f"profiling.profile_freq = {freq} must be >= 1")
    require(
        not _profiles(cfg) or freq <= steps,
        f"profiling.profile_freq = {freq} is more than training.steps = {steps}: every profile_freq-th step "
        f"is profiled, so none would be; set it to at most {steps}",
    )
    for name in ("freq", "steps"):
        value = getattr(cfg.validation, name)
        require(value >= 1, f"validation.{name} = {value} must be >= 1")


def _profiles(cfg: JobConfig) -> bool:
    return cfg.profiling.enable_profiling or cfg.profiling.enable_memory_snapshot


def _setting(cfg: JobConfig, field: str, in_use: bool, needs: str) -> tuple[str, object, object, bool, str]:
    """One entry of ``_settings_in_use`` for the dotted ``field`` (e.g. 'compile.ep_overlap.reorder')."""
    value, default = cfg, JobConfig()
    for part in field.split("."):
        value, default = getattr(value, part), getattr(default, part)
    return field, value, default, in_use, needs


def _settings_in_use(cfg: JobConfig) -> list[tuple[str, object, object, bool, str]]:
    """(field, value, default, whether what it depends on is set, what that is) for every setting
    that means something only together with another (``compile.inductor_scope`` has its own check
    in ``_check_compile``)."""
    p, c, ac, prof = cfg.parallelism, cfg.compile, cfg.activation_checkpoint, cfg.profiling
    pipeline = f"parallelism.pp > 1 (it is {p.pp})"
    inductor = f"compile.backend 'inductor' (it is {c.backend!r})"
    files, named = cfg.training.dataset != "synthetic", "training.dataset other than 'synthetic' (generated)"
    v, validating = cfg.validation.enable, "validation.enable"
    fp8 = cfg.float8.recipe_name != "none"
    saves, decay = cfg.checkpoint.interval > 0, cfg.training.decay_type
    decays, background = decay != "constant", saves and cfg.checkpoint.async_mode == "async"
    in_background = f"checkpoint.async_mode 'async' (it is {cfg.checkpoint.async_mode!r}) and checkpoint.interval > 0"
    selective = "activation_checkpoint.mode 'selective'"
    return [
        _setting(
            cfg,
            "profiling.profile_freq",
            _profiles(cfg),
            "profiling.enable_profiling or profiling.enable_memory_snapshot",
        ),
        _setting(cfg, "profiling.save_traces_folder", prof.enable_profiling, "profiling.enable_profiling"),
        _setting(
            cfg,
            "profiling.save_memory_snapshot_folder",
            prof.enable_memory_snapshot,
            "profiling.enable_memory_snapshot",
        ),
        *[_setting(cfg, f"validation.{name}", v, validating) for name in ("freq", "steps", "dataset", "split")],
        *[_setting(cfg, f"training.{name}", files, named) for name in ("dataset_subset", "dataset_streaming")],
        _setting(
            cfg,
            "validation.dataset_subset",
            v and cfg.validation.dataset != "",
            "validation.enable and validation.dataset",
        ),
        *[
            _setting(cfg, f"checkpoint.{name}", saves, f"checkpoint.interval > 0 (it is {cfg.checkpoint.interval})")
            for name in ("async_mode", "keep_latest_k")
        ],
        _setting(cfg, "checkpoint.finish_timeout_seconds", background, in_background),
        *[
            _setting(cfg, f"training.{name}", decays, f"training.decay_type other than 'constant' (it is {decay!r})")
            for name in ("decay_ratio", "min_lr_ratio")
        ],
        _setting(cfg, "parallelism.sequence_parallel", p.tp > 1, f"parallelism.tp > 1 (it is {p.tp})"),
        _setting(cfg, "parallelism.pp_stage_blocks", p.pp > 1, pipeline),
        _setting(cfg, "parallelism.pp_schedule", p.pp > 1, pipeline),
        *[
            _setting(cfg, f"float8.{name}", fp8, "float8.recipe_name")
            for name in ("filter_fqns", "convert_output", "convert_router", "convert_routed_experts")
        ],
        _setting(
            cfg,
            "float8.dispatch_in_float8",
            cfg.float8.convert_routed_experts,
            "float8.convert_routed_experts (the experts' float8 rows are what it sends)",
        ),
        _setting(cfg, "compile.cache_dir", c.backend == "inductor", inductor),
        _setting(cfg, "compile.once_per_node", c.backend == "inductor", inductor),
        *[
            _setting(cfg, f"activation_checkpoint.{name}", ac.mode == "selective", f"{selective} (it is {ac.mode!r})")
            for name in ("selective_ops", "selective_matmuls")
        ],
        _setting(
            cfg,
            "activation_checkpoint.full_blocks",
            ac.mode != "full" and c.mode == "graph",
            f"activation_checkpoint.mode 'selective' or 'none' and compile.mode 'graph' (they are {ac.mode!r}, "
            f"{c.mode!r})",
        ),
        *[
            _setting(cfg, f"compile.ep_overlap.{f.name}", "ep_overlap" in c.passes, "'ep_overlap' in compile.passes")
            for f in dataclasses.fields(c.ep_overlap)
        ],
    ]


def _check_settings_in_use(cfg: JobConfig) -> None:
    """A setting that means something only together with another is refused where it would be
    ignored, rather than the job training silently without it."""
    for name, value, default, in_use, needs in _settings_in_use(cfg):
        require(
            in_use or value == default,
            f"{name} = {value!r} means something only with {needs}: it would be ignored; leave it out or set that too",
        )


def _same_dataset(a: str, b: str) -> bool:
    """Whether two dataset settings name the same data (a local path however it is spelled)."""
    if is_local_dataset(a) and is_local_dataset(b):
        return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))
    return a == b


def held_out_training_data(cfg: JobConfig) -> str:
    """Why the held-out batches of ``[validation]`` hold rows training reads ('' when they do not,
    or are not known to: two different slices of one split are taken to be apart). The same data
    (``validation.dataset`` '' reads ``training.dataset``) with: of the synthetic corpus, the same
    split name; of a local file or folder, whose split names all read its every row, either split
    whole or both the same; of a hub dataset, the same split, whole on one side or the same slice."""
    t, v = cfg.training, cfg.validation
    if v.dataset and not (_same_dataset(v.dataset, t.dataset) and v.dataset_subset == t.dataset_subset):
        return ""
    held, trained = v.split, t.dataset_split
    if t.dataset == "synthetic":
        overlap, reason = held == trained, "the same documents of the synthetic corpus"
    else:
        local = is_local_dataset(t.dataset)
        nested = "[" not in held or "[" not in trained or held == trained  # one holds the other's rows
        overlap = nested and (local or held.split("[")[0] == trained.split("[")[0])
        reason = "a local path has no splits: every split name reads all its rows" if local else "the same split"
    if not overlap:
        return ""
    default = " (the default)" if held == Validation.split else ""
    dataset = f"validation.dataset {v.dataset!r}" if v.dataset else f"training.dataset {t.dataset!r}"
    return (
        f"validation.split {held!r}{default} of {dataset} reads rows that training.dataset_split {trained!r} of "
        f"training.dataset {t.dataset!r} trains on ({reason})"
    )


def held_out_asked_for(cfg: JobConfig) -> bool:
    """Whether the user chose the held-out data (``validation.dataset`` or ``validation.split`` set)."""
    return cfg.validation.dataset != "" or cfg.validation.split != Validation.split


def _check_held_out(cfg: JobConfig) -> None:
    """Held-out data that is training data is refused unless the user chose it (then the trainer
    warns once, ``loop.held_out``): the defaults never validate on training rows silently."""
    why = held_out_training_data(cfg) if cfg.validation.enable else ""
    if not why or held_out_asked_for(cfg):
        return
    instead = (
        f"choose another validation.split (any name other than {cfg.training.dataset_split!r} draws other documents)"
        if cfg.training.dataset == "synthetic"
        else "give validation.dataset held-out data, or split the rows: training.dataset_split 'train[:95%]' and "
        "validation.split 'train[95%:]'"
    )
    raise ConfigError(f"validation.enable: the held-out data would be training data: {why}; {instead}")


def validate_config(cfg: JobConfig, world_size: int = 1) -> None:
    """Check every field before anything is built; raise ConfigError on the first problem, in the
    order of the sections (model, training, parallelism, compile and memory policy, the rest)."""
    _check_fields(cfg, "")
    args = _check_model(cfg)
    _check_training(cfg, args)
    degrees = _check_parallelism(cfg, world_size, args)
    _check_compile(cfg, degrees)
    check_float8(cfg, args, degrees)
    _check_around_the_loop(cfg)
    _check_settings_in_use(cfg)
    _check_held_out(cfg)


__all__ = ["check_device", "held_out_asked_for", "held_out_training_data", "resolve_device", "validate_config"]
