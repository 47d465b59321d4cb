"""Multi-turn trajectories in the training batch: observation tokens masked, the engine's log-probs where the
policy sampled, the environment's rewards in the advantages, and GRPO/GSPO losses over masks with holes equal to
the same losses over the sampled tokens alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_rl.agent.trajectory import Segment, Trajectory, trajectory_stats
from mcore_rl.algorithms.advantages import estimate
from mcore_rl.algorithms.grpo import PolicyLossConfig, group_advantages, policy_loss
from mcore_rl.batch import Sample, add_advantages, filter_truncated, staleness_stats, step_starts, training_batch
from mcore_rl.config.schema import TrainerConfig
from mcore_rl.data.prompts import Prompt, PromptRow

ROW = PromptRow("q", [{"role": "user", "content": "?"}], "42")


def _trajectory(turns: list[list[int]], observations: list[list[int]], stop="done", **stats) -> Trajectory:
    ids, mask, logprobs = [], [], []
    for i, turn in enumerate(turns):
        ids, mask, logprobs = ids + turn, mask + [1] * len(turn), logprobs + [-0.1 * t for t in turn]
        if i < len(observations):
            obs = observations[i]
            ids, mask, logprobs = ids + obs, mask + [0] * len(obs), logprobs + [0.0] * len(obs)
    versions = [3] * sum(mask)
    return Trajectory(ids, logprobs, stop, versions, mask, prompt_ids=[1, 2, 3], turns=len(turns), **stats)


def test_observation_tokens_are_masked_and_engine_logprobs_sit_where_the_policy_sampled():
    a = _trajectory([[10, 11], [12]], [[50, 51, 52]])
    b = _trajectory([[20, 21, 22, 23]], [])
    samples = [Sample(f"q/{k}", Prompt(ROW, t.prompt_ids), t, "") for k, t in enumerate((a, b))]
    batch = training_batch(samples, [1.0, 0.0])
    assert batch["tokens"].tolist() == [[1, 2, 3, 10, 11, 50, 51, 52, 12], [1, 2, 3, 20, 21, 22, 23, 0, 0]]
    # position i predicts token i + 1: the prompt's last position predicts the first response token
    assert batch["mask"].tolist() == [[0, 0, 1, 1, 0, 0, 0, 1], [0, 0, 1, 1, 1, 1, 0, 0]]
    expected = [[0, 0, -1.0, -1.1, 0, 0, 0, -1.2], [0, 0, -2.0, -2.1, -2.2, -2.3, 0, 0]]
    assert torch.allclose(batch["rollout_logp"], torch.tensor(expected))
    assert batch["lengths"].tolist() == [9, 7] and batch["prompt_lengths"].tolist() == [3, 3]
    # the environment's rewards reach the advantages, group-normalised
    add_advantages(batch, TrainerConfig(advantage_estimator="dr_grpo"), group_size=2)
    assert batch["advantages"].tolist() == group_advantages(torch.tensor([1.0, 0.0]), 2, False).tolist()


def _compact(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's masked-in values, left-aligned and zero-padded: the sequence of sampled tokens alone."""
    out = torch.zeros_like(values)
    for i, row in enumerate(mask.bool()):
        out[i, : int(row.sum())] = values[i, row]
    return out


@pytest.mark.parametrize("algorithm", ["grpo", "gspo"])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_losses_over_multi_turn_masks_equal_losses_over_the_sampled_tokens(algorithm, loss_agg):
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0], [0, 1, 0, 1, 0, 1, 0, 1], [1, 1, 1, 1, 1, 0, 0, 0]]).float()
    logp = (torch.randn(3, 8) * 0.3 - 1).requires_grad_()
    old, ref, rollout = (logp.detach() + torch.randn(3, 8) * 0.2 for _ in range(3))
    # what observation positions hold must not matter
    noise = torch.randn(3, 8) * 5 * (1 - mask)
    advantages = torch.tensor([1.0, -0.5, 0.3])
    config = PolicyLossConfig(algorithm=algorithm, loss_agg=loss_agg, kl_coef=0.1)
    loss, metrics = policy_loss(config, logp + noise, old + noise, advantages, mask, ref + noise, rollout + noise)
    (grad,) = torch.autograd.grad(loss, logp)

    compact_mask = _compact(mask, mask)
    leaf = _compact(logp.detach(), mask).requires_grad_()
    expected, expected_metrics = policy_loss(
        config, leaf, _compact(old, mask), advantages, compact_mask, _compact(ref, mask), _compact(rollout, mask)
    )
    (expected_grad,) = torch.autograd.grad(expected, leaf)
    assert torch.allclose(loss, expected, atol=1e-6)
    for name, value in expected_metrics.items():
        assert torch.allclose(metrics[name], value, atol=1e-6), name
    assert torch.allclose(_compact(grad, mask), expected_grad, atol=1e-6)
    assert torch.all(grad[mask == 0] == 0)  # observations get no gradient


