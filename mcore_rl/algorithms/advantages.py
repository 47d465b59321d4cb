"""Advantage estimators, chosen by ``models.policy_trainer.advantage_estimator``.

Outcome estimators (:data:`ESTIMATORS`) give one advantage per sample from the rewards of its prompt group
(consecutive groups of ``group_size`` samples) and, for batch normalisation, of the whole training batch; each is a
pure function ``(rewards, group_size, tokens)`` where ``tokens`` is each sample's count of response (action) tokens.

- ``grpo``: reward minus the group mean, divided by the group's std (Shao et al. 2024).
- ``dr_grpo``: reward minus the group mean (Liu et al. 2025, "Understanding R1-Zero-like training").
- ``rloo``: reward minus the mean of the *other* samples of its group (Ahmadian et al. 2024), unbiased:
  ``r_i - (sum_g r - r_i) / (G - 1)``, which is ``G / (G - 1)`` times the group-centred reward.
- ``reinforce_pp_baseline``: the group mean subtracted, then whitened over the batch's response tokens (REINFORCE++
  with a baseline, Hu et al. 2025). verl and OpenRLHF whiten the per-token advantages, so a sample weighs by its
  number of tokens in the batch mean and (unbiased) variance; this follows them.

Token estimators (:data:`TOKEN_ESTIMATORS`) give one advantage per response token from per-token rewards: the
outcome reward on a sample's last action token plus, optionally, a KL penalty on every token. Tensors are
[samples, positions] with a 0/1 action ``mask``; positions outside it (padding, prompt, a multi-turn trajectory's
observation tokens) are not steps of the return: they get 0 and the return passes over them unchanged.

- ``reinforce_pp``: discounted returns, whitened over the batch's action tokens (REINFORCE++, Hu et al. 2025;
  OpenRLHF's ``get_cumulative_returns`` then whitening).
- ``gae``: generalised advantage estimation against a critic's values (Schulman et al. 2016), advantages whitened
  over the batch's action tokens as verl and OpenRLHF do; the returns (advantage + value, before whitening) are
  the critic's targets.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mcore_rl.algorithms.grpo import group_advantages


def grpo(rewards: torch.Tensor, group_size: int, tokens: torch.Tensor) -> torch.Tensor:
    return group_advantages(rewards, group_size, normalize_std=True)


def dr_grpo(rewards: torch.Tensor, group_size: int, tokens: torch.Tensor) -> torch.Tensor:
    return group_advantages(rewards, group_size, normalize_std=False)


def rloo(rewards: torch.Tensor, group_size: int, tokens: torch.Tensor) -> torch.Tensor:
    if group_size < 2:
        raise ValueError("rloo needs at least 2 samples per prompt (models.policy.num_inference_per_prompt)")
    return group_advantages(rewards, group_size, normalize_std=False) * group_size / (group_size - 1)


def reinforce_pp_baseline(
    rewards: torch.Tensor, group_size: int, tokens: torch.Tensor, eps: float = 1e-8
) -> torch.Tensor:
    centred = group_advantages(rewards, group_size, normalize_std=False)
    return whiten(centred, tokens.float(), eps)


def whiten(values: torch.Tensor, weights: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``values`` minus their ``weights``-weighted mean, divided by the weighted (unbiased) std: with a 0/1 token
    mask as weights, whitening over the masked tokens; with token counts, over each sample's tokens at once."""
    count = weights.sum()
    mean = (values * weights).sum() / count
    variance = ((values - mean) ** 2 * weights).sum() / (count - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(variance + eps)


ESTIMATORS: dict[str, Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp_baseline": reinforce_pp_baseline,
}


def outcome_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sample's reward on its last action token, 0 elsewhere ([samples, positions])."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask.bool(), positions, -1).max(dim=1).values
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = (last >= 0).nonzero().squeeze(1)
    out[rows, last[rows]] = rewards.float()[rows]
    return out


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_next over action tokens, G_next the return of the next action token (0 after the last)."""
    out = torch.zeros_like(token_rewards, dtype=torch.float32)
    running = torch.zeros(mask.shape[0], device=mask.device)
    for t in reversed(range(mask.shape[1])):
        act = mask[:, t].bool()
        running = torch.where(act, token_rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(act, running, 0.0)
    return out


def reinforce_pp(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++'s per-token advantages: discounted returns whitened over the batch's action tokens."""
    mask = mask.float()
    return whiten(discounted_returns(token_rewards, mask, gamma), mask) * mask


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over action tokens: delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next (V_next, A_next:
    the next action token's, 0 after the last). Returns (advantages whitened over the batch's action tokens,
    returns A_t + V_t for the critic), both 0 off the mask."""
    mask = mask.float()
    advantages = torch.zeros_like(mask)
    next_value = torch.zeros(mask.shape[0], device=mask.device)
    running = torch.zeros_like(next_value)
    for t in reversed(range(mask.shape[1])):
        act = mask[:, t].bool()
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(act, delta + gamma * lam * running, running)
        next_value = torch.where(act, values[:, t], next_value)
        advantages[:, t] = torch.where(act, running, 0.0)
    returns = (advantages + values) * mask
    return whiten(advantages, mask) * mask, returns


def reward_kl(old_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The k1 estimate of KL(policy || reference) per action token, log pi_old - log pi_ref: the penalty REINFORCE++
    and PPO fold into the per-token reward (times ``reward_kl_coef``)."""
    return (old_logp - ref_logp) * mask


TOKEN_ESTIMATORS = ("reinforce_pp", "gae")


def estimate(name: str, rewards: torch.Tensor, group_size: int, tokens: torch.Tensor) -> torch.Tensor:
    """Per-sample advantages by the estimator ``name`` (see :data:`ESTIMATORS`)."""
    return ESTIMATORS[name](rewards, group_size, tokens)


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to each sample's reward: 0 up to
    ``max_new_tokens - buffer`` response tokens, then falling linearly to ``-penalty`` at ``max_new_tokens``."""
    exceed = lengths.float() - (max_new_tokens - buffer)
    return (-exceed / buffer * penalty).clamp(max=0.0)
