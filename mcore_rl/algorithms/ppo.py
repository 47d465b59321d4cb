"""PPO's critic objective as a pure function over padded [batch, tokens] tensors with a 0/1 action ``mask``.

``values`` are the critic's current predictions (differentiable), ``old_values`` its predictions before this
episode's updates (those GAE used), ``returns`` GAE's targets (:func:`mcore_rl.algorithms.advantages.gae`).
"""

from __future__ import annotations

import torch

from mcore_rl.algorithms.grpo import Share, aggregate


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    share: Share | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss, token-mean: 0.5 max((V - R)^2, (V_clip - R)^2) with V_clip = V_old + clip(V -
    V_old, -clip, clip), which keeps the critic's update near its old predictions (``clip`` 0: the plain squared
    error). Returns (loss, detached metrics: the loss, the fraction of tokens where the clipped term was larger,
    and the mean prediction)."""
    mask = mask.to(values.dtype)
    error = (values - returns) ** 2
    if clip:
        # V itself where it is within the clip (V_old + (V - V_old) may round away from V: the clipped term would
        # then count as larger for an unclipped token)
        delta = values - old_values
        clipped = torch.where(delta.abs() > clip, old_values + delta.clamp(-clip, clip), values)
        clipped_error = (clipped - returns) ** 2
        per_token = 0.5 * torch.maximum(error, clipped_error)
        clip_fraction = aggregate((clipped_error > error).to(values.dtype), mask, "token-mean", share)
    else:
        per_token, clip_fraction = 0.5 * error, torch.zeros((), dtype=values.dtype)
    loss = aggregate(per_token, mask, "token-mean", share)
    metrics = {
        "value_loss": loss,
        "value_clip_fraction": clip_fraction,
        "values_mean": aggregate(values, mask, "token-mean", share),
    }
    return loss, {name: value.detach() for name, value in metrics.items()}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, eps: float = 1e-5) -> float:
    """1 - Var(R - V) / (Var(R) + eps) over the action tokens: 1 for a perfect critic, 0 for one that predicts the
    mean. ``eps`` as verl's: a batch whose returns are all equal (every reward 0, GAE's returns then equal within
    rounding) would otherwise divide by a variance of 1e-16."""
    mask = mask.bool()
    target = returns[mask].double()
    if target.numel() < 2:
        return 0.0
    return float(1 - (target - values[mask].double()).var() / (target.var() + eps))
