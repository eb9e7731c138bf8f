"""Weights resident for a step: SimpleFSDP's gathers once per step, its gradient reductions once.

With ``parallelism.fsdp_collectives = "per_step"`` a module's data-parallel parameters (those behind
SimpleFSDP's ``ReplicateComputation``) are gathered once, before the step's first microbatch, and
the gathered tensors are kept until its last microbatch's backward: every microbatch computes
with them and differentiates them (not the sharded parameters), so its graph holds no gather and
no gradient reduction. Each microbatch's gradients of the gathered tensors are cast to the reduce
dtype and summed over the step's microbatches, in microbatch order (the first one is the buffer);
after the last one, the sums go through the same reductions the backward of the gather would run
(``ReplicateComputation.reduce``: reduce-scatter over the sharded dim, all-reduce over replicas),
once. Parameters without that parametrization (no data parallelism, or mixed precision alone)
are differentiated directly, as per microbatch.

``ResidentWeights(module)`` says which of a module's parameters are gathered and runs the three
parts eagerly (``compile.mode eager``); ``graph_trainer.compiler.resident`` traces the same three
parts as graphs, so graph and eager compute the same values with the same ops.

Numerics: the gathered tensors are bitwise those each microbatch would gather (same shards, same
cast). The reduction sums over microbatches before summing over ranks instead of after: another
order of the same additions (docs/numerics.md bounds it); with one microbatch it is bitwise the
per-microbatch reduction.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import Shard
from torch.nn.utils import parametrize

from graph_trainer.distributed.simple_fsdp import ReplicateComputation, clean_fqn, owner_fqn


def _gathering_parametrization(module: nn.Module, name: str) -> ReplicateComputation | None:
    """The ``ReplicateComputation`` behind parameter ``name`` of ``module`` (as ``named_parameters``
    spells it), or None when it is not gathered."""
    owner = module.get_submodule(owner_fqn(name))
    attr = clean_fqn(name).rpartition(".")[2]
    if not parametrize.is_parametrized(owner, attr):
        return None
    found = [p for p in owner.parametrizations[attr] if isinstance(p, ReplicateComputation)]
    return found[0] if found else None


class ResidentWeights:
    """Which of ``module``'s parameters are gathered once per step, and the three parts run eagerly.

    ``gathered_index`` / ``direct_index``: positions in ``module.named_parameters()`` of the
    gathered parameters and of the others; every list below follows them."""

    def __init__(self, module: nn.Module):
        self.module = module
        named = list(module.named_parameters())
        self.names = [n for n, _ in named]
        found = [_gathering_parametrization(module, n) for n in self.names]
        self.gathered_index = [i for i, rc in enumerate(found) if rc is not None]
        self.direct_index = [i for i, rc in enumerate(found) if rc is None]
        self.parametrizations: list[ReplicateComputation] = [found[i] for i in self.gathered_index]
        float8 = [rc.param_fqn for rc in self.parametrizations if rc.float8 is not None]
        if float8:  # the step would differentiate float8 data; the configuration refuses it first
            raise ValueError(f"weights gathered in float8 ({float8[0]}, ...) cannot be kept resident for a step")

    @property
    def gathered_names(self) -> list[str]:
        return [clean_fqn(self.names[i]) for i in self.gathered_index]

    def split(self, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the gathered parameters, the others) of ``params`` in ``named_parameters`` order."""
        return [params[i] for i in self.gathered_index], [params[i] for i in self.direct_index]

    def merge(self, gathered: list, direct: list) -> list:
        """The inverse of ``split``: one list in ``named_parameters`` order."""
        out: list = [None] * len(self.names)
        for i, value in zip(self.gathered_index, gathered, strict=True):
            out[i] = value
        for i, value in zip(self.direct_index, direct, strict=True):
            out[i] = value
        return out

    def gather(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gathered local tensors of the gathered parameters (``params``: those, ``split``)."""
        return [rc.gather(p) for rc, p in zip(self.parametrizations, params, strict=True)]

    @contextlib.contextmanager
    def use(self, gathered: list[torch.Tensor]) -> Iterator[None]:
        """While active, the module computes with ``gathered`` instead of gathering its parameters."""
        for rc, tensor in zip(self.parametrizations, gathered, strict=True):
            rc.resident = tensor
        try:
            yield
        finally:
            for rc in self.parametrizations:
                rc.resident = None

    def to_reduce_dtype(self, gathered_grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """A microbatch's gradients of the gathered tensors in the dtype they are summed and reduced in."""
        return [g.to(rc.mp.reduce_dtype) for rc, g in zip(self.parametrizations, gathered_grads, strict=True)]

    def reduce(self, params: list[torch.Tensor], sums: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gathered parameters' gradients from the step's summed gradients of their gathered tensors."""
        return [rc.reduce(p, s) for rc, p, s in zip(self.parametrizations, params, sums, strict=True)]


def resident_bytes(module: nn.Module) -> int:
    """Bytes the rank with the largest pieces holds for the step with weights resident per step:
    every gathered weight in ``param_dtype`` and its gradient sum in ``reduce_dtype`` (the weight
    split only by its inner dim, tp or ep, as ``parallel_dims.largest_local_numel`` splits). Works
    on the meta device."""
    weights = ResidentWeights(module)
    total = 0
    for rc, param in zip(weights.parametrizations, weights.split(list(module.parameters()))[0], strict=True):
        shape = list(param.shape)
        for mesh_dim, placement in enumerate(param.placements):
            if mesh_dim >= rc.dp_dims and isinstance(placement, Shard):
                shape[placement.dim] = -(-shape[placement.dim] // param.device_mesh.size(mesh_dim))
        itemsize = sum(torch.empty((), dtype=d).element_size() for d in (rc.mp.param_dtype, rc.mp.reduce_dtype))
        total += math.prod(shape) * itemsize
    return total


class EagerResidentStep:
    """A step's gathered weights for eager runs: ``gather()`` (or else ``differentiated()`` at the
    step's first microbatch) gathers them and keeps them; ``accumulands`` casts a microbatch's gradients for the sum;
    ``grads(sums)`` reduces the step's sums and forgets the weights."""

    def __init__(self, module: nn.Module):
        self.resident = ResidentWeights(module)
        self.gathered: list[torch.Tensor] | None = None

    def params(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.resident.split([p for _, p in self.resident.module.named_parameters()])

    def gather(self) -> None:
        """Gather the step's weights, unless this step has gathered them already."""
        if self.gathered is None:
            with torch.no_grad():
                self.gathered = self.resident.gather(self.params()[0])

    def differentiated(self) -> tuple[list[torch.Tensor], contextlib.AbstractContextManager]:
        """What a microbatch differentiates (fresh leaves of the gathered weights, then the other
        parameters) and the context its forward runs in (the module computing with those leaves)."""
        self.gather()
        leaves = [g.detach().requires_grad_(True) for g in self.gathered]
        return [*leaves, *self.params()[1]], self.resident.use(leaves)

    def accumulands(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """A microbatch's gradients (``differentiated``'s order) as they are summed over the step."""
        n = len(self.resident.gathered_index)
        return [*self.resident.to_reduce_dtype(grads[:n]), *grads[n:]]

    def grads(self, sums: list[torch.Tensor]) -> list[torch.Tensor]:
        """The step's gradients in ``named_parameters`` order from its summed ``accumulands``."""
        n = len(self.resident.gathered_index)
        gathered_params, _ = self.params()
        with torch.no_grad():
            reduced = self.resident.reduce(gathered_params, sums[:n])
        self.gathered = None
        return self.resident.merge(reduced, sums[n:])


__all__ = ["EagerResidentStep", "ResidentWeights", "resident_bytes"]
