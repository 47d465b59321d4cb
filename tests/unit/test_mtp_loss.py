"""The MTP loss (mcore_rl/algorithms/mtp.py) against the DeepSeek-V3 report's formula, written out per token."""

import torch

from mcore_rl.algorithms.grpo import Share
from mcore_rl.algorithms.mtp import mtp_loss


def _report(logps: list[torch.Tensor], mask: torch.Tensor) -> float:
    """L_MTP = 1/D sum_k L_k, L_k = -1/T sum over the predicted response tokens of log p_k; position i of depth k
    predicts token i + k + 1, whose label position is i + k."""
    total, rows, width = mask.sum().item(), *mask.shape
    losses = []
    for k, logp in enumerate(logps, start=1):
        terms = [logp[r, i].item() for r in range(rows) for i in range(width - k) if mask[r, i + k]]
        losses.append(-sum(terms) / total)
    return sum(losses) / len(losses)


def test_the_loss_is_the_report_s_on_response_tokens_and_a_batch_mean_over_micro_batches():
    generator = torch.Generator().manual_seed(0)
    mask = torch.zeros(4, 9)
    for row, (start, end) in enumerate([(3, 9), (2, 6), (4, 8), (1, 9)]):
        mask[row, start:end] = 1
    logps = [-torch.rand(4, 9, generator=generator) for _ in range(2)]
    expected = _report(logps, mask)
    assert abs(mtp_loss(logps, mask).item() - expected) < 1e-6
    # two micro-batches of two rows, each its share of the batch: their mean is the batch's loss
    share = Share.of(mask, micro_batches=2, ranks=1)
    parts = [mtp_loss([x[rows] for x in logps], mask[rows], share) for rows in (slice(0, 2), slice(2, 4))]
    assert abs(sum(parts) / 2 - expected) < 1e-6
    # a depth predicts nothing past the row: the last k positions never count
    last = [x.clone() for x in logps]
    last[1][:, -2:] = -1e9
    assert abs(mtp_loss(last, mask) - expected) < 1e-6
