"""Job configuration: documented dataclass sections, TOML loading, command-line overrides.

A job is described by one ``JobConfig`` with the sections ``job, model, training,
parallelism, compile, activation_checkpoint, metrics, checkpoint, comm, debug``.
``load_config(argv)`` reads
``--job.config_file X.toml`` (tomli) and then applies every other ``--section.key value``
from the command line (tyro); the command line wins over the file. A flag may be spelled with
dashes or underscores (``--job.config-file`` is ``--job.config_file``), as ``--help`` shows them.

Validation (``validate_config``) runs before anything is built. Every user error raises
``ConfigError`` with one message naming the field, the bad value and what is allowed;
``train.py`` prints it as one line and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any

import tomli
import tyro

from graph_trainer.errors import ConfigError

DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclass
class Job:
    config_file: str = ""
    """TOML file holding the job; other flags override its values."""
    dump_folder: str = "./outputs"
    """Folder for logs, TensorBoard events, the per-step loss file and checkpoints."""
    description: str = ""
    """Free text shown at the start of the run."""
    device: str = "auto"
    """Device type: 'auto' (cuda when available, else cpu), 'cpu' or 'cuda'."""


@dataclass
class Model:
    name: str = "llama3"
    """Model family: a key of ``models.registry.MODEL_SPECS`` (e.g. 'llama3')."""
    flavor: str = "debugmodel"
    """Size of the model within its family (e.g. 'debugmodel', '8B', '70B', '405B')."""
    n_layers: int = 0
    """Transformer blocks to build: 0 = the flavor's; N = the flavor's shapes with only N blocks
    (e.g. to measure a real block's speed and memory on one GPU). Logs, MFU and the memory estimate use N."""


@dataclass
class Training:
    steps: int = 10
    """Number of optimizer steps to run (>= 1)."""
    local_batch_size: int = 8
    """Sequences per data-parallel rank per step."""
    seq_len: int = 256
    """Tokens per sequence; at most the flavor's max_seq_len."""
    lr: float = 8e-4
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 2
    """Linear warmup from lr/(warmup_steps+1) to lr over this many steps."""
    decay_type: str = "linear"
    """Decay after warmup: 'linear', 'cosine' or 'constant'."""
    min_lr_ratio: float = 0.0
    """The decay ends at lr * min_lr_ratio on the last step (0 <= ratio <= 1)."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    seed: int = 42
    """Seeds weight initialisation and the synthetic dataset; the same seed gives the same run."""
    dataset: str = "synthetic"
    """'synthetic' (built in, no download), a local .json/.jsonl/.parquet/.txt file or folder, or a Hugging Face hub name."""
    dataset_split: str = "train"
    """Split of a Hugging Face dataset."""
    text_field: str = "text"
    """Column holding the document text in a Hugging Face dataset."""
    tokenizer_path: str = ""
    """Path to a Hugging Face tokenizer.json; empty means the built-in byte-level tokenizer."""
    loss_chunks: int = 1
    """Compute the output projection and cross-entropy in this many blocks of tokens (graph_trainer/loss.py);
    in graph mode each block's logits are recomputed in backward, so the loss region holds ~1/N of its
    memory (for one more output matmul). The loss matches the unchunked one to an ulp (bitwise unless a
    block is a row or two); later steps agree to float rounding."""
    mixed_precision_param: str = "float32"
    """Dtype parameters are cast to for compute, on every layout (SimpleFSDP casts before the all-gather;
    without data parallelism a cast parametrization does it): float32, bfloat16 or float16. The
    optimizer keeps float32 master weights either way."""
    mixed_precision_reduce: str = "float32"
    """Dtype gradients are reduced in across data-parallel ranks: float32, bfloat16 or float16
    (no effect without data parallelism: nothing is reduced)."""


@dataclass
class Parallelism:
    dp_replicate: int = 1
    """Data-parallel replicas (DDP when alone, HSDP together with dp_shard > 1)."""
    dp_shard: int = -1
    """Data-parallel shards (FSDP); -1 takes whatever the world size leaves after the other degrees."""
    tp: int = 1
    """Tensor-parallel degree."""
    ep: int = 1
    """Expert-parallel degree (MoE models only)."""
    fsdp_reshard_after_forward: str = "always"
    """'always': backward re-gathers parameters instead of keeping them from forward; 'never': keep them."""


@dataclass
class EpOverlap:
    """Settings of the ``ep_overlap`` pass (``graph_trainer/passes/ep_overlap.py``); TOML table ``[compile.ep_overlap]``."""

    module_fqn: str = "layers.*"
    """Which modules run as two chunks: 'layers.*' (whole transformer blocks that hold a MoE) or
    'layers.*.moe' (the MoE layers only). A pattern of dot-separated parts, '*' matching one part."""
    chunk_dim: str = "batch"
    """Dimension the chunks split: 'batch', or 'seq' (only when the selected modules are MoE layers)."""
    reorder: bool = True
    """False: chunk, but keep the traced order (the numerics reference the reordering must match bitwise)."""


@dataclass
class Compile:
    mode: str = "graph"
    """'graph': trace forward + loss + backward into one FX graph and run it; 'eager': run the model directly (the numerics baseline)."""
    passes: list[str] = field(default_factory=list)
    """Graph passes to run after the default ones, in order (comma- or space-separated, e.g. 'a,b')."""
    dump_graphs: str = ""
    """If set, a folder where the readable code of the graph is written before and after every pass (one subfolder rank<r> per process in multi-process jobs)."""
    ep_overlap: EpOverlap = field(default_factory=EpOverlap)
    """Settings of the ep_overlap pass."""
    backend: str = "none"
    """What runs the graph after the passes (``graph_trainer/backend.py``): 'none', op by op (the
    numerics reference); 'inductor', compiled by Inductor (not bitwise 'none': fusion rounds
    differently; graph mode only)."""
    inductor_scope: str = "regional"
    """With backend 'inductor': 'regional' compiles each transformer block's forward and backward
    (and the embedding, head and loss) on its own, leaving collectives, waits and the order the
    passes gave them untouched; 'full' compiles the whole step, collectives included, as one
    graph (Inductor may move them)."""
    cache_dir: str = ""
    """Folder of Inductor's on-disk caches, reused by the next start of the job ('': Inductor's
    default, $TORCHINDUCTOR_CACHE_DIR or /tmp/torchinductor_<user>)."""


AC_MODES = ("none", "selective", "full")
SELECTIVE_OPS = ["mm", "addmm", "bmm", "baddbmm", "_grouped_mm",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"]


@dataclass
class ActivationCheckpoint:
    """The memory policy (``graph_trainer/passes/activation_checkpoint.py``); TOML table ``[activation_checkpoint]``."""

    mode: str = "none"
    """'none': backward reads every activation it needs from forward; 'full': each transformer block
    keeps only its input and recomputes the rest in backward; 'selective': also keeps the outputs of
    ``selective_ops`` and recomputes only the cheap ops (norms, activations, RoPE). Losses are
    bitwise the same in every mode. Graph mode only."""
    selective_ops: list[str] = field(default_factory=lambda: list(SELECTIVE_OPS))
    """aten ops (names without overload, comma-separated on the command line) whose outputs
    'selective' saves; the default: matmuls, grouped matmuls and attention."""


@dataclass
class Metrics:
    log_freq: int = 1
    """Log one line (and TensorBoard scalars) every this many steps; losses are written every step."""
    enable_tensorboard: bool = True
    """Write TensorBoard events under <dump_folder>/tb."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device for MFU; 0 looks it up for CUDA devices and reports n/a on CPU."""


