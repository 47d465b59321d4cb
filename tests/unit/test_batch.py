"""Episode samples -> training tensors: response positions, engine log-probs, advantages, dynamic sampling."""

import pytest
import torch

from mcore_rl.batch import (
    add_advantages,
    fill_with_spares,
    filter_truncated,
    partition_groups,
    rollout_stats,
    samples_of,
    shape_overlong,
    training_batch,
)
from mcore_rl.config.schema import TrainerConfig
from mcore_rl.data.prompts import Prompt, PromptRow
from mcore_rl.rollout.engine import Completion


def _samples():
    prompts = [Prompt(PromptRow(f"p{i}", [{"role": "user", "content": "q"}], "1"), [7] * (2 + i)) for i in range(2)]
    completions = [
        [Completion([1, 2], [-0.5, -0.25], "stop"), Completion([3], [-1.0], "length")],
        [Completion([4, 5, 6], [-0.1, -0.2, -0.3], "stop"), Completion([8], [-2.0], "stop")],
    ]
    return samples_of(prompts, completions, ["a", "b", "c", "d"])


def test_training_batch_marks_response_targets_and_engine_logprobs():
    samples = _samples()
    assert [s.id for s in samples] == ["p0/0", "p0/1", "p1/0", "p1/1"]
    batch = training_batch(samples, [1.0, 0.0, 0.5, 0.5])
    assert batch["tokens"].tolist()[0] == [7, 7, 1, 2, 0, 0]  # prompt, response, right padding
    assert batch["tokens"].tolist()[2] == [7, 7, 7, 4, 5, 6]
    # Position i predicts token i+1: sample 0's response tokens sit at 2..3, so its targets are positions 1..2.
    assert batch["mask"][0].tolist() == [0, 1, 1, 0, 0]
    assert batch["rollout_logp"][0].tolist() == [0, -0.5, -0.25, 0, 0]
    assert batch["mask"][2].tolist() == [0, 0, 1, 1, 1]
    assert torch.allclose(batch["rollout_logp"][2], torch.tensor([0, 0, -0.1, -0.2, -0.3]))
    assert add_advantages(batch, TrainerConfig(advantage_estimator="dr_grpo"), group_size=2) == {}
    assert batch["advantages"].tolist() == [0.5, -0.5, 0.0, 0.0]  # Dr.GRPO: mean-centred per group


def test_dynamic_sampling_drops_constant_groups_and_stats_report_them():
    samples, rewards = _samples(), [1.0, 0.0, 0.5, 0.5]
    (kept, kept_rewards), (constant, _) = partition_groups(samples, rewards, 2)
    assert [s.id for s in kept] == ["p0/0", "p0/1"] and kept_rewards == [1.0, 0.0]
    assert [s.id for s in constant] == ["p1/0", "p1/1"]
    stats = rollout_stats(samples, rewards, 2)
    assert stats["reward/constant_group_fraction"] == 0.5
    assert stats["response/length_mean"] == 7 / 4 and stats["response/truncated_fraction"] == 0.25
    # the fill rule: kept groups first, then spares up to the batch, the rest left over; a full batch takes none
    assert fill_with_spares(["k1", "k2"], ["s1", "s2", "s3"], 4) == (["k1", "k2", "s1", "s2"], ["s3"])
    assert fill_with_spares(["k1", "k2"], ["s1"], 2) == (["k1", "k2"], ["s1"])


def test_routed_experts_are_kept_per_input_position_and_checked():
    import dataclasses

    import numpy as np
    import pytest

    samples = _samples()
    lengths = [4, 3, 6, 5]  # prompt + response tokens
    routed = [np.arange(n * 3 * 2).reshape(n, 3, 2).astype(np.uint8) for n in lengths]  # vLLM: one row per token
    with_routing = [
        dataclasses.replace(s, completion=dataclasses.replace(s.completion, routed_experts=r))
        for s, r in zip(samples, routed, strict=True)
    ]
    batch = training_batch(with_routing, [1.0, 0.0, 0.5, 0.5])
    assert batch["routed_experts"].shape == (4, 5, 3, 2)  # [samples, input positions, layers, top-k]
    assert torch.equal(batch["routed_experts"][0, :3], torch.from_numpy(routed[0][:3].astype("int16")))
    assert batch["routed_experts"][1, 2:].abs().sum() == 0  # padding past the sample's 2 input positions
    short = list(with_routing)
    short[2] = dataclasses.replace(
        short[2], completion=dataclasses.replace(short[2].completion, routed_experts=routed[2][:3])
    )
    with pytest.raises(ValueError, match=r"sample p1/0: the engine's routed experts have shape \(3, 3, 2\); expected"):
        training_batch(short, [1.0, 0.0, 0.5, 0.5])


