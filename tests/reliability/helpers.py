"""Helpers shared by the long-job reliability tests; not a test module.

Each test file pins one behaviour a long job relies on (verified loads, finite state, atomic
saves, timeouts, one-line errors, ...). Most cases run one eager process in this process, whose
steps are quick (measured: docs/performance.md); the ones that need a real exit code, a resource
limit or several ranks run ``train.py`` (under torchrun for the latter).
``scripts/fault_injection.py`` kills and corrupts in a loop; these tests pin each behaviour. The
``three_steps`` fixture they share is in ``conftest.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from graph_trainer.checkpoint import manifest
from graph_trainer.checkpoint.safe_metadata import load_dcp_metadata, metadata_path, safe_reader
from graph_trainer.config_loading import load_config
from graph_trainer.trainer import Trainer
from graph_trainer.validation import validate_config
from tests.conftest import ROOT
from tests.launch import FAST_ARGS

EAGER = [*FAST_ARGS, "--compile.mode", "eager"]
DEBUG_TOML = os.path.join(ROOT, "configs", "llama3_debug.toml")


def make_trainer(folder, *args) -> Trainer:
    """A validated eager one-process Trainer writing into ``folder``; ``args`` are further flags."""
    cfg = load_config([*EAGER, "--job.dump_folder", str(folder), *args])
    validate_config(cfg)
    return Trainer(cfg)


def train_py(*args, preexec_fn=None, timeout=300) -> subprocess.CompletedProcess:
    """``train.py`` with ``args`` in a process of its own (for its exit code and stderr)."""
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        preexec_fn=preexec_fn,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT},
    )


def error_lines(stderr: str) -> list[str]:
    """The ``error: `` lines of ``stderr``."""
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@contextlib.contextmanager
def logged_warnings():
    """The graph_trainer logger's WARNING lines while inside (it does not propagate to pytest)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Keep(logging.WARNING)
    log = logging.getLogger("graph_trainer")
    log.addHandler(handler)
    try:
        yield lines
    finally:
        log.removeHandler(handler)


@contextlib.contextmanager
def immutable(path):
    """``path`` read-only even for root (``chattr +i``), or skip where the file system cannot."""
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def copy_job(source, tmp_path):
    """A copy of the job folder ``source`` (e.g. ``three_steps``) as ``tmp_path/job``, for a test to change."""
    job = tmp_path / "job"
    shutil.copytree(source, job)
    return job


def saved_tensors_finite(step_dir) -> bool:
    """Whether every tensor saved in the checkpoint folder ``step_dir`` is finite."""
    import torch.distributed.checkpoint as dcp

    index = load_dcp_metadata(metadata_path(str(step_dir))).state_dict_metadata
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in index.items()}
    dcp.load(state, storage_reader=safe_reader(str(step_dir)), no_dist=True)
    return all(bool(torch.isfinite(t).all()) for t in state.values())


def seal(folder) -> None:
    """Rewrite the manifest of a checkpoint folder as it is now (after the test changed a file)."""
    manifest.seal(str(folder))
