"""How one of our tensors is made of Hugging Face tensors: the pieces of a state-dict adapter.

A model family's adapter (``models/<family>/hf.py``) maps every tensor of our state (parameters
and persistent buffers, by clean FQN) to one ``HFSource``. A source answers three questions, with
no I/O of its own:

- ``hf_shapes(shape)``: the Hugging Face tensors it is made of, and their shapes, given our
  tensor's global ``shape`` (to check a folder before anything is read);
- ``read(read_fn, offsets, lengths)``: the box ``[offsets, offsets + lengths)`` of our global
  tensor, asking ``read_fn(hf_name, index)`` for exactly the Hugging Face elements that box holds,
  so a rank that owns a shard reads only that shard's bytes;
- ``to_hf(full)``: our full tensor as Hugging Face tensors (for export).

For every source ``read`` over the whole tensor of what ``to_hf`` wrote gives back the tensor
bitwise: the adapters only rename, stack and permute rows, never compute.

Also here, below both families: reading a folder's ``config.json`` (``folder_config``; one
``ConfigError`` line when it is missing or not a JSON object), the fields both families check and
write alike (``ConfigCheck``, ``decoder_config``), and an adapter's ``args_from_config``, the model a
``config.json`` describes (``--model.flavor hf``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from graph_trainer.errors import ConfigError, one_line

ReadFn = Callable[[str, tuple[slice, ...]], torch.Tensor]


def box(offsets: Sequence[int], lengths: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))


@dataclass(frozen=True)
class Same:
    """Our tensor is the Hugging Face tensor ``name``, element for element."""

    name: str

    def hf_shapes(self, shape: Sequence[int]) -> dict[str, list[int]]:
        return {self.name: list(shape)}

    def read(self, read_fn: ReadFn, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
        return read_fn(self.name, box(offsets, lengths))

    def to_hf(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        return {self.name: full}


@dataclass(frozen=True)
class RotaryRows:
    """A query/key projection whose rows are permuted within each head between the two RoPE layouts.

    Ours rotates the pairs (2i, 2i+1) of a head (Meta's layout); Hugging Face's LLaMA rotates
    (i, i + head_dim/2) ("rotate half"), so its checkpoints hold each head's rows reordered: our row
    ``2i + c`` of a head is its row ``c * head_dim/2 + i``. A box of our rows inside one head holds
    our even rows (one contiguous run of Hugging Face rows in the first half) and our odd rows (one
    run in the second half): two reads per head, no byte more than the box.
    """

    name: str
    head_dim: int

    def hf_shapes(self, shape: Sequence[int]) -> dict[str, list[int]]:
        return {self.name: list(shape)}

    def read(self, read_fn: ReadFn, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
        hd, half = self.head_dim, self.head_dim // 2
        rest = box(offsets[1:], lengths[1:])
        first, end = offsets[0], offsets[0] + lengths[0]
        pieces = []
        for head in range(first // hd, (end - 1) // hd + 1):
            base = head * hd
            lo, hi = max(first, base) - base, min(end, base + hd) - base  # our rows [lo, hi) of this head
            even = read_fn(self.name, (slice(base + (lo + 1) // 2, base + (hi + 1) // 2), *rest))
            odd = read_fn(self.name, (slice(base + half + lo // 2, base + half + hi // 2), *rest))
            rows = torch.empty((hi - lo, *even.shape[1:]), dtype=even.dtype)
            rows[lo % 2 :: 2] = even  # our row lo + j is even when (lo + j) % 2 == 0
            rows[1 - lo % 2 :: 2] = odd
            pieces.append(rows)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def to_hf(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        rows, rest = full.shape[0], full.shape[1:]
        heads = rows // self.head_dim
        # our [head, i, c] -> theirs [head, c, i]
        hf = full.reshape(heads, self.head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)
        return {self.name: hf.contiguous()}


@dataclass(frozen=True)
class ExpertStack:
    """Our ``[E, ...]`` expert weight is the Hugging Face tensors ``names[e]`` (one per expert) stacked on dim 0."""

    names: tuple[str, ...]

    def hf_shapes(self, shape: Sequence[int]) -> dict[str, list[int]]:
        if shape[0] != len(self.names):
            raise ValueError(f"{shape[0]} experts in our tensor, {len(self.names)} Hugging Face names")
        return {n: list(shape[1:]) for n in self.names}

    def read(self, read_fn: ReadFn, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
        rest = box(offsets[1:], lengths[1:])
        return torch.stack([read_fn(self.names[e], rest) for e in range(offsets[0], offsets[0] + lengths[0])])

    def to_hf(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: full[e] for e, n in enumerate(self.names)}


HFSource = Same | RotaryRows | ExpertStack


def hf_names(sources: dict[str, HFSource], shapes: dict[str, Sequence[int]]) -> dict[str, list[int]]:
    """Every Hugging Face tensor the ``sources`` read, with its shape (our global ``shapes`` by FQN)."""
    names: dict[str, list[int]] = {}
    for fqn, source in sources.items():
        names.update(source.hf_shapes(shapes[fqn]))
    return names


CONFIG_FILE = "config.json"


def read_json(path: str, what: str) -> dict:
    """The JSON object in ``path``; ``ConfigError`` naming ``what`` when it is missing, unreadable
    or not an object."""
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


def folder_config(path: str) -> dict:
    """``config.json`` of the Hugging Face folder ``path`` (``ConfigError`` when there is none)."""
    if not os.path.isdir(path):
        raise ConfigError(f"Hugging Face folder {path} does not exist (checkpoint.initial_load_hf)")
    return read_json(os.path.join(path, CONFIG_FILE), "Hugging Face config")


def rope_parameters(config: dict) -> tuple[float | None, dict | None]:
    """(rope theta, rope scaling) of a ``config.json``: the ``rope_theta`` / ``rope_scaling`` keys of
    published checkpoints, or the ``rope_parameters`` dict newer ``transformers`` writes. A scaling
    of type ``default`` (or none) is None; ``type`` is read as ``rope_type``."""
    params = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", params.get("rope_theta"))
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type"))
        if scaling["rope_type"] == "default":
            scaling = None
    return theta, scaling


@dataclass(frozen=True)
class HFAdapter:
    """A model family in Hugging Face's format (``models/<family>/hf.py``)."""

    architecture: str
    """``config.json``'s ``architectures`` entry (``transformers``' class)."""
    model_type: str
    """``config.json``'s ``model_type``."""
    sources: Callable[..., dict[str, HFSource]]
    """``sources(args)``: our clean FQN -> its source, for every parameter and persistent buffer."""
    config_problems: Callable[..., list[str]]
    """``config_problems(config, args)``: what a ``config.json`` says that the flavor does not."""
    config: Callable[..., dict]
    """``config(args, dtype)``: the ``config.json`` of the flavor, weights in ``dtype``."""
    args_from_config: Callable[[dict], object]
    """``args_from_config(config)``: the model ``config`` describes, whose ``config_problems`` are
    none (``ConfigError`` listing what the family cannot represent)."""
    field_aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    """Other names ``transformers`` writes some ``config.json`` fields under: that name -> the one
    ``config`` writes. Read where the field itself is missing (``with_aliases``); an export that
    carries a folder's fields leaves them out, so its ``config.json`` names each field once."""


def with_aliases(config: dict, aliases: dict[str, str]) -> dict:
    """``config`` with each field of ``aliases`` it lacks taken from its other name, when present."""
    taken = {name: config[alias] for alias, name in aliases.items() if name not in config and alias in config}
    return {**config, **taken}


FIXED_FIELDS = {"hidden_act": "silu", "attention_bias": False}
"""``config.json`` fields both families hold to one value (also the value when a file leaves one out)."""


def decoder_fields(args) -> dict:
    """The ``config.json`` fields of the decoder stack both families write and check alike: field ->
    the flavor's value (``args``: either family's model arguments)."""
    return {
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": getattr(args, "tie_embeddings", False),
    }


def represented(args, problems: list[str], family: str):
    """``args`` when ``problems`` (its ``config_problems``) is empty; else ``ConfigError`` naming them."""
    if problems:
        raise ConfigError(f"config.json has what this {family} cannot represent: " + "; ".join(problems))
    return args


def required_fields(config: dict, fields: Sequence[str], family: str) -> None:
    """``ConfigError`` naming the ``fields`` a ``config.json`` lacks (to build a ``family`` model from it)."""
    missing = [f for f in fields if config.get(f) is None]
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)}: a {family} model cannot be built from it")


