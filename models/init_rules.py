"""Parameter initialisation described as data, so it can be replayed under any sharding.

A model says *how* each parameter is initialised (``init_rules() -> {fqn: InitRule}``);
the trainer decides *when* and *where*. Every parameter's FULL tensor is drawn from its
own generator, seeded from ``(seed, fqn)`` by ``stable_seed``, and only then sharded, so
the initial weights are the same whatever the parallel layout, the number of processes
or the order in which parameters are visited.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn as nn

_KINDS = ("normal", "trunc_normal", "ones")


@dataclass(frozen=True)
class InitRule:
    """How one parameter is initialised.

    kind: ``"normal"`` (mean 0, ``std``), ``"trunc_normal"`` (mean 0, ``std``, cut at the
        absolute bounds ``a``/``b``) or ``"ones"``.
    std: standard deviation for the two normal kinds (ignored for ``"ones"``).
    a, b: truncation bounds for ``"trunc_normal"``; ``None`` means torch's defaults -2 / 2
        (absolute values, not multiples of ``std``).
    """

    kind: str
    std: float = 0.0
    a: float | None = None
    b: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"InitRule.kind must be one of {_KINDS}, got {self.kind!r}")
        if self.kind != "ones" and self.std <= 0.0:
            raise ValueError(f"InitRule({self.kind!r}) needs std > 0, got {self.std}")


def stable_seed(seed: int, fqn: str) -> int:
    """A 63-bit generator seed from ``(seed, fqn)``, identical in every process and run.

    Python's ``hash()`` of a str is salted per interpreter, so it cannot be used here.
    """
    digest = hashlib.sha256(f"{int(seed)}/{fqn}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def materialize_init(rule: InitRule, shape, dtype: torch.dtype, generator: torch.Generator | None,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """A new tensor of ``shape`` filled according to ``rule``, drawing from ``generator``."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    with torch.no_grad():
        if rule.kind == "ones":
            nn.init.ones_(out)
        elif rule.kind == "normal":
            nn.init.normal_(out, mean=0.0, std=rule.std, generator=generator)
        else:  # trunc_normal
            a = -2.0 if rule.a is None else rule.a
            b = 2.0 if rule.b is None else rule.b
            nn.init.trunc_normal_(out, mean=0.0, std=rule.std, a=a, b=b, generator=generator)
    return out


def draw_parameter(rule: InitRule, fqn: str, shape, seed: int, device: torch.device | str) -> torch.Tensor:
    """The FULL float32 initial value of parameter ``fqn``: from its own generator seeded by
    ``(seed, fqn)``, so it does not depend on sharding, process count or visiting order."""
    generator = torch.Generator(device=device).manual_seed(stable_seed(seed, fqn))
    return materialize_init(rule, shape, torch.float32, generator, device)


@torch.no_grad()
def init_plain_parameters(model: nn.Module, rules: dict[str, InitRule], seed: int) -> None:
    """Initialise a plain (unsharded, materialised) model in place, exactly as the trainer does."""
    for fqn, param in model.named_parameters():
        param.copy_(draw_parameter(rules[fqn], fqn, param.shape, seed, param.device))


__all__ = ["InitRule", "draw_parameter", "init_plain_parameters", "materialize_init", "stable_seed"]
