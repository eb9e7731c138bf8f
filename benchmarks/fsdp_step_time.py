"""Step time of the traced graph with SimpleFSDP vs eager FSDP2, measured in one run.

    torchrun --standalone --nproc_per_node 2 -m benchmarks.fsdp_step_time \
        [--job.config_file configs/llama3_debug.toml] [--section.key value ...]

Run from the repository root (set OMP_NUM_THREADS=1 on CPU so the ranks do not fight
over cores). Every rank holds two copies of the same model:

(a) graph_simplefsdp: ``graph_trainer.trainer.Trainer`` in ``compile.mode = "graph"`` with
    the default layout, SimpleFSDP fully sharded over all ranks; one step is
    ``Trainer.train_step`` (the traced forward + loss + backward with its all-gathers and
    reduce-scatters, grad clipping, AdamW, LR schedule);
(b) eager_fsdp2: the plain LLaMA-3 ``Transformer`` of the same flavor, initialised with
    ``init_weights(seed)`` (the same weights as (a)), wrapped with
    ``torch.distributed.fsdp.fully_shard`` per transformer block and at the root (with the
    job's mixed-precision dtypes and ``parallelism.fsdp_reshard_after_forward``), the
    same AdamW and LR schedule (``graph_trainer.loop.optim``), the same loss
    (``graph_trainer.loss.token_cross_entropy``) and ``torch.nn.utils.clip_grad_norm_``.

Both take the same batches (the Trainer's dataloader, this rank's data-parallel share) and
their steps alternate, one of (a) then one of (b), so both see the same machine noise. A
step is timed on each rank from a barrier to the loss (averaged over ranks) read back as a
Python float, as in ``Trainer.train_step``. After 3 warm-up steps each (the first step of
(a) traces the graph; its trace time is printed separately), the median over the measured
steps of rank 0's times is printed for each, and graph_simplefsdp / eager_fsdp2.

The first measured step's loss of each is printed to show they train the same model. They
agree closely but not bitwise: SimpleFSDP reduce-scatters the gradients of the 1/dp-scaled
loss while FSDP2 divides by dp around its own reduce-scatter, and the two reduce (gradients
and the grad norm) in a different order, so float32 rounding differs.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist

from benchmarks.alternating import time_alternating

WARMUP, MEASURED = 3, 12


def build_eager_fsdp2(trainer):
    """The same model, optimizer and schedule as ``trainer``, sharded with FSDP2 over its dp ranks."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from graph_trainer.loop.optim import build_lr_scheduler, build_optimizer
    from models.llama3.model import Transformer

    cfg, t = trainer.cfg, trainer.cfg.training
    with torch.device(trainer.dist.device):
        model = Transformer(trainer.model_args)
    model.init_weights(t.seed)
    mp = MixedPrecisionPolicy(
        param_dtype=getattr(torch, t.mixed_precision_param), reduce_dtype=getattr(torch, t.mixed_precision_reduce)
    )
    mode = cfg.parallelism.fsdp_reshard_after_forward
    mesh = trainer.mesh["dp_shard"]
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=mode != "never")
    # The head (norm, output) resharded only under 'always', as ours and torchtitan's default do.
    fully_shard([model.norm, model.output], mesh=mesh, mp_policy=mp, reshard_after_forward=mode == "always")
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=mode != "never")
    optimizer = build_optimizer(list(model.parameters()), t)
    return model, optimizer, build_lr_scheduler(optimizer, t)


def main(argv: list[str]) -> int:
    from graph_trainer.config_loading import load_config
    from graph_trainer.distributed.parallel_dims import average_over_dp
    from graph_trainer.loss import token_cross_entropy
    from graph_trainer.trainer import Trainer
    from graph_trainer.validation import validate_config

    world_size = int(os.environ.get("WORLD_SIZE", 1))
    cfg = load_config(argv or ["--job.config_file", "configs/llama3_debug.toml"])
    cfg.compile.mode = "graph"
    cfg.training.steps = WARMUP + MEASURED
    cfg.metrics.enable_tensorboard = False
    cfg.metrics.log_freq = 1000
    validate_config(cfg, world_size=world_size)
    if world_size < 2 or cfg.model.name != "llama3":
        raise SystemExit("run under torchrun with >= 2 processes and a llama3 model")

    with tempfile.TemporaryDirectory() as tmp:
        cfg.job.dump_folder = tmp
        trainer = Trainer(cfg)
        if trainer.dims.fsdp_mode != "fully_shard" or trainer.dims.tp > 1:
            raise SystemExit("this benchmark compares plain FSDP: leave parallelism at its defaults")
        model, optimizer, scheduler = build_eager_fsdp2(trainer)
        t, device = cfg.training, trainer.dist.device
        max_norm = t.max_norm if t.max_norm > 0 else float("inf")  # inf: norm computed, nothing scaled

        def eager_step(tokens: torch.Tensor, labels: torch.Tensor) -> float:
            tokens, labels = tokens.to(device), labels.to(device)
            loss = model(tokens, head=lambda h, output, local: token_cross_entropy(h, output, local(labels)))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            return average_over_dp(loss, trainer.dims).item()

        steps = {"graph_simplefsdp": lambda tk, lb: trainer.train_step([(tk, lb)])[0], "eager_fsdp2": eager_step}
        timings = time_alternating(steps, iter(trainer.dataloader), WARMUP, MEASURED)
        trace_seconds = next(iter(trainer.gradients.step_fn.graphs.values())).trace_seconds
        trainer.metrics.close()

    if trainer.dist.rank == 0:
        graph, eager = (timings.median_ms(n) / 1000 for n in steps)
        first_losses = timings.first_losses
        print(f"model: {cfg.model.name} {cfg.model.flavor}")
        print(f"world size: {world_size} (fully sharded over all ranks), {torch.get_num_threads()} thread(s) per rank")
        print(
            f"batch: {t.local_batch_size} x {t.seq_len} tokens per rank; "
            f"{MEASURED} measured steps each after {WARMUP} warm-up, alternating"
        )
        print(
            f"graph_simplefsdp first step: {timings.first_step_seconds['graph_simplefsdp']:.2f} s, of which trace "
            f"{trace_seconds:.2f} s (not in the median)"
        )
        print(
            f"loss at the first measured step (step {WARMUP + 1}): graph_simplefsdp "
            f"{first_losses['graph_simplefsdp']:.6f}, eager_fsdp2 {first_losses['eager_fsdp2']:.6f}"
        )
        print(f"median step time graph_simplefsdp: {graph * 1000:.1f} ms")
        print(f"median step time eager_fsdp2: {eager * 1000:.1f} ms")
        print(f"graph_simplefsdp/eager_fsdp2: {graph / eager:.3f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
