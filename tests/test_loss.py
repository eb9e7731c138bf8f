"""The loss head (graph_trainer/loss.py): the vocabulary-parallel cross-entropy against
``F.cross_entropy`` on the whole logits (2 gloo ranks: loss and logits gradient, float32 and bf16,
targets in both ranks' vocabulary ranges and ignored ones), its collectives in a traced graph
(two all_reduces forward, none backward), and the logits layouts it refuses. (The runs: the cpu
suite's tensor-parallel cases against one process, ``tp2_loss_chunks4`` with the chunked loss.)"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graph_trainer.loss import IGNORE_INDEX, token_cross_entropy, vocab_parallel_cross_entropy
from tests.launch import run_forked

ROWS, VOCAB = 24, 40
LOSS_BOUND = 4e-6
"""Per-token loss, absolute: a few float32 ulps of losses below 32 (the sums over the vocabulary
added in another order than one process's log-softmax)."""
GRAD_BOUNDS = {"float32": 2e-6, "bfloat16": 2.0**-7}
"""Logits gradient entries (below 2), absolute: float32 rounding; for bf16 logits one bf16 ulp (the
float32 gradients, a float32 rounding apart, may round to neighbouring bf16 values)."""


def _problem(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [ROWS, VOCAB] with a wide spread, targets in both halves of the vocabulary and two
    ignored, per-token weights of the loss: the upstream gradient), the same on every rank."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(ROWS, VOCAB, generator=g) * 4).to(dtype)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=g)
    targets[:4] = torch.tensor([0, VOCAB // 2 - 1, VOCAB // 2, VOCAB - 1])  # each rank's first and last id
    targets[5], targets[9] = IGNORE_INDEX, IGNORE_INDEX
    weights = torch.rand(ROWS, generator=g) + 0.5
    return logits, targets, weights


@pytest.fixture(scope="module")
def gloo_reports(tmp_path_factory) -> dict[str, list[dict]]:
    """Each rank's report per dtype from one 2-rank launch of ``_worker``."""
    folder = tmp_path_factory.mktemp("vocab_parallel_loss")
    run_forked(2, os.path.abspath(__file__), str(folder), timeout=300)
    return {dtype: [json.loads((folder / f"{dtype}{r}.json").read_text()) for r in range(2)] for dtype in _DTYPES}


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.mark.parametrize("dtype", list(_DTYPES))
def test_vocab_parallel_loss_and_gradient_are_cross_entropys_on_the_whole_logits(gloo_reports, dtype):
    bound = GRAD_BOUNDS[dtype]
    for rank, report in enumerate(gloo_reports[dtype]):
        assert report["grad_dtype"] == dtype, report
        assert report["loss_error"] <= LOSS_BOUND, (rank, report)
        assert report["grad_error"] <= bound, (rank, report)
        assert report["ignored_loss"] == [0.0, 0.0] and report["ignored_grad"] == 0.0, report
        # the bounds are far below what a loss or gradient off by 2x (or missing the one-hot) would show
        assert bound < report["grad_largest"] / 4 and LOSS_BOUND < report["loss_mean"] / 4, report
    assert gloo_reports[dtype][0]["loss"] == gloo_reports[dtype][1]["loss"]  # the same on every rank


def _worker(folder: str) -> None:
    """Under a 2-rank launcher: each rank its half of the vocabulary; the per-token loss weighted
    by ``_problem``'s weights, backward; against ``F.cross_entropy`` on the whole logits."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from graph_trainer.torch_compat import cpu_backend

    dist.init_process_group(cpu_backend())
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for name, dtype in _DTYPES.items():
        logits, targets, weights = _problem(dtype)
        whole = logits.clone().requires_grad_(True)
        reference = F.cross_entropy(whole.float(), targets, reduction="none", ignore_index=IGNORE_INDEX)
        (reference * weights).sum().backward()
        local = logits.chunk(2, dim=-1)[rank].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(local, targets, mesh)
        (loss * weights).sum().backward()
        expected_grad = whole.grad.chunk(2, dim=-1)[rank].float()
        kept = targets != IGNORE_INDEX
        report = {
            "loss": loss.tolist(),
            "loss_error": (loss - reference).abs().max().item(),
            "loss_mean": reference[kept].mean().item(),
            "grad_dtype": str(local.grad.dtype).removeprefix("torch."),
            "grad_error": (local.grad.float() - expected_grad).abs().max().item(),
            "grad_largest": expected_grad.abs().max().item(),
            "ignored_loss": loss[~kept].tolist(),
            "ignored_grad": local.grad[~kept].abs().max().item(),
        }
        with open(os.path.join(folder, f"{name}{rank}.json"), "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def test_traced_vocab_parallel_loss_reduces_twice_forward_and_never_backward():
    """One all_reduce max of the row maxima, one all_reduce sum of the stacked sums and target
    logits; the backward is local (softmax - one-hot on this rank's slice)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.fx.experimental.proxy_tensor import make_fx

    from graph_trainer.fake_trace import fake_world
    from graph_trainer.graph.collectives import ALL_REDUCE, WAIT

    logits, targets, _ = _problem(torch.float32)
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))

        def loss_and_grad(local, targets):
            loss = vocab_parallel_cross_entropy(local, targets, mesh).mean()
            return loss, torch.autograd.grad(loss, local)[0]

        local = logits[:, : VOCAB // 2].clone().requires_grad_(True)
        gm = make_fx(loss_and_grad, tracing_mode="fake")(local, targets)
    reduces = [n for n in gm.graph.nodes if n.target is ALL_REDUCE]
    assert [(n.args[1], tuple(n.meta["val"].shape)) for n in reduces] == [("max", (ROWS,)), ("sum", (2, ROWS))]
    waits = [n for n in gm.graph.nodes if n.target is WAIT]
    assert len(waits) == 2 and all(len(r.users) == 1 for r in reduces)


def test_logits_split_other_than_over_the_vocabulary_are_refused():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from graph_trainer.fake_trace import fake_world

    class Fixed(nn.Module):
        def __init__(self, placement):
            super().__init__()
            self.placement = placement

        def forward(self, rows):
            return DTensor.from_local(rows, self.mesh, [self.placement], run_check=False)

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        for placement in (Replicate(), Shard(0)):
            output = Fixed(placement)
            output.mesh = mesh
            with pytest.raises(ValueError, match=r"split over the vocabulary \(their last dim\) on one mesh dim"):
                token_cross_entropy(torch.randn(1, 4, VOCAB), output, torch.zeros(1, 4, dtype=torch.long))


if __name__ == "__main__":
    _worker(sys.argv[1])
