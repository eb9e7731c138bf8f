"""Data-parallel ranks and the rows they read (graph_trainer/distributed/parallel_dims.py ``dp_rank``,
as the trainer's data loaders use it): under DDP, HSDP and FSDP x TP every data-parallel rank reads
rows of its own, together exactly the global batch one process reads, and tensor-parallel peers
read the same rows.

Each rank's mesh is built in this process on a fake process group of the job's world size (the
mesh coordinates are the real ones; no collective runs), and its loaders are the trainer's own
(``trainer.job_dataloader``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from graph_trainer.build import build_layout
from graph_trainer.config_loading import load_config
from graph_trainer.torch_compat import clear_dtensor_sharding_caches, fake_store
from graph_trainer.trainer import job_dataloader
from tests.launch import FAST_ARGS

LOCAL_BATCH = 2
BATCHES = 2

LAYOUTS = {
    # name: (world size, flags, tp)
    "ddp2": (2, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1"], 1),
    "hsdp2x2": (4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"], 1),
    "fsdp2xtp2": (4, ["--parallelism.dp_shard", "2", "--parallelism.tp", "2"], 2),
    "hsdp2x2xtp2": (8, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2", "--parallelism.tp", "2"], 2),
}


@contextlib.contextmanager
def _as_rank(rank: int, world_size: int) -> Iterator[None]:
    """This process as rank ``rank`` of a fake process group of ``world_size`` ranks."""
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        clear_dtensor_sharding_caches()  # (the next rank's meshes are its own)


def _rows_read(world_size: int, *flags: str, held_out: bool = False) -> torch.Tensor:
    """The first ``BATCHES`` batches' tokens a rank's trainer loader reads, [BATCHES, rows, seq_len]."""
    cfg = load_config([*FAST_ARGS, "--training.seq_len", "16", *flags])
    loader = job_dataloader(cfg, build_layout(cfg, world_size, "cpu"), held_out=held_out)
    return torch.stack([next(loader)[0] for _ in range(BATCHES)])


def _positions(rows: torch.Tensor, global_batch: torch.Tensor) -> list[list[int]]:
    """Per batch, where each of a rank's ``rows`` stands in one process's ``global_batch`` (-1: nowhere)."""
    positions = []
    for mine, every in zip(rows, global_batch, strict=True):
        index = {tuple(row.tolist()): i for i, row in enumerate(every)}
        positions.append([index.get(tuple(row.tolist()), -1) for row in mine])
    return positions


@pytest.mark.parametrize("held_out", [False, True], ids=["training", "held_out"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_data_parallel_ranks_share_out_one_process_global_batch(layout, held_out):
    world_size, flags, tp = LAYOUTS[layout]
    dp = world_size // tp
    per_rank = []
    for rank in range(world_size):
        with _as_rank(rank, world_size):
            per_rank.append(
                _rows_read(world_size, *flags, "--training.local_batch_size", str(LOCAL_BATCH), held_out=held_out)
            )
    global_batch = _rows_read(1, "--training.local_batch_size", str(LOCAL_BATCH * dp), held_out=held_out)
    assert all(len({tuple(row.tolist()) for row in batch}) == len(batch) for batch in global_batch)  # rows differ
    # The mesh is row-major (dp_replicate, dp_shard, tp): rank // tp is the data-parallel index,
    # replicate-major, and the ranks of one index are tensor-parallel peers. Data-parallel index i
    # reads the global batch's rows [i * LOCAL_BATCH, (i + 1) * LOCAL_BATCH), every step.
    read = {rank: _positions(rows, global_batch) for rank, rows in enumerate(per_rank)}
    expected = {
        rank: [list(range(rank // tp * LOCAL_BATCH, (rank // tp + 1) * LOCAL_BATCH))] * BATCHES for rank in read
    }
    assert read == expected
