"""The files of a checkpoint (graph_trainer/checkpoint/state.py): DCP's index ``.metadata`` is a
function of the state saved, whichever folder the save wrote into and however it was written
(blocking or in the background), and loads as before; two runs of one job write the same bytes
in every file of a checkpoint."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed.checkpoint as dcp

from graph_trainer.checkpoint.safe_metadata import safe_reader
from graph_trainer.checkpoint.state import save_tensors, single_process_ok, start_saving_tensors
from tests.reliability.helpers import make_trainer


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(8, 4, generator=generator)
    return {"model.w": w, "optim.w.exp_avg": w * 0.5, "optim.w.step": torch.tensor(2.0)}


def test_two_saves_of_one_state_write_the_same_index_and_it_loads(tmp_path):
    state = _state()
    blocking = [tmp_path / "step-2.tmp-0a1b2c3d", tmp_path / "elsewhere" / "step-2.tmp-ffffffff"]
    for folder in blocking:
        save_tensors(str(folder), state, distributed=False)
    background = tmp_path / "step-2.tmp-12345678"
    start_saving_tensors(str(background), state, distributed=False, group=None).result()
    index = (blocking[0] / ".metadata").read_bytes()
    assert (blocking[1] / ".metadata").read_bytes() == index
    assert (background / ".metadata").read_bytes() == index
    loaded = {name: torch.zeros_like(t) for name, t in state.items()}
    with single_process_ok():
        dcp.load(loaded, storage_reader=safe_reader(str(background)), no_dist=True)
    assert all(torch.equal(loaded[name], t) for name, t in state.items())


def test_two_runs_of_one_job_write_the_same_checkpoint_files(tmp_path):
    hashes = []
    for run in ("first", "second"):
        torch.seed()  # what each new process starts from: a random seed
        make_trainer(tmp_path / run, "--training.steps", "1", "--checkpoint.interval", "1").train()
        folder = tmp_path / run / "checkpoint" / "step-1"
        hashes.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())})
    assert "rng-rank0.pt" in hashes[0] and ".metadata" in hashes[0]
    assert hashes[0] == hashes[1]
