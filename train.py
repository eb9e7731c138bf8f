"""Entry point: parse the config, build, trace, run passes, train.

    torchrun --nproc_per_node N train.py --job.config_file configs/llama3_debug.toml [--section.key value ...]

User errors (bad config, missing files) print one line and exit with code 2.
"""

from __future__ import annotations

import os
import sys

from graph_trainer.errors import ConfigError, TorchCompatError


def _report(message: str) -> None:
    # Every rank hits the same configuration error; one line from rank 0 is enough.
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from graph_trainer.config import check_device, load_config, validate_config

    try:
        cfg = load_config(argv)
        validate_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", 1)))
        check_device(cfg.job.device)
    except (ConfigError, TorchCompatError) as e:
        _report(str(e))
        return 2

    import torch.distributed as dist

    from graph_trainer.trainer import Trainer

    try:
        trainer = Trainer(cfg)
        trainer.train()
        if dist.is_initialized():
            # Leave together: a rank tearing gloo down while its peer still talks to it
            # can abort the peer at exit ("terminate called without an active exception").
            dist.barrier()
    except (ConfigError, TorchCompatError) as e:  # found while building (checkpoint, a private API, ...)
        _report(str(e))
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # Everything is written and every rank has left the process group. Skip interpreter
        # finalization: gloo worker threads still holding work objects can abort the process
        # there ("terminate called without an active exception", seen rarely on loaded CPUs).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
