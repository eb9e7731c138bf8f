"""A Hugging Face model folder: ``config.json`` and safetensors files, read by slices and written sharded.

Contract
--------
``HFFolder(path)`` checks the whole folder before any tensor is read, each failure one
``ConfigError`` line: the folder exists; ``config.json`` is a JSON object; the weights are
``model.safetensors.index.json`` (its ``weight_map`` names every tensor's file) or, without an
index, every ``*.safetensors`` file of the folder; every file opens (safetensors parses its header
and refuses a file that is truncated or whose header is corrupt: the message names the file); every
tensor is floating point (F32, BF16, F16, F64), or an FP8 weight in DeepSeek-V3's release format
(below; the dtypes are in the headers, so this is known before any data is read); a tensor lives
in one file only, and the index names exactly the tensors the files hold.

FP8 weights (``fp8_blocks``): a ``config.json`` whose ``quantization_config`` says ``quant_method``
"fp8" with a ``weight_block_size`` [b0, b1] (DeepSeek-V3's official release: [128, 128]) may hold
2-D ``float8_e4m3fn`` (F8_E4M3) tensors, each with an F32 ``<name>_scale_inv`` of
[ceil(rows / b0), ceil(cols / b1)]: block (i, j) of the weight is its fp8 values times
``scale_inv[i, j]``. Such a weight is listed in ``shapes`` as bf16 and read dequantized: each rank
reads the fp8 elements of its slice and the scales of the blocks the slice touches, and gets
``(fp8.float() * scale).to(bfloat16)``, the arithmetic of DeepSeek's own ``fp8_cast_bf16.py``
(fp32 product, rounded to bf16 once), so a slice equals the same slice of the folder
dequantized offline, bit for bit. The scale tensors are not listed in ``shapes``. An FP8 tensor
without its scales (or of another shape), scales without their weight, F8_E4M3 without the
``quantization_config``, and other 8-bit formats are one ``ConfigError`` each.

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
from models.hf_weights import CONFIG_FILE, folder_config, read_json

INDEX_FILE = "model.safetensors.index.json"


class HFFolder:
    """The checked folder (module docstring); ``shapes`` maps every tensor to (shape, dtype)."""

    def __init__(self, path: str):
        self.config = folder_config(path)
        self.path = path
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
        self.fp8_blocks: dict[str, tuple[str, tuple[int, int]]] = _fp8_weights(self.config, self.shapes, path)
        """FP8 weight -> (its scale tensor, the block size): read dequantized (module docstring)."""
        for name, (scale, _) in self.fp8_blocks.items():
            self.shapes[name] = (self.shapes[name][0], torch.bfloat16)
            del self.shapes[scale]
        index_path = os.path.join(path, INDEX_FILE)
        if os.path.exists(index_path):
            indexed = read_json(index_path, "safetensors index").get("weight_map", {})
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
            weight_map = read_json(index_path, "safetensors index").get("weight_map")
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
        """``tensor[index]`` of the folder's tensor ``name`` (file dtype; an FP8 weight dequantized to
        bf16); counted in ``bytes_read`` (an FP8 weight: its fp8 elements and scales)."""
        if name in self.fp8_blocks:
            return self._dequantized(name, index)
        return self._read_raw(name, index)

    def _dequantized(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """``index`` of the FP8 weight ``name``, dequantized with the scales of the blocks it touches."""
        scale_name, block = self.fp8_blocks[name]
        shape = self.shapes[name][0]
        if len(index) != 2 or any(s.step not in (None, 1) for s in index):
            raise JobError(f"reading {name}: an FP8 weight is read by 2-D contiguous slices, not {index}")
        bounds = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
        fp8 = self._read_raw(name, tuple(slice(lo, hi) for lo, hi in bounds))
        scales = self._read_raw(
            scale_name, tuple(slice(lo // b, -(-hi // b)) for (lo, hi), b in zip(bounds, block, strict=True))
        )
        for dim, ((lo, hi), b) in enumerate(zip(bounds, block, strict=True)):
            scales = scales.repeat_interleave(b, dim).narrow(dim, lo % b, hi - lo)
        return (fp8.float() * scales).to(torch.bfloat16)

    def _read_raw(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
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


_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
}
SCALE_SUFFIX = "_scale_inv"
"""An FP8 weight ``W``'s block scales are the tensor ``W_scale_inv`` (DeepSeek-V3's release)."""


def _dtype(code: str, name: str, file: str) -> torch.dtype:
    if code not in _DTYPES:
        raise ConfigError(
            f"tensor {name} of {file} is {code}; floating-point F32, BF16, F16 or F64 weights load, and "
            "F8_E4M3 weights with block scales (DeepSeek-V3's FP8 release format)"
        )
    return _DTYPES[code]


def _block_size(config: dict, path: str) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of an FP8 folder (ConfigError when not one)."""
    quant = config.get("quantization_config") or {}
    block = quant.get("weight_block_size")
    if quant.get("quant_method") != "fp8" or not (
        isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ConfigError(
            f"{path} holds F8_E4M3 tensors but its config.json has no fp8 quantization_config with a "
            f"weight_block_size [rows, cols] (DeepSeek-V3's release: quant_method 'fp8', [128, 128]); found {quant!r}"
        )
    return block[0], block[1]


def _fp8_weights(config: dict, shapes: dict, path: str) -> dict[str, tuple[str, tuple[int, int]]]:
    """Every FP8 weight of the folder with its scale tensor and block size, checked (module docstring)."""
    fp8 = sorted(n for n, (_, dtype) in shapes.items() if dtype == torch.float8_e4m3fn)
    orphans = sorted(n for n in shapes if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] not in fp8)
    if orphans:
        raise ConfigError(f"{path}: scales without an FP8 weight: {some_names(orphans)}")
    if not fp8:
        return {}
    block = _block_size(config, path)
    out = {}
    for name in fp8:
        shape, scale = shapes[name][0], name + SCALE_SUFFIX
        expected = [-(-n // b) for n, b in zip(shape, block, strict=True)] if len(shape) == 2 else None
        found = shapes.get(scale)
        if expected is None or found is None or found != (expected, torch.float32):
            raise ConfigError(
                f"{path}: FP8 tensor {name} {shape} needs 2 dims and float32 block scales {scale} of shape "
                f"{expected} ({block[0]}x{block[1]} blocks); found {found and (found[0], str(found[1]))}"
            )
        out[name] = (scale, block)
    return out


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
