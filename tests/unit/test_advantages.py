"""Each advantage estimator against an independent reference written from its paper's formula (and, where they
differ, the one verl and OpenRLHF publish, which mcore-rl follows)."""

from __future__ import annotations

import statistics

import pytest
import torch

from mcore_rl.algorithms.advantages import ESTIMATORS, estimate, overlong_penalty

REWARDS = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.5, 0.0, 1.0, 0.25]
TOKENS = [3, 5, 1, 7, 2, 2, 4, 9, 6, 1, 3, 8]  # response tokens per sample
G = 4


def _groups(values):
    return [values[i : i + G] for i in range(0, len(values), G)]


def test_rloo_subtracts_the_mean_of_the_other_samples():
    want = [r - (sum(g) - r) / (G - 1) for g in _groups(REWARDS) for r in g]
    got = estimate("rloo", torch.tensor(REWARDS), G, torch.tensor(TOKENS))
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)
    # verl's form: G / (G - 1) times the group-centred reward
    centred = [(r - statistics.mean(g)) * G / (G - 1) for g in _groups(REWARDS) for r in g]
    assert torch.allclose(got, torch.tensor(centred), atol=1e-6)
    with pytest.raises(ValueError, match="rloo needs at least 2 samples per prompt"):
        estimate("rloo", torch.tensor([1.0, 2.0]), 1, torch.tensor([1, 1]))


def test_reinforce_pp_baseline_whitens_the_group_centred_rewards_over_the_batch_tokens():
    """verl's compute_reinforce_plus_plus_baseline_outcome_advantage: subtract the group mean, broadcast to every
    response token, whiten over the batch's response tokens (unbiased variance). Written here token by token."""
    centred = [r - statistics.mean(g) for g in _groups(REWARDS) for r in g]
    per_token = [a for a, n in zip(centred, TOKENS, strict=True) for _ in range(n)]
    mean, std = statistics.mean(per_token), statistics.stdev(per_token)
    want = [(a - mean) / std for a in centred]
    got = estimate("reinforce_pp_baseline", torch.tensor(REWARDS), G, torch.tensor(TOKENS))
    assert torch.allclose(got, torch.tensor(want), atol=1e-5)
    whitened = [a for a, n in zip(got.tolist(), TOKENS, strict=True) for _ in range(n)]
    assert abs(statistics.mean(whitened)) < 1e-6 and abs(statistics.stdev(whitened) - 1) < 1e-5


def test_grpo_and_dr_grpo_are_the_group_normalised_and_centred_rewards():
    groups = _groups(REWARDS)
    centred = [r - statistics.mean(g) for g in groups for r in g]
    stds = [statistics.stdev(g) for g in groups for _ in g]
    assert torch.allclose(estimate("dr_grpo", torch.tensor(REWARDS), G, torch.tensor(TOKENS)), torch.tensor(centred))
    grpo = [c / (s + 1e-6) for c, s in zip(centred, stds, strict=True)]
    assert torch.allclose(estimate("grpo", torch.tensor(REWARDS), G, torch.tensor(TOKENS)), torch.tensor(grpo))


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_a_constant_group_gets_no_advantage_of_its_own_and_bad_groups_are_refused(name):
    """Every estimator gives a group of equal rewards equal advantages (none of its samples is preferred)."""
    got = estimate(name, torch.tensor(REWARDS), G, torch.tensor(TOKENS)).view(-1, G)
    assert torch.allclose(got[1], got[1, :1].expand(G))
    with pytest.raises(ValueError, match="12 rewards do not split into groups of 5"):
        estimate(name, torch.tensor(REWARDS), 5, torch.tensor(TOKENS))


def test_overlong_penalty_follows_dapos_piecewise_formula():
    """DAPO eq. 13 with L_max = 20 and L_cache = 8, scaled by the penalty 0.5: 0 up to 12 tokens, then
    ((L_max - L_cache) - |y|) / L_cache, down to -1 at L_max."""
    lengths = list(range(0, 21))
    want = [0.5 * (0.0 if n <= 12 else (12 - n) / 8) for n in lengths]
    got = overlong_penalty(torch.tensor(lengths), 20, 8, 0.5)
    assert torch.allclose(got, torch.tensor(want)) and got[-1] == -0.5
