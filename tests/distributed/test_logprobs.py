"""Vocab-parallel token statistics equal their full-vocabulary values (padding excluded), gradients included."""

from __future__ import annotations

import torch

from tests.distributed import cases


def test_vocab_parallel_entropy_matches_full_vocab(ranks):
    vocab = 300
    logits = torch.randn(2, 5, vocab, generator=torch.Generator().manual_seed(0)) * 3
    full = logits.clone().requires_grad_(True)
    probs = full.softmax(-1)
    reference = -(probs * full.log_softmax(-1)).sum(-1)
    reference.sum().backward()
    for tp in (1, 2, 4):
        for entropy, grad in ranks.run(cases.vocab_parallel_entropy, logits=logits, vocab_size=vocab, tp=tp):
            assert torch.allclose(entropy, reference.detach(), atol=1e-5), tp
            assert torch.allclose(grad, full.grad, atol=1e-6), tp
