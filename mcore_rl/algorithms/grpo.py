"""GRPO/GSPO/CISPO math as pure functions over padded [batch, tokens] tensors with a 0/1 response ``mask``.

Nothing here knows about ranks, devices or models: the trainer computes log-probs and calls these per micro-batch.
Conventions: ``logp`` is the current policy's log-prob of each response token (differentiable), ``old_logp`` the
policy's before this episode's updates, ``ref_logp`` the reference model's, ``rollout_logp`` the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6):
    """Per-sample advantage: reward minus its prompt group's mean, divided by the group's std (GRPO) or not
    (``normalize_std=False``, Dr.GRPO). ``rewards`` holds consecutive groups of ``group_size`` samples."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.float().view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (groups.std(dim=1, keepdim=True) + eps)
    return centered.view(-1)


def constant_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which prompt groups have all-equal rewards (no learning signal): bool [num_groups]."""
    groups = rewards.view(-1, group_size)
    return (groups == groups[:, :1]).all(dim=1)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || ref) per token: exp(r) - r - 1 with r = ref_logp - logp (>= 0)."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1


def token_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """GRPO's per-token importance ratio pi/pi_old."""
    return torch.exp(logp - old_logp)


def sequence_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence ratio s_i = exp(mean_t (logp - old_logp)), broadcast to every token.

    Written as sg[s_i] * pi_t / sg[pi_t] so its value is s_i on every token while each token's gradient is
    s_i * grad log pi_t / |y_i| after token-mean aggregation within the sequence (the GSPO-token form).
    """
    lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    seq_log_ratio = ((logp - old_logp) * mask).sum(dim=-1, keepdim=True) / lengths
    return torch.exp(seq_log_ratio.detach() + logp - logp.detach()).expand_as(logp)


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic clipped objective as a per-token loss, with separate low/high clip (clip-higher).

    ``advantages`` is [batch] (one per sequence) or per token. Returns (loss, clipped) where ``clipped`` marks
    tokens whose gradient the clip removed.
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == ratio.dim() - 1 else advantages
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped)


def cispo_surrogate(
    ratio: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO's per-token loss (MiniMax-M1, 2025): ``-sg(clip(ratio)) * A * logp``. The importance weight is clipped
    and detached instead of the update, so every token keeps a gradient (PPO's clip drops those outside the band).
    Returns (loss, clipped) where ``clipped`` marks tokens whose weight the clip changed."""
    adv = advantages.unsqueeze(-1) if advantages.dim() == ratio.dim() - 1 else advantages
    weight = ratio.clamp(1 - clip_low, 1 + clip_high)
    return -weight.detach() * adv * logp, (weight != ratio)


def _token_clip(config, logp, old_logp, advantages, mask):
    ratio = token_ratio(logp, old_logp)
    return (ratio, *clipped_surrogate(ratio, advantages, config.clip_low, config.clip_high))


def _sequence_clip(config, logp, old_logp, advantages, mask):
    ratio = sequence_ratio(logp, old_logp, mask)
    return (ratio, *clipped_surrogate(ratio, advantages, config.clip_low, config.clip_high))


def _cispo(config, logp, old_logp, advantages, mask):
    ratio = token_ratio(logp, old_logp)
    return (ratio, *cispo_surrogate(ratio, logp, advantages, config.clip_low, config.clip_high))


# The policy losses by ``algorithm``: (ratio, per-token loss, clipped) of a micro-batch. A new loss is a function
# here and its line in this table.
LOSSES = {"grpo": _token_clip, "gspo": _sequence_clip, "cispo": _cispo}


