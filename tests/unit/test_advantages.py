"""Each advantage estimator against an independent reference written from its paper's formula (and, where they
differ, the one verl and OpenRLHF publish, which mcore-rl follows)."""

from __future__ import annotations

import statistics

import pytest
import torch

from mcore_rl.algorithms.advantages import (
    ESTIMATORS,
    discounted_returns,
    estimate,
    gae,
    outcome_rewards,
    overlong_penalty,
    reinforce_pp,
    reward_kl,
)

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


# Per-token estimators. Two samples: the first a multi-turn trajectory (an observation of 2 tokens between its
# turns: not actions), the second a plain response; right padding after both.
MASK = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 0, 0, 0]], dtype=torch.float32)
OUTCOME = [1.0, -0.5]
KL = torch.tensor([[0, 0.1, -0.2, 9, 9, 0.3, 0.05, 9], [0, 0, 0.2, 0.1, -0.1, 9, 9, 9]])  # 9: never read
VALUES = torch.tensor([[0, 0.2, 0.4, 9, 9, 0.1, 0.7, 9], [0, 0, -0.3, 0.1, 0.5, 9, 9, 9]])


def _actions(values: torch.Tensor) -> list[list[float]]:
    """Each sample's values at its action tokens, in order: the sequence the paper's formulas run over."""
    rows = zip(values.tolist(), MASK.tolist(), strict=True)
    return [[v for v, m in zip(row, mask, strict=True) if m] for row, mask in rows]


def _whitened(per_sample: list[list[float]]) -> list[list[float]]:
    flat = [v for row in per_sample for v in row]
    mean, std = statistics.mean(flat), statistics.stdev(flat)
    return [[(v - mean) / std for v in row] for row in per_sample]


def _placed(per_sample: list[list[float]]) -> torch.Tensor:
    out = torch.zeros_like(MASK)
    for i, row in enumerate(per_sample):
        out[i, MASK[i].bool()] = torch.tensor(row)
    return out


def _token_rewards(kl_coef: float) -> list[list[float]]:
    """r_t = -kl_coef * kl_t on every action token, plus the outcome on the last one."""
    rewards = [[-kl_coef * k for k in row] for row in _actions(KL)]
    for row, outcome in zip(rewards, OUTCOME, strict=True):
        row[-1] += outcome
    return rewards


def test_outcome_rewards_sit_on_the_last_action_token():
    got = outcome_rewards(torch.tensor(OUTCOME), MASK)
    assert got.tolist() == [[0, 0, 0, 0, 0, 0, 1.0, 0], [0, 0, 0, 0, -0.5, 0, 0, 0]]
    empty = outcome_rewards(torch.tensor([2.0]), torch.zeros(1, 4))  # a filtered sample: no action token
    assert empty.abs().sum() == 0


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_whitens_discounted_returns_over_action_tokens(gamma):
    """REINFORCE++ (Hu et al. 2025, eq. 5-6; OpenRLHF's get_cumulative_returns): G_t = sum_{s >= t} gamma^(s - t)
    r_s over the sample's action tokens, then whitened over all action tokens of the batch (unbiased std)."""
    rewards = _token_rewards(kl_coef=0.05)
    returns = [[sum(gamma ** (s - t) * row[s] for s in range(t, len(row))) for t in range(len(row))] for row in rewards]
    token_rewards = outcome_rewards(torch.tensor(OUTCOME), MASK) - 0.05 * reward_kl(KL, torch.zeros_like(KL), MASK)
    got = reinforce_pp(token_rewards, MASK, gamma)
    assert torch.allclose(got, _placed(_whitened(returns)), atol=1e-5)
    assert torch.allclose(discounted_returns(token_rewards, MASK, gamma), _placed(returns), atol=1e-6)
    assert got[MASK == 0].abs().sum() == 0  # the observation tokens and the padding are no steps


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (1.0, 0.0)])
def test_gae_follows_the_recursion_over_action_tokens(gamma, lam):
    """GAE (Schulman et al. 2016, eq. 16) on each sample's action tokens: delta_t = r_t + gamma V_{t+1} - V_t
    (V after the last token: 0), A_t = sum_l (gamma lam)^l delta_{t+l}; returns A_t + V_t; advantages whitened
    over the batch's action tokens (verl's compute_gae_advantage_return, OpenRLHF's get_advantages_and_returns)."""
    rewards, values = _token_rewards(kl_coef=0.0), _actions(VALUES)
    advantages, returns = [], []
    for r, v in zip(rewards, values, strict=True):
        n = len(r)
        delta = [r[t] + gamma * (v[t + 1] if t + 1 < n else 0.0) - v[t] for t in range(n)]
        a = [sum((gamma * lam) ** (s - t) * delta[s] for s in range(t, n)) for t in range(n)]
        advantages.append(a)
        returns.append([x + y for x, y in zip(a, v, strict=True)])
    got, got_returns = gae(outcome_rewards(torch.tensor(OUTCOME), MASK), VALUES, MASK, gamma, lam)
    assert torch.allclose(got_returns, _placed(returns), atol=1e-5)
    assert torch.allclose(got, _placed(_whitened(advantages)), atol=1e-5)
    if gamma == lam == 1.0:  # Monte Carlo: the return of every action token is the outcome
        assert torch.allclose(got_returns, _placed([[OUTCOME[0]] * 4, [OUTCOME[1]] * 3]))
