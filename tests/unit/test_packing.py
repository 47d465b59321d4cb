"""The packing plan: every sample once, budgets kept, ranks balanced within one sample, high utilization."""

import random

import pytest
import torch

from mcore_rl.trainer.packing import plan_packing, plan_shared_prompts, prompt_groups, share_prompt_rows


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


def test_prompt_groups_are_runs_of_one_prompt():
    tokens = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9, 9], [1, 2, 9, 8], [7, 7, 7, 7]])
    # rows 2-3 share two tokens with rows 0-1 but their prompts are longer; row 4 is alone
    assert prompt_groups(tokens, [3, 3, 3, 3, 2]) == [[0, 1], [2, 3], [4]]


def test_shared_prompt_rows_layout():
    """Two groups in one row: each prompt once, each response without its last token; positions restart after the
    prompt; a response sees its prompt and itself; the prompt's last position predicts every first token."""
    tokens = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 6, 0], [7, 8, 9, 10, 11]])
    lengths, prompts = [5, 4, 5], [3, 3, 2]
    mask = torch.arange(4)[None].expand(3, -1).float()
    batch = share_prompt_rows(tokens, lengths, prompts, [[0, 1], [2]], align=3, mask=mask)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 7, 8, 9, 10, 0]]  # padded to a multiple of 3
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0]]
    assert batch["output_index"].tolist() == [2, 3, 2, 5, 6, 7]
    assert batch["labels"].tolist() == [[4, 5, 6, 9, 10, 11]]
    assert batch["packed_seq_params"].cu_seqlens_q.tolist() == [0, 4, 8, 9]  # two groups and the padding
    visible = ~batch["attention_mask"][0, 0]  # [positions, keys from the group's start]
    assert visible[3].nonzero().flatten().tolist() == [0, 1, 2, 3]  # sample 0's response token: its prompt, itself
    assert visible[7].nonzero().flatten().tolist() == [0, 1, 2, 3]  # group 2's own positions 4-7 only
    assert visible[2].nonzero().flatten().tolist() == [0, 1, 2]  # causal prompt
    assert visible[8].nonzero().flatten().tolist() == [0]  # padding sees itself only
    scores = batch["unpack"](torch.arange(1.0, 7.0)[None])  # scores back at each sample's next-token positions
    assert scores.tolist() == [[0, 0, 1, 2], [0, 0, 3, 0], [0, 4, 5, 6]]
    assert torch.equal(batch["mask"], mask[[0, 1, 2]])


def test_plan_shared_prompts_keeps_groups_whole_and_ranks_even():
    tokens = torch.tensor([[i // 2, 1, 2, 3] for i in range(8)])  # 4 prompts of 1 token, 2 samples each
    plan = plan_shared_prompts(tokens, [4] * 8, [1] * 8, max_tokens=10, dp=2)  # a group: 1 + 2 x 2 positions
    assert [len(rank) for rank in plan] == [1, 1]  # as many micro-batches on every rank
    groups = [g for rank in plan for mb in rank for g in mb]
    assert sorted(groups) == [[0, 1], [2, 3], [4, 5], [6, 7]]
