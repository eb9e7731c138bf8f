"""Checks of THIS machine against the job, before anything is built (``check_job`` runs them after
``validate_config``: ``train.py`` in every process, ``graph_trainer.cli.check`` once before torchrun;
each failure is a one-line ``ConfigError``, exit code 2).

* Output folders: ``job.dump_folder``, the checkpoint folder (when the job saves; a job that only
  resumes may read a read-only one), ``compile.dump_graphs`` and the profiling folders (when
  profiling) must be folders this process can
  create and write in. The test writes and removes a file, so it holds for root too and on
  read-only mounts.
* Input paths: every file or folder the job reads exists (the local datasets, the tokenizer, the
  Hugging Face folder to start from: ``check_input_paths``), so ``graph_trainer.cli.check`` finds
  a missing one before torchrun starts.
* Optional packages a setting needs are installed (``metrics.enable_wandb``: wandb), and W&B's
  settings would start its run: a ``WANDB_MODE`` wandb accepts, credentials when the run is
  uploaded, a run folder that is one (``wandb_writer.wandb_run_folder``).
* ``debug.num_threads`` at most the CPUs of this machine (a huge value makes OpenMP abort
  while allocating its thread pool).
* The batch fits: one step needs at least the output logits, ``local_batch_size x seq_len x
  vocab/tp`` values in the compute dtype (every model here materialises them for the loss; with
  ``training.loss_chunks`` N, one block of them: 1/N); when
  that lower bound alone exceeds the memory of the device (a GPU's, or this machine's RAM shared
  by its local processes), the job is refused before the data loader allocates the batch.

Memory
------
Two more checks run later, when what they need exists, and refuse a job that does not fit with
one line (exit code 2) before it allocates what would not fit; ``--debug.skip_memory_check True``
turns each refusal into a warning. The memory a rank may use (``usable_memory_bytes``) is a GPU's
total less ``GPU_RESERVE_BYTES``, or this machine's RAM shared by its local processes.

* ``check_model_state_fits``, called by the build once the model is parallelised on the meta
  device and before it is materialised: parameters, gradients and optimizer state of the rank
  holding the largest shards (``parallel.largest_local_numel``), exact from the shapes, and with
  weights resident per step the gathered weights and their gradient sums. It names how many
  times more sharding the state needs.
* ``check_step_fits``, called by the trainer before the first step (graph mode: after tracing,
  the memory policy and the passes; eager: at start, where activations are unknown and the
  estimate is a lower bound, and an eager pipeline again once its stages are traced on fake
  tensors for the estimate): the peak of ``analysis.memory.estimate_step_memory``, the largest
  over all ranks, so every rank takes the same decision. It names the settings that shrink
  what dominates. The estimate ignores what ``GPU_RESERVE_BYTES`` stands for, so a step it
  passes can still run out of memory; one it refuses needs more than the device has.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import tempfile

from graph_trainer.analysis.memory import StepMemoryEstimate, optimizer_memory
from graph_trainer.config import JobConfig
from graph_trainer.config_loading import load_config
from graph_trainer.config_paths import LOCAL_DATASET_SUFFIXES, checkpoint_root, in_dump_folder, is_local_dataset
from graph_trainer.distributed.parallel_dims import largest_local_numel
from graph_trainer.distributed.resident import resident_bytes
from graph_trainer.errors import ConfigError
from graph_trainer.loop.wandb_writer import wandb_run_folder
from graph_trainer.validation import check_device, resolve_device, validate_config
from models.hf_weights import folder_config
from models.registry import model_args

GIB = float(1 << 30)
GPU_RESERVE_BYTES = 2 << 30
"""GPU memory the estimates do not count and a job cannot use for its tensors: the CUDA context,
NCCL's communicator buffers, kernel workspaces (cuBLAS, attention) and the caching allocator's
rounding and fragmentation (``analysis/memory.py``, "Assumptions"). Chosen, not measured: no
multi-GPU job has run here; an H100 run should measure it (total memory less the largest
``torch.cuda.max_memory_reserved`` of a job that fits)."""
_SKIP = "--debug.skip_memory_check True goes on anyway"
logger = logging.getLogger("graph_trainer")


def check_writable_folder(path: str, what: str) -> None:
    """``path`` is (or can be made) a folder this process can write in; else a one-line ConfigError."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{what} = {path!r} is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create {what} = {path!r}: {e.strerror or e}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{what} = {path!r} is not writable: {e.strerror or e}") from None


