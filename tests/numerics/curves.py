"""The jobs whose per-step losses are stored in ``tests/assets/losses/<name>.txt``.

Each curve is one fixed command: a debug model on CPU, one thread per process
(``OMP_NUM_THREADS=1``, set by ``tests.launch.run_torchrun``), a pinned seed, gloo, and a
checkpoint at the last step (so the same run also gives the final parameters, for the
determinism test). The files hold ``train.py``'s ``losses.txt`` verbatim: one
``<step> <repr(loss)>`` line per step, so comparing the text compares the floats bit for bit.
Regenerate with ``python -m tests.numerics.regenerate`` (README: when that is legitimate).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tests.conftest import ROOT
from tests.launch import run_torchrun

ASSETS = Path(ROOT) / "tests" / "assets" / "losses"
STEPS = 20

_COMMON = [
    "--training.steps", str(STEPS), "--training.seq_len", "64", "--training.local_batch_size", "2",
    "--training.seed", "42", "--job.device", "cpu", "--metrics.log_freq", "10",
    "--metrics.enable_tensorboard", "False", "--checkpoint.interval", str(STEPS),
]

CURVES: dict[str, tuple[int, list[str]]] = {
    # name: (processes, train.py flags besides the common ones)
    "llama3_debug": (1, ["--job.config_file", os.path.join(ROOT, "configs", "llama3_debug.toml")]),
    "deepseek_v3_debug": (1, ["--job.config_file", os.path.join(ROOT, "configs", "deepseek_v3_debug.toml")]),
    "llama3_debug_fsdp2": (2, ["--job.config_file", os.path.join(ROOT, "configs", "llama3_debug.toml")]),
}


def curve_path(name: str) -> Path:
    return ASSETS / f"{name}.txt"


def run_curve(name: str, dump_folder: Path) -> str:
    """Run a curve's job into ``dump_folder`` (which must not hold checkpoints); its losses.txt text."""
    nproc, args = CURVES[name]
    run_torchrun(nproc, os.path.join(ROOT, "train.py"), *args, *_COMMON, "--job.dump_folder", str(dump_folder))
    return (Path(dump_folder) / "losses.txt").read_text()


def final_state_hashes(dump_folder: Path) -> dict[str, str]:
    """SHA-256 of every tensor (parameters, buffers, AdamW moments) of the checkpoint saved at the
    last step, by its checkpoint key; dtype and shape are part of the hash."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = Path(dump_folder) / "checkpoint" / f"step-{STEPS}"
    flat = Path(dump_folder) / "final_state.pt"
    dcp_to_torch_save(str(folder), str(flat))
    state = torch.load(flat, weights_only=False)
    hashes = {}
    for key, value in _flatten(state):
        if isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous().reshape(-1)
            digest = hashlib.sha256(f"{value.dtype} {tuple(value.shape)}".encode())
            digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
            hashes[key] = digest.hexdigest()
    return hashes


def _flatten(state, prefix: str = ""):
    if isinstance(state, dict):
        for key, value in state.items():
            yield from _flatten(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], state
