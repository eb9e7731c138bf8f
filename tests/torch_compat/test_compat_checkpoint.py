"""graph_trainer.torch_compat.checkpoint: the DCP entries: the globals a checkpoint's metadata pickle
holds, and the reader that never pickle-loads.

Fails loudly when a PyTorch upgrade changes a private API graph_trainer relies on."""

import pytest
import torch


class _Recording(__import__("pickle").Unpickler):
    """Plain unpickling (of a file this test wrote) that records every global the pickle names."""

    def __init__(self, file, seen):
        super().__init__(file)
        self.seen = seen

    def find_class(self, module, name):
        self.seen.add((module, name))
        return super().find_class(module, name)


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to (save|load) in a single process")
def test_dcp_metadata_globals_cover_a_real_checkpoint_and_the_reader_never_pickle_loads(tmp_path, monkeypatch):
    import pickle

    import torch.distributed.checkpoint as dcp

    from graph_trainer.checkpoint.safe_metadata import load_dcp_metadata, safe_reader
    from graph_trainer.torch_compat import DCP_METADATA_FILE, dcp_metadata_globals, dcp_storage_files

    state = {
        "model.w": torch.randn(4, 3),
        "model.h": torch.randn(5, dtype=torch.bfloat16),
        "optim.w.step": torch.zeros((), dtype=torch.float32),
        "model.i": torch.arange(3),
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    seen: set = set()
    with open(tmp_path / DCP_METADATA_FILE, "rb") as f:
        _Recording(f, seen).load()
    allowed = dcp_metadata_globals()
    assert seen <= set(allowed), seen - set(allowed)  # DCP started pickling something new: admit it knowingly
    md = "torch.distributed.checkpoint.metadata"
    assert {
        (md, "Metadata"),
        (md, "TensorStorageMetadata"),
        (md, "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "bfloat16"),
    } <= seen
    assert (md, "BytesStorageMetadata") not in allowed
    assert dcp_storage_files(load_dcp_metadata(str(tmp_path / DCP_METADATA_FILE))) == {"__0_0.distcp"}

    def no_pickle(*args, **kwargs):
        raise AssertionError("pickle.load called")

    monkeypatch.setattr(pickle, "load", no_pickle)
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, storage_reader=safe_reader(str(tmp_path)), no_dist=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
