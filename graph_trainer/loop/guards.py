"""The finite-loss guard: a job never takes an optimizer step from, nor saves, a non-finite state.

* ``check_step(step, loss, grad_norm, named_params)`` runs after the gradients and their global
  norm exist and before the optimizer step. The loss (averaged over data-parallel ranks) and the
  norm (over all ranks) are the same number on every rank, so every rank takes the same decision;
  when either is inf or NaN it finds the first parameter (in the model's order) whose value, else
  whose gradient, is non-finite on any rank, and raises ``NonFiniteError``: one line naming the
  step, what was non-finite and that parameter. Cost per step: two scalars already computed.
* ``check_state(step, tensors)`` runs before a checkpoint is written: every tensor of the state
  (parameters, AdamW moments) must be finite, on every rank. The last optimizer step can make the
  weights non-finite with no loss left to show it (e.g. a huge learning rate at the last step);
  such a state is never saved, so ``load_step -1`` cannot resume from it. Cost: one read of the state.

Every rank raises the same error (a collective picks the first parameter over the ranks), so no
rank is left waiting in a collective the others skipped.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from graph_trainer.distributed.parallel_dims import local_tensor
from graph_trainer.distributed.simple_fsdp import clean_fqn
from graph_trainer.errors import NonFiniteError


def _is_finite(t: torch.Tensor | None) -> bool:
    if t is None:
        return True
    local = local_tensor(t).detach()
    return bool(torch.isfinite(local).all()) if local.is_floating_point() else True


def first_non_finite(items: list[tuple[str, torch.Tensor | None]]) -> str | None:
    """The name of the first item whose (local) tensor is non-finite on any rank (first in item
    order; ranks may hold different items, as pipeline ranks do); collective."""
    index = next((i for i, (_, t) in enumerate(items) if not _is_finite(t)), None)
    mine = (index, items[index][0]) if index is not None else None
    if not (dist.is_available() and dist.is_initialized()):
        return mine[1] if mine else None
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    bad = [f for f in found if f is not None]
    return min(bad)[1] if bad else None


def check_step(step: int, loss: float, grad_norm: float, named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Raise ``NonFiniteError`` on every rank when the step's loss or gradient norm is not finite."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    bad = [f"loss {loss}"] if not math.isfinite(loss) else []
    bad += [f"gradient norm {grad_norm}"] if not math.isfinite(grad_norm) else []
    param = first_non_finite(named_params)
    if param is not None:
        culprit = f"; first non-finite parameter: {clean_fqn(param)} (an earlier update made it so)"
    else:
        grad = first_non_finite([(name, p.grad) for name, p in named_params])
        culprit = f"; first non-finite gradient: {clean_fqn(grad)}" if grad else ""
    raise NonFiniteError(
        f"step {step}: non-finite {' and '.join(bad)}{culprit}; stopped before the optimizer "
        f"step, no checkpoint of this state was written (lower training.lr, check the data)"
    )


def check_state(step: int, tensors: dict[str, torch.Tensor]) -> None:
    """Raise ``NonFiniteError`` on every rank when any tensor of the state to save is not finite."""
    name = first_non_finite(list(tensors.items()))
    if name is not None:
        raise NonFiniteError(
            f"step {step}: the state to checkpoint is not finite (first: {name}); not saved, "
            f"so no checkpoint holds it (lower training.lr)"
        )