@dataclass
class Checkpoint:
    """Distributed checkpoints (torch.distributed.checkpoint); layout and guarantees in graph_trainer/checkpoint.py."""

    interval: int = 0
    """Save <folder>/step-<N> every this many steps and at the last step; 0 disables saving."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder unless absolute; every rank must see the same folder."""
    load_step: int = -1
    """Resume from step-<N> (N >= 1, must exist and verify); -1 resumes from the newest checkpoint that verifies
    (an older one when the newest is corrupt, saying so), or starts fresh when the folder holds none; 0 starts fresh.
    Resuming continues at step N+1, appends to losses.txt and may use another parallel layout (tensors are resharded)."""
    move_aside: bool = False
    """A run that would not continue the newest checkpoints of the folder (load_step 0 in a folder holding checkpoints,
    or load_step N with later steps there) is refused, so one folder and one losses.txt never mix two runs. True
    moves those checkpoints (and, starting fresh, losses.txt) into <folder>.aside-<time>/ instead, and starts."""


@dataclass
class Comm:
    """Collective timeouts (``init_process_group``'s ``timeout``, applied to every process group)."""

    init_timeout_seconds: float = 600.0
    """Longest wait for the other ranks from the start until the first step has finished (rendezvous, building,
    loading and verifying a checkpoint, tracing): ranks may reach their first collective far apart."""
    timeout_seconds: float = 300.0
    """Longest wait in any collective after the first step (steps, checkpoint saves): a rank that stops
    answering (stuck, stopped, deadlocked) ends the job with a one-line error after this long."""