def check_output_folders(cfg: JobConfig) -> None:
    check_writable_folder(cfg.job.dump_folder, "job.dump_folder")
    root = checkpoint_root(cfg)
    if cfg.checkpoint.interval > 0:
        check_writable_folder(root, "checkpoint.folder")
    elif os.path.exists(root) and not os.path.isdir(root):  # only read (resuming): may be read-only
        raise ConfigError(f"checkpoint.folder = {root!r} is a file, not a folder")
    if cfg.compile.dump_graphs:
        check_writable_folder(cfg.compile.dump_graphs, "compile.dump_graphs")
    p = cfg.profiling
    if p.enable_profiling:
        check_writable_folder(in_dump_folder(cfg, p.save_traces_folder), "profiling.save_traces_folder")
    if p.enable_memory_snapshot and resolve_device(cfg.job.device) == "cuda":  # (elsewhere: none written)
        check_writable_folder(
            in_dump_folder(cfg, p.save_memory_snapshot_folder), "profiling.save_memory_snapshot_folder"
        )


def _check_dataset_path(dataset: str, setting: str) -> None:
    if is_local_dataset(dataset) and not os.path.exists(os.path.expanduser(dataset)):
        raise ConfigError(
            f"{setting} path {dataset!r} does not exist; give 'synthetic', an existing "
            f"{', '.join(LOCAL_DATASET_SUFFIXES)} file or folder of them, or a Hugging Face hub dataset name"
        )


def check_input_paths(cfg: JobConfig) -> None:
    """Every file or folder the job reads exists: the local datasets (``training.dataset``, and
    ``validation.dataset`` when validating), ``training.tokenizer_path``, the Hugging Face folder
    ``checkpoint.initial_load_hf`` (its ``config.json``). The job file (``job.config_file``) was
    read by ``load_config``; what the others hold is checked by what reads them."""
    t, v = cfg.training, cfg.validation
    _check_dataset_path(t.dataset, "training.dataset")
    if v.enable and v.dataset:
        _check_dataset_path(v.dataset, "validation.dataset")
    if t.tokenizer_path not in ("", "bytes"):
        path = os.path.expanduser(t.tokenizer_path)
        if not os.path.isfile(os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path):
            raise ConfigError(
                f"training.tokenizer_path {t.tokenizer_path!r} does not exist; give '' or 'bytes' for the "
                "built-in byte tokenizer, or the path of a Hugging Face tokenizer.json (or its folder)"
            )
    if cfg.checkpoint.initial_load_hf:
        folder_config(cfg.checkpoint.initial_load_hf)


def check_optional_packages(cfg: JobConfig) -> None:
    if cfg.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "metrics.enable_wandb = True needs the optional wandb package, which is not installed: "
            "pip install wandb (into .venv), or leave the flag out"
        )


def check_wandb_settings(cfg: JobConfig) -> None:
    """With ``metrics.enable_wandb``: W&B's settings would start a run (``wandb_writer.wandb_run_folder``),
    in a folder this process can write in."""
    if not cfg.metrics.enable_wandb:
        return
    folder = wandb_run_folder(cfg.job.dump_folder)
    if folder:
        check_writable_folder(folder, "metrics.enable_wandb's run folder")


def check_threads(cfg: JobConfig) -> None:
    cpus = os.cpu_count() or 1
    if cfg.debug.num_threads > cpus:
        raise ConfigError(f"debug.num_threads = {cfg.debug.num_threads} is more than this machine's {cpus} CPUs")


def host_memory_bytes() -> int:
    """RAM this process may use: the machine's, or its cgroup's limit when lower (containers)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def device_memory_bytes(device: str) -> tuple[int, str]:
    """(bytes one rank may use, description) on ``device`` ('cpu' or 'cuda')."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if device == "cuda":
        import torch

        index = int(os.environ.get("LOCAL_RANK", 0))
        total = torch.cuda.get_device_properties(index).total_memory
        return total, f"a {torch.cuda.get_device_name(index)} has {total / GIB:.3g} GiB"
    total = host_memory_bytes()
    return total // local, f"this machine has {total / GIB:.3g} GiB of memory for {local} process(es)"


def usable_memory_bytes(device: str) -> tuple[int, str]:
    """(bytes one rank may use for its tensors, description) on ``device`` ('cpu' or 'cuda')."""
    total, what = device_memory_bytes(device)
    if device == "cuda":
        return total - GPU_RESERVE_BYTES, f"{what}, {GPU_RESERVE_BYTES / GIB:.0f} GiB of it reserved"
    return total, what


def _refuse_or_warn(cfg: JobConfig, message: str) -> None:
    if not cfg.debug.skip_memory_check:
        raise ConfigError(f"{message}; {_SKIP}")
    logger.warning("%s (going on: debug.skip_memory_check)", message)


