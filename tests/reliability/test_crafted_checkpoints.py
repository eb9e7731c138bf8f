"""Resuming never runs code from the folder: a crafted ``.metadata`` is refused with one line and
nothing in it runs; entries that are not tensors are refused."""

from __future__ import annotations

import pickle

import pytest
import torch

from graph_trainer.checkpoint.safe_metadata import UnsafeCheckpointError, load_dcp_metadata
from graph_trainer.errors import ConfigError
from tests.reliability.helpers import copy_job, make_trainer, seal


def test_crafted_metadata_is_refused_with_one_line_and_nothing_runs(tmp_path, three_steps):
    job = copy_job(three_steps, tmp_path)
    step = job / "checkpoint" / "step-3"
    marker = tmp_path / "ran"

    class Payload:  # what a crafted .metadata holds: a call to run at unpickling time
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').close()",)

    (step / ".metadata").write_bytes(pickle.dumps(Payload()))
    seal(step)  # whoever can write the folder can write a matching manifest too
    with pytest.raises(ConfigError) as info:
        make_trainer(job, "--training.steps", "4")
    assert str(info.value) == (
        f"{step / '.metadata'} refers to builtins.exec, which checkpoint metadata never "
        f"holds; refusing to load it (nothing in it was run). Only load checkpoints you or "
        f"your jobs wrote"
    )
    assert not marker.exists()
    pickle.loads((step / ".metadata").read_bytes())  # what DCP's reader does with it: the code runs
    assert marker.exists()


def test_non_tensor_entries_are_refused(tmp_path):
    # DCP reads a non-tensor entry back with torch.load(weights_only=False); graph_trainer never saves one.
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning):
        dcp.save(
            {"w": torch.ones(2), "extra": {"a": 1}}, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True
        )
    with pytest.raises(UnsafeCheckpointError, match="BytesStorageMetadata"):
        load_dcp_metadata(str(tmp_path / ".metadata"))
