"""Checks of THIS machine against the job, before anything is built (``train.py`` runs them after
``validate_config``; each failure is a one-line ``ConfigError``, exit code 2).

* Output folders: ``job.dump_folder``, the checkpoint folder (when the job saves; a job that only
  resumes may read a read-only one) and ``compile.dump_graphs`` must be folders this process can
  create and write in. The test writes and removes a file, so it holds for root too and on
  read-only mounts.
* ``debug.num_threads`` at most the CPUs of this machine (a huge value makes OpenMP abort
  while allocating its thread pool).
* The batch fits: one step needs at least the output logits, ``local_batch_size x seq_len x
  vocab/tp`` values in the compute dtype (every model here materialises them for the loss; with
  ``training.loss_chunks`` N, one block of them: 1/N); when
  that lower bound alone exceeds the memory of the device (a GPU's, or this machine's RAM shared
  by its local processes), the job is refused before the data loader allocates the batch.
  Estimates above the memory only warn (``Trainer._report_memory``): they can be wrong, this cannot.
"""

from __future__ import annotations

import os
import tempfile

from graph_trainer.config import JobConfig
from graph_trainer.errors import ConfigError
from graph_trainer.validation import resolve_device
from models.registry import model_args

GIB = float(1 << 30)


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
    from graph_trainer.checkpoint import checkpoint_root

    check_writable_folder(cfg.job.dump_folder, "job.dump_folder")
    root = checkpoint_root(cfg)
    if cfg.checkpoint.interval > 0:
        check_writable_folder(root, "checkpoint.folder")
    elif os.path.exists(root) and not os.path.isdir(root):  # only read (resuming): may be read-only
        raise ConfigError(f"checkpoint.folder = {root!r} is a file, not a folder")
    if cfg.compile.dump_graphs:
        check_writable_folder(cfg.compile.dump_graphs, "compile.dump_graphs")


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
        return total, f"a {torch.cuda.get_device_name(index)} has {total / GIB:.0f} GiB"
    total = host_memory_bytes()
    return total // local, f"this machine has {total / GIB:.0f} GiB of memory for {local} process(es)"


def check_batch_fits(cfg: JobConfig) -> None:
    import torch

    t = cfg.training
    vocab = model_args(cfg.model).vocab_size // max(1, cfg.parallelism.tp)
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
    check_threads(cfg)
    check_batch_fits(cfg)
