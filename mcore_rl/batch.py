"""One episode's samples as padded training tensors, and the statistics logged about them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mcore_rl.agent.trajectory import Segment
from mcore_rl.algorithms.advantages import (
    ESTIMATORS,
    estimate,
    gae,
    outcome_rewards,
    overlong_penalty,
    reinforce_pp,
    reward_kl,
)
from mcore_rl.algorithms.grpo import constant_groups
from mcore_rl.data.prompts import Prompt
from mcore_rl.rollout.engine import Completion


@dataclass(frozen=True)
class Sample:
    id: str  # "<prompt id>/<k>": the k-th completion of a prompt
    prompt: Prompt
    completion: Completion
    text: str  # the completion, decoded
    reward_parts: dict[str, float] = field(default_factory=dict)  # each weighted reward's value (and components)


def samples_of(prompts: list[Prompt], completions: list[list[Completion]], texts: list[str]) -> list[Sample]:
    """Flatten per-prompt completions into samples, grouped by prompt (what group advantages expect)."""
    flat = [(p, k, c) for p, group in zip(prompts, completions, strict=True) for k, c in enumerate(group)]
    return [Sample(f"{p.row.id}/{k}", p, c, t) for (p, k, c), t in zip(flat, texts, strict=True)]


def sample_rows(sample: Sample) -> list[Segment]:
    """A sample's training rows: one, or a multi-turn trajectory's segments where its chat template rewrote the
    history (:class:`~mcore_rl.agent.trajectory.Segment`), in order."""
    c = sample.completion
    last = Segment(sample.prompt.token_ids, c.token_ids, c.logprobs, c.loss_mask or [1] * len(c.token_ids))
    return [*getattr(c, "segments", ()), last]


def response_length(sample: Sample) -> int:
    """The tokens after the sample's prompt, over all its rows."""
    return sum(len(row.token_ids) for row in sample_rows(sample))


def training_batch(samples: list[Sample], rewards: list[float]) -> dict:
    """Right-padded tensors of prompt + response: ``tokens`` [N, L]; per next-token position ([N, L-1]) the
    response ``mask`` and the engine's ``rollout_logp``; per row ``lengths`` and ``prompt_lengths`` (real
    tokens) and ``rewards``; and when the engine returned them, ``routed_experts`` [N, L-1, layers, top-k]. A
    multi-turn trajectory's observation tokens are masked (``Completion.loss_mask``). Where a trajectory became
    several rows (:func:`sample_rows`), ``owner`` [N] holds each row's sample index (and the rows outnumber the
    samples)."""
    owners, rows = zip(*[(i, row) for i, sample in enumerate(samples) for row in sample_rows(sample)], strict=True)
    sequences = [row.prompt_ids + row.token_ids for row in rows]
    length = max(map(len, sequences))
    n = len(rows)
    tokens = torch.zeros(n, length, dtype=torch.long)
    mask = torch.zeros(n, length - 1)
    rollout_logp = torch.zeros(n, length - 1)
    for i, (row, seq) in enumerate(zip(rows, sequences, strict=True)):
        tokens[i, : len(seq)] = torch.tensor(seq)
        start, count = len(row.prompt_ids) - 1, len(row.token_ids)
        mask[i, start : start + count] = torch.tensor(row.loss_mask, dtype=mask.dtype)
        rollout_logp[i, start : start + count] = torch.tensor(row.logprobs, dtype=rollout_logp.dtype)
    owner = torch.tensor(owners)
    batch = {
        "tokens": tokens,
        "lengths": torch.tensor([len(seq) for seq in sequences]),
        "prompt_lengths": torch.tensor([len(row.prompt_ids) for row in rows]),
        "mask": mask,
        "rollout_logp": rollout_logp,
        "rewards": torch.tensor(rewards, dtype=torch.float32)[owner],
    }
    if n > len(samples):
        batch["owner"] = owner
    if samples[0].completion.routed_experts is not None:
        batch["routed_experts"] = routed_experts(samples, sequences, length - 1)
    return batch


