"""Run under torchrun (4 gloo ranks) by test_transformer_block_bucketing.py: does a parameter's
reduce-scatter inside a bucket sum its elements exactly as its own reduce-scatter does?

Prints one line per bucket: ``<sizes> unpadded=<all members bitwise> padded=<all members bitwise>``
(rank 0, with every rank's verdict folded in), padding as ``ring_aligned_row`` says.
"""

import torch
import torch.distributed as dist

from graph_trainer.compiler.passes.bucket_merge import ring_aligned_row
from graph_trainer.torch_compat import cpu_backend

BUCKETS = [[65536, 1024, 256, 147456, 512, 81920], [32768, 512, 64, 65536], [2**20, 6]]


def member_equal(parts: list[torch.Tensor], alone: list[torch.Tensor], pad: int, world: int) -> bool:
    rows = parts + ([torch.zeros(world, pad)] if pad else [])
    out = torch.empty(sum(r.shape[1] for r in rows))
    dist.reduce_scatter_tensor(out, torch.cat(rows, 1).reshape(-1))
    pieces = out.split([p.shape[1] for p in parts] + ([pad] if pad else []))
    # the padding's piece (last, when there is one) has no member to compare with
    return all(torch.equal(a, b) for a, b in zip(pieces[: len(alone)], alone, strict=True))


def main() -> None:
    dist.init_process_group(cpu_backend())  # the trainer's CPU backend
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(11 + rank)
    for sizes in BUCKETS:
        # magnitudes over 6 decades, so that the order of the sums shows in the last bits
        parts = [
            torch.randn(world, n, generator=g) * 10.0 ** torch.randint(-3, 3, (world, n), generator=g) for n in sizes
        ]
        alone = []
        for p in parts:
            out = torch.empty(p.shape[1])
            dist.reduce_scatter_tensor(out, p.reshape(-1).clone())
            alone.append(out)
        pad = ring_aligned_row(sum(sizes), world, 4) - sum(sizes)
        verdict = torch.tensor(
            [member_equal(parts, alone, 0, world), member_equal(parts, alone, pad, world)], dtype=torch.int32
        )
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
        if rank == 0:
            print(f"{sizes} pad={pad} unpadded={bool(verdict[0])} padded={bool(verdict[1])}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
