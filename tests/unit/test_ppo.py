"""PPO's critic objective against a reference written token by token from its definition."""

import pytest
import torch

from mcore_rl.algorithms.grpo import Share
from mcore_rl.algorithms.ppo import explained_variance, value_loss

MASK = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.float32)
OLD = torch.tensor([[0.0, 0.5, 1.0, 7], [7, -0.2, 0.3, 0.4]])
RETURNS = torch.tensor([[1.0, 1.0, 1.0, 7], [7, -1.0, -1.0, -1.0]])
VALUES = torch.tensor([[0.5, 0.55, 0.2, 7], [7, -0.2, 0.0, 1.0]])


@pytest.mark.parametrize("clip", [0.0, 0.2])
def test_value_loss_is_the_clipped_squared_error(clip):
    """0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), token-mean over the mask (verl's
    compute_value_loss, OpenRLHF's ValueLoss); its gradient flows through the term the max picks."""
    terms, clipped = [], []
    for v, old, r, m in zip(VALUES.flatten(), OLD.flatten(), RETURNS.flatten(), MASK.flatten(), strict=True):
        if not m:
            continue
        plain = (v - r) ** 2
        vc = old + min(max(v - old, -clip), clip) if clip else v
        terms.append(0.5 * max(plain, (vc - r) ** 2))
        clipped.append(float(clip > 0 and (vc - r) ** 2 > plain))
    values = VALUES.clone().requires_grad_()
    loss, metrics = value_loss(values, OLD, RETURNS, MASK, clip)
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-6)
    assert metrics["value_clip_fraction"].item() == pytest.approx(sum(clipped) / len(clipped))
    loss.backward()
    assert values.grad[MASK == 0].abs().sum() == 0
    if clip:  # tokens whose clipped term is the larger get no gradient when the clip binds
        assert sum(clipped) > 0 and (values.grad[MASK == 1] == 0).sum() >= 1
    # a micro-batch's share of the batch mean: two halves add up to the whole
    share = Share.of(MASK, micro_batches=2, ranks=1)
    halves = [
        value_loss(VALUES[i : i + 1], OLD[i : i + 1], RETURNS[i : i + 1], MASK[i : i + 1], clip, share) for i in (0, 1)
    ]
    assert (halves[0][0] + halves[1][0]).item() / 2 == pytest.approx(loss.item(), rel=1e-6)


def test_an_unclipped_token_never_counts_as_clipped():
    """Within the clip, V_old + (V - V_old) may round away from V: such a token is not clipped, and its loss and
    gradient are the plain squared error's."""
    generator = torch.Generator().manual_seed(0)
    old = 0.1 * (2 * torch.rand(64, 32, generator=generator) - 1)
    values = (0.1 * (2 * torch.rand(64, 32, generator=generator) - 1)).requires_grad_()  # within clip 0.2 of old
    returns = torch.randn(64, 32, generator=generator)
    assert ((old + (values.detach() - old)) != values.detach()).any()  # rounding is there to be caught
    loss, metrics = value_loss(values, old, returns, torch.ones(64, 32), clip=0.2)
    assert metrics["value_clip_fraction"].item() == 0.0
    assert loss.item() == 0.5 * ((values.detach() - returns) ** 2).mean().item()
    loss.backward()
    assert torch.equal(values.grad, (values.detach() - returns) / values.numel())


def test_explained_variance():
    mask = MASK.bool()
    assert explained_variance(RETURNS, RETURNS, MASK) == 1.0
    mean = RETURNS[mask].mean()
    assert explained_variance(torch.full_like(RETURNS, mean.item()), RETURNS, MASK) == pytest.approx(0.0, abs=1e-4)
    assert explained_variance(VALUES, RETURNS, torch.zeros_like(MASK)) == 0.0
    # returns equal but for rounding (a batch without reward): the critic's spread, not a division by 1e-16
    flat = torch.zeros_like(RETURNS) + 1e-9 * torch.randn(RETURNS.shape, generator=torch.Generator().manual_seed(0))
    assert explained_variance(torch.zeros_like(RETURNS), flat, MASK) == pytest.approx(1.0, abs=1e-6)
    assert -1e5 < explained_variance(VALUES, flat, MASK) < 0  # Var(V) / eps: about -2e4, not -1e13
