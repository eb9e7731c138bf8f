"""Hugging Face weights in (``checkpoint.initial_load_hf``) and out (``graph_trainer.cli.export_hf``).

Contract
--------
``open_hf_weights(cfg, args)`` (every rank, before the model is built) checks the folder
(``graph_trainer.checkpoint.hf_folder``), that ``config.json`` is the family's architecture and says what the
flavor says (each differing field named with both values), and that the folder holds exactly the
tensors the flavor needs with the right shapes (``models/<family>/hf.py``): each failure is one
``ConfigError`` naming what is missing, unexpected or of another shape. Layers beyond
``num_hidden_layers`` of a folder whose config declares ``num_nextn_predict_layers`` (DeepSeek-V3's
multi-token-prediction module, which we do not train) are skipped, and logged.

``load_hf_weights(weights, model, distributed)`` (every rank, after building, before the optimizer
sees a step) fills every parameter and persistent buffer of this rank's model in place through
``torch.distributed.checkpoint``: ``HFStorageReader`` presents the folder as a checkpoint of our
tensors (one chunk per tensor, our names, our global shapes), DCP's planner gives each rank the
boxes its shards cover (FSDP, HSDP, TP, EP and pipeline stages alike, as for our own checkpoints),
and the reader reads exactly those boxes from the files through the family's sources (row
permutations and expert stacks included): no rank materialises another rank's part. Values are
copied into our parameters' dtype (a bf16 folder loads into fp32 master weights exactly). A
folder value that is not finite is a ``ConfigError`` naming the tensor, on every rank, before the
first step: nothing half-loaded trains.

``export_hf(folder, step, out, dtype, max_shard_bytes)`` (one process, no process group) writes a
checkpoint ``<folder>/step-<N>`` (verified against its manifest first) as a Hugging Face folder,
one shard at a time: DCP loads only the tensors of the shard being written, so the export holds
about one shard in memory, never the model; the tokenizer files of a folder are copied beside, and
the ``config.json`` fields of a folder that do not describe the architecture (token ids,
generation settings) are carried over, provided that folder describes the same model.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import LoadPlan, LoadPlanner, StorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor

from graph_trainer.checkpoint import manifest
from graph_trainer.checkpoint.hf_folder import HFFolder, tokenizer_files, write_folder
from graph_trainer.checkpoint.safe_metadata import load_dcp_metadata, metadata_path, safe_reader
from graph_trainer.checkpoint.state import model_tensors, read_metadata, shape_diff, single_process_ok
from graph_trainer.config import JobConfig
from graph_trainer.distributed.comm import agree
from graph_trainer.errors import ConfigError, some_names
from graph_trainer.loop.guards import first_non_finite
from models.hf_weights import CONFIG_FILE, HFAdapter, HFSource, hf_names, read_json
from models.registry import HF_FLAVOR, MODEL_SPECS, check_hf_family, recorded_args

logger = logging.getLogger("graph_trainer")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class HFWeights:
    """A checked Hugging Face folder and how each of our tensors is read from it."""

    folder: HFFolder
    sources: dict[str, HFSource]
    """Our clean FQN -> how it is read from the folder (the family's adapter)."""
    shapes: dict[str, list[int]]
    """Our clean FQN -> global shape (every parameter and persistent buffer of the whole model)."""
    skipped: list[str]
    """The folder's tensors not read: its multi-token-prediction layers."""


def _global_shapes(model_name: str, args) -> dict[str, list[int]]:
    """Every parameter's and persistent buffer's global shape, by clean FQN, from the meta model."""
    with torch.device("meta"):
        model = MODEL_SPECS[model_name].build(args)
    return {fqn: list(t.shape) for fqn, t in model_tensors(model).items()}


def open_hf_weights(cfg: JobConfig, args) -> HFWeights:
    """The folder of ``checkpoint.initial_load_hf``, checked against the job's model (module docstring)."""
    path = cfg.checkpoint.initial_load_hf
    folder = HFFolder(path)
    adapter: HFAdapter = MODEL_SPECS[cfg.model.name].hf
    config = folder.config
    what = f"{cfg.model.name} {cfg.model.flavor}" + (f" ({args.n_layers} layers)" if cfg.model.n_layers else "")
    check_hf_family(path, config, cfg.model.name)
    problems = adapter.config_problems(config, args)
    if problems:
        hint = "" if cfg.model.flavor == HF_FLAVOR else " (--model.flavor hf builds the model the folder describes)"
        raise ConfigError(f"{path}/config.json does not fit {what}: " + "; ".join(problems) + hint)
    shapes = _global_shapes(cfg.model.name, args)
    sources = adapter.sources(args)
    expected = hf_names(sources, shapes)
    present = {n: shape for n, (shape, _) in folder.shapes.items()}
    mtp = set()
    if config.get("num_nextn_predict_layers"):
        mtp = {n for n in present if (m := _LAYER.match(n)) and int(m.group(1)) >= args.n_layers}
    missing = set(expected) - set(present)
    unexpected = set(present) - set(expected) - mtp
    both = sorted(set(expected) & set(present))
    wrong = [f"{n} {present[n]} (model: {expected[n]})" for n in both if present[n] != expected[n]]
    if missing or unexpected or wrong:
        parts = [
            f"missing {some_names(missing)}" if missing else "",
            f"unexpected {some_names(unexpected)}" if unexpected else "",
            f"shape {some_names(wrong)}" if wrong else "",
        ]
        raise ConfigError(f"{path} does not hold the tensors of {what}: " + "; ".join(p for p in parts if p))
    if mtp:
        logger.info("%s: skipping %d tensors of the multi-token-prediction layers (not trained here)", path, len(mtp))
    return HFWeights(folder, sources, shapes, sorted(mtp))


class HFStorageReader(StorageReader):
    """A Hugging Face folder seen by DCP as a checkpoint of our tensors (module docstring)."""

    def __init__(self, weights: HFWeights, keys: dict[str, torch.dtype]):
        super().__init__()
        self.weights, self.keys = weights, keys

    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def read_metadata(self, *args, **kwargs) -> Metadata:
        tensors, storage = {}, {}
        for key, shape in self.weights.shapes.items():
            zeros = torch.Size([0] * len(shape))
            tensors[key] = TensorStorageMetadata(
                TensorProperties(dtype=self.keys.get(key, torch.float32)),
                torch.Size(shape),
                [ChunkStorageMetadata(offsets=zeros, sizes=torch.Size(shape))],
            )
            storage[MetadataIndex(key, zeros)] = key
        return Metadata(state_dict_metadata=tensors, storage_data=storage)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        read_fn = self.weights.folder.read
        for item in plan.items:
            source = self.weights.sources[item.storage_index.fqn]
            values = source.read(read_fn, list(item.storage_offsets), list(item.lengths))
            target = planner.resolve_tensor(item).detach()
            target.copy_(values)
            planner.commit_tensor(item, target)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done


def load_hf_weights(weights: HFWeights, model: torch.nn.Module, distributed: bool) -> int:
    """(every rank) This rank's part of every tensor, in place (module docstring); returns the bytes it read."""
    state = model_tensors(model)
    reader = HFStorageReader(weights, {k: v.dtype for k, v in state.items()})
    path = weights.folder.path
    with single_process_ok():
        agree(lambda: dcp.load(state, storage_reader=reader, no_dist=not distributed), f"cannot load {path}")
    bad = first_non_finite([(k, v.to_local() if isinstance(v, DTensor) else v) for k, v in state.items()])
    everywhere = [bad]
    if distributed:
        everywhere = [None] * dist.get_world_size()
        dist.all_gather_object(everywhere, bad)
    named = next((b for b in everywhere if b), None)
    if named:
        raise ConfigError(f"{path}: tensor {named} holds non-finite values (a corrupt file?); nothing trained")
    weights.folder.close()
    return weights.folder.bytes_read


# ------------------------------------------------------------------------------ export


def _shards(keys: list[str], shapes: dict[str, list[int]], max_bytes: int, itemsize: int) -> Iterator[list[str]]:
    """``keys`` in order, cut into groups of at most ``max_bytes`` (a larger tensor is a group of its own)."""
    group, size = [], 0
    for key in keys:
        n = itemsize * math.prod(shapes[key])
        if group and size + n > max_bytes:
            yield group
            group, size = [], 0
        group.append(key)
        size += n
    if group:
        yield group


NOT_CARRIED = ("quantization_config",)
"""Fields of a ``config_from`` folder's ``config.json`` an export leaves out: its weights are
written dequantized (a float8 release's block scales describe the folder's files, not ours)."""


def carried_config(ours: dict, config_from: str, adapter: HFAdapter, args) -> dict:
    """``ours`` (the checkpoint's ``config.json``) with the fields of the Hugging Face folder
    ``config_from``'s that ours does not write (token ids, generation settings, ...), except
    ``NOT_CARRIED`` and the other names of fields ours writes (``HFAdapter.field_aliases``); ours
    win where both have one. ``ConfigError`` when the folder's fields describe another model than
    ``args`` (the folder is not the model this checkpoint was trained from)."""
    theirs = read_json(os.path.join(config_from, CONFIG_FILE), "Hugging Face config")
    merged = {**{k: v for k, v in theirs.items() if k not in NOT_CARRIED}, **ours}
    if "dtype" in merged:  # (newer transformers' name of torch_dtype)
        merged["dtype"] = ours["torch_dtype"]
    problems = adapter.config_problems(merged, args)  # (aliases still in: theirs must agree too)
    merged = {k: v for k, v in merged.items() if adapter.field_aliases.get(k) not in ours}
    if theirs.get("model_type") != ours["model_type"]:
        problems.insert(0, f"model_type {theirs.get('model_type')!r}, not {ours['model_type']!r}")
    if problems:
        what = f"{config_from}/{CONFIG_FILE}"
        raise ConfigError(f"{what} describes another model than the checkpoint: " + "; ".join(problems))
    return merged


def export_hf(
    checkpoint_folder: str,
    step: int,
    out: str,
    dtype: torch.dtype,
    max_shard_bytes: int,
    tokenizer: str = "",
    config_from: str = "",
) -> list[str]:
    """Write ``<checkpoint_folder>/step-<step>`` as a Hugging Face folder at ``out`` (module docstring),
    with the tokenizer files of the folder ``tokenizer`` and the other ``config.json`` fields of the
    folder ``config_from`` (``carried_config``) when given."""
    copies = tokenizer_files(tokenizer) if tokenizer else []
    folder = os.path.join(checkpoint_folder, f"step-{step}")
    if not os.path.isfile(os.path.join(folder, manifest.MANIFEST_FILE)):
        raise ConfigError(f"{folder} is not a checkpoint (no {manifest.MANIFEST_FILE}); see --checkpoint and --step")
    problem = manifest.verify_folder(folder)
    if problem:
        raise ConfigError(f"checkpoint {folder} does not verify: {problem}")
    meta = read_metadata(folder)
    name, flavor = meta.get("model", {}).get("name"), meta.get("model", {}).get("flavor")
    args = recorded_args(meta.get("model", {}))
    if args is None:
        raise ConfigError(f"checkpoint {folder} is of an unknown model {name!r} flavor {flavor!r}")
    spec = MODEL_SPECS[name]
    params = meta.get("params", {})
    n_layers = 1 + max((int(m.group(1)) for k in params if (m := re.match(r"layers\.(\d+)\.", k))), default=-1)
    if n_layers != args.n_layers:  # trained with model.n_layers
        args = dataclasses.replace(args, n_layers=n_layers)
    shapes = _global_shapes(name, args)
    saved = {
        k.removeprefix("model."): list(v.size)
        for k, v in load_dcp_metadata(metadata_path(folder)).state_dict_metadata.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
    }
    problem = shape_diff(saved, shapes)
    if problem:
        what = f"{name} {flavor} ({n_layers} layers)"
        raise ConfigError(f"checkpoint {folder} does not hold the tensors of {what}: {problem}")
    sources = spec.hf.sources(args)
    itemsize = torch.empty((), dtype=dtype).element_size()

    def shards() -> Iterator[dict[str, torch.Tensor]]:
        for keys in _shards(list(sources), shapes, max_shard_bytes, itemsize):
            state = {f"model.{k}": torch.empty(shapes[k], dtype=torch.float32) for k in keys}
            with single_process_ok():
                dcp.load(state, storage_reader=safe_reader(folder), no_dist=True)
            hf: dict[str, torch.Tensor] = {}
            for k in keys:
                hf.update({n: t.to(dtype) for n, t in sources[k].to_hf(state[f"model.{k}"]).items()})
            yield hf

    dtype_name = str(dtype).removeprefix("torch.")
    config = spec.hf.config(args, dtype_name)
    if config_from:
        config = carried_config(config, config_from, spec.hf, args)
    files = write_folder(out, config, shards(), copies)
    logger.info("exported %s (%s %s, %d layers) to %s: %d files", folder, name, flavor, n_layers, out, len(files))
    return files


__all__ = [
    "NOT_CARRIED",
    "HFStorageReader",
    "HFWeights",
    "carried_config",
    "export_hf",
    "load_hf_weights",
    "open_hf_weights",
]
