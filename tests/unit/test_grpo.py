"""GRPO/GSPO/CISPO math against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.algorithms.grpo import (
    PolicyLossConfig,
    Share,
    aggregate,
    clipped_surrogate,
    constant_groups,
    group_advantages,
    kl_k3,
    policy_loss,
    sequence_ratio,
    tis_weight,
)


def test_group_advantages_grpo_and_dr_grpo():
    rewards = torch.tensor([1.0, 0, 0, 1, 2, 2, 2, 2])
    # group 1: mean 0.5, unbiased std sqrt(1/3); group 2: constant -> 0
    s = 0.5 / math.sqrt(1 / 3)
    expected = torch.tensor([s, -s, -s, s, 0, 0, 0, 0])
    assert torch.allclose(group_advantages(rewards, 4), expected, atol=1e-5)
    assert torch.equal(
        group_advantages(rewards, 4, normalize_std=False), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    )
    assert constant_groups(rewards, 4).tolist() == [False, True]
    with pytest.raises(ValueError, match="8 rewards do not split into groups of 3"):
        group_advantages(rewards, 3)


def test_kl_k3():
    logp, ref = torch.tensor([math.log(0.5), -1.0]), torch.tensor([math.log(0.25), -1.0])
    # r = log(0.25/0.5) = -log 2: exp(r) - r - 1 = 0.5 + log 2 - 1
    assert torch.allclose(kl_k3(logp, ref), torch.tensor([0.5 + math.log(2) - 1, 0.0]))


def test_clipped_surrogate_with_clip_higher():
    ratio = torch.tensor([[0.5, 1.0, 1.5]])
    loss, clipped = clipped_surrogate(ratio, torch.tensor([1.0]), clip_low=0.2, clip_high=0.28)
    assert torch.allclose(loss, torch.tensor([[-0.5, -1.0, -1.28]]))
    assert clipped.tolist() == [[False, False, True]]
    loss, clipped = clipped_surrogate(ratio, torch.tensor([-1.0]), clip_low=0.2, clip_high=0.28)
    assert torch.allclose(loss, torch.tensor([[0.8, 1.0, 1.5]]))
    assert clipped.tolist() == [[True, False, False]]


def test_gspo_sequence_ratio_value_and_gradient():
    old = torch.zeros(1, 3)
    logp = torch.tensor([[0.2, -0.1, 0.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the last token is padding
    ratio = sequence_ratio(logp, old, mask)
    s = math.exp((0.2 - 0.1) / 2)
    assert torch.allclose(ratio, torch.full((1, 3), s))
    (ratio * mask).sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[s, s, 0.0]]))


def test_tis_weight_is_truncated_and_constant():
    old = torch.tensor([math.log(3.0), math.log(0.5)], requires_grad=True)
    weight = tis_weight(old, torch.zeros(2), cap=2.0)
    assert torch.allclose(weight, torch.tensor([2.0, 0.5])) and not weight.requires_grad


def test_aggregation_modes():
    values = torch.tensor([[1.0, 2, 3], [4, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(values, mask, "token-mean").item() == pytest.approx(2.5)
    assert aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="loss aggregation 'sum'"):
        aggregate(values, mask, "sum")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_batch_share_makes_any_grouping_give_the_batch_mean(mode):
    """Averaged over micro-batches (as Megatron does), the micro-batches' shares of the batch mean add up to the
    batch mean for any grouping; each micro-batch's own mean would not (responses differ in length)."""
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(6, 5, generator=generator)
    mask = (torch.arange(5)[None] < torch.tensor([5, 1, 3, 2, 4, 0])[:, None]).float()
    whole = aggregate(values, mask, mode)
    for groups in ([[0, 1], [2, 3], [4, 5]], [[0, 5], [1, 2, 3, 4]], [[3], [0, 1, 2, 4, 5]]):
        share = Share.of(mask, micro_batches=len(groups), ranks=1)
        parts = [aggregate(values[g], mask[g], mode, share) for g in groups]
        assert torch.stack(parts).mean().item() == pytest.approx(whole.item(), rel=1e-6)
    uneven = [aggregate(values[g], mask[g], mode) for g in ([3], [0, 1, 2, 4, 5])]
    assert torch.stack(uneven).mean().item() != pytest.approx(whole.item(), rel=1e-3)