def first_rows(batch: dict) -> torch.Tensor:
    """Whether each row is its sample's first: every row, but a trajectory's later segments."""
    first = torch.ones(batch["tokens"].shape[0], dtype=torch.bool)
    if "owner" in batch:
        first[1:] = batch["owner"][1:] != batch["owner"][:-1]
    return first


def step_starts(batch: dict, global_batch_size: int) -> list[int]:
    """The first row of each optimizer step: every ``global_batch_size`` samples, whatever rows they became (an
    episode keeps its number of steps, and each step its samples)."""
    rows = batch["tokens"].shape[0]
    if "owner" not in batch:
        return list(range(0, rows, global_batch_size))
    step = batch["owner"] // global_batch_size
    return [0, *(torch.nonzero(step[1:] != step[:-1]).flatten() + 1).tolist()]


def add_advantages(batch: dict, trainer, group_size: int) -> dict[str, float]:
    """``batch["advantages"]`` by ``trainer.advantage_estimator`` (``trainer``: the policy trainer's config), per
    sample or, for per-token estimators and distillation, per response position; with GAE also the critic's
    ``returns``. Reads what the estimator needs: ``old_logp`` and ``ref_logp`` of every row for a KL penalty in the
    reward, ``values`` for GAE, ``teacher_logp`` and ``old_logp`` for distillation. Returns the metrics."""
    mask, rewards, estimator = batch["mask"], batch["rewards"], trainer.advantage_estimator
    metrics = {}
    if estimator in ESTIMATORS and "owner" in batch:  # per sample, over all its rows; each row its sample's
        owner = batch["owner"]
        tokens = torch.zeros(int(owner[-1]) + 1).index_add_(0, owner, mask.sum(dim=1))
        advantages = estimate(estimator, rewards[first_rows(batch)], group_size, tokens)[owner]
    elif estimator in ESTIMATORS:
        advantages = estimate(estimator, rewards, group_size, mask.sum(dim=1))
    elif estimator == "none":  # distillation alone
        advantages = torch.zeros_like(mask)
    else:
        token_rewards = outcome_rewards(rewards, mask)
        if trainer.reward_kl_coef:
            kl = reward_kl(batch["old_logp"], batch["ref_logp"], mask)
            token_rewards = token_rewards - trainer.reward_kl_coef * kl
            metrics["batch/reward_kl"] = (kl.sum() / mask.sum().clamp(min=1)).item()
        if estimator == "reinforce_pp":
            advantages = reinforce_pp(token_rewards, mask, trainer.gamma)
        else:
            advantages, batch["returns"] = gae(token_rewards, batch["values"], mask, trainer.gamma, trainer.lam)
    if trainer.distill_coef:
        reverse_kl = (batch["old_logp"] - batch["teacher_logp"]) * mask
        per_token = advantages if advantages.dim() == 2 else advantages[:, None] * mask
        advantages = per_token - trainer.distill_coef * reverse_kl
        metrics["distill/reverse_kl"] = (reverse_kl.sum() / mask.sum().clamp(min=1)).item()
    batch["advantages"] = advantages
    return metrics


def routed_experts(samples: list[Sample], sequences: list[list[int]], positions: int) -> torch.Tensor:
    """The engine's expert ids of every input position [N, positions, layers, top-k] (int16; padding: expert 0).
    A sequence of n tokens is the model's input at n - 1 positions (its last token is only predicted)."""
    first = samples[0].completion.routed_experts
    out = torch.zeros(len(samples), positions, *first.shape[1:], dtype=torch.int16)
    for i, (sample, seq) in enumerate(zip(samples, sequences, strict=True)):
        routed = sample.completion.routed_experts
        if routed is None or routed.shape[0] < len(seq) - 1 or routed.shape[1:] != first.shape[1:]:
            got = None if routed is None else tuple(routed.shape)
            raise ValueError(
                f"sample {sample.id}: the engine's routed experts have shape {got}; expected at least "
                f"{len(seq) - 1} positions x {tuple(first.shape[1:])} (layers, top-k) for its {len(seq)} tokens"
            )
        out[i, : len(seq) - 1] = torch.from_numpy(routed[: len(seq) - 1].astype("int16"))
    return out


