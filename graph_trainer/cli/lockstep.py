"""Run one job two ways in lock step and show, step by step, where the two part.

    python -m graph_trainer.cli.lockstep --b "--compile.backend inductor" [--from_same_state] \\
        --job.config_file configs/deepseek_v3_debug.toml --training.steps 20 [--section.key value ...]

One process (CPU, or one GPU). Run A is the job the flags describe; run B is the same job with
the flags of ``--b`` added after them (so they win). Both are built in this process, take every
batch from A's data loader and step together through ``Trainer.train_step`` (the optimizer,
clipping and MoE load balancing of a real run; no metrics or checkpoints are written; each
run's files go to ``<dump_folder>/a`` and ``<dump_folder>/b``). Per step it prints A's loss, B's
loss relative to it, the largest difference between the two runs' gradients (per tensor,
relative to that tensor's largest gradient in A; before clipping) and the L2 distance between
the two sets of parameters after the update.

``--from_same_state``: before each step B's parameters, buffers and AdamW state are set to A's.
Each line then shows what one step of B does differently from one step of A, its own error,
and not the drift that builds up when both run freely. Running a comparison both ways tells
an error that grows (it grows here too) from a trajectory that amplifies a constant one (here
it stays at its first steps' size). This is how the drift of Inductor (regional) from op by
op on debug DeepSeek-V3 was taken apart (docs/numerics.md, "Inductor").
"""

from __future__ import annotations

import math
import shlex
import sys
from dataclasses import dataclass

import torch

from graph_trainer.distributed.parallel_dims import local_tensor  # (one process: a DTensor's local shard is all of it)
from graph_trainer.errors import ConfigError, OneLineError
from graph_trainer.loop.grad_record import relative_deviation


@dataclass
class StepDiff:
    """How run B differed from run A at one step."""

    step: int
    loss_a: float
    loss_b: float
    grad_dev: float
    """max over tensors of max|g_b - g_a| / max|g_a| (0 where a tensor's A gradient is all 0 and B's equals it)."""
    param_dist: float
    """L2 distance between all of A's and all of B's parameters after this step's update."""

    @property
    def loss_dev(self) -> float:
        return relative_deviation(self.loss_b, self.loss_a)

    def line(self) -> str:
        return (
            f"step {self.step:3d}  loss A {self.loss_a:.7f}  B rel dev {self.loss_dev:.2e}  "
            f"grads max rel dev {self.grad_dev:.2e}  params L2 distance {self.param_dist:.3e}"
        )


def _recording(trainer) -> dict:
    """Wrap ``trainer.gradients`` so each step's gradients (summed over its microbatches) are
    kept (a copy: clipping scales them in place)."""
    accumulate, seen = trainer.gradients, {}

    def recorded(microbatches):
        loss, grads = accumulate(microbatches)
        seen["grads"] = [local_tensor(g).detach().clone() for g in grads]
        return loss, grads

    trainer.gradients = recorded
    return seen


def _same_model(cfg_a, cfg_b) -> None:
    """Refuse --from_same_state when B's flags change the model: B's state could not be set to A's."""
    import dataclasses

    a, b = dataclasses.asdict(cfg_a.model), dataclasses.asdict(cfg_b.model)
    changed = [f"model.{k}" for k in a if a[k] != b[k]]
    if changed:
        raise ConfigError(f"--from_same_state needs the same model in both runs; --b changed {', '.join(changed)}")


@torch.no_grad()
def copy_state(src, dst) -> None:
    """Set ``dst``'s parameters, buffers and AdamW state to ``src``'s, in place (the compiled
    step of ``dst`` holds its tensors, so they must stay the same objects)."""
    for (_, a), (_, b) in zip(src.model.named_parameters(), dst.model.named_parameters(), strict=True):
        local_tensor(b).copy_(local_tensor(a))
    for (_, a), (_, b) in zip(src.model.named_buffers(), dst.model.named_buffers(), strict=True):
        b.copy_(a)
    for pa, pb in zip(src.params, dst.params, strict=True):
        state_a, state_b = src.optimizer.state.get(pa, {}), dst.optimizer.state[pb]
        for key, value in state_a.items():
            if isinstance(value, torch.Tensor) and key in state_b:
                local_tensor(state_b[key]).copy_(local_tensor(value))
            else:
                state_b[key] = value.clone() if isinstance(value, torch.Tensor) else value


