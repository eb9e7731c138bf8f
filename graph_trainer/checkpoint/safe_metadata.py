"""Read a DCP checkpoint's ``.metadata`` without running anything a checkpoint folder holds.

DCP stores its index (which tensor, which shape, which piece lies where in which file) as a
pickle, and ``FileSystemReader`` reads it with plain ``pickle.load``: a crafted ``.metadata``
runs code in the job that resumes from it. ``load_dcp_metadata`` unpickles with an
``Unpickler`` whose ``find_class`` admits exactly the globals a checkpoint written by
graph_trainer holds (``torch_compat.dcp_metadata_globals``: the metadata dataclasses, sizes,
dtypes, the layout and memory-format lookups, the saving folder's path). Any other global is
refused before it is imported, with one line naming it, so nothing in the file runs. The result
must be a DCP ``Metadata``. ``dcp_reader`` (``torch_compat``) makes ``dcp.load`` use this too.

What this does not do: judge the values. A hostile (but well-formed) index can still describe
wrong tensors; the trainer checks names and shapes against the model and the manifest
(``graph_trainer.checkpoint.manifest``) checks the bytes against what was saved.
"""

from __future__ import annotations

import io
import os
import pickle

from graph_trainer.errors import ConfigError
from graph_trainer.torch_compat import DCP_METADATA_FILE, dcp_metadata_globals, dcp_reader


class UnsafeCheckpointError(ConfigError):
    """A checkpoint's metadata refers to something a checkpoint never holds (crafted or foreign)."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str, allowed: dict):
        super().__init__(file)
        self._path = path
        self._allowed = allowed

    def find_class(self, module: str, name: str):
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(
                f"{self._path} refers to {module}.{name}, which checkpoint metadata never holds; refusing to load it "
                f"(nothing in it was run). Only load checkpoints you or your jobs wrote"
            ) from None

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(
            f"{self._path} holds a persistent reference, which checkpoint metadata never holds; refusing to load it"
        )


def load_dcp_metadata(path: str):
    """The ``Metadata`` pickled in ``path`` (a checkpoint's ``.metadata``), admitting only checkpoint classes."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), path, dcp_metadata_globals()).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # truncated or garbled: pickle raises many kinds
        raise ConfigError(f"cannot read {path}: not a DCP metadata file ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP checkpoint metadata")
    return metadata


def safe_reader(folder: str):
    """A ``dcp.FileSystemReader`` of ``folder`` that reads ``.metadata`` with ``load_dcp_metadata``."""
    return dcp_reader(folder, load_dcp_metadata)


def metadata_path(folder: str) -> str:
    return os.path.join(folder, DCP_METADATA_FILE)