def partition_groups(samples: list[Sample], rewards: list[float], group_size: int):
    """Dynamic sampling: split samples (and rewards) into prompt groups with a learning signal and groups whose
    rewards are all equal (zero advantage, no gradient): ((kept, kept_rewards), (constant, constant_rewards))."""
    constant = constant_groups(torch.tensor(rewards), group_size).tolist()
    parts = ([], []), ([], [])
    for i, (sample, reward) in enumerate(zip(samples, rewards, strict=True)):
        part = parts[constant[i // group_size]]
        part[0].append(sample)
        part[1].append(reward)
    return parts


def fill_with_spares(kept: list, spares: list, need: int) -> tuple[list, list]:
    """Dynamic sampling's fill rule, for the sync loop and the async buffer alike: the ``kept`` groups (those with
    a learning signal) first, then constant-reward ``spares`` up to ``need`` items; (batch, unused spares)."""
    short = max(need - len(kept), 0)
    return kept + spares[:short], spares[short:]


def shape_overlong(samples: list[Sample], rewards: list[float], trainer, max_new_tokens: int):
    """DAPO's overlong shaping (``trainer``: the policy trainer's config): the rewards with the soft penalty of
    responses within ``overlong_buffer`` tokens of ``max_new_tokens`` added, and its metrics."""
    if not trainer.overlong_buffer:
        return rewards, {}
    lengths = torch.tensor([response_length(s) for s in samples])
    penalty = overlong_penalty(lengths, max_new_tokens, trainer.overlong_buffer, trainer.overlong_penalty)
    metrics = {
        "reward/overlong_penalty_mean": penalty.mean().item(),
        "reward/overlong_fraction": (penalty < 0).float().mean().item(),
    }
    return (torch.tensor(rewards) + penalty).tolist(), metrics


def filter_truncated(batch: dict, samples: list[Sample]) -> dict[str, float]:
    """DAPO's overlong filtering: truncated samples (stopped at max_new_tokens) leave the loss (their response
    mask is cleared; they still count in their groups' advantages)."""
    truncated = torch.tensor([s.completion.finish_reason == "length" for s in samples])
    batch["mask"][truncated[batch["owner"]] if "owner" in batch else truncated] = 0
    return {"batch/truncated_filtered_fraction": truncated.float().mean().item()}


def rollout_stats(samples: list[Sample], rewards: list[float], group_size: int) -> dict[str, float]:
    r = torch.tensor(rewards, dtype=torch.float32)
    lengths = torch.tensor([response_length(s) for s in samples], dtype=torch.float32)
    groups = r.view(-1, group_size)
    truncated = sum(s.completion.finish_reason == "length" for s in samples)
    return reward_part_stats(samples) | {
        "reward/mean": r.mean().item(),
        "reward/max": r.max().item(),
        "reward/group_std_mean": groups.std(dim=1).mean().item() if group_size > 1 else 0.0,
        "reward/constant_group_fraction": constant_groups(r, group_size).float().mean().item(),
        "response/length_mean": lengths.mean().item(),
        "response/length_max": lengths.max().item(),
        "response/truncated_fraction": truncated / len(samples),
    }


def reward_part_stats(samples: list[Sample]) -> dict[str, float]:
    """Each weighted reward's mean over the samples that have it (``reward/<name>/mean``) and each component's
    (``reward/<name>/<component>_mean``)."""
    values: dict[str, list[float]] = {}
    for sample in samples:
        for name, value in sample.reward_parts.items():
            values.setdefault(name, []).append(value)
    return {
        f"reward/{name}_mean" if "/" in name else f"reward/{name}/mean": sum(v) / len(v) for name, v in values.items()
    }


def staleness_stats(samples: list[Sample], version: int) -> dict[str, float]:
    """How many policy versions the trained samples lag a trainer at ``version`` (a sample is as old as its oldest
    token): mean, max, and the share of samples at each lag (``staleness/lag_<k>_fraction``)."""
    lags = [version - min(s.completion.versions) for s in samples]
    shares = {f"staleness/lag_{k}_fraction": lags.count(k) / len(lags) for k in sorted(set(lags))}
    return {"staleness/mean": sum(lags) / len(lags), "staleness/max": float(max(lags))} | shares