def tis_weight(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance-sampling weight min(pi_old / pi_rollout, cap) per token: corrects for the rollout
    engine sampling from slightly different probabilities than the trainer computes (no gradient)."""
    return torch.exp(old_logp - rollout_logp).clamp(max=cap).detach()


def sequence_mis_keep(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """Sequence-level masked importance sampling: 1 for the sequences whose geometric-mean ratio
    exp(mean_t (old_logp - rollout_logp)) over their response tokens lies in [low, high], else 0 ([batch, 1]): a
    sequence the engine sampled from a visibly different distribution than the trainer's leaves the loss."""
    lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(((old_logp - rollout_logp) * mask).sum(dim=-1, keepdim=True) / lengths)
    return ((ratio >= low) & (ratio <= high)).to(old_logp.dtype)


def icepop_keep(old_logp: torch.Tensor, rollout_logp: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """IcePop's token rejection (Ring-1T, 2025): 1 for the tokens whose ratio pi_old / pi_rollout lies in
    [low, high], else 0: a token the two compute too differently gets no gradient, rather than a capped weight."""
    ratio = torch.exp(old_logp - rollout_logp)
    return ((ratio >= low) & (ratio <= high)).to(old_logp.dtype)


LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


@dataclass(frozen=True)
class Share:
    """A training batch's response tokens and sequences divided by (micro-batches x data-parallel ranks).

    Megatron averages micro-batch losses over micro-batches and ranks. Dividing each micro-batch's sums by these
    shares, instead of by its own counts, makes that average the exact mean over the whole batch: the loss and
    its gradient then do not depend on how samples are grouped (micro-batch size, packing, parallel layout).
    """

    tokens: float
    sequences: float

    @classmethod
    def of(cls, mask: torch.Tensor, micro_batches: int, ranks: int) -> Share:
        parts = micro_batches * ranks
        return cls(tokens=max(float(mask.sum()), 1.0) / parts, sequences=mask.shape[0] / parts)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, share: Share | None = None) -> torch.Tensor:
    """Reduce per-token ``values`` over response tokens.

    token-mean: mean over all tokens of the batch (long responses weigh more);
    seq-mean-token-sum: per-sequence sum, then mean over sequences (Dr.GRPO);
    seq-mean-token-mean: per-sequence mean, then mean over sequences (the original GRPO).
    Means are over ``values`` alone, or, given the batch's ``share``, the micro-batch's part of the batch mean.
    """
    mask = mask.to(values.dtype)
    tokens = share.tokens if share else mask.sum().clamp(min=1)
    sequences = share.sequences if share else mask.shape[0]
    if mode == "token-mean":
        return (values * mask).sum() / tokens
    per_seq = (values * mask).sum(dim=-1)
    if mode == "seq-mean-token-sum":
        return per_seq.sum() / sequences
    if mode == "seq-mean-token-mean":
        return (per_seq / mask.sum(dim=-1).clamp(min=1)).sum() / sequences
    raise ValueError(f"loss aggregation {mode!r}: expected token-mean, seq-mean-token-sum or seq-mean-token-mean")


@dataclass
class PolicyLossConfig:
    # "grpo": PPO's clip of token ratios; "gspo": of sequence ratios; "cispo": clipped, detached token weights
    algorithm: str = "grpo"
    clip_low: float = 0.2  # ratio floor 1 - clip_low
    clip_high: float = 0.28  # ratio ceiling 1 + clip_high (clip-higher keeps low-probability tokens learning)
    kl_coef: float = 0.0  # weight of k3 KL to the reference; 0 skips the reference model's log-probs
    entropy_coef: float = 0.0  # entropy bonus weight
    loss_agg: str = "token-mean"
    tis: bool = True  # truncated importance sampling against the rollout engine's log-probs
    tis_cap: float = 2.0
    # Train-inference mismatch, beside TIS (0 and 0: off). Sequences whose geometric-mean ratio pi_old / pi_rollout
    # leaves [seq_mis_low, seq_mis_high] leave the loss; tokens whose ratio leaves [icepop_low, icepop_high] get no
    # gradient (IcePop). The loss keeps its denominators: a rejected token counts as a zero term.
    seq_mis_low: float = 0.0
    seq_mis_high: float = 0.0
    icepop_low: float = 0.0
    icepop_high: float = 0.0

    def validate(self, prefix: str = "algorithm") -> None:
        if self.algorithm not in LOSSES:
            raise ValueError(f"{prefix}.algorithm={self.algorithm!r}: expected one of {sorted(LOSSES)}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"{prefix}.clip_low must be in [0, 1) and {prefix}.clip_high >= 0")
        if self.tis_cap < 1:
            raise ValueError(f"{prefix}.tis_cap={self.tis_cap}: expected >= 1")
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"{prefix}.loss_agg={self.loss_agg!r}: expected one of {list(LOSS_AGGREGATIONS)}")
        for name in ("seq_mis", "icepop"):
            low, high = getattr(self, f"{name}_low"), getattr(self, f"{name}_high")
            if (low, high) != (0.0, 0.0) and not 0 < low < 1 < high:
                raise ValueError(
                    f"{prefix}.{name}_low={low}, {prefix}.{name}_high={high}: expected 0 < low < 1 < high (a band "
                    "around ratio 1), or both 0 to turn it off"
                )


def policy_loss(
    config: PolicyLossConfig,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    share: Share | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy objective (``config.algorithm``, see :data:`LOSSES`) for one micro-batch; returns (loss, detached
    metrics). Loss and metrics are means over the micro-batch, or its part of the batch means given the batch's
    ``share`` (see :class:`Share`)."""
    mask = mask.to(logp.dtype)
    ratio, per_token, clipped = LOSSES[config.algorithm](config, logp, old_logp, advantages, mask)
    metrics = {}
    if config.tis and rollout_logp is not None:
        weight = tis_weight(old_logp, rollout_logp, config.tis_cap)
        per_token = per_token * weight
        metrics["tis_weight_mean"] = aggregate(weight, mask, "token-mean", share)
        metrics["rollout_logp_abs_diff"] = aggregate((old_logp - rollout_logp).abs(), mask, "token-mean", share)
    if config.seq_mis_high and rollout_logp is not None:
        keep = sequence_mis_keep(old_logp, rollout_logp, mask, config.seq_mis_low, config.seq_mis_high)
        per_token = per_token * keep
        metrics["seq_mis_rejected_fraction"] = aggregate((1 - keep).expand_as(mask), mask, "token-mean", share)
    if config.icepop_high and rollout_logp is not None:
        keep = icepop_keep(old_logp, rollout_logp, config.icepop_low, config.icepop_high)
        per_token = per_token * keep
        metrics["icepop_rejected_fraction"] = aggregate(1 - keep, mask, "token-mean", share)
    loss = aggregate(per_token, mask, config.loss_agg, share)
    if config.kl_coef and ref_logp is not None:
        kl = aggregate(kl_k3(logp, ref_logp), mask, config.loss_agg, share)
        loss = loss + config.kl_coef * kl
        metrics["kl"] = kl
    if entropy is not None:
        ent = aggregate(entropy, mask, config.loss_agg, share)
        loss = loss - config.entropy_coef * ent
        metrics["entropy"] = ent
    metrics["ratio_mean"] = aggregate(ratio, mask, "token-mean", share)
    metrics["clip_fraction"] = aggregate(clipped.to(logp.dtype), mask, "token-mean", share)
    metrics["policy_loss"] = loss
    return loss, {name: value.detach() for name, value in metrics.items()}
