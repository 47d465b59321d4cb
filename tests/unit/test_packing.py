"""The packing plan: every sample once, budgets kept, ranks balanced within one sample, high utilization."""

import random

import pytest

from mcore_rl.packing import plan_packing


def _check(plan, lengths, max_tokens, dp):
    placed = sorted(i for rank in plan.ranks for mb in rank for i in mb)
    assert placed == list(range(len(lengths)))  # each sample exactly once
    assert len(plan.ranks) == dp and len({len(rank) for rank in plan.ranks}) == 1  # same micro-batch count
    tokens = plan.micro_batch_tokens()
    assert max(max(rank) for rank in tokens) <= max_tokens
    per_rank = [sum(rank) for rank in tokens]
    assert max(per_rank) - min(per_rank) <= max(plan.lengths)  # balanced within one sequence


@pytest.mark.parametrize("seed", range(3))
def test_realistic_lengths_pack_at_98_percent_and_balance_ranks(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(32, 2048) for _ in range(512)]
    plan = plan_packing(lengths, max_tokens=16384, dp=4, align=8)
    _check(plan, lengths, 16384, 4)
    assert plan.utilization >= 0.98, plan.utilization
    assert all(n % 8 == 0 for n in plan.lengths)


def test_fewest_micro_batches_and_edge_cases():
    plan = plan_packing([5, 5, 5, 5], max_tokens=10, dp=2)
    assert [len(rank) for rank in plan.ranks] == [1, 1] and plan.utilization == 1.0
    plan = plan_packing([9, 9, 9, 1], max_tokens=10, dp=1)  # 28 tokens but 9s cannot share: 3 micro-batches
    _check(plan, [9, 9, 9, 1], 10, 1)
    assert len(plan.ranks[0]) == 3
    with pytest.raises(ValueError, match="2 data-parallel ranks fill fewer than the 1 micro-batches"):
        plan_packing([3], max_tokens=10, dp=2)  # an empty micro-batch cannot run
    plan = plan_packing([5, 5, 5, 5], max_tokens=10, dp=1, multiple=4)  # interleaved PP=4: groups of 4
    assert [len(mb) for mb in plan.ranks[0]] == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="sample 1 has 11 tokens .* more than max_tokens=10"):
        plan_packing([4, 11], max_tokens=10, dp=1)
