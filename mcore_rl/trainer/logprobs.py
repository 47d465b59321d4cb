"""Per-token log-probabilities and entropies from vocab-parallel logits, in chunks of positions.

Both come from one pass over this TP rank's vocabulary shard, ``LM_HEAD_CHUNK_BYTES`` of fp32 at a time: the
softmax of a whole micro-batch ([tokens, V/tp] in fp32, 6x the bf16 logits with the entropy's copies) is never
materialised, neither in the forward nor in the backward, which recomputes each chunk's softmax from the logits and
two saved numbers per position. Autograd keeps only the logits themselves (in the model's dtype), which the
output layer's backward needs as a gradient of the same shape anyway.

Megatron pads the vocabulary to a TP-friendly multiple; the padded rows produce logits that HF and the rollout
engine do not have. They are masked out of the softmax here, so trainer and rollout log-probs agree.
"""

from __future__ import annotations

import torch

from parallel.comm import all_reduce_

# fp32 bytes of one chunk's [positions, V/tp] logits; its working set is a few of these (LM_HEAD_CHUNK_COPIES).
LM_HEAD_CHUNK_BYTES = 256 << 20
LM_HEAD_CHUNK_COPIES = 3  # fp32 chunks alive at once: logits, exponentials (probabilities), products or gradient


def _chunk(logits: torch.Tensor, rows: slice, valid: int) -> tuple[torch.Tensor, bool]:
    """``logits[rows]`` in fp32 with the padded vocabulary (local ids >= ``valid``) at the dtype's minimum, and
    whether that is a copy the caller may overwrite (else a view of fp32 logits, never written to)."""
    z = logits[rows].float()
    if valid < z.shape[-1]:
        padded = torch.arange(z.shape[-1], device=z.device) >= max(valid, 0)
        return z.masked_fill(padded, torch.finfo(logits.dtype).min), True
    return z, logits.dtype != torch.float32


def _local_targets(targets: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets as ids into this rank's shard [start, start + width) (0 where outside) and where they are inside."""
    inside = (targets >= start) & (targets < start + width)
    return torch.where(inside, targets - start, 0), inside


class _VocabParallelScores(torch.autograd.Function):
    """log p(target) and, where asked, H = log sum exp(z) - sum p z, over the TP-split vocabulary, chunk by chunk.

    d log p(t) / dz_j = [j = t] - p_j and dH/dz_j = -p_j (z_j - sum p z): local to the shard once p and sum p z are
    known, so the backward needs no collective. The arithmetic is that of Megatron's ``vocab_parallel_cross_entropy``
    (shift by the max, exp, sum) and of the entropy over the same shifted exponentials, so the results are those
    of computing both on the whole micro-batch.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_size, group, entropy, chunk_bytes):
        width = logits.shape[-1]
        start, flat, ids = torch.distributed.get_rank(group) * width, logits.reshape(-1, width), targets.reshape(-1)
        valid = vocab_size - start
        count, step = flat.shape[0], max(1, chunk_bytes // (4 * width))  # positions a chunk
        top = torch.empty(count, dtype=torch.float32, device=logits.device)
        total, logp = torch.empty_like(top), torch.empty_like(top)
        mean = torch.empty_like(top) if entropy else None
        for begin in range(0, count, step):
            rows = slice(begin, begin + step)
            z, copy = _chunk(flat, rows, valid)
            top[rows] = all_reduce_(z.max(dim=-1).values, group, "max")
            local, inside = _local_targets(ids[rows], start, width)
            picked = torch.where(inside, z.gather(-1, local[:, None]).squeeze(-1) - top[rows], 0.0)
            shifted = z.sub_(top[rows, None]) if copy and not entropy else z - top[rows, None]  # z: for the entropy
            exp = shifted.exp_()
            sums = all_reduce_(torch.stack([exp.sum(dim=-1), picked]), group)
            total[rows], logp[rows] = sums[0], sums[1] - torch.log(sums[0])
            if entropy:
                mean[rows] = all_reduce_((exp.div_(total[rows, None]) * z).sum(dim=-1), group)
        ctx.save_for_backward(logits, targets, top, total, mean if entropy else None)
        ctx.meta = (vocab_size, start, step)
        ctx.set_materialize_grads(False)
        shape = logits.shape[:-1]
        entropy_out = (torch.log(total) + top - mean).view(shape) if entropy else None
        return logp.view(shape), entropy_out

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets, top, total, mean = ctx.saved_tensors
        vocab_size, start, step = ctx.meta
        width = logits.shape[-1]
        flat, ids = logits.reshape(-1, width), targets.reshape(-1)
        grad = torch.empty_like(flat)  # every row is written below, in the logits' dtype
        g_logp = grad_logp.reshape(-1) if grad_logp is not None else None
        g_entropy = grad_entropy.reshape(-1) if grad_entropy is not None else None
        lse = top + torch.log(total)  # p = exp(z - lse): the forward's softmax, in one pass
        valid = vocab_size - start
        for begin in range(0, flat.shape[0], step):
            rows = slice(begin, begin + step)
            z, copy = _chunk(flat, rows, valid)
            if g_entropy is None:  # -p g everywhere, + g at the target below
                p = (z.sub_(lse[rows, None]) if copy else z - lse[rows, None]).exp_()
                torch.mul(p, -g_logp[rows, None], out=grad[rows])
            else:  # -p (g + g_H (z - sum p z)), and the same + g at the target
                p = (z - lse[rows, None]).exp_()
                scale = z.sub_(mean[rows, None]) if copy else z - mean[rows, None]
                scale.mul_(g_entropy[rows, None])
                if g_logp is not None:
                    scale.add_(g_logp[rows, None])
                torch.mul(scale, p.neg_(), out=grad[rows])
            if g_logp is not None:
                local, inside = _local_targets(ids[rows], start, width)
                target = torch.where(inside, g_logp[rows], 0.0).to(grad.dtype)
                grad[rows].scatter_add_(-1, local[:, None], target[:, None])
            if valid < width:
                grad[rows, max(valid, 0) :] = 0  # padded entries: p = 0, but (z - mean) is near the dtype's minimum
        return grad.view(logits.shape), None, None, None, None, None


def token_scores(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    group,
    entropy: bool = True,
    chunk_bytes: int = LM_HEAD_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target), entropy or None) per position from this TP rank's vocab shard of ``logits`` ([..., V/tp],
    the model's dtype, not modified) over ``group`` (the TP group); both differentiable, fp32, shape [...]."""
    return _VocabParallelScores.apply(logits, targets, vocab_size, group, entropy, chunk_bytes)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, group) -> torch.Tensor:
    """log p(target) per position (:func:`token_scores` without the entropy)."""
    return token_scores(logits, targets, vocab_size, group, entropy=False)[0]
