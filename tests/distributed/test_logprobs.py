"""Vocab-parallel log-probs and entropies, chunked over positions, equal their full-vocabulary values (padding
excluded) and the trainer's unchunked computation before chunking, gradients included."""

from __future__ import annotations

import torch

from tests.distributed import cases


def _reference(logits: torch.Tensor, targets: torch.Tensor, weights: tuple[float, float]):
    """log p(target), entropy and the gradient of w_logp sum log p + w_entropy sum H over the whole vocabulary."""
    full = logits.clone().requires_grad_(True)
    logp_all = full.log_softmax(-1)
    logp, entropy = logp_all.gather(-1, targets[..., None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)
    (weights[0] * logp.sum() + weights[1] * entropy.sum()).backward()
    return logp.detach(), entropy.detach(), full.grad


def test_chunked_scores_equal_full_vocab_and_unchunked(ranks):
    vocab, generator = 300, torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, vocab, generator=generator) * 3
    targets = torch.randint(0, vocab, (2, 5), generator=generator)
    # one position a chunk, three (the last chunk short), and the whole micro-batch in one
    for tp in (1, 4):  # 4: shards of the whole vocabulary, a partly padded one and a wholly padded one
        width = -(-vocab // (128 * tp)) * 128
        sizes = [4 * width, 3 * 4 * width, 1 << 30]
        results = ranks.run(cases.vocab_parallel_scores, logits=logits, targets=targets, vocab_size=vocab, tp=tp,
                            chunk_bytes=sizes)  # fmt: skip
        for result in (r for per_rank in results for r in per_rank):
            before = result["runs"]["before"]
            # gradients: fp32 within a few ulps (p from exp(z - lse), not exp(z - max) / sum), bf16 one rounding apart
            exact = 1e-5 if result["dtype"] == "torch.float32" else 1e-2
            for size in sizes:
                logp, entropy, grad, scored_logp, scored_entropy = result["runs"][size]
                what = (tp, size, result["dtype"], result["weights"])
                assert (logp - before[0]).abs().max() <= 1e-6, what
                assert (entropy - before[1]).abs().max() <= 1e-6, what
                assert torch.allclose(grad, before[2], rtol=exact, atol=1e-6), (what, (grad - before[2]).abs().max())
                assert torch.equal(scored_logp, logp) and torch.equal(scored_entropy, entropy), what  # scoring
            if result["dtype"] == "torch.float32":
                ref_logp, ref_entropy, ref_grad = _reference(logits, targets, result["weights"])
                assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(entropy, ref_entropy, atol=1e-5)
                assert torch.allclose(grad, ref_grad, atol=1e-6), what


def test_rows_computed_in_shares_come_back_whole_and_in_order(ranks):
    """The ranks' shares of a batch (what each data-parallel replica scores: the probe's rows, old log-probs):
    equal, filled up with copies of the last row where the rows do not divide, at least ``min_rows`` each."""
    for count, min_rows, share in [(8, 1, 2), (5, 1, 2), (2, 1, 1), (4, 2, 2)]:
        expected = [[6.0 * i + 2 * j + i + 0.5 for j in range(3)] for i in range(count)]
        results = ranks.run(cases.rows_in_shares, count=count, min_rows=min_rows)
        assert all(r["result"] == expected for r in results), (count, min_rows)
        computed = [r["computed"] for r in results]
        assert all(len(rows) == share for rows in computed), (count, min_rows, computed)
        assert sorted({x for rows in computed for x in rows}) == [3.0 * i for i in range(count)]