def decoder_config(architecture: str, model_type: str, args, dtype: str) -> dict:
    """The part of a family's ``config.json`` both families write the same way (weights in ``dtype``)."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        **decoder_fields(args),
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        **FIXED_FIELDS,
        "torch_dtype": dtype,
    }


class ConfigCheck:
    """Collects the fields of a ``config.json`` that differ from the flavor, one phrase each."""

    def __init__(self, config: dict):
        self.config = config
        self.problems: list[str] = []

    def equal(self, field: str, ours, default=None, what: str = "") -> None:
        theirs = self.config.get(field, default)
        same = (
            theirs is not None and abs(float(theirs) - float(ours)) <= 1e-9 * max(1.0, abs(float(ours)))
            if isinstance(ours, float)
            else theirs == ours
        )
        if not same:
            self.problems.append(f"{field} {theirs!r} (flavor{what}: {ours!r})")

    def decoder(self, args) -> None:
        """The fields both families check alike (``decoder_fields``, ``FIXED_FIELDS``)."""
        for field, ours in decoder_fields(args).items():
            self.equal(field, ours, default=False if field == "tie_word_embeddings" else None)
        for field, ours in FIXED_FIELDS.items():
            self.equal(field, ours, default=ours)

    def require(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)

    def rope(self, theta: float, scaling: dict | None) -> None:
        """The RoPE base is ``theta`` and the scaling is ``scaling`` (every key of it, numbers to 1e-9;
        None: no scaling), read from either config layout (``rope_parameters``)."""
        theirs_theta, theirs = rope_parameters(self.config)
        self.require(
            theirs_theta is not None and abs(float(theirs_theta) - theta) <= 1e-9 * theta,
            f"rope_theta {theirs_theta!r} (flavor: {theta!r})",
        )
        if scaling is None:
            self.require(theirs is None, f"rope_scaling {theirs!r} (flavor: none)")
            return

        def same(key, ours) -> bool:
            value = (theirs or {}).get(key)
            if isinstance(ours, str) or value is None or isinstance(value, str):
                return value == ours
            return abs(float(value) - float(ours)) <= 1e-9 * max(1.0, abs(float(ours)))

        self.require(all(same(k, v) for k, v in scaling.items()), f"rope_scaling {theirs!r} (flavor: {scaling})")


__all__ = [
    "CONFIG_FILE",
    "ConfigCheck",
    "ExpertStack",
    "HFAdapter",
    "HFSource",
    "RotaryRows",
    "Same",
    "FIXED_FIELDS",
    "box",
    "decoder_config",
    "decoder_fields",
    "folder_config",
    "hf_names",
    "read_json",
    "represented",
    "required_fields",
    "rope_parameters",
]
