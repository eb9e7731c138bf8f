"""Expert parallelism: MoE tokens travel to the rank holding their expert and back.

The routed experts of a MoE layer are split over the ``ep`` mesh dimension: rank ``r`` of
``ep`` holds experts ``[r * E_local, (r + 1) * E_local)``. ``ExpertParallelDispatcher``
implements the MoE layer's token-dispatcher contract (see ``LocalTokenDispatcher`` in
``models/moe.py``):

- ``dispatch(x_sorted, counts)``: ``x_sorted`` holds this rank's (token, slot) rows sorted by
  global expert id and ``counts`` [E] how many go to each expert. The counts are exchanged
  with an all_to_all (every rank learns how many rows it will receive for each of its local
  experts from each peer), the rows are sent with ``all_to_all_single`` using split sizes
  read from those counts (data-dependent: unbacked symbols in the fake trace), and the
  received rows, grouped by source rank, are regrouped by local expert.
- ``combine(y_local, ctx)``: the inverse: back to source-rank order, the reverse
  all_to_all, and the rows are again this rank's, sorted by global expert id.

Metadata contract (read by graph passes such as ``ep_overlap``; keys and values in
``graph_trainer.graph.tags``). Every node created here carries:

==================  ==========================================================================
``ep_role``         ``count_exchange``: the counts all_to_all, its wait and the split-size reads;
                    ``dispatch``: the token all_to_all and its wait, and the regrouping by expert;
                    ``combine``: the regrouping back and the reverse all_to_all and its wait.
                    (``expert_compute`` is written by the model around its local experts.)
``moe_fqn``         FQN of the MoE module (``layers.3.moe``).
==================  ==========================================================================

The tracer copies ``ep_role`` and ``moe_fqn`` onto the backward nodes that differentiate
these (the backward of a dispatch is an all_to_all tagged ``dispatch``, phase ``backward``).
With ``float8_dtype`` (``float8.dispatch_in_float8``) the forward's dispatch sends its rows in
float8, each row cast as the experts cast it (``models.float8.rows_to_float8_bytes``: float8
values and a float32 scale per row, one ``all_to_all`` of bytes), scaled back to the parameter
dtype on arrival; the other three exchanges (the combine, and both in the backward) move the
parameter dtype. What it changes numerically: ``config.Float8.dispatch_in_float8``.

Regrouping is an exact permutation (``models.common.sorted_copies`` both ways: a row gather in
the forward and, with the inverse permutation, in the backward), so expert parallelism changes no
value: only where the rows are computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from graph_trainer.graph.tags import COMBINE, COUNT_EXCHANGE, DISPATCH, EP_ROLE, MOE_FQN, annotate
from graph_trainer.torch_compat import all_to_all_single, all_to_all_single_autograd
from models.common import inverse_permutation, sorted_copies
from models.float8 import float8_bytes_to_rows, rows_to_float8_bytes


class _Float8Dispatch(torch.autograd.Function):
    """An all_to_all of rows sent in float8 and scaled back on arrival; the reverse exchange of
    their gradients in their own dtype (module docstring)."""

    @staticmethod
    def forward(ctx, rows, receive_splits, send_splits, group, float8_dtype):
        ctx.reverse = (send_splits, receive_splits, group)
        packed = all_to_all_single(rows_to_float8_bytes(rows, float8_dtype), receive_splits, send_splits, group)
        return float8_bytes_to_rows(packed, float8_dtype, rows.dtype)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_single(grad.contiguous(), *ctx.reverse), None, None, None, None


@dataclass
class _DispatchContext:
    order: torch.Tensor
    """Received rows in local-expert order: ``x_local = x_received[order]``."""
    back_to_received: torch.Tensor
    """Its inverse: ``x_received = x_local[back_to_received]``."""
    send_splits: list
    receive_splits: list


class ExpertParallelDispatcher:
    """Token dispatcher over the ``ep`` mesh (see the module docstring for the contract)."""

    def __init__(self, ep_mesh: DeviceMesh, num_experts: int, moe_fqn: str, float8_dtype: torch.dtype | None = None):
        if ep_mesh.ndim != 1:
            raise ValueError("the expert-parallel mesh must be 1-D")
        self.ep_mesh = ep_mesh
        self.ep = ep_mesh.size()
        if num_experts % self.ep != 0:
            raise ValueError(f"{num_experts} experts cannot be split over ep={self.ep}")
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep
        self.moe_fqn = moe_fqn
        self.float8_dtype = float8_dtype
        """Rows to the experts travel in this float8 dtype (module docstring); None: as they are."""

    def _tags(self, role: str) -> dict:
        return {EP_ROLE: role, MOE_FQN: self.moe_fqn}

    def dispatch(self, x_sorted: torch.Tensor, counts: torch.Tensor):
        """Rows for this rank's local experts (sorted by local expert), their counts, a context."""
        group = self.ep_mesh.get_group()
        with annotate(self._tags(COUNT_EXCHANGE)):
            # received[r, e]: rows rank r sends to our local expert e.
            received = all_to_all_single(counts, None, None, group).view(self.ep, self.num_local)
            send_splits = counts.view(self.ep, self.num_local).sum(dim=1).tolist()
            receive_splits = received.sum(dim=1).tolist()
        with annotate(self._tags(DISPATCH)):
            if self.float8_dtype is None:
                x_received = all_to_all_single_autograd(x_sorted, receive_splits, send_splits, group)
            else:
                x_received = _Float8Dispatch.apply(x_sorted, receive_splits, send_splits, group, self.float8_dtype)
            # Rows arrive grouped by source rank, then expert; the experts want them grouped by
            # expert. A stable sort of each row's expert id gives that order.
            block_expert = torch.arange(self.num_local, device=counts.device).repeat(self.ep)
            row_expert = torch.repeat_interleave(block_expert, received.flatten(), output_size=x_received.shape[0])
            order = torch.argsort(row_expert, stable=True)
            back_to_received = inverse_permutation(order)
            x_local = sorted_copies(x_received, order, inverse=back_to_received)
            local_counts = received.sum(dim=0)
        return x_local, local_counts, _DispatchContext(order, back_to_received, send_splits, receive_splits)

    def combine(self, y_local: torch.Tensor, ctx: _DispatchContext) -> torch.Tensor:
        """The expert outputs back on the ranks their tokens came from, sorted by global expert."""
        group = self.ep_mesh.get_group()
        with annotate(self._tags(COMBINE)):
            y_received = sorted_copies(y_local, ctx.back_to_received, inverse=ctx.order)
            return all_to_all_single_autograd(y_received, ctx.send_splits, ctx.receive_splits, group)


__all__ = ["ExpertParallelDispatcher"]