def check_model_state_fits(cfg: JobConfig, model, device: str, weights_per_step: bool = False) -> None:
    """Parameters (as stored), gradients and optimizer state of the rank with the largest shards,
    and with ``weights_per_step`` the gathered weights and their gradient sums held for the step
    (``distributed.resident.resident_bytes``), against ``usable_memory_bytes``. ``model``: the
    parallelised model (meta is fine)."""
    opt = optimizer_memory(cfg.training)
    param_bytes = sum(largest_local_numel(p) * p.element_size() for p in model.parameters())
    resident = resident_bytes(model) if weights_per_step else 0
    need = param_bytes * (2 + opt.state_tensors) + resident  # parameters, gradients, optimizer states
    available, what = usable_memory_bytes(device)
    if need <= available:
        return
    held = (
        f" + {resident / GIB:,.1f} GiB of weights gathered for the step and their gradient sums "
        "(parallelism.fsdp_collectives per_microbatch holds none)"
        if resident
        else ""
    )
    _refuse_or_warn(
        cfg,
        f"the model state needs {need / GIB:,.1f} GiB per rank (parameters {param_bytes / GIB:,.1f} GiB, "
        f"gradients as much, {opt.name} state {opt.state_tensors}x{held}) but {what}; it needs at least "
        f"{math.ceil(need / available)}x more sharding (parallelism.dp_shard, parallelism.tp)",
    )


def _ways_to_shrink(cfg: JobConfig, estimate: StepMemoryEstimate) -> list[str]:
    """Settings that shrink the largest parts of ``estimate``'s peak, most effective first."""
    t, ac = cfg.training, cfg.activation_checkpoint.mode
    ways = []
    if estimate.peak.resident_weights:
        ways.append(
            "parallelism.fsdp_collectives per_microbatch (weights gathered per microbatch, not kept for the step)"
        )
    if estimate.peak.activations > estimate.peak.params and estimate.peak.moment in ("graph", "pipeline"):
        if estimate.peak.moment == "pipeline" and cfg.parallelism.pp_schedule != "1F1B":
            ways.append("parallelism.pp_schedule 1F1B (the fewest microbatches in flight)")
        if estimate.peak.moment == "pipeline":
            ways.append(
                "parallelism.pp_stage_blocks giving the first stages (more microbatches in flight) fewer blocks"
            )
        if ac != "full" and cfg.compile.mode == "graph":
            ways.append(f"activation_checkpoint.mode {'selective or full' if ac == 'none' else 'full'}")
            if ac == "selective":
                ways.append("activation_checkpoint.full_blocks N (each stage's first N blocks recomputed in full)")
        if t.local_batch_size > 1:
            ways.append("a smaller training.local_batch_size (training.global_batch_size keeps the global batch)")
        if t.loss_chunks == 1:
            ways.append("training.loss_chunks > 1")
    ways.append("more parallelism.dp_shard or parallelism.tp")
    return ways


def check_step_fits(cfg: JobConfig, estimate: StepMemoryEstimate, peak_bytes: int, device: str) -> None:
    """A training step's estimated peak (``peak_bytes``: the largest over the ranks; ``estimate``:
    this rank's, for its parts) against ``usable_memory_bytes``."""
    available, what = usable_memory_bytes(device)
    if peak_bytes <= available:
        return
    _refuse_or_warn(
        cfg,
        f"a training step needs an estimated {peak_bytes / GIB:,.2f} GiB per rank ({estimate.summary()}) but "
        f"{what}; to fit: {'; '.join(_ways_to_shrink(cfg, estimate))}",
    )


def check_batch_fits(cfg: JobConfig) -> None:
    import torch

    t = cfg.training
    vocab = model_args(cfg).vocab_size // max(1, cfg.parallelism.tp)
    itemsize = torch.empty((), dtype=getattr(torch, t.mixed_precision_param)).element_size()
    rows = -(-t.local_batch_size * t.seq_len // t.loss_chunks)  # a chunked loss holds one block's logits
    need = rows * vocab * itemsize
    available, what = device_memory_bytes(resolve_device(cfg.job.device))
    if need > available:
        chunks = f", in {t.loss_chunks} loss chunks" if t.loss_chunks > 1 else ""
        raise ConfigError(
            f"training.local_batch_size = {t.local_batch_size} with seq_len {t.seq_len}{chunks} needs at least "
            f"{need / GIB:,.0f} GiB per rank for the output logits alone ({rows} tokens x "
            f"{vocab} vocab x {itemsize} bytes); {what}"
        )


def preflight(cfg: JobConfig) -> None:
    """Every check above; the first failure raises ConfigError."""
    check_output_folders(cfg)
    check_input_paths(cfg)
    check_threads(cfg)
    check_optional_packages(cfg)
    check_wandb_settings(cfg)
    check_batch_fits(cfg)


def check_job(argv: list[str] | None, world_size: int) -> JobConfig:
    """Everything a job checks before it builds anything, in order: its configuration
    (``load_config``, ``validate_config`` for ``world_size`` processes), the device, then this
    machine (``preflight``). Returns the config; the first problem raises a one-line ConfigError.
    ``train.py`` runs it in every process, ``graph_trainer.cli.check`` once before torchrun."""
    cfg = load_config(argv)
    validate_config(cfg, world_size=world_size)
    check_device(cfg.job.device)
    preflight(cfg)
    return cfg
