"""Node metadata: every tag the project writes on a traced node or reads from one.

Tags live in ``node.meta["custom"]``, a dict PyTorch copies from the active
``torch.fx.traceback.annotate`` regions onto every node made while tracing (``annotate`` below
wraps it) and keeps through ``node_copy``. Passes write tags on the nodes they create. Every key
and every value with a meaning is a constant here: no module spells one as a string of its own.
Read with ``get(node, KEY)`` (or the few named getters), write with ``update(node, ...)`` or
``replace(node, {...})``.

Who writes each key and who reads it: ``KEYS`` below (docs/architecture.md shows it as a table,
which ``tests/test_docs.py`` holds equal to ``KEYS``).

The tracer copies the keys in ``INHERITED_BY_BACKWARD`` from a forward node onto the backward
nodes that differentiate it, so a tag written once in the forward also marks its backward.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch.fx as fx
import torch.fx.traceback

CUSTOM = "custom"
"""The ``node.meta`` entry holding the tags."""

# --- keys -----------------------------------------------------------------------------------
PHASE = "phase"
MODULE_FQN = "module_fqn"
INPUT_FQN = "input_fqn"
FSDP_ROLE = "fsdp_role"
FSDP_PARAM = "fsdp_param"
FSDP_BUCKET = "fsdp_bucket"
FSDP_PARAMS = "fsdp_params"
EP_ROLE = "ep_role"
TP_ROLE = "tp_role"
CP_ROLE = "cp_role"
MOE_FQN = "moe_fqn"
CHUNKED_MODULE = "chunked_module"
CHUNK_ID = "chunk_id"
LOSS_CHUNK = "loss_chunk"
ACTIVATION = "activation"
RECOMPUTED = "recomputed"
RECOMPUTE_OF = "recompute_of"
INDUCTOR_REGION = "inductor_region"
AUTO_BUCKET = "auto_bucket"


@dataclass(frozen=True)
class KeyDoc:
    """Who writes a key (or a pair of keys written together) and who reads it."""

    keys: tuple[str, ...]
    written_by: str
    read_by: str


KEYS = (
    KeyDoc(
        (PHASE,),
        "tracer: INPUT, FORWARD, LOSS, BACKWARD, OUTPUT; memory policy copies: BACKWARD; backend `full`: STEP",
        "every part of the compile chain (which half of the step a node is in)",
    ),
    KeyDoc(
        (MODULE_FQN,),
        "tracer (innermost module; backward nodes get their forward op's); `LOSS_MODULE` for the loss",
        "memory policy and backend (`block_of`, `unit_of`), bucketing passes, simulator",
    ),
    KeyDoc((INPUT_FQN,), "tracer, placeholders: parameter/buffer name, `tokens` or `labels`", "tests, dumps"),
    KeyDoc(
        (FSDP_ROLE,),
        "SimpleFSDP: UNSHARD on a parameter's cast + gather chain; tracer: REDUCE_GRAD on its backward "
        "(the gradient reduction); compiler.resident: GATHERED on a step graph's gathered-weight inputs "
        "(compiler.hoist: and on the values computed once per step from them)",
        "reshard_after_forward, memory policy (never recomputed), transformer_block_bucketing, ep_overlap "
        "(not chunked-module nodes), memory estimate and pipeline timeline (GATHERED: resident weights)",
    ),
    KeyDoc(
        (FSDP_PARAM,),
        "SimpleFSDP (the parameter's FQN); copied to its reduction by the tracer",
        "reshard_after_forward, bucketing",
    ),
    KeyDoc(
        (FSDP_BUCKET, FSDP_PARAMS),
        "transformer_block_bucketing on the nodes it makes: bucket name, its parameters",
        "dumps, tests",
    ),
    KeyDoc(
        (EP_ROLE,),
        "expert_parallel: COUNT_EXCHANGE, DISPATCH, COMBINE; the MoE model: EXPERT_COMPUTE",
        "ep_overlap, dry run, tests",
    ),
    KeyDoc((MOE_FQN,), "expert_parallel: the MoE module's FQN", "dry run, tests"),
    KeyDoc(
        (TP_ROLE,),
        "models' sequence-parallel plans: SEQUENCE_GATHER on the all-gather of a region's input",
        "memory policy (may recompute it for backward)",
    ),
    KeyDoc(
        (CP_ROLE,),
        "models.sequence: KV_GATHER on the all-gather of keys and values over the context-parallel ranks",
        "memory policy (may recompute it for backward)",
    ),
    KeyDoc(
        (CHUNKED_MODULE, CHUNK_ID),
        "chunking (ep_overlap's model preparation): the chunked module, chunk 0 or 1",
        "ep_overlap",
    ),
    KeyDoc((LOSS_CHUNK,), "loss: which row block of a chunked loss", "memory policy, backend (`unit_of`)"),
    KeyDoc(
        (ACTIVATION,), "memory policy `tag_activations`: SAVE or RECOMPUTE", "memory policy `recompute_activations`"
    ),
    KeyDoc(
        (RECOMPUTED, RECOMPUTE_OF),
        "reshard_after_forward and memory policy on their copies; `recompute_of`: the original",
        "transformer_block_bucketing (not a block's first compute), tests",
    ),
    KeyDoc((INDUCTOR_REGION,), "backend: the compiled region a call runs", "backend report, tests"),
    KeyDoc((AUTO_BUCKET,), "auto_bucketing on nodes PyTorch's bucketer made untagged", "tests"),
)
"""Every key, who writes it and who reads it (one entry per key or pair of keys written together)."""

# --- values ---------------------------------------------------------------------------------
INPUT, FORWARD, LOSS, BACKWARD, OUTPUT, STEP = "input", "forward", "loss", "backward", "output", "step"
"""Values of PHASE (STEP: the one call of a whole-step compiled graph)."""
LOSS_MODULE = "loss"
"""MODULE_FQN of the loss's own nodes (the mean cross-entropy after the logits)."""
UNSHARD = "unshard"
"""FSDP_ROLE of the forward nodes that cast and gather a parameter (and of their re-gathers)."""
REDUCE_GRAD = "reduce_grad"
"""FSDP_ROLE of the backward nodes that reduce (and cast) that parameter's gradient."""
GATHERED = "gathered"
"""FSDP_ROLE of a step graph's inputs that are gathered weights, or values computed once per step
from one (``input_fqn``: its name), resident for the step (``graph_trainer.compiler.resident``,
``graph_trainer.compiler.hoist``)."""
COUNT_EXCHANGE, DISPATCH, COMBINE, EXPERT_COMPUTE = "count_exchange", "dispatch", "combine", "expert_compute"
"""Values of EP_ROLE: the token-count all_to_all, the token all_to_all there, the one back, the local experts."""
SEQUENCE_GATHER = "sequence_gather"
"""TP_ROLE of the forward nodes that all-gather a tensor-parallel region's input along the sequence
(sequence parallel: ``models.common.gather_sequence``)."""
KV_GATHER = "kv_gather"
"""CP_ROLE of the forward nodes that all-gather attention's keys and values over the context-parallel
ranks (``models.sequence.gather_over_cp``)."""
SAVE, RECOMPUTE = "save", "recompute"
"""Values of ACTIVATION."""

