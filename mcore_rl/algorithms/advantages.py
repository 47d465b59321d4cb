"""Outcome advantage estimators: one advantage per sample from the rewards of its prompt group (consecutive groups
of ``group_size`` samples) and, for batch normalisation, of the whole training batch. Chosen by
``models.policy_trainer.advantage_estimator``; each is a pure function ``(rewards, group_size, tokens)`` where
``tokens`` is each sample's count of response (action) tokens.

- ``grpo``: reward minus the group mean, divided by the group's std (Shao et al. 2024).
- ``dr_grpo``: reward minus the group mean (Liu et al. 2025, "Understanding R1-Zero-like training").
- ``rloo``: reward minus the mean of the *other* samples of its group (Ahmadian et al. 2024), unbiased:
  ``r_i - (sum_g r - r_i) / (G - 1)``, which is ``G / (G - 1)`` times the group-centred reward.
- ``reinforce_pp_baseline``: the group mean subtracted, then whitened over the batch's response tokens (REINFORCE++
  with a baseline, Hu et al. 2025). verl and OpenRLHF whiten the per-token advantages, so a sample weighs by its
  number of tokens in the batch mean and (unbiased) variance; this follows them.
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
    weights = tokens.float()
    count = weights.sum()
    mean = (centred * weights).sum() / count
    variance = ((centred - mean) ** 2 * weights).sum() / (count - 1).clamp(min=1)
    return (centred - mean) * torch.rsqrt(variance + eps)


ESTIMATORS: dict[str, Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp_baseline": reinforce_pp_baseline,
}


def estimate(name: str, rewards: torch.Tensor, group_size: int, tokens: torch.Tensor) -> torch.Tensor:
    """Per-sample advantages by the estimator ``name`` (see :data:`ESTIMATORS`)."""
    return ESTIMATORS[name](rewards, group_size, tokens)


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to each sample's reward: 0 up to
    ``max_new_tokens - buffer`` response tokens, then falling linearly to ``-penalty`` at ``max_new_tokens``."""
    exceed = lengths.float() - (max_new_tokens - buffer)
    return (-exceed / buffer * penalty).clamp(max=0.0)
