"""The loss on held-out data during training (``[validation]``): forward only, every layout.

``HeldOutLoss(cfg, layout, model, loader, device)`` is called after a step's update when
``due(step)`` (step 1 and every ``validation.freq``); it returns (loss, perplexity):

- the batches: the first ``validation.steps`` batches of ``loader`` (built by the trainer from
  ``validation.dataset`` and ``validation.split``, sharded over the data-parallel ranks as the
  training loader is), rewound before every validation, so every validation of a run sees the
  same tokens;
- each batch's loss is the models' loss head (the mean token cross-entropy, ``training.loss_chunks``
  blocks) of the model run op by op under ``torch.no_grad()``, in graph jobs too (no trace): the
  same module calls as an eager training step's forward. Under pipeline parallel the batches are
  the microbatches of a forward-only pipeline (``pipelining.forward_only``) over this rank's
  stages, and the last stage's loss sum is shared with every pipeline rank;
- the loss is the sum of this rank's batch losses in order, divided by ``validation.steps``, then
  averaged over the data-parallel ranks (``average_over_dp``); the perplexity is its exp.

Numerics: on one process (or a pipeline without data parallelism) the value is bitwise what an
offline eager forward of the same weights computes on the same batches with the same sums; over
data-parallel ranks each rank's forward is its share of the batch, and the mean is taken over
ranks (within float rounding of one process). The model's state is not changed: every buffer a
forward writes (DeepSeek-V3's routed-token counts, which steer the next update's expert bias) is
restored afterwards.

Held-out data that is training data (``validation.held_out_training_data``: ``validation.split``
'train' of the synthetic corpus, a local file's rows again) is refused before anything is built
when the user did not choose it; when they did (``validation.dataset`` or ``validation.split``
set), one warning at start says so.

Fails: nothing of its own; a loader or collective error propagates.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from graph_trainer.build import JobLayout, stage_modules
from graph_trainer.compiler.tracer import loss_head
from graph_trainer.config import JobConfig
from graph_trainer.distributed.parallel_dims import average_over_dp, pp_group
from graph_trainer.pipelining.executor import run_pipeline
from graph_trainer.pipelining.forward_only import ForwardOnlyRunner, forward_only_plan
from graph_trainer.validation import held_out_training_data

logger = logging.getLogger("graph_trainer")


class HeldOutLoss:
    """Validation of one job (module docstring). ``loader``: an endless iterator of (tokens,
    labels) CPU batches with ``state_dict`` / ``load_state_dict`` (``data.loader.TokenBatchLoader``)."""

    def __init__(self, cfg: JobConfig, layout: JobLayout, model: nn.Module, loader, device: torch.device):
        self.settings, self.loss_chunks = cfg.validation, cfg.training.loss_chunks
        training_data = held_out_training_data(cfg)
        if training_data:  # (chosen by the user: validate_config refuses it otherwise)
            logger.warning("validation reads training data: %s; its loss is no held-out loss", training_data)
        self.layout, self.model, self.loader, self.device = layout, model, loader, device
        self.start = loader.state_dict()
        self.pipeline = layout.pipeline
        self.runners: dict[int, ForwardOnlyRunner] = {}
        if self.pipeline is not None:
            last = self.pipeline.last_stage
            modules = stage_modules(model, self.pipeline)
            self.runners = {s: ForwardOnlyRunner(m, s == last, self.loss_chunks) for s, m in modules.items()}
            self.plan = forward_only_plan(self.pipeline.plan, self.settings.steps)
            self.group = pp_group(layout.mesh, layout.dims)

    def due(self, step: int) -> bool:
        return step == 1 or step % self.settings.freq == 0

    def __call__(self) -> tuple[float, float]:
        """(loss, perplexity) of the held-out batches with the current weights."""
        self.loader.load_state_dict(self.start)
        batches = [next(self.loader) for _ in range(self.settings.steps)]
        batches = [(t.to(self.device), lab.to(self.device)) for t, lab in batches]
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        try:
            total = self._pipeline_sum(batches) if self.pipeline is not None else self._sum(batches)
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
        loss = average_over_dp(total / self.settings.steps, self.layout.dims).item()
        return loss, math.exp(loss) if loss < 700 else math.inf

    def _sum(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        total = None
        with torch.no_grad():
            for tokens, labels in batches:
                loss = self.model(tokens, head=loss_head(labels, self.loss_chunks))
                total = loss if total is None else total + loss
        return total

    def _pipeline_sum(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        tokens, labels = [t for t, _ in batches], [lab for _, lab in batches]
        dim, dtype = self.layout.model_args.dim, self.layout.mp.param_dtype

        def make_hidden() -> torch.Tensor:
            return torch.empty(*tokens[0].shape, dim, dtype=dtype, device=self.device)

        losses = run_pipeline(self.plan, self.pipeline.rank, self.runners, tokens, labels, self.group, make_hidden)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for loss in losses:  # (the last stage's, in microbatch order; other ranks add 0)
            total = total + loss
        dist.all_reduce(total, group=self.group)
        return total


__all__ = ["HeldOutLoss"]