INHERITED_BY_BACKWARD = (EP_ROLE, MOE_FQN, CHUNKED_MODULE, CHUNK_ID, LOSS_CHUNK)
"""Forward tags that the backward nodes differentiating a node carry too (copied by the tracer)."""

_EMPTY: Mapping[str, Any] = MappingProxyType({})
_BLOCK = re.compile(r"^(layers\.\d+)(\.|$)")


# --- reading --------------------------------------------------------------------------------
def tags(node: fx.Node) -> Mapping[str, Any]:
    """All tags of ``node``, read-only (empty for an untagged node)."""
    custom = node.meta.get(CUSTOM)
    return MappingProxyType(custom) if custom is not None else _EMPTY


def get(node: fx.Node, key: str, default: Any = None) -> Any:
    """One tag of ``node``, or ``default``."""
    return node.meta.get(CUSTOM, _EMPTY).get(key, default)


def has(node: fx.Node, key: str) -> bool:
    return key in node.meta.get(CUSTOM, _EMPTY)


def phase(node: fx.Node) -> str | None:
    return get(node, PHASE)


def module_fqn(node: fx.Node) -> str:
    return get(node, MODULE_FQN, "")


def within(fqn: str, prefixes: Iterable[str]) -> bool:
    """Whether the module or parameter ``fqn`` is one of ``prefixes`` or inside one of them."""
    return any(fqn == p or fqn.startswith(p + ".") for p in prefixes)


