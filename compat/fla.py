"""Stand-ins, in plain torch, for the kernels Megatron-Core 0.16.1's Gated DeltaNet (``ssm/gated_delta_net.py``) takes
from flash-linear-attention (``fla``, 0.3's ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` and
``fla.modules.l2norm.l2norm``) and from ``causal_conv1d`` (1.5's ``causal_conv1d_fn``): those are Triton/CUDA only.
Chosen where the packages do not import (every CPU machine); the GPU keeps the kernels.

Both take packed sequences (``cu_seqlens``, THD): a sequence's recurrent state and convolution window start empty at
its first token, so nothing crosses from one sequence of a pack into the next.

The chunked gated delta rule, per head with state ``S`` (key dim x value dim), token by token::

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

is computed a chunk of C tokens at a time. With ``G_i`` the cumulative log-decay inside the chunk and ``S0`` the
state entering it, the corrections solve the unit lower-triangular system ``(I + A) U = beta*V - beta*exp(G)*K S0``
with ``A_ij = beta_i exp(G_i - G_j) k_i.k_j`` (j < i); then ``O = exp(G)*Q S0 + (exp(G_i - G_j) q_i.k_j)_{j<=i} U``
and the state leaving it is ``exp(G_C) S0 + (exp(G_C - G)*K)^T U``.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
import torch.nn.functional as F

CHUNK = 64


def gated_delta_rule():
    """fla's ``chunk_gated_delta_rule`` where it is installed (an optional GPU package, not a requirement), else
    :func:`chunk_gated_delta_rule` (the same signature and results)."""
    if importlib.util.find_spec("fla") is None:
        return chunk_gated_delta_rule
    return importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` along ``dim``, as fla's ``l2norm`` (computed in fp32)."""
    y = x.float()
    return (y * torch.rsqrt(y.square().sum(dim=dim, keepdim=True) + eps)).to(x.dtype)


def _bounds(cu_seqlens: torch.Tensor | None, length: int) -> list[tuple[int, int]]:
    edges = [0, length] if cu_seqlens is None else cu_seqlens.tolist()
    return list(zip(edges[:-1], edges[1:], strict=True))


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Depthwise causal convolution with SiLU: ``x`` [batch, channels, time], ``weight`` [channels, width]; with
    ``cu_seqlens`` (batch 1) each packed sequence is convolved alone, its first tokens seeing zeros before them."""
    width = weight.shape[-1]
    parts = []
    for start, end in _bounds(cu_seqlens, x.shape[-1]):
        part = F.pad(x[..., start:end], (width - 1, 0))
        parts.append(F.conv1d(part, weight.unsqueeze(1), bias, groups=x.shape[1]))
    return F.silu(torch.cat(parts, dim=-1))


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's signature: ``q``, ``k`` [B, T, H, dk], ``v`` [B, T, H, dv], ``g`` (log decay, <= 0) and ``beta``
    [B, T, H]; ``scale`` of the queries (default ``dk ** -0.5``); ``cu_seqlens``: N packed sequences (B = 1). Each
    sequence starts from its ``initial_state`` ([B or N, H, dk, dv]; default zeros). Returns the outputs
    [B, T, H, dv] in ``v``'s dtype and, if asked, the final states [B or N, H, dk, dv] (fp32)."""
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = v.dtype
    # [B, H, T, d] in fp32
    q, k, v = (x.transpose(1, 2).float() for x in (q * scale, k, v))
    g, beta = (x.transpose(1, 2).float() for x in (g, beta))
    outputs, states = [], []
    for n, (start, end) in enumerate(_bounds(cu_seqlens, q.shape[2])):
        state = initial_state
        if state is not None:  # a batch's states, or a pack's: one per sequence
            state = (state if cu_seqlens is None else state[n : n + 1]).float()
        out, state = _sequence(*(x[:, :, start:end] for x in (q, k, v, g, beta)), state, chunk_size)
        outputs.append(out)
        states.append(state)
    out = torch.cat(outputs, dim=2).transpose(1, 2).to(dtype)
    return out, torch.cat(states) if output_final_state else None


def _sequence(q, k, v, g, beta, state, chunk_size):
    """One sequence, [B, H, T, d] (fp32): its outputs and final state."""
    batch, heads, length, dk = k.shape
    if state is None:
        state = q.new_zeros(batch, heads, dk, v.shape[-1])
    outs = []
    for start in range(0, length, chunk_size):
        chunk = slice(start, min(start + chunk_size, length))
        out, state = _chunk(q[:, :, chunk], k[:, :, chunk], v[:, :, chunk], g[:, :, chunk], beta[:, :, chunk], state)
        outs.append(out)
    return torch.cat(outs, dim=2), state


def _chunk(q, k, v, g, beta, state):
    """One chunk of C tokens from the entering ``state`` (module docstring): its outputs and the leaving state."""
    size = q.shape[2]
    cum = g.cumsum(-1)  # G
    lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i, 0 above the diagonal (masked before exp: G_i - G_j > 0 there)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    strict = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)  # A
    system = strict + torch.eye(size, dtype=q.dtype, device=q.device)
    rhs = torch.cat([beta[..., None] * v, (beta * cum.exp())[..., None] * k], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    corrections = solved[..., : v.shape[-1]] - solved[..., v.shape[-1] :] @ state  # U
    out = cum.exp()[..., None] * (q @ state) + ((q @ k.transpose(-1, -2)) * decay) @ corrections
    last = cum[..., -1:]
    state = last.exp()[..., None] * state + ((last - cum).exp()[..., None] * k).transpose(-1, -2) @ corrections
    return out, state