def _grad_dev(grads_a: list[torch.Tensor], grads_b: list[torch.Tensor]) -> float:
    worst = 0.0
    for ga, gb in zip(grads_a, grads_b, strict=True):
        diff = (gb.float() - ga.float()).abs().max().item()
        scale = ga.float().abs().max().item()
        worst = max(worst, diff / scale if scale else (0.0 if diff == 0 else math.inf))
    return worst


def _param_dist(a, b) -> float:
    total = sum(
        ((local_tensor(pb).double() - local_tensor(pa).double()) ** 2).sum().item()
        for pa, pb in zip(a.params, b.params, strict=True)
    )
    return math.sqrt(total)


def lockstep(cfg_a, cfg_b, from_same_state: bool = False, report=None) -> list[StepDiff]:
    """Train ``cfg_a`` and ``cfg_b`` together for ``cfg_a.training.steps`` steps on A's batches;
    one ``StepDiff`` per step (also passed to ``report`` as it is made)."""
    from graph_trainer.trainer import Trainer

    if from_same_state:
        _same_model(cfg_a, cfg_b)
    a, b = Trainer(cfg_a), Trainer(cfg_b)
    seen_a, seen_b = _recording(a), _recording(b)
    data = iter(a.dataloader)
    diffs = []
    try:
        for step in range(1, cfg_a.training.steps + 1):
            microbatches = [next(data) for _ in range(a.microbatches)]
            if from_same_state:
                copy_state(a, b)
            a.step = b.step = step
            loss_a, _ = a.train_step(microbatches)
            loss_b, _ = b.train_step(microbatches)
            diff = StepDiff(step, loss_a, loss_b, _grad_dev(seen_a["grads"], seen_b["grads"]), _param_dist(a, b))
            diffs.append(diff)
            if report is not None:
                report(diff)
    finally:
        a.metrics.close()
        b.metrics.close()
    return diffs


def _configs(argv: list[str], b_flags: list[str]):
    import os

    from graph_trainer.config_loading import load_config
    from graph_trainer.validation import check_device, validate_config

    dump_folder = load_config(argv).job.dump_folder
    configs = []
    for name, flags in (("a", []), ("b", b_flags)):
        cfg = load_config([*argv, *flags])
        cfg.job.dump_folder = os.path.join(dump_folder, name)
        validate_config(cfg, world_size=1)
        check_device(cfg.job.device)
        configs.append(cfg)
    return configs


def main(argv: list[str] | None = None) -> int:
    import os

    from graph_trainer.config_loading import canonical_flag, take_flag

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            raise ConfigError(
                "graph_trainer.cli.lockstep runs both jobs in one process; run it with python, not torchrun"
            )
        argv, b_flags = take_flag(argv, "--b", None)
        same_state = any(canonical_flag(arg) == "--from_same_state" for arg in argv)
        argv = [arg for arg in argv if canonical_flag(arg) != "--from_same_state"]
        if b_flags is None:
            raise ConfigError("--b is required: the flags that make run B differ from run A, in one quoted string")
        cfg_a, cfg_b = _configs(argv, shlex.split(b_flags))
        mode = "from the same state each step" if same_state else "running freely"
        print(f"A: the job; B: the job with {b_flags}; {cfg_a.training.steps} steps, {mode}", flush=True)
        diffs = lockstep(cfg_a, cfg_b, same_state, report=lambda d: print(d.line(), flush=True))
    except OneLineError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    worst = max(diffs, key=lambda d: d.loss_dev)
    print(
        f"largest loss deviation {worst.loss_dev:.2e} (step {worst.step}); largest gradient deviation "
        f"{max(d.grad_dev for d in diffs):.2e}; final parameter distance {diffs[-1].param_dist:.3e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
