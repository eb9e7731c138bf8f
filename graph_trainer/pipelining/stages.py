"""Which blocks each pipeline stage holds.

A stage is a contiguous range of transformer blocks; the first stage also holds the embedding and
the last the final norm, the output projection and the loss (``models.common.keep_stage``).
``balanced_stage_blocks`` chooses the ranges that make the most expensive stage as cheap as
possible, from a cost per block (e.g. FLOPs per token: DeepSeek-V3's dense and MoE blocks
differ) and the extra cost of the two ends (the output projection and loss of a large
vocabulary are worth several blocks).

``stage_ranges`` takes the user's counts (``parallelism.pp_stage_blocks``) instead when given.

Fails: fewer blocks than stages, a non-positive stage count, or counts that do not fit raise
``ValueError``.
"""

from __future__ import annotations


def balanced_stage_blocks(
    block_costs: list[float], num_stages: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[range]:
    """Contiguous block ranges, one per stage in order, each non-empty, that minimise the largest
    stage cost (the sum of its blocks' costs, plus ``first_extra`` on the first stage and
    ``last_extra`` on the last). Exact (dynamic programming over split points); among equally
    good splits the one whose earlier stages hold fewer blocks wins, so the choice is the same on
    every rank and every run."""
    n = len(block_costs)
    if num_stages < 1:
        raise ValueError(f"the number of pipeline stages must be at least 1, got {num_stages}")
    if n < num_stages:
        raise ValueError(f"{num_stages} pipeline stages need at least {num_stages} blocks; the model has {n}")
    prefix = [0.0]
    for cost in block_costs:
        prefix.append(prefix[-1] + cost)

    def stage_cost(stage: int, start: int, stop: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == num_stages - 1 else 0.0)
        return prefix[stop] - prefix[start] + extra

    # best[s][j]: the smallest largest-stage cost of blocks [0, j) in stages 0..s-1; cut[s][j]: where stage s-1 starts
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):  # stage s-1 holds blocks [i, j); the earliest i wins a tie
                candidate = max(best[s - 1][i], stage_cost(s - 1, i, j))
                if candidate < best[s][j]:
                    best[s][j], cut[s][j] = candidate, i
    ranges, stop = [], n
    for s in range(num_stages, 0, -1):
        start = cut[s][stop]
        ranges.append(range(start, stop))
        stop = start
    return ranges[::-1]


def stage_ranges(blocks_per_stage: str, num_stages: int, block_costs: list[float], last_extra: float) -> list[range]:
    """The block range of every stage: ``blocks_per_stage`` ("3,3,2": one count per stage, in
    order, adding up to the blocks) when given, else ``balanced_stage_blocks``. A wrong
    ``blocks_per_stage`` raises ``ValueError`` naming what was wrong."""
    n = len(block_costs)
    if not blocks_per_stage.strip():
        return balanced_stage_blocks(block_costs, num_stages, last_extra=last_extra)
    try:
        counts = [int(part) for part in blocks_per_stage.split(",")]
    except ValueError:
        raise ValueError(f"{blocks_per_stage!r} is not a comma-separated list of block counts, e.g. '3,3,2'") from None
    if len(counts) != num_stages or any(c < 1 for c in counts) or sum(counts) != n:
        raise ValueError(
            f"{blocks_per_stage!r} must give {num_stages} positive block counts (one per pipeline stage) "
            f"adding up to the model's {n} blocks"
        )
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


__all__ = ["balanced_stage_blocks", "stage_ranges"]
