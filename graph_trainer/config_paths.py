"""Where a job's settings point on disk: output folders under ``job.dump_folder``, the checkpoint
folder, and whether a dataset setting names local files or a hub dataset."""

from __future__ import annotations

import os

from graph_trainer.config import JobConfig


def in_dump_folder(cfg: JobConfig, folder: str) -> str:
    """An output folder setting: ``folder``, relative to ``job.dump_folder`` unless absolute."""
    return folder if os.path.isabs(folder) else os.path.join(cfg.job.dump_folder, folder)


def checkpoint_root(cfg: JobConfig) -> str:
    """The checkpoint folder: ``checkpoint.folder``, relative to ``job.dump_folder`` unless absolute."""
    return in_dump_folder(cfg, cfg.checkpoint.folder)


LOCAL_DATASET_SUFFIXES = (".json", ".jsonl", ".parquet", ".txt")
"""The files a local ``training.dataset`` or ``validation.dataset`` (a file, or a folder of them)
may be (``graph_trainer/data/documents.py`` reads each with its ``datasets`` builder)."""


def is_local_dataset(dataset: str) -> bool:
    """Whether the dataset setting ``dataset`` names a local file or folder rather than a hub dataset
    ("org/name"): it exists, or it is spelled as a path (absolute, ``.``, ``~``) or as a data file."""
    if os.path.exists(os.path.expanduser(dataset)):
        return True
    suffix = os.path.splitext(dataset)[1].lower()
    return os.path.isabs(dataset) or dataset.startswith((".", "~")) or suffix in LOCAL_DATASET_SUFFIXES
