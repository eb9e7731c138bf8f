"""The pass registry and the types every pass shares (kept apart so pass modules can import them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx


class PassError(RuntimeError):
    """A graph pass failed or left the graph invalid."""


@dataclass
class PassContext:
    """What a pass may read besides the graph."""

    config: Any = None
    """The JobConfig of the run (None in unit tests that build graphs by hand)."""
    degrees: dict[str, int] = field(default_factory=dict)
    """Resolved parallel degrees: dp_replicate, dp_shard, tp, ep."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Model-provided information (e.g. the transformer block bucket plan)."""


@dataclass(frozen=True)
class PassSpec:
    """A registered pass: its function and the config check run at validation time."""

    name: str
    fn: Callable[[fx.GraphModule, PassContext], fx.GraphModule]
    description: str
    check_config: Callable[[Any, dict[str, int]], None] = lambda cfg, degrees: None
    prepare_model: Callable[[Any, Any], None] | None = None
    """Called with (model, config) after the model is parallelized and before tracing, for
    passes that need the model to run differently (``ep_overlap`` installs chunking)."""
    on_fsdp_collectives: bool = False
    """The pass acts on SimpleFSDP's collectives: with weights resident per step
    (``parallelism.fsdp_collectives``) it runs on the once-per-step gather and reduce graphs,
    where they are, not on the microbatch's graph (``compiler.chain.transform_resident``)."""


PASS_REGISTRY: dict[str, PassSpec] = {}
"""User-selectable passes by name (``--compile.passes``)."""


def unknown_pass(name: str) -> str:
    """The one-line message for a ``compile.passes`` entry that names no registered pass."""
    available = ", ".join(sorted(PASS_REGISTRY)) or "(none registered)"
    return f"unknown pass {name!r} in compile.passes; available passes: {available}"


def register_pass(spec: PassSpec) -> PassSpec:
    if spec.name in PASS_REGISTRY:
        raise ValueError(f"pass {spec.name!r} registered twice")
    PASS_REGISTRY[spec.name] = spec
    return spec
