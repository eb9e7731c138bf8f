"""FP8 training of a model's linears: which ``nn.Linear`` modules compute in float8, and the swap.

``convert_linears(model, settings, tp)`` replaces the chosen linears of a model built on the meta
device, before it is parallelised, with torchao's ``Float8Linear`` under the recipe
``settings.recipe_name`` names (``Float8LinearConfig.from_recipe_name``: dynamic scaling; the
forward, input-gradient and weight-gradient matmuls each cast their two operands to float8 with
scales from their amax and run ``torch._scaled_mm``). A ``Float8Linear`` is an ``nn.Linear``:
the same ``weight`` parameter, FQN and state dict, so tensor parallel, SimpleFSDP, checkpoints
and Hugging Face weights see no difference. The casts and matmuls are aten ops: the tracer
records them in the step's graph (``_scaled_mm`` nodes and the amax/scale/cast chains around
them), and eager mode runs the same ops, so graph == eager bitwise as for every layout.

Which linears (``select_linears``; each decision logged by the caller):

- every ``nn.Linear`` of the model, except
- those whose FQN contains an entry of ``settings.filter_fqns`` (every entry must match one:
  a filter that names nothing is a ``ConfigError``),
- the output projection (``output``) unless ``settings.convert_output``, and DeepSeek-V3's router
  gate (``moe.router.gate``) unless ``settings.convert_router``: precision-sensitive, kept in the
  parameter dtype, as DeepSeek-V3's FP8 training keeps its output head and gating,
- linears with a dimension that is not a multiple of 16 on every tensor-parallel rank
  (``_scaled_mm``'s requirement: in and out features each a multiple of ``16 * tp``, whichever
  of them tensor parallel splits).

Numerics: float8 rounds both operands of every matmul (e4m3: 3 mantissa bits; the tensorwise
recipe's output gradient e5m2: 2), a relative error of a few percent per product against the
parameter dtype's; how far a training run moves is measured in docs/numerics.md. torchao is
imported here only (and only when a recipe is chosen).

Failure: ``ConfigError`` when torchao is missing, this torch or device has no scaled matmul
(``check_scaled_mm``), or a filter names no linear.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn

from graph_trainer.config import Float8
from graph_trainer.errors import ConfigError

OUTPUT_FQN = "output"
"""The output projection (vocabulary logits), kept unless ``convert_output``."""
ROUTER_SUFFIX = "router.gate"
"""DeepSeek-V3's router gate (``layers.N.moe.router.gate``), kept unless ``convert_router``."""
SCALED_MM_MULTIPLE = 16
"""``_scaled_mm`` needs each matrix dimension to be a multiple of this."""


@dataclass(frozen=True)
class LinearChoice:
    """What happens to one ``nn.Linear``: converted, or kept and why."""

    fqn: str
    converted: bool
    reason: str


def _why_kept(fqn: str, linear: nn.Linear, settings: Float8, tp: int) -> str | None:
    """Why ``linear`` stays in high precision (None: it is converted)."""
    matching = [f for f in settings.filter_fqns if f in fqn]
    if matching:
        return f"float8.filter_fqns ({matching[0]!r})"
    if fqn == OUTPUT_FQN and not settings.convert_output:
        return "the output projection; float8.convert_output converts it"
    if fqn.endswith(ROUTER_SUFFIX) and not settings.convert_router:
        return "the router gate; float8.convert_router converts it"
    multiple = SCALED_MM_MULTIPLE * tp
    if linear.in_features % multiple or linear.out_features % multiple:
        return f"[{linear.out_features}, {linear.in_features}] is not a multiple of {multiple} (16 x tp) in each dim"
    return None


def select_linears(model: nn.Module, settings: Float8, tp: int = 1) -> list[LinearChoice]:
    """The decision for every ``nn.Linear`` of ``model`` (module docstring); raises ``ConfigError``
    when an entry of ``settings.filter_fqns`` matches no linear."""
    linears = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    unmatched = [f for f in settings.filter_fqns if not any(f in fqn for fqn, _ in linears)]
    if unmatched:
        raise ConfigError(
            f"float8.filter_fqns: {', '.join(map(repr, unmatched))} matches no linear of the model "
            f"(its linears are e.g. {', '.join(fqn for fqn, _ in linears[:4])})"
        )
    choices = []
    for fqn, linear in linears:
        reason = _why_kept(fqn, linear, settings, tp)
        choices.append(LinearChoice(fqn, reason is None, reason or "converted"))
    return choices


_IMPORT_NOISE = ("torchao", "torch.utils._pytree")
"""Loggers that warn while torchao imports on a machine without its compiled kernels (CPU: the
CUDA-only extensions it cannot load) or about its enum registration; none concerns float8
training, and an error line after them would not be the one line a bad config gets."""


def torchao_float8():
    """torchao's float8 training module, or a ConfigError saying how to get it."""
    loggers = [logging.getLogger(name) for name in _IMPORT_NOISE]
    levels = [log.level for log in loggers]
    try:
        for log in loggers:
            log.setLevel(logging.ERROR)
        import torchao.float8 as ao_float8
    except ImportError as error:
        raise ConfigError(
            f"float8.recipe_name needs torchao's float8 training ({error}); pip install torchao (requirements.txt)"
        ) from None
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)
    return ao_float8


def check_scaled_mm(device: torch.device | str) -> None:
    """Raise ``ConfigError`` unless this torch runs an e4m3 ``_scaled_mm`` on ``device`` (CUDA:
    compute capability 8.9 or newer, e.g. H100; CPU: torch builds that implement it)."""
    device = torch.device(device)
    if device.type == "meta":
        return
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"float8 needs a GPU with FP8 matmuls (compute capability 8.9+, e.g. H100); {name} has none")
    try:
        a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        torch._scaled_mm(a, a.t(), one, one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, AttributeError) as error:
        first = str(error).splitlines()[0][:160]
        raise ConfigError(
            f"float8 needs torch._scaled_mm on {device.type}; torch {torch.__version__} refused it: {first}"
        ) from None


def convert_linears(model: nn.Module, settings: Float8, tp: int = 1) -> list[LinearChoice]:
    """Swap the selected linears of ``model`` (on meta, not yet parallelised) for torchao's
    ``Float8Linear`` under ``settings.recipe_name``; returns every linear's decision."""
    if settings.recipe_name == "none":
        return []
    ao_float8 = torchao_float8()
    choices = select_linears(model, settings, tp)
    chosen = {c.fqn for c in choices if c.converted}
    config = ao_float8.Float8LinearConfig.from_recipe_name(settings.recipe_name)
    ao_float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn in chosen)
    return choices


def summary(choices: list[LinearChoice]) -> str:
    """One log line: how many linears compute in float8, and each kept one with its reason."""
    kept = [c for c in choices if not c.converted]
    converted = len(choices) - len(kept)
    reasons: dict[str, list[str]] = {}
    for c in kept:
        reasons.setdefault(c.reason, []).append(c.fqn)
    parts = [
        f"{len(fqns)} kept ({why}): {', '.join(fqns[:3])}{' ...' if len(fqns) > 3 else ''}"
        for why, fqns in reasons.items()
    ]
    return f"{converted} of {len(choices)} linears compute in float8" + ("; " + "; ".join(parts) if parts else "")


__all__ = ["LinearChoice", "check_scaled_mm", "convert_linears", "select_linears", "summary", "torchao_float8"]
