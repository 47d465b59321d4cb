"""The trainer's log-probs and entropy before they were chunked (one pass over the whole micro-batch's fp32
logits): the reference :func:`mcore_rl.trainer.logprobs.token_scores` must reproduce within 1e-6, and the "before"
of the benchmark suite's LM-head memory rows (``python -m benchmarks lm_head``)."""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from parallel.comm import all_reduce_


class _UnchunkedEntropy(torch.autograd.Function):
    """H = log sum exp(z) - sum p z over the TP-split vocabulary; saves the fp32 probabilities and logits."""

    @staticmethod
    def forward(ctx, logits, group):
        top = all_reduce_(logits.max(dim=-1, keepdim=True).values, group, "max")
        exp = torch.exp(logits - top)
        total = all_reduce_(exp.sum(dim=-1, keepdim=True), group)
        probs = exp / total
        mean_logit = all_reduce_((probs * logits).sum(dim=-1, keepdim=True), group)
        ctx.save_for_backward(probs, logits, mean_logit)
        return (torch.log(total) + top - mean_logit).squeeze(-1)

    @staticmethod
    def backward(ctx, grad):
        probs, logits, mean_logit = ctx.saved_tensors
        return -probs * (logits - mean_logit) * grad.unsqueeze(-1), None


def unchunked_scores(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, group, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) from this TP rank's shard of ``logits`` as the trainer computed them before: the
    padded vocabulary masked in a fp32 copy, Megatron's ``vocab_parallel_cross_entropy`` (its softmax saved for the
    backward), the entropy with a graph only when it is optimised (``entropy_grad``)."""
    width, valid = logits.shape[-1], vocab_size - torch.distributed.get_rank(group) * logits.shape[-1]

    def masked() -> torch.Tensor:  # the padded entries at the dtype's minimum; ``logits`` itself where none are
        if valid >= width:
            return logits
        ids = torch.arange(width, device=logits.device)
        return logits.masked_fill(ids >= max(valid, 0), torch.finfo(logits.dtype).min)

    scratch = masked().float()  # vocab_parallel_cross_entropy turns its argument into the softmax in place
    logp = -vocab_parallel_cross_entropy(
        scratch.clone() if scratch.data_ptr() == logits.data_ptr() else scratch, targets
    )
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = _UnchunkedEntropy.apply(masked().float(), group)
    return logp, entropy