def block_of(node: fx.Node) -> str | None:
    """The transformer block (``layers.<i>``) a node belongs to, from its MODULE_FQN; None elsewhere."""
    match = _BLOCK.match(module_fqn(node))
    return match.group(1) if match else None


def unit_of(node: fx.Node) -> str | None:
    """The unit the memory policy decides for and the backend compiles as one region: a row block
    of the loss (``loss_chunk.<k>``) or a transformer block; None elsewhere (embeddings, final norm)."""
    chunk = get(node, LOSS_CHUNK)
    return f"{LOSS_CHUNK}.{chunk}" if chunk is not None else block_of(node)


# --- writing --------------------------------------------------------------------------------
# Writes never mutate a node's tag dict in place: ``Graph.node_copy`` copies ``node.meta``
# shallowly, so a copy and its original share one dict until either is written.
def update(node: fx.Node, values: Mapping[str, Any] | None = None, **more: Any) -> None:
    """Add or overwrite tags of ``node``."""
    node.meta[CUSTOM] = {**node.meta.get(CUSTOM, _EMPTY), **(values or {}), **more}


def replace(node: fx.Node, values: Mapping[str, Any]) -> None:
    """Make ``values`` (copied) all the tags of ``node``."""
    node.meta[CUSTOM] = dict(values)


def remove(node: fx.Node, key: str) -> None:
    if key in node.meta.get(CUSTOM, _EMPTY):
        node.meta[CUSTOM] = {k: v for k, v in node.meta[CUSTOM].items() if k != key}


def set_default(node: fx.Node, key: str, value: Any) -> None:
    """Tag ``key`` = ``value`` unless ``node`` already has ``key``."""
    if key not in node.meta.get(CUSTOM, _EMPTY):
        update(node, {key: value})


@contextmanager
def annotate(values: Mapping[str, Any]) -> Iterator[None]:
    """While tracing, tag every node made inside the block with ``values`` (nested blocks add
    their own; an inner value wins). Outside tracing it does nothing."""
    with torch.fx.traceback.annotate(dict(values)):
        yield


__all__ = [
    "ACTIVATION",
    "AUTO_BUCKET",
    "BACKWARD",
    "CHUNK_ID",
    "CHUNKED_MODULE",
    "COMBINE",
    "COUNT_EXCHANGE",
    "CUSTOM",
    "DISPATCH",
    "EP_ROLE",
    "EXPERT_COMPUTE",
    "FORWARD",
    "FSDP_BUCKET",
    "FSDP_PARAM",
    "FSDP_PARAMS",
    "FSDP_ROLE",
    "INDUCTOR_REGION",
    "INHERITED_BY_BACKWARD",
    "KEYS",
    "KeyDoc",
    "INPUT",
    "INPUT_FQN",
    "LOSS",
    "LOSS_CHUNK",
    "LOSS_MODULE",
    "MODULE_FQN",
    "MOE_FQN",
    "OUTPUT",
    "PHASE",
    "RECOMPUTE",
    "RECOMPUTED",
    "RECOMPUTE_OF",
    "REDUCE_GRAD",
    "SAVE",
    "STEP",
    "UNSHARD",
    "annotate",
    "block_of",
    "get",
    "has",
    "module_fqn",
    "phase",
    "remove",
    "replace",
    "set_default",
    "tags",
    "unit_of",
    "update",
    "within",
]