def test_overlong_shaping_penalises_near_the_limit_and_filtering_drops_truncated_samples():
    """DAPO's overlong shaping (max_new_tokens 3, buffer 2: 1 token is free, 2 cost half the penalty, 3 all of it)
    and filtering (the one sample stopped by the length limit leaves the loss)."""
    samples = _samples()  # responses of 2, 1, 3 and 1 tokens; the second was truncated
    trainer = TrainerConfig(overlong_buffer=2, overlong_penalty=0.4)
    rewards, metrics = shape_overlong(samples, [1.0, 0.0, 0.5, 0.5], trainer, max_new_tokens=3)
    assert rewards == pytest.approx([0.8, 0.0, 0.1, 0.5])
    assert metrics == pytest.approx({"reward/overlong_penalty_mean": -0.15, "reward/overlong_fraction": 0.5})
    assert shape_overlong(samples, [1.0, 0.0, 0.5, 0.5], TrainerConfig(), 3) == ([1.0, 0.0, 0.5, 0.5], {})
    batch = training_batch(samples, rewards)
    kept = batch["mask"].sum(dim=1).tolist()
    assert filter_truncated(batch, samples) == {"batch/truncated_filtered_fraction": 0.25}
    assert batch["mask"].sum(dim=1).tolist() == [kept[0], 0, kept[2], kept[3]] and kept[1] == 1


def test_advantages_per_token_with_a_kl_penalty_a_critic_and_a_teacher():
    """add_advantages reads what each estimator needs: the reward's KL penalty from old and reference log-probs,
    GAE's values (and gives the critic its returns), distillation's teacher log-probs; each per response token."""
    from mcore_rl.algorithms.advantages import gae, outcome_rewards, reinforce_pp

    batch = training_batch(_samples(), [1.0, 0.0, 0.5, 0.5])
    mask = batch["mask"]
    generator = torch.Generator().manual_seed(0)
    for key in ("old_logp", "ref_logp", "teacher_logp", "values"):
        batch[key] = -torch.rand(mask.shape, generator=generator) * mask
    outcome = outcome_rewards(batch["rewards"], mask)
    kl = (batch["old_logp"] - batch["ref_logp"]) * mask

    trainer = TrainerConfig(advantage_estimator="reinforce_pp", reward_kl_coef=0.1, gamma=0.9)
    metrics = add_advantages(batch, trainer, group_size=2)
    assert torch.allclose(batch["advantages"], reinforce_pp(outcome - 0.1 * kl, mask, 0.9))
    assert metrics == pytest.approx({"batch/reward_kl": (kl.sum() / mask.sum()).item()})

    trainer = TrainerConfig(advantage_estimator="gae", lam=0.95)
    add_advantages(batch, trainer, group_size=2)
    want, returns = gae(outcome, batch["values"], mask, 1.0, 0.95)
    assert torch.equal(batch["advantages"], want) and torch.equal(batch["returns"], returns)

    reverse_kl = (batch["old_logp"] - batch["teacher_logp"]) * mask
    trainer = TrainerConfig(advantage_estimator="none", distill_coef=0.5)
    metrics = add_advantages(batch, trainer, group_size=2)
    assert torch.allclose(batch["advantages"], -0.5 * reverse_kl)  # the teacher alone
    assert metrics == pytest.approx({"distill/reverse_kl": (reverse_kl.sum() / mask.sum()).item()})
    trainer = TrainerConfig(advantage_estimator="dr_grpo", distill_coef=0.5)
    add_advantages(batch, trainer, group_size=2)
    task = torch.tensor([0.5, -0.5, 0.0, 0.0])[:, None] * mask  # Dr.GRPO's, on every response token
    assert torch.allclose(batch["advantages"], task - 0.5 * reverse_kl)


def test_each_weighted_reward_is_logged_by_name():
    import dataclasses

    parts = [{"math": 1.0, "brief": 0.5, "brief/words": 3.0}, {"math": 0.0, "brief": 0.25, "brief/words": 5.0}, {}, {}]
    samples = [dataclasses.replace(s, reward_parts=p) for s, p in zip(_samples(), parts, strict=True)]
    stats = rollout_stats(samples, [1.0, 0.25, 0.0, 0.0], 2)
    assert stats["reward/math/mean"] == 0.5 and stats["reward/brief/mean"] == 0.375
    assert stats["reward/brief/words_mean"] == 4.0 and stats["reward/mean"] == 0.3125
