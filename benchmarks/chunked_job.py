"""One-process ``train.py`` with ep_overlap's chunking and without ep_overlap: what chunking costs.

    python3 -m benchmarks.chunked_job [train.py flags ...]

ep_overlap hides expert-parallel all_to_alls behind the other chunk's compute. It refuses
``parallelism.ep`` 1 (there is no all_to_all to hide) and its model preparation selects only
modules holding an expert-parallel MoE, so one process cannot run it. What one process can
measure is the chunking it installs: this job builds the ``Trainer`` of the flags (one process,
``world_size`` 1), then makes the modules ``compile.ep_overlap.module_fqn`` selects that hold a
MoE run as two chunks along ``compile.ep_overlap.chunk_dim`` (``graph_trainer.distributed.chunking``, the
call ep_overlap's ``prepare_model`` makes), before the first step traces the model. The graph is
what ep_overlap's chunked twin (``compile.ep_overlap.reorder = false``) traces, without the
all_to_alls; everything else (memory policy, backend, logs, ``metrics.jsonl``) is the trainer's.

Exit codes as ``train.py``: 2 for the configuration (one line: ``error: ...``; also a selection
that matches no module holding a MoE, or ``seq`` chunks of modules that are not MoE layers), 1
for a job that failed while running.
"""

from __future__ import annotations

import sys

from graph_trainer.compiler.passes.ep_overlap import chunk_selected_modules
from graph_trainer.errors import OneLineError


def _is_moe(module) -> bool:
    return hasattr(module, "token_dispatcher")


def chunk_moe_modules(model, settings) -> list[str]:
    """Install two-chunk execution on the modules ``settings`` (``compile.ep_overlap``) selects
    that hold a MoE layer, expert-parallel or not (module docstring); returns their FQNs."""
    return chunk_selected_modules(model, settings, _is_moe, "a MoE")


def main(argv: list[str] | None = None) -> int:
    from graph_trainer.config import EpOverlap
    from graph_trainer.config_loading import load_config
    from graph_trainer.loop.preflight import preflight
    from graph_trainer.trainer import Trainer
    from graph_trainer.validation import check_device, validate_config

    try:
        cfg = load_config(argv)
        # The ep_overlap settings are this job's own (it chunks the modules itself, below, without
        # the pass they belong to): set aside while the job is validated, checked by the chunking.
        chunking, cfg.compile.ep_overlap = cfg.compile.ep_overlap, EpOverlap()
        validate_config(cfg, world_size=1)
        cfg.compile.ep_overlap = chunking
        check_device(cfg.job.device)
        preflight(cfg)
        trainer = Trainer(cfg)
        selected = chunk_moe_modules(trainer.model, cfg.compile.ep_overlap)
        trainer.logger.info(
            "chunked_job: %d modules run as 2 chunks along %s (%s ...), in traced order",
            len(selected),
            cfg.compile.ep_overlap.chunk_dim,
            selected[0],
        )
        trainer.train()
    except OneLineError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
