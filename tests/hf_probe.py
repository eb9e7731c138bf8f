"""Start a job from a Hugging Face folder (``checkpoint.initial_load_hf``) and report what its model computes.

    torchrun --nproc_per_node N tests/hf_probe.py OUT TOKENS [--section.key value ...]

Builds the job's ``Trainer`` (which checks and loads the folder), runs the model forward on the
tokens saved in ``TOKENS`` (``[B, S]`` int64, the same on every rank) and writes
``OUT/rank<R>.json``: the bytes this rank read from the folder, the elements of its own shards
(parameters and persistent buffers, local pieces) and the seconds the load took. Rank 0 also
writes ``OUT/logits.pt`` (the full ``[B, S, vocab]`` float32 logits, gathered from tensor-parallel
shards).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def probe(cfg, tokens: torch.Tensor) -> tuple[torch.Tensor, int, int, float]:
    """(logits, bytes read from the folder, local elements of the state, seconds the load took) of a job
    loading ``cfg``'s folder."""
    from graph_trainer.checkpoint.state import model_tensors
    from graph_trainer.trainer import Trainer

    trainer = Trainer(cfg)
    with torch.no_grad():
        logits = trainer.model(tokens)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    local = sum((v.to_local() if isinstance(v, DTensor) else v).numel() for v in model_tensors(trainer.model).values())
    return logits.float(), trainer.hf_bytes_read, local, trainer.hf_load_seconds


def main(argv: list[str]) -> int:
    from graph_trainer.config_loading import load_config
    from graph_trainer.validation import validate_config

    out, tokens_path, *flags = argv
    cfg = load_config(flags)
    validate_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", 1)))
    logits, nbytes, local, seconds = probe(cfg, torch.load(tokens_path))
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"bytes_read": nbytes, "local_elements": local, "load_seconds": seconds}, f)
    if rank == 0:
        torch.save(logits, os.path.join(out, "logits.pt"))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