@dataclass
class Debug:
    deterministic: bool = False
    """Call torch.use_deterministic_algorithms(True) (and the CUDA settings it needs)."""
    num_threads: int = 0
    """Intra-op CPU threads (torch.set_num_threads); 0 keeps torch's default."""
    log_level: str = "INFO"
    """Python logging level: DEBUG, INFO, WARNING or ERROR."""
    grad_record_step: int = 0
    """At this step (>= 1) write <dump_folder>/grad_record_step<N>.pt: the gradient norm before clipping and,
    per parameter, the norm and a fixed sample of the full (gathered) gradient, to compare layouts
    (graph_trainer/grad_record.py); 0: off."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    compile: Compile = field(default_factory=Compile)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    comm: Comm = field(default_factory=Comm)
    debug: Debug = field(default_factory=Debug)


# --------------------------------------------------------------------------------------
# Loading


def canonical_flag(arg: str) -> str:
    """``--a-b.c-d[=v]`` -> ``--a_b.c_d[=v]``: the one spelling of a flag; other arguments are returned as they are.

    Dashes and underscores in a flag's name are the same everywhere (tyro shows dashes, the
    dataclasses and TOML use underscores); the value after ``=`` is left alone."""
    if not arg.startswith("--") or len(arg) < 3 or not arg[2].isalpha():
        return arg
    name, eq, value = arg.partition("=")
    return "--" + name[2:].replace("-", "_") + eq + value


def take_flag(argv: list[str], flag: str, default, kind=str):
    """Remove ``--flag value`` (or ``--flag=value``; either spelling, ``canonical_flag``) from
    ``argv``: returns (the rest of argv, the value converted by ``kind``, or ``default`` when the
    flag is absent). For command lines that add their own flags to the job's; a missing or
    unconvertible value is a ``ConfigError``."""
    for i, arg in enumerate(argv):
        arg = canonical_flag(arg)
        if arg == flag:
            if i + 1 >= len(argv):
                raise ConfigError(f"{flag} needs a value")
            rest, value = argv[:i] + argv[i + 2:], argv[i + 1]
        elif arg.startswith(flag + "="):
            rest, value = argv[:i] + argv[i + 1:], arg.split("=", 1)[1]
        else:
            continue
        try:
            return rest, kind(value)
        except ValueError:
            what = {int: "a whole number", float: "a number"}.get(kind, f"a valid {kind.__name__}")
            raise ConfigError(f"{flag} {value!r} is not {what}") from None
    return argv, default


def normalize_flags(argv: list[str]) -> list[str]:
    """Every flag of ``argv`` in its one spelling (``canonical_flag``), for parsers that know only one."""
    return [canonical_flag(arg) for arg in argv]


def _config_file_from_argv(argv: list[str]) -> str:
    """The TOML file named on the command line (either spelling); if named twice, the last one (as for any flag)."""
    path = ""
    argv = normalize_flags(argv)
    for i, arg in enumerate(argv):
        if arg == "--job.config_file":
            if i + 1 >= len(argv):
                raise ConfigError("--job.config_file needs a path to a TOML file")
            path = argv[i + 1]
        elif arg.startswith("--job.config_file="):
            path = arg.split("=", 1)[1]
    return path


def _field_types(section_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Check a TOML value against a field's type (TOML already gives typed values)."""
    if typ is bool:
        ok = isinstance(value, bool)
    elif typ is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif typ is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif typ is str:
        ok = isinstance(value, str)
    elif typing.get_origin(typ) is list:
        if isinstance(value, str):  # "a,b" is accepted for lists of names
            value = [value]
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    else:  # pragma: no cover - every field type is listed above
        raise TypeError(f"unsupported config field type {typ} at {where}")
    if not ok:
        raise ConfigError(f"{where} = {value!r} has the wrong type; expected {getattr(typ, '__name__', typ)}")
    return value