def test_trajectory_stats():
    trajectories = [
        _trajectory([[1], [2]], [[9, 9]], "done", tool_calls=1, tool_seconds=[0.5]),
        _trajectory(
            [[1], [2], [3]], [[9], [9]], "max_turns", tool_calls=2, tool_errors={"timeout": 1}, tool_seconds=[0.1, 1.5]
        ),
        _trajectory([[1, 1, 1, 1]], [], "env_error", env_errors=1),
        _trajectory([[1, 1]], [], "done"),
    ]
    stats = trajectory_stats(trajectories)
    assert stats["agent/turns_mean"] == 7 / 4 and stats["agent/turns_max"] == 3
    assert stats["agent/tool_calls_mean"] == 3 / 4 and stats["agent/tool_errors"] == 1
    assert stats["agent/tool_errors/timeout"] == 1
    assert stats["agent/tool_latency_mean_s"] == pytest.approx(0.7) and stats["agent/tool_latency_max_s"] == 1.5
    assert stats["agent/env_errors"] == 1
    assert stats["agent/observation_token_fraction"] == 4 / 15
    assert stats["agent/stop_done_fraction"] == 0.5 and stats["agent/stop_max_turns_fraction"] == 0.25
    assert stats["agent/stop_env_error_fraction"] == 0.25 and stats["agent/stop_length_fraction"] == 0


def _rewritten(prompt_ids, segments, turns, observations, stop="done") -> Trajectory:
    """A trajectory whose template rewrote its history: ``segments`` before the last one (prompt ids, turns, observations
    each)."""
    earlier = []
    for prompt, seg_turns, seg_observations in segments:
        t = _trajectory(seg_turns, seg_observations)
        earlier.append(Segment(prompt, t.token_ids, t.logprobs, t.loss_mask))
    last = _trajectory(turns, observations, stop)
    versions = [1] * sum(sum(s.loss_mask) for s in earlier) + last.versions  # sampled 2 versions before the last
    return dataclasses.replace(last, prompt_ids=prompt_ids, segments=tuple(earlier), versions=versions)


def test_a_rewritten_history_trains_as_rows_that_share_their_trajectory_s_advantage():
    a = _rewritten([1, 7], [([1, 2, 3], [[10, 11]], [[50]])], [[12]], [])  # two samples: [1 2 3|10 11 50], [1 7|12]
    b = _trajectory([[20, 21, 22, 23]], [], "length")
    c = _rewritten([4, 5], [([1, 2, 3], [[30]], [[51]]), ([6], [[31]], [[52, 53]])], [[32, 33]], [])
    d = _trajectory([[40]], [])
    samples = [Sample(f"q/{k}", Prompt(ROW, t.prompt_ids), t, "") for k, t in enumerate((a, b, c, d))]
    rewards = [1.0, 0.0, 0.5, 0.25]
    batch = training_batch(samples, rewards)
    assert batch["owner"].tolist() == [0, 0, 1, 2, 2, 2, 3]
    assert batch["tokens"].tolist() == [
        [1, 2, 3, 10, 11, 50, 0],
        [1, 7, 12, 0, 0, 0, 0],
        [1, 2, 3, 20, 21, 22, 23],
        [1, 2, 3, 30, 51, 0, 0],
        [6, 31, 52, 53, 0, 0, 0],
        [4, 5, 32, 33, 0, 0, 0],
        [1, 2, 3, 40, 0, 0, 0],
    ]
    # each row's own sampled positions and the engine's log-probs there; its prompt and observations masked
    assert batch["mask"][:2].tolist() == [[0, 0, 1, 1, 0, 0], [0, 1, 0, 0, 0, 0]]
    assert batch["mask"][3:6].tolist() == [[0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0]]
    assert torch.allclose(batch["rollout_logp"][4], torch.tensor([-3.1, 0, 0, 0, 0, 0]))
    assert batch["rewards"].tolist() == [1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.25]
    assert batch["prompt_lengths"].tolist() == [3, 2, 3, 3, 1, 2, 3]
    # advantages per trajectory (over all its samples' tokens), the same on each of its rows
    add_advantages(batch, TrainerConfig(advantage_estimator="grpo"), group_size=2)
    expected = group_advantages(torch.tensor(rewards), 2, True)
    assert torch.equal(batch["advantages"], expected[batch["owner"]])
    lengths = TrainerConfig(advantage_estimator="dr_grpo")  # a length-aware estimator reads trajectory lengths
    add_advantages(batch, lengths, group_size=2)
    tokens = torch.tensor([3.0, 4.0, 4.0, 1.0])
    assert torch.equal(batch["advantages"], estimate("dr_grpo", torch.tensor(rewards), 2, tokens)[batch["owner"]])
    # the optimizer steps take whole trajectories: 2 samples each, whatever rows they became
    assert step_starts(batch, 2) == [0, 3] and step_starts(batch, 1) == [0, 2, 3, 6]
    assert step_starts(training_batch(samples[1:2] + samples[3:], [0.0, 1.0]), 1) == [0, 1]
    # DAPO's overlong filter clears the truncated trajectory's rows, whichever
    filter_truncated(batch, samples)
    assert batch["mask"].sum(dim=1).tolist() == [2, 1, 0, 1, 1, 2, 1]
    # and a sample's lag is its oldest token's, over every segment
    stats = staleness_stats(samples, 5)
    assert stats["staleness/max"] == 4 and stats["staleness/lag_4_fraction"] == stats["staleness/lag_2_fraction"] == 0.5


def test_trajectory_stats_count_every_segment():
    a = _rewritten([1], [([1], [[10, 11]], [[50, 51]])], [[12]], [[52]])
    stats = trajectory_stats([a, _trajectory([[1]], [])])
    assert stats["agent/segments_mean"] == 1.5
    assert stats["agent/observation_token_fraction"] == 3 / 7
    assert a.response_ids == [10, 11, 50, 51, 12, 52]
