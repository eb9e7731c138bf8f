"""Private APIs of torch.distributed.checkpoint (DCP): the classes a ``.metadata`` pickle holds, the
files a checkpoint's metadata names, and a reader that never unpickles ``.metadata`` itself."""

from __future__ import annotations

import os

import torch

from graph_trainer.torch_compat.versions import private_api


def dcp_metadata_globals() -> dict[tuple[str, str], object]:
    """Every global a DCP ``.metadata`` pickle written by graph_trainer refers to, by (module, name).

    Found by unpickling real checkpoints (one process and FSDP over gloo, float32 and bfloat16)
    and recording each ``find_class``: the ``Metadata`` dataclasses, ``_StorageInfo`` (where each
    tensor lies in which file), ``torch.Size``, the dtypes, the layout (pickled as a call of
    ``torch.serialization._get_layout("torch.strided")``, a lookup by name), the memory-format
    enum ``_MEM_FORMAT_ENCODING`` and ``pathlib.PosixPath`` (the saving folder). None of them
    runs anything but its own constructor. Deliberately absent: ``BytesStorageMetadata`` (a
    non-tensor entry, which DCP's planner would read back with ``torch.load(weights_only=False)``:
    graph_trainer saves only tensors).
    """
    import pathlib

    import torch.distributed.checkpoint.metadata as md

    allowed: dict[tuple[str, str], object] = {
        ("torch", "Size"): torch.Size,
        ("pathlib", "PosixPath"): pathlib.PosixPath,
    }
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
    ):
        allowed[(md.__name__, name)] = getattr(md, name)
    with private_api("torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING"):
        allowed[(md.__name__, "_MEM_FORMAT_ENCODING")] = md._MEM_FORMAT_ENCODING
    with private_api("torch.distributed.checkpoint.filesystem._StorageInfo"):
        from torch.distributed.checkpoint.filesystem import _StorageInfo
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    with private_api("torch.serialization._get_layout"):
        from torch.serialization import _get_layout
    allowed[("torch.serialization", "_get_layout")] = _get_layout
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    return allowed


def dcp_storage_files(metadata) -> set[str]:
    """The files (relative to the checkpoint folder) a DCP ``Metadata`` says hold its tensors
    (``_StorageInfo.relative_path`` of every ``storage_data`` entry)."""
    with private_api("torch.distributed.checkpoint.filesystem._StorageInfo.relative_path"):
        return {info.relative_path for info in metadata.storage_data.values()}


DCP_METADATA_FILE = ".metadata"
"""The file ``dcp.FileSystemWriter`` writes its pickled ``Metadata`` to (``filesystem._metadata_fn``)."""


def dcp_reader(path: str, read_metadata):
    """A ``dcp.FileSystemReader`` of ``path`` whose ``read_metadata()`` returns ``read_metadata(file)``
    for the folder's ``.metadata`` file instead of ``pickle.load``-ing it.

    ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle`` (torch
    2.11 to 2.14), so whoever can write a checkpoint folder could run code in the job that
    resumes from it. The subclass keeps what the original does besides unpickling: it stamps
    the reader's ``load_id`` into ``metadata.storage_meta``. Per-rank metadata files
    (``read_metadata(rank=r)``, a fallback DCP tries when the global file cannot be read) are
    not offered: graph_trainer always writes the global one.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(dcp.FileSystemReader):
        def read_metadata(self):
            with private_api("FileSystemReader.path / load_id"):
                folder, load_id = str(self.path), self.load_id
            metadata = read_metadata(os.path.join(folder, DCP_METADATA_FILE))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = load_id
            return metadata

    return _Reader(path)