def config_from_toml(path: str) -> JobConfig:
    """Read a TOML job file into a JobConfig; unknown sections or keys are errors."""
    if not os.path.isfile(path):
        raise ConfigError(f"--job.config_file {path!r} does not exist")
    try:
        with open(path, "rb") as f:
            data = tomli.load(f)
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:  # TOML is UTF-8; tomli decodes before parsing
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); TOML files must be UTF-8") from None
    except OSError as e:
        raise ConfigError(f"cannot read --job.config_file {path!r}: {e.strerror or e}") from None
    cfg = JobConfig()
    sections = {f.name: f for f in dataclasses.fields(JobConfig)}
    for section, values in data.items():
        if section not in sections:
            raise ConfigError(
                f"unknown section [{section}] in {path}; allowed sections: {', '.join(sections)}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"'{section}' in {path} must be a [{section}] table")
        _fill_section(getattr(cfg, section), values, section, path)
    cfg.job.config_file = path
    return cfg


def _fill_section(obj: Any, values: dict, section: str, path: str) -> None:
    """Set a section's fields from its TOML table; a nested dataclass field is a sub-table."""
    types = _field_types(type(obj))
    for key, value in values.items():
        if key not in types:
            raise ConfigError(
                f"unknown key '{key}' in section [{section}] of {path}; allowed keys: {', '.join(types)}"
            )
        if dataclasses.is_dataclass(types[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"'{section}.{key}' in {path} must be a [{section}.{key}] table")
            _fill_section(getattr(obj, key), value, f"{section}.{key}", path)
        else:
            setattr(obj, key, _coerce(value, types[key], f"[{section}] {key} in {path}"))


def load_config(argv: list[str] | None = None) -> JobConfig:
    """TOML file (if ``--job.config_file`` is given) overridden by the command line."""
    argv = normalize_flags(list(sys.argv[1:] if argv is None else argv))
    path = _config_file_from_argv(argv)
    default = config_from_toml(path) if path else JobConfig()
    cfg = tyro.cli(
        JobConfig,
        default=default,
        args=argv,
        config=(tyro.conf.FlagConversionOff,),
        description="Train a model whose whole training step is one traced FX graph.",
    )
    cfg.compile.passes = normalize_pass_list(cfg.compile.passes)
    cfg.activation_checkpoint.selective_ops = normalize_pass_list(cfg.activation_checkpoint.selective_ops)
    return cfg


def normalize_pass_list(passes: list[str]) -> list[str]:
    """Accept 'a,b c' style lists from TOML or the command line: split on commas, drop blanks."""
    return [p.strip() for item in passes for p in item.split(",") if p.strip()]


# --------------------------------------------------------------------------------------
# Validation


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _one_of(value: str, allowed: tuple[str, ...], name: str) -> None:
    _require(value in allowed, f"{name} = {value!r} is not allowed; choose one of: {', '.join(allowed)}")


def resolve_parallel_degrees(p: Parallelism, world_size: int) -> dict[str, int]:
    """Fill in dp_shard=-1 and check that the degrees multiply to the world size."""
    for name in ("dp_replicate", "tp", "ep"):
        _require(getattr(p, name) >= 1, f"parallelism.{name} = {getattr(p, name)} must be >= 1")
    _require(p.dp_shard == -1 or p.dp_shard >= 1, f"parallelism.dp_shard = {p.dp_shard} must be >= 1 or -1")
    others = p.dp_replicate * p.tp
    dp_shard = p.dp_shard
    if dp_shard == -1:
        _require(
            world_size % others == 0,
            f"world size {world_size} is not divisible by dp_replicate*tp = {others}",
        )
        dp_shard = world_size // others
    product = p.dp_replicate * dp_shard * p.tp
    _require(
        product == world_size,
        f"parallelism degrees dp_replicate={p.dp_replicate} x dp_shard={dp_shard} x tp={p.tp} = {product} "
        f"do not match the world size {world_size}",
    )
    # Experts are split over a sub-group of the data-parallel shard ranks (see graph_trainer.parallel).
    _require(
        dp_shard % p.ep == 0,
        f"parallelism.ep = {p.ep} must divide parallelism.dp_shard = {dp_shard} (experts are split over "
        f"data-parallel shard ranks)",
    )
    return {"dp_replicate": p.dp_replicate, "dp_shard": dp_shard, "tp": p.tp, "ep": p.ep}


def model_args(cfg: JobConfig):
    """The model's shape: the flavor's arguments, with ``model.n_layers`` applied when set."""
    import dataclasses as dc

    from models.registry import MODEL_SPECS

    args = MODEL_SPECS[cfg.model.name].flavors[cfg.model.flavor]
    return dc.replace(args, n_layers=cfg.model.n_layers) if cfg.model.n_layers else args


def resolve_device(requested: str) -> str:
    """``job.device`` as the job will run it: 'auto' is 'cuda' when CUDA is available, else 'cpu'."""
    import torch

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
            raise ConfigError(f"{local} processes on this node need {local} CUDA devices, {visible} visible; "
                              f"use --job.device cpu or fewer processes")


def _check_finite_floats(obj: Any, prefix: str) -> None:
    """Every float field is a finite number: TOML and the command line both accept inf and nan, and an
    inf weight decay or eps trains nothing (or NaN) without any error."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_finite_floats(value, f"{prefix}{f.name}.")
        elif isinstance(value, float):
            _require(math.isfinite(value), f"{prefix}{f.name} = {value} must be a finite number")


def validate_config(cfg: JobConfig, world_size: int = 1) -> None:
    """Check every field before anything is built; raise ConfigError on the first problem."""
    from graph_trainer.backend import BACKENDS, INDUCTOR_SCOPES
    from graph_trainer.passes import PASS_REGISTRY
    from models.registry import MODEL_SPECS

    t, c = cfg.training, cfg.compile
    _check_finite_floats(cfg, "")
    _one_of(cfg.job.device, ("auto", "cpu", "cuda"), "job.device")
    _one_of(cfg.model.name, tuple(MODEL_SPECS), "model.name")
    spec = MODEL_SPECS[cfg.model.name]
    _one_of(cfg.model.flavor, tuple(spec.flavors), f"model.flavor (for {cfg.model.name})")
    flavor = spec.flavors[cfg.model.flavor]
    _require(cfg.model.n_layers >= 0, f"model.n_layers = {cfg.model.n_layers} must be >= 0 (0: the flavor's "
                                      f"{flavor.n_layers})")
    try:
        args = model_args(cfg)
    except ValueError as e:  # the flavor's own shape checks (e.g. DeepSeek-V3's dense layers)
        raise ConfigError(f"model.n_layers = {cfg.model.n_layers} does not fit flavor {cfg.model.flavor}: {e}") from None

    _require(t.steps >= 1, f"training.steps = {t.steps} must be >= 1")
    _require(t.local_batch_size >= 1, f"training.local_batch_size = {t.local_batch_size} must be >= 1")
    _require(
        1 <= t.seq_len <= args.max_seq_len,
        f"training.seq_len = {t.seq_len} must be between 1 and the flavor's max_seq_len {args.max_seq_len}",
    )
    _require(1 <= t.loss_chunks <= t.local_batch_size * t.seq_len,
             f"training.loss_chunks = {t.loss_chunks} must be between 1 and the tokens per batch "
             f"({t.local_batch_size * t.seq_len})")
    _require(t.lr > 0 and math.isfinite(t.lr), f"training.lr = {t.lr} must be a positive number")
    _require(t.weight_decay >= 0, f"training.weight_decay = {t.weight_decay} must be >= 0")
    _require(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "training.beta1 and training.beta2 must be in [0, 1)")
    _require(t.eps > 0, f"training.eps = {t.eps} must be > 0")
    _require(t.warmup_steps >= 0, f"training.warmup_steps = {t.warmup_steps} must be >= 0")
    _one_of(t.decay_type, ("linear", "cosine", "constant"), "training.decay_type")
    _require(0 <= t.min_lr_ratio <= 1, f"training.min_lr_ratio = {t.min_lr_ratio} must be in [0, 1]")
    _require(t.max_norm >= 0, f"training.max_norm = {t.max_norm} must be >= 0 (0 disables clipping)")
    _one_of(t.mixed_precision_param, DTYPE_NAMES, "training.mixed_precision_param")
    _one_of(t.mixed_precision_reduce, DTYPE_NAMES, "training.mixed_precision_reduce")

    degrees = resolve_parallel_degrees(cfg.parallelism, world_size)
    _one_of(cfg.parallelism.fsdp_reshard_after_forward, ("always", "never"), "parallelism.fsdp_reshard_after_forward")
    spec.validate_parallelism(args, degrees)

    _one_of(c.mode, ("graph", "eager"), "compile.mode")
    for name in c.passes:
        _require(
            name in PASS_REGISTRY,
            f"unknown pass {name!r} in compile.passes; available passes: "
            f"{', '.join(sorted(PASS_REGISTRY)) or '(none registered)'}",
        )
    _require(
        len(set(c.passes)) == len(c.passes),
        f"compile.passes lists a pass more than once: {','.join(c.passes)}",
    )
    _require(not (c.passes and c.mode == "eager"), "compile.passes needs compile.mode = 'graph'")
    _one_of(c.backend, BACKENDS, "compile.backend")
    _one_of(c.inductor_scope, INDUCTOR_SCOPES, "compile.inductor_scope")
    _require(c.backend == "none" or c.mode == "graph",
             f"compile.backend = {c.backend!r} needs compile.mode = 'graph' (it compiles the traced graph)")
    _require(c.inductor_scope == "regional" or c.backend == "inductor",
             f"compile.inductor_scope = {c.inductor_scope!r} needs compile.backend = 'inductor'")
    for name in c.passes:
        PASS_REGISTRY[name].check_config(cfg, degrees)

    ac = cfg.activation_checkpoint
    _one_of(ac.mode, AC_MODES, "activation_checkpoint.mode")
    _require(ac.mode == "none" or c.mode == "graph",
             f"activation_checkpoint.mode = {ac.mode!r} needs compile.mode = 'graph' (the policy rewrites the "
             f"traced graph; eager mode keeps every activation)")
    import torch

    unknown = [op for op in ac.selective_ops if not hasattr(torch.ops.aten, op)]
    _require(not unknown, f"activation_checkpoint.selective_ops: {', '.join(unknown)} is not an aten op name "
                          f"(e.g. {', '.join(SELECTIVE_OPS[:3])})")
    _require(cfg.metrics.log_freq >= 1, f"metrics.log_freq = {cfg.metrics.log_freq} must be >= 1")
    _require(cfg.metrics.peak_tflops >= 0, f"metrics.peak_tflops = {cfg.metrics.peak_tflops} must be >= 0")
    _require(cfg.checkpoint.interval >= 0, f"checkpoint.interval = {cfg.checkpoint.interval} must be >= 0")
    _require(cfg.checkpoint.load_step >= -1, f"checkpoint.load_step = {cfg.checkpoint.load_step} must be >= -1")
    for name in ("init_timeout_seconds", "timeout_seconds"):
        _require(getattr(cfg.comm, name) > 0, f"comm.{name} = {getattr(cfg.comm, name)} must be > 0")
    _require(cfg.debug.grad_record_step >= 0,
             f"debug.grad_record_step = {cfg.debug.grad_record_step} must be >= 0 (0: off)")
    _require(cfg.debug.num_threads >= 0, f"debug.num_threads = {cfg.debug.num_threads} must be >= 0")
    _one_of(cfg.debug.log_level.upper(), ("DEBUG", "INFO", "WARNING", "ERROR"), "debug.log_level")
