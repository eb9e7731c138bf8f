"""The model families the trainer knows, by ``model.name``.

A ``ModelSpec`` tells the trainer how to build a family's model from a flavor, how many
FLOPs a token costs (for MFU), and which parallel layouts the model admits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from graph_trainer.config import JobConfig
from graph_trainer.errors import ConfigError
from models.common import block_bucket_plan, head_modules
from models.deepseek_v3 import flavors as deepseek_v3_flavors
from models.deepseek_v3 import hf as deepseek_v3_hf
from models.deepseek_v3 import parallelize as deepseek_v3_parallelize
from models.deepseek_v3.model import DeepSeekV3
from models.hf_weights import HFAdapter, folder_config
from models.llama3 import flavors as llama3_flavors
from models.llama3 import hf as llama3_hf
from models.llama3 import parallelize as llama3_parallelize
from models.llama3.model import Transformer
from models.qwen3 import flavors as qwen3_flavors
from models.qwen3 import hf as qwen3_hf
from models.qwen3 import parallelize as qwen3_parallelize
from models.qwen3.model import Qwen3


@dataclass(frozen=True)
class ModelSpec:
    name: str
    flavors: dict[str, Any]
    """Flavor name -> model args (a frozen dataclass with at least ``max_seq_len`` and ``vocab_size``)."""
    build: Callable[[Any], nn.Module]
    """Construct the model from its args (called under ``torch.device('meta')``)."""
    flops_per_token: Callable[[Any, int], int]
    """Training FLOPs per token (forward + backward) at a sequence length."""
    validate_parallelism: Callable[[Any, dict[str, int]], None]
    """Raise ConfigError if the resolved degrees do not fit the model."""
    parallelize: Callable[..., nn.Module]
    """``parallelize(model, mesh, dims, mixed_precision) -> model``: TP/EP/SimpleFSDP on a meta model."""
    hf: HFAdapter
    """The family in Hugging Face's format: tensor names and ``config.json`` (weights in and out)."""
    bucket_plan: Callable[[nn.Module], list[list[str]]] = block_bucket_plan
    """Module FQN groups that form one communication bucket each (for bucketing passes); every
    family's: a bucket per block (``models.common.block_bucket_plan``)."""
    head_modules: Callable[[nn.Module], list[str]] = head_modules
    """FQNs of the modules the backward starts with (the final norm and the output projection), whose
    gathered weights ``parallelism.fsdp_reshard_after_forward = 'default'`` keeps for it."""


MODEL_SPECS: dict[str, ModelSpec] = {
    "llama3": ModelSpec(
        name="llama3",
        flavors=llama3_flavors.FLAVORS,
        build=Transformer,
        flops_per_token=llama3_flavors.flops_per_token,
        validate_parallelism=llama3_parallelize.validate_parallelism,
        parallelize=llama3_parallelize.parallelize_llama3,
        hf=llama3_hf.ADAPTER,
    ),
    "deepseek_v3": ModelSpec(
        name="deepseek_v3",
        flavors=deepseek_v3_flavors.FLAVORS,
        build=DeepSeekV3,
        flops_per_token=deepseek_v3_flavors.flops_per_token,
        validate_parallelism=deepseek_v3_parallelize.validate_parallelism,
        parallelize=deepseek_v3_parallelize.parallelize_deepseek_v3,
        hf=deepseek_v3_hf.ADAPTER,
    ),
    "qwen3": ModelSpec(
        name="qwen3",
        flavors=qwen3_flavors.FLAVORS,
        build=Qwen3,
        flops_per_token=qwen3_flavors.flops_per_token,
        validate_parallelism=qwen3_parallelize.validate_parallelism,
        parallelize=qwen3_parallelize.parallelize_qwen3,
        hf=qwen3_hf.DENSE_ADAPTER,
    ),
    "qwen3_moe": ModelSpec(
        name="qwen3_moe",
        flavors=qwen3_flavors.MOE_FLAVORS,
        build=Qwen3,
        flops_per_token=qwen3_flavors.flops_per_token,
        validate_parallelism=qwen3_parallelize.validate_parallelism,
        parallelize=qwen3_parallelize.parallelize_qwen3,
        hf=qwen3_hf.MOE_ADAPTER,
    ),
}


HF_FLAVOR = "hf"
"""``model.flavor`` for the shapes of the Hugging Face folder ``checkpoint.initial_load_hf``."""


def _loads(adapter: HFAdapter, config: dict) -> bool:
    """Whether ``adapter``'s family is the one a ``config.json`` names (architecture or model type)."""
    return adapter.architecture in (config.get("architectures") or []) or config.get("model_type") == adapter.model_type


def check_hf_family(path: str, config: dict, model_name: str) -> None:
    """``ConfigError`` when the Hugging Face folder ``path`` (its ``config.json`` is ``config``) is
    not of ``model_name``'s family, naming the ``model.name`` that loads it when one does."""
    adapter = MODEL_SPECS[model_name].hf
    if _loads(adapter, config):
        return
    fits = [name for name, spec in MODEL_SPECS.items() if _loads(spec.hf, config)]
    hint = f" (model.name {fits[0]} loads it)" if fits else " (no model.name loads it)"
    raise ConfigError(
        f"{path}/config.json is a {config.get('architectures') or config.get('model_type')!r} model; "
        f"model.name {model_name} loads {adapter.architecture} (model_type {adapter.model_type})" + hint
    )


def model_args(cfg: JobConfig):
    """The model's shape: the flavor's arguments (flavor ``hf``: those ``config.json`` of
    ``checkpoint.initial_load_hf`` describes), with ``model.n_layers`` and ``model.max_seq_len``
    applied when set."""
    spec = MODEL_SPECS[cfg.model.name]
    if cfg.model.flavor == HF_FLAVOR:
        folder = cfg.checkpoint.initial_load_hf
        if not folder:
            raise ConfigError(
                "model.flavor 'hf' takes the model's shape from a Hugging Face folder's config.json: "
                "set checkpoint.initial_load_hf to that folder"
            )
        config = folder_config(folder)
        check_hf_family(folder, config, cfg.model.name)
        try:
            args = spec.hf.args_from_config(config)
        except ConfigError as e:
            raise ConfigError(f"{folder}: {e} (model.flavor hf)") from None
    else:
        args = spec.flavors[cfg.model.flavor]
    if cfg.model.n_layers:
        args = dataclasses.replace(args, n_layers=cfg.model.n_layers)
    return dataclasses.replace(args, max_seq_len=cfg.model.max_seq_len) if cfg.model.max_seq_len else args


def model_record(cfg: JobConfig) -> dict:
    """What a checkpoint records of the job's model: family and flavor, and under flavor 'hf' the
    ``config.json`` of its shapes (the folder need not exist when the checkpoint is exported)."""
    record = {"name": cfg.model.name, "flavor": cfg.model.flavor}
    if cfg.model.flavor == HF_FLAVOR:
        record["hf_config"] = MODEL_SPECS[cfg.model.name].hf.config(model_args(cfg), "float32")
    return record


def recorded_args(record: dict):
    """The model arguments of a ``model_record`` (None when it names no model this build knows)."""
    spec = MODEL_SPECS.get(record.get("name"))
    if spec is None:
        return None
    if record.get("flavor") == HF_FLAVOR and isinstance(record.get("hf_config"), dict):
        return spec.hf.args_from_config(record["hf_config"])
    return spec.flavors.get(record.get("flavor"))
