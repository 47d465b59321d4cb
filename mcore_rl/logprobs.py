"""Per-token log-probabilities from vocab-parallel logits, without gathering the vocabulary on one rank.

Megatron pads the vocabulary to a TP-friendly multiple; the padded rows produce logits that HF and the rollout
engine do not have. They are masked out of the softmax here, so trainer and rollout log-probs agree.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Give this TP rank's padded vocabulary entries (global id >= ``vocab_size``) zero probability."""
    local = logits.shape[-1]
    valid = vocab_size - tp_rank * local
    if valid >= local:
        return logits
    ids = torch.arange(local, device=logits.device)
    return logits.masked_fill(ids >= max(valid, 0), torch.finfo(logits.dtype).min)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(target) per position from this TP rank's vocab shard of ``logits`` ([..., V/tp]); differentiable."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return -vocab_parallel_cross_entropy(mask_padded_vocab(logits, vocab_size, tp_rank).float(), targets)
