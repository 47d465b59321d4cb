"""The plain-torch Gated DeltaNet kernels (compat/fla.py) against transformers' own implementations of Qwen3-Next's
(its chunked and token-by-token references), and packed sequences against each sequence alone."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from compat.fla import causal_conv1d, chunk_gated_delta_rule, l2norm


def _inputs(batch: int, length: int, heads: int = 4, dk: int = 32, dv: int = 48, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(batch, length, heads, dk, generator=g), torch.randn(batch, length, heads, dk, generator=g)
    v = torch.randn(batch, length, heads, dv, generator=g)
    decay = -torch.rand(batch, length, heads, generator=g)  # log decays, <= 0
    beta = torch.rand(batch, length, heads, generator=g)
    return q, k, v, decay, beta


@pytest.mark.parametrize("length", [1, 63, 64, 150])  # shorter than a chunk, one and a bit, several
def test_the_chunked_rule_is_transformers_chunked_and_token_by_token_rules(length):
    q, k, v, decay, beta = _inputs(2, length)
    state = torch.randn(2, 4, 32, 48, generator=torch.Generator().manual_seed(1))
    ours, our_state = chunk_gated_delta_rule(
        q, k, v, decay, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    for reference in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        want, want_state = reference(
            q, k, v, decay, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        assert (ours - want).abs().max().item() <= 2e-5 and (our_state - want_state).abs().max().item() <= 2e-5


def test_gradients_are_the_token_by_token_rule_s():
    inputs = [x.requires_grad_() for x in _inputs(1, 70, seed=2)]
    ours, _ = chunk_gated_delta_rule(*inputs, use_qk_l2norm_in_kernel=True)
    ours_grads = torch.autograd.grad((ours * torch.linspace(-1, 1, ours.numel()).view_as(ours)).sum(), inputs)
    want, _ = hf.torch_recurrent_gated_delta_rule(*inputs, use_qk_l2norm_in_kernel=True)
    want_grads = torch.autograd.grad((want * torch.linspace(-1, 1, want.numel()).view_as(want)).sum(), inputs)
    for got, expected in zip(ours_grads, want_grads, strict=True):
        assert (got - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()


def test_a_packed_sequence_starts_from_an_empty_state_and_convolution_window():
    """Three sequences in one pack (THD, cu_seqlens): each one's outputs and final state are its own alone."""
    lengths = [5, 70, 33]
    cu = torch.tensor([0, 5, 75, 108])
    packed = _inputs(1, sum(lengths), seed=3)
    out, states = chunk_gated_delta_rule(*packed, cu_seqlens=cu, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert states.shape == (3, 4, 32, 48)
    x = torch.randn(1, 16, sum(lengths), generator=torch.Generator().manual_seed(4))
    weight, bias = torch.randn(16, 4), torch.randn(16)
    conv = causal_conv1d(x, weight, bias, cu_seqlens=cu)
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        alone, state = hf.torch_recurrent_gated_delta_rule(
            *(t[:, start:end] for t in packed), output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        assert (out[:, start:end] - alone).abs().max().item() <= 2e-5
        assert (states[n : n + 1] - state).abs().max().item() <= 2e-5
        reference = hf.causal_conv1d_fn(x[..., start:end], weight, bias, activation="silu")
        assert (conv[..., start:end] - reference).abs().max().item() <= 1e-6


def test_l2norm_is_fla_s():
    x = torch.randn(3, 7, 16)
    assert torch.allclose(l2norm(x), hf.l2norm(x), atol=1e-7)
    assert l2norm(x.bfloat16()).dtype == torch.bfloat16
