"""A Hugging Face model folder: ``config.json`` and safetensors files, read by slices and written sharded.

Contract
--------
``HFFolder(path)`` checks the whole folder before any tensor is read, each failure one
``ConfigError`` line: the folder exists; ``config.json`` is a JSON object; the weights are
``model.safetensors.index.json`` (its ``weight_map`` names every tensor's file) or, without an
index, every ``*.safetensors`` file of the folder; every file opens (safetensors parses its header
and refuses a file that is truncated or whose header is corrupt: the message names the file); every
tensor is floating point (F32, BF16, F16, F64: a quantized release such as DeepSeek-V3's FP8 one
must be dequantized first; the dtype is in the header, so this is known before any data is read); a
tensor lives in one file only, and the index names exactly the tensors the files hold.

``read(name, index)`` returns ``tensor[index]`` (a tuple of slices, one per dim) in the file's
dtype, read through safetensors' lazy slicing: only the requested elements are copied out of the
memory-mapped file. ``bytes_read`` counts those bytes (numel x itemsize of every slice returned),
so a test can hold each rank to the slices it owns.

``write_folder(out, config, shards)`` writes a folder ``transformers`` loads: ``config.json``, the
shards ``model-0000K-of-0000N.safetensors`` and ``model.safetensors.index.json`` (the total size
and every tensor's file) into a temporary sibling folder renamed to ``out`` at the end, so a
failed export never leaves a half-written folder; an existing ``out`` is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from graph_trainer.errors import ConfigError, JobError, one_line, some_names

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what} {path} cannot be read: {one_line(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} is not a JSON object")
    return data


class HFFolder:
    """The checked folder (module docstring); ``shapes`` maps every tensor to (shape, dtype)."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise ConfigError(f"Hugging Face folder {path} does not exist (checkpoint.initial_load_hf)")
        self.path = path
        self.config = _read_json(os.path.join(path, CONFIG_FILE), "Hugging Face config")
        self.bytes_read = 0
        self._handles: dict[str, object] = {}
        self.file_of: dict[str, str] = {}
        self.shapes: dict[str, tuple[list[int], torch.dtype]] = {}
        for file in self._weight_files():
            handle = self._open(file)
            for name in handle.keys():
                if name in self.file_of:
                    raise ConfigError(f"{path}: tensor {name} is in both {self.file_of[name]} and {file}")
                self.file_of[name] = file
                piece = handle.get_slice(name)
                self.shapes[name] = (list(piece.get_shape()), _dtype(piece.get_dtype(), name, file))
        index_path = os.path.join(path, INDEX_FILE)
        if os.path.exists(index_path):
            indexed = _read_json(index_path, "safetensors index").get("weight_map", {})
            wrong = sorted(n for n, f in indexed.items() if self.file_of.get(n) != f)
            unlisted = sorted(set(self.file_of) - set(indexed))
            if wrong or unlisted:
                raise ConfigError(
                    f"{index_path} does not match the files: "
                    + "; ".join(
                        p
                        for p in (
                            f"not in the file it names: {some_names(wrong)}" if wrong else "",
                            f"not in the index: {some_names(unlisted)}" if unlisted else "",
                        )
                        if p
                    )
                )

    def _weight_files(self) -> list[str]:
        index_path = os.path.join(self.path, INDEX_FILE)
        if os.path.exists(index_path):
            weight_map = _read_json(index_path, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConfigError(f"{index_path} has no weight_map")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not files:
            raise ConfigError(f"Hugging Face folder {self.path} holds no *.safetensors file")
        return files

    def _open(self, file: str):
        if file not in self._handles:
            full = os.path.join(self.path, file)
            if not os.path.isfile(full):
                raise ConfigError(f"safetensors file {full} does not exist")
            try:
                self._handles[file] = safe_open(full, framework="pt").__enter__()
            except (SafetensorError, OSError) as e:
                raise ConfigError(
                    f"safetensors file {full} cannot be read (truncated or corrupt?): {one_line(e)}"
                ) from None
        return self._handles[file]

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """``tensor[index]`` of the folder's tensor ``name`` (file dtype); counted in ``bytes_read``."""
        try:
            piece = self._open(self.file_of[name]).get_slice(name)[index]
        except SafetensorError as e:
            raise JobError(f"reading {name} from {self.file_of[name]} failed: {one_line(e)}") from None
        self.bytes_read += piece.numel() * piece.element_size()
        return piece

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def _dtype(code: str, name: str, file: str) -> torch.dtype:
    if code not in _DTYPES:
        raise ConfigError(
            f"tensor {name} of {file} is {code}; floating-point F32, BF16, F16 or F64 weights load "
            "(a quantized release, e.g. DeepSeek-V3's FP8 one, must be dequantized to BF16 first: DeepSeek's "
            "fp8_cast_bf16.py)"
        )
    return _DTYPES[code]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_files(folder: str) -> list[str]:
    """The Hugging Face tokenizer files of ``folder`` (``tokenizer.json`` and the files naming its
    special tokens); ConfigError when it holds no ``tokenizer.json``."""
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise ConfigError(f"tokenizer folder {folder} holds no tokenizer.json")
    return [os.path.join(folder, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]


def write_folder(
    out: str, config: dict, shards: Iterable[dict[str, torch.Tensor]], copies: Iterable[str] = ()
) -> list[str]:
    """Write ``config`` and the ``shards`` (each a {name: tensor} written as one file) as a Hugging
    Face folder at ``out`` (module docstring), with a copy of each file of ``copies`` (e.g. the
    tokenizer's); returns the shard file names."""
    if os.path.exists(out):
        raise ConfigError(f"output folder {out} already exists; choose a new one")
    parent = os.path.dirname(os.path.abspath(out))
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(tmp)
        weight_map: dict[str, str] = {}
        written: list[tuple[str, list[str]]] = []  # (temporary file name, its tensors' names)
        total = 0
        for k, shard in enumerate(shards):  # one shard in memory at a time
            temp = f"shard-{k}.safetensors"  # renamed once the number of shards is known
            save_file({n: t.contiguous() for n, t in shard.items()}, os.path.join(tmp, temp), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in shard.values())
            written.append((temp, list(shard)))
        files = [f"model-{k + 1:05d}-of-{len(written):05d}.safetensors" for k in range(len(written))]
        for (temp, names), final in zip(written, files, strict=True):
            os.rename(os.path.join(tmp, temp), os.path.join(tmp, final))
            weight_map.update({n: final for n in names})
        with open(os.path.join(tmp, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        with open(os.path.join(tmp, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        for path in copies:
            shutil.copyfile(path, os.path.join(tmp, os.path.basename(path)))
        os.rename(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise JobError(f"cannot write {out}: {e.strerror or e}: {e.filename}") from None
    return files


__all__ = ["CONFIG_FILE", "HFFolder", "INDEX_FILE", "TOKENIZER_FILES", "tokenizer_files", "write_folder"]
