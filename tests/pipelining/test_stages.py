"""Stage ranges: balanced_stage_blocks is the best contiguous split, checked against every split."""

import itertools
import random

import pytest

from graph_trainer.pipelining.stages import balanced_stage_blocks


def _largest(ranges, costs, first_extra, last_extra):
    totals = [sum(costs[i] for i in r) for r in ranges]
    totals[0] += first_extra
    totals[-1] += last_extra
    return max(totals)


def _every_split(n, stages):
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        yield [range(a, b) for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("seed", range(20))
def test_the_split_is_contiguous_complete_and_no_split_is_better(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    stages = rng.randint(1, n)
    costs = [rng.choice([1.0, 1.0, 3.0]) for _ in range(n)]  # dense and MoE blocks
    first_extra, last_extra = rng.choice([0.0, 0.5]), rng.choice([0.0, 2.0])
    ranges = balanced_stage_blocks(costs, stages, first_extra, last_extra)
    assert len(ranges) == stages and all(len(r) > 0 for r in ranges)
    assert [i for r in ranges for i in r] == list(range(n))
    best = min(_largest(split, costs, first_extra, last_extra) for split in _every_split(n, stages))
    assert _largest(ranges, costs, first_extra, last_extra) == best


def test_uniform_blocks_split_evenly_and_the_loss_end_gets_fewer_when_it_costs_more():
    assert balanced_stage_blocks([1.0] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert balanced_stage_blocks([1.0] * 8, 2, last_extra=2.0) == [range(0, 5), range(5, 8)]


def test_fewer_blocks_than_stages_is_refused():
    with pytest.raises(ValueError, match="4 pipeline stages need at least 4 blocks; the model has 3"):
        balanced_stage_blocks([1.0] * 3, 4)
