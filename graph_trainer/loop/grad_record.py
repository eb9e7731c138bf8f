"""Gradient records: one step's gradients in a form two runs of different layouts can compare.

With ``--debug.grad_record_step N`` the trainer writes ``<dump_folder>/grad_record_step<N>.pt``
at step N, from the gradients the step produced, BEFORE clipping (clipping and AdamW hide a
wrong gradient scale: a layout whose gradients are all doubled trains to losses very close to
the right ones; measured: docs/performance.md). The record holds

* ``norm``: the global L2 norm of the gradients (the ``grad_norm`` the metrics line logs);
* per parameter, by its name in the plain model (``layers.0.attention.wq.weight``): the shape,
  the L2 norm of the full gradient (float64 over the float32 values), and ``SAMPLE_SIZE``
  entries of the full gradient at fixed, evenly spaced positions of the flattened tensor.

Sharded gradients (SimpleFSDP, tensor and expert parallel) are gathered one parameter at a
time (``DTensor.full_tensor``, a collective every rank joins), so every layout records the same
model's gradient; rank 0 writes the file. Cost at that one step: an all-gather of every
gradient, and the memory of the largest full gradient.

``compare_records(record, reference, rtol)`` says what differs: the global norm, each
parameter's norm, and each parameter's sample (relative L2 error of the sample vector), each
within ``rtol``; ``rtol=0`` asks for bitwise equality. Runs of one model on the same global
batch that differ only in how sums are ordered (another layout) agree to float32 rounding;
the cpu suite holds its ``close_to`` cases to ``suites.GRAD_RTOL`` against one process.
``python -m graph_trainer.cli.grad_record RECORD REFERENCE`` compares two files by hand.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from graph_trainer.distributed.simple_fsdp import clean_fqn

SAMPLE_SIZE = 64
"""Entries kept per parameter (all of them for smaller parameters)."""


def record_path(dump_folder: str, step: int) -> str:
    return f"{dump_folder.rstrip('/')}/grad_record_step{step}.pt"


def sample_positions(numel: int) -> torch.Tensor:
    """Evenly spaced flat indices, the first and the last included; the same in every layout."""
    if numel <= SAMPLE_SIZE:
        return torch.arange(numel)
    return torch.linspace(0, numel - 1, SAMPLE_SIZE, dtype=torch.float64).round().long()


def _full(grad: torch.Tensor) -> torch.Tensor:
    full = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return full.detach().float().cpu()


@torch.no_grad()
def gather_record(named_grads: list[tuple[str, torch.Tensor]]) -> dict:
    """The per-parameter part of a record (every rank must call it: it gathers shards).

    ``named_grads``: (parameter name as in ``model.named_parameters()``, its gradient).
    The global norm is added by the caller (``record["norm"]``) once it is known.
    """
    params = {}
    for name, grad in named_grads:
        full = _full(grad)
        flat = full.reshape(-1)
        params[clean_fqn(name)] = {
            "shape": list(full.shape),
            "norm": float(flat.double().norm()),
            "sample": flat[sample_positions(flat.numel())].clone(),
        }
    return {"params": params}


def merge_over(record: dict, group) -> dict:
    """``record`` with the ``params`` of every rank of ``group`` (the pipeline: each rank recorded
    its own stages' parameters); every rank of the group must call it."""
    import torch.distributed as dist

    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, record["params"], group=group)
    return {**record, "params": {name: entry for params in every for name, entry in params.items()}}


def save_record(record: dict, path: str) -> None:
    torch.save(record, path)


def load_record(path: str) -> dict:
    return torch.load(path, weights_only=True)


def relative_deviation(a: float, b: float) -> float:
    """|a - b| / |b|: 0 when equal, infinite when only ``b`` is 0."""
    if a == b:
        return 0.0
    return abs(a - b) / abs(b) if b != 0 else math.inf


def compare_records(record: dict, reference: dict, rtol: float) -> tuple[list[str], float]:
    """(problems, largest relative deviation seen) of ``record`` against ``reference``.

    Checks, each within ``rtol`` (``0``: bitwise): the global norm; for every parameter, the
    norm of its full gradient and the relative L2 error of its sample. A parameter missing on
    either side, or of another shape, is a problem whatever ``rtol``.
    """
    problems: list[str] = []
    worst = relative_deviation(record["norm"], reference["norm"])
    if worst > rtol:
        problems.append(
            f"global gradient norm {record['norm']:.9g} vs {reference['norm']:.9g} (rel {worst:.1e} > {rtol:.0e})"
        )
    ours, theirs = record["params"], reference["params"]
    for name in sorted(ours.keys() ^ theirs.keys()):
        problems.append(f"{name}: only in {'this record' if name in ours else 'the reference'}")
    for name in sorted(ours.keys() & theirs.keys()):
        a, b = ours[name], theirs[name]
        if a["shape"] != b["shape"]:
            problems.append(f"{name}: shape {a['shape']} vs {b['shape']}")
            continue
        norm_dev = relative_deviation(a["norm"], b["norm"])
        ref_size = float(b["sample"].double().norm())
        diff = float((a["sample"].double() - b["sample"].double()).norm())
        sample_dev = 0.0 if diff == 0 else diff / ref_size if ref_size else math.inf
        worst = max(worst, norm_dev, sample_dev)
        if norm_dev > rtol:
            problems.append(
                f"{name}: gradient norm {a['norm']:.9g} vs {b['norm']:.9g} (rel {norm_dev:.1e} > {rtol:.0e})"
            )
        elif sample_dev > rtol:
            problems.append(f"{name}: sampled gradient entries differ (rel L2 {sample_dev:.1e} > {rtol:.0e})")
    return problems, worst
