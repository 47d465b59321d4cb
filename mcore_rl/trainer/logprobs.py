"""Per-token log-probabilities and entropies from vocab-parallel logits, without gathering the vocabulary.

Megatron pads the vocabulary to a TP-friendly multiple; the padded rows produce logits that HF and the rollout
engine do not have. They are masked out of the softmax here, so trainer and rollout log-probs agree.

Neither function modifies its ``logits``: the trainer computes log-probs and entropy from the same model output.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from parallel.comm import all_reduce_


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Give this TP rank's padded vocabulary entries (global id >= ``vocab_size``) zero probability."""
    local = logits.shape[-1]
    valid = vocab_size - tp_rank * local
    if valid >= local:
        return logits
    ids = torch.arange(local, device=logits.device)
    return logits.masked_fill(ids >= max(valid, 0), torch.finfo(logits.dtype).min)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(target) per position from this TP rank's vocab shard of ``logits`` ([..., V/tp]); differentiable.

    Megatron's ``vocab_parallel_cross_entropy`` turns its argument into the softmax in place (megatron-core
    0.16.1, cross_entropy.py: ``-=`` max, ``exp(out=)``, ``div_``). Masking and the fp32 cast copy ``logits``,
    except for fp32 logits of an unpadded vocabulary (SmolLM2's 49152 rows), which are copied here.
    """
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    scratch = mask_padded_vocab(logits, vocab_size, tp_rank).float()
    if scratch.data_ptr() == logits.data_ptr():
        scratch = scratch.clone()
    return -vocab_parallel_cross_entropy(scratch, targets)


class _VocabParallelEntropy(torch.autograd.Function):
    """H = log sum exp(z) - sum p z over the TP-split vocabulary; dH/dz_j = -p_j (z_j - sum p z) (local)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, group) -> torch.Tensor:
        top = all_reduce_(logits.max(dim=-1, keepdim=True).values, group, "max")
        exp = torch.exp(logits - top)
        total = all_reduce_(exp.sum(dim=-1, keepdim=True), group)
        probs = exp / total
        mean_logit = all_reduce_((probs * logits).sum(dim=-1, keepdim=True), group)
        ctx.save_for_backward(probs, logits, mean_logit)
        return (torch.log(total) + top - mean_logit).squeeze(-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        probs, logits, mean_logit = ctx.saved_tensors
        return -probs * (logits - mean_logit) * grad.unsqueeze(-1), None


def token_entropy(logits: torch.Tensor, vocab_size: int, group) -> torch.Tensor:
    """Entropy of the next-token distribution per position from this TP rank's vocab shard; differentiable."""
    masked = mask_padded_vocab(logits, vocab_size, torch.distributed.get_rank(group)).float()
    return _VocabParallelEntropy.apply(masked, group)
