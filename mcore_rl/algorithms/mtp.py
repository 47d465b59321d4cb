"""DeepSeek-V3's multi-token-prediction loss on the policy's samples, which keeps the MTP drafter in step with the
policy (the model side: :mod:`models.mtp`)."""

from __future__ import annotations

import torch
from megatron.core.transformer.multi_token_prediction import roll_tensor

from mcore_rl.algorithms.grpo import Share
from mcore_rl.trainer.logprobs import token_logprobs


def mtp_logprobs(
    batch: dict, depths: tuple[torch.Tensor, ...], vocab_size: int, tp_group, cp_group
) -> list[torch.Tensor]:
    """Per depth k, log p_k(token i + k + 1) at each position i of the micro-batch (its layout, as the model's
    outputs; :func:`mcore_rl.trainer.packing.rows_of` turns them into rows). Labels roll as Megatron rolls the MTP's
    inputs: within each packed sequence and across context-parallel ranks."""
    labels, packed, out = batch["labels"], batch.get("packed_seq_params"), []
    for logits in depths:
        labels, _ = roll_tensor(labels, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed)
        out.append(token_logprobs(logits, labels, vocab_size, tp_group))
    return out


def mtp_loss(logps: list[torch.Tensor], mask: torch.Tensor, share: Share | None = None) -> torch.Tensor:
    """DeepSeek-V3's MTP loss on the response tokens, from :func:`mtp_logprobs` in rows: per depth k the
    cross-entropy of the response tokens it predicts (position i predicts token i + k + 1, a response token where
    ``mask[i + k]``) over the response's token count (the report's 1/T), averaged over the depths. ``share``: the micro-batch's part of the batch mean
    (:class:`mcore_rl.algorithms.grpo.Share`)."""
    losses = []
    for k, logp in enumerate(logps, start=1):
        predicted = torch.nn.functional.pad(mask[:, k:], (0, k))
        total = share.tokens if share else mask.sum().clamp(min=1)
        losses.append(-(logp * predicted.to(logp.dtype)).sum() / total)
    return torch.stack(losses).mean()
