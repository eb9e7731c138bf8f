"""Weights & Biases as a second home of the scalars TensorBoard gets (``--metrics.enable_wandb``).

``WandbWriter`` is what ``loop.metrics.MetricsLogger`` writes to on rank 0 beside the TensorBoard
writer: one W&B run per start of a job, created in ``<dump_folder>/wandb/`` with the job's resolved
config (every field, as ``<dump_folder>/config.toml`` holds it) as the run's config. A logged
step's scalars are one ``log`` call at that step; the one-off setup numbers (trace and compile
times, the memory estimate) go to the run's summary as ``setup/<name>``, since W&B steps only
increase. The project is ``$WANDB_PROJECT`` (default ``graph_trainer``), the run name
``job.description`` (W&B's own when empty); the rest is W&B's environment: ``WANDB_MODE=offline``
writes the run to disk only (``wandb sync`` uploads it later), ``WANDB_API_KEY``, ``WANDB_ENTITY``.

``wandb`` is an optional dependency: a job asking for it without it installed is refused before
anything is built (``loop.preflight``).
"""

from __future__ import annotations

import os
from typing import Any

DEFAULT_PROJECT = "graph_trainer"


class WandbWriter:
    """One W&B run; ``add_scalars`` per logged step, ``add_setup_scalars`` for one-off numbers."""

    def __init__(self, dump_folder: str, config: dict[str, Any], name: str = ""):
        import wandb

        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT),
            dir=dump_folder,
            config=config,
            name=name or None,
        )

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(dict(scalars), step=step)

    def add_setup_scalars(self, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self._run.summary[f"setup/{tag}"] = value

    def close(self) -> None:
        self._run.finish()


__all__ = ["DEFAULT_PROJECT", "WandbWriter"]