@pytest.mark.parametrize("algorithm", ["grpo", "gspo"])
def test_first_update_has_unit_ratio_and_zero_kl(algorithm):
    """Before any change, policy == old == reference == rollout: ratio 1, KL 0, TIS 1, loss = -mean advantage."""
    logp = torch.log(torch.rand(2, 4, generator=torch.Generator().manual_seed(0)))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv = torch.tensor([1.5, -0.5])
    config = PolicyLossConfig(algorithm=algorithm, kl_coef=0.1)
    loss, metrics = policy_loss(config, logp, logp, adv, mask, ref_logp=logp, rollout_logp=logp)
    assert metrics["ratio_mean"].item() == pytest.approx(1.0)
    assert metrics["kl"].item() == pytest.approx(0.0)
    assert metrics["tis_weight_mean"].item() == pytest.approx(1.0)
    assert metrics["clip_fraction"].item() == 0
    assert loss.item() == pytest.approx(-(1.5 * 3 - 0.5 * 2) / 5)


def test_policy_loss_config_errors_name_the_field():
    with pytest.raises(ValueError, match="algorithm.algorithm='ppo'"):
        PolicyLossConfig(algorithm="ppo").validate()
    with pytest.raises(ValueError, match="algorithm.tis_cap=0.5"):
        PolicyLossConfig(tis_cap=0.5).validate()
    with pytest.raises(ValueError, match="algorithm.loss_agg='mean': expected one of"):
        PolicyLossConfig(loss_agg="mean").validate()


def test_cispo_clips_and_detaches_the_weight_so_every_token_keeps_a_gradient():
    """MiniMax-M1's CISPO: loss -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp, so d loss / d logp_t is
    -clip(r_t) * A / N over the N response tokens (token-mean), written out here; PPO's clip (grpo) instead drops
    the gradient of a token whose ratio left the band in the advantage's direction."""
    old = torch.tensor([[-1.0, -1.0, -1.0, -2.0]])
    start = torch.tensor([[-0.5, -1.0, -1.6, -2.0]])  # ratios e^0.5 (above 1.28), 1, e^-0.6 (below 0.8); padding
    mask = torch.tensor([[1, 1, 1, 0]])
    adv = torch.tensor([2.0])
    weight = torch.exp(start - old).clamp(0.8, 1.28)
    logp = start.clone().requires_grad_()
    loss, metrics = policy_loss(PolicyLossConfig(algorithm="cispo", tis=False), logp, old, adv, mask)
    loss.backward()
    assert torch.allclose(logp.grad, -weight * 2.0 * mask / 3)
    assert loss.item() == pytest.approx((-weight * 2.0 * start * mask).sum().item() / 3)
    assert metrics["clip_fraction"].item() == pytest.approx(2 / 3)
    logp = start.clone().requires_grad_()
    policy_loss(PolicyLossConfig(algorithm="grpo", tis=False), logp, old, adv, mask)[0].backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 2] != 0  # above the band with A > 0: no gradient under PPO's clip


def test_mismatch_corrections_reject_sequences_and_tokens_outside_their_bands():
    """Sequence-level masked IS drops a sequence whose geometric-mean ratio pi_old / pi_rollout leaves its band;
    IcePop drops single tokens whose ratio does. Rejected terms count as zeros in the token mean, and their tokens
    get no gradient; the rest are as without the corrections."""
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.0, -1.5, -1.0], [-1.1, -0.9, -1.0]])  # row 0: mean log-ratio 1/6; token 1: e^0.5
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([1.0, -1.0])
    base = PolicyLossConfig(tis=False)
    seq = PolicyLossConfig(tis=False, seq_mis_low=0.9, seq_mis_high=1.1)  # e^(1/6) = 1.18: row 0 out, row 1 in
    ice = PolicyLossConfig(tis=False, icepop_low=0.5, icepop_high=1.5)  # e^0.5 = 1.65: token (0, 1) out
    grads, losses, metrics = {}, {}, {}
    for name, config in (("base", base), ("seq", seq), ("ice", ice)):
        logp = old.clone().requires_grad_()
        losses[name], metrics[name] = policy_loss(config, logp, old, adv, mask, rollout_logp=rollout)
        losses[name].backward()
        grads[name] = logp.grad
    assert torch.equal(grads["seq"][0], torch.zeros(3)) and torch.equal(grads["seq"][1], grads["base"][1])
    assert grads["ice"][0, 1] == 0 and torch.equal(grads["ice"][1], grads["base"][1]) and grads["ice"][0, 0] != 0
    assert losses["seq"].item() == pytest.approx(-(-1.0 * 2) / 5)  # row 0's three terms are zeros; 5 tokens
    assert losses["ice"].item() == pytest.approx(-(1.0 * 2 - 1.0 * 2) / 5)
    assert metrics["seq"]["seq_mis_rejected_fraction"].item() == pytest.approx(3 / 5)
    assert metrics["ice"]["icepop_rejected_fraction"].item() == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match=r"icepop_low=1.2, algorithm.icepop_high=2.0: expected 0 < low < 1 < high"):
        PolicyLossConfig(icepop_low=1.2, icepop_high=2.0).validate()
