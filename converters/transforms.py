"""Pure layout transforms between Hugging Face tensors and Megatron's (TP-ordered) tensors.

No collectives and no process groups here: every function maps tensors to tensors, so each is unit-testable in
one process. "Full Megatron tensor" means the concatenation of the TP shards along the TP axis, i.e. the tensor
whose ``tp`` equal chunks are the shards of ranks 0..tp-1.
"""

from __future__ import annotations

import torch

from compat.torch import cat


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """Interleave Q/K/V per query group: ``[g0: q(heads/groups), k, v][g1: ...]`` (works for weights and biases).

    Example: 4 query heads, 2 groups, head_dim d -> rows ``[q0 q1 k0 v0 | q2 q3 k1 v1]`` (each block d rows), so a
    TP split on group boundaries gives every rank its own heads with their K/V.
    """
    rest = q.shape[1:]
    g = num_query_groups
    return cat([q.reshape(g, -1, *rest), k.reshape(g, -1, *rest), v.reshape(g, -1, *rest)], dim=1).reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, num_attention_heads: int, num_query_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`merge_qkv`."""
    rest = qkv.shape[1:]
    g = num_query_groups
    per_group_q = num_attention_heads // g * head_dim
    grouped = qkv.reshape(g, per_group_q + 2 * head_dim, *rest)
    q, k, v = torch.split(grouped, [per_group_q, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def merge_gated_qkv(
    q_gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_attention_heads: int, num_query_groups: int
) -> torch.Tensor:
    """Queries with an output gate (Qwen3-Next's ``q_proj``: each head's queries, then its gate) and K/V ->
    Megatron's ``linear_qkv`` with ``attention_output_gate``: per query group ``[q heads | gate heads | k | v]``
    (:func:`merge_qkv` of the group's queries, then gates, as its queries)."""
    rest = q_gate.shape[1:]
    g, per_group = num_query_groups, num_attention_heads // num_query_groups
    grouped = q_gate.reshape(g, per_group, 2, -1, *rest).transpose(1, 2)  # [group, (q, gate), head, head_dim, ...]
    return merge_qkv(grouped.reshape(-1, *rest), k, v, g)


def split_gated_qkv(
    qkv: torch.Tensor, num_attention_heads: int, num_query_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`merge_gated_qkv`."""
    rest = qkv.shape[1:]
    g, per_group = num_query_groups, num_attention_heads // num_query_groups
    q_gate, k, v = split_qkv(qkv, 2 * num_attention_heads, g, head_dim)
    heads = q_gate.reshape(g, 2, per_group, head_dim, *rest).transpose(1, 2)  # [group, head, (q, gate), ...]
    return heads.reshape(-1, *rest), k, v


def merge_per_rank(parts: list[torch.Tensor], tp: int) -> torch.Tensor:
    """Tensors whose TP rank i holds ``[part_0 chunk i; part_1 chunk i; ...]`` (a fused projection of several
    parts, each split over TP by rows)."""
    chunks = [part.chunk(tp) for part in parts]
    return cat([c[rank] for rank in range(tp) for c in chunks])


def split_per_rank(full: torch.Tensor, sizes: list[int], tp: int) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`merge_per_rank` for parts of ``sizes`` rows."""
    shards = [shard.split([n // tp for n in sizes]) for shard in full.chunk(tp)]
    return tuple(cat([shard[i] for shard in shards]) for i in range(len(sizes)))


def merge_gated(gate: torch.Tensor, up: torch.Tensor, tp: int) -> torch.Tensor:
    """Megatron's fused ``linear_fc1`` holds ``[gate_i; up_i]`` on TP rank i (:func:`merge_per_rank` of the two)."""
    return merge_per_rank([gate, up], tp)


def split_gated(fc1: torch.Tensor, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`merge_gated`; at TP 1, views of ``fc1`` (a weight sync exports every layer's: no copies)."""
    if tp == 1:
        return fc1.chunk(2)
    return split_per_rank(fc1, [fc1.shape[0] // 2] * 2, tp)


def permute_rope_rows(
    weight: torch.Tensor, period: int, offset: int, rope_dim: int, inverse: bool = False
) -> torch.Tensor:
    """De-interleave (``inverse``: interleave) rows ``offset:offset+rope_dim`` of every ``period``-row block.

    Example, rope_dim 4: block rows ``[n0 | r0 r1 r2 r3]`` -> ``[n0 | r0 r2 r1 r3]``.
    """
    if weight.shape[0] % period:
        raise ValueError(f"{weight.shape[0]} rows are not whole blocks of {period}")
    rope = torch.arange(rope_dim).reshape(rope_dim // 2, 2).t().reshape(-1)  # 0 2 4 ... 1 3 5 ...
    if inverse:
        rope = torch.argsort(rope)
    block = torch.arange(period)
    block[offset : offset + rope_dim] = offset + rope
    index = (torch.arange(weight.shape[0] // period)[:, None] * period + block).reshape(-1)
    return weight[index]


def pad_vocab(weight: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Zero rows up to Megatron's padded vocabulary (a multiple of TP * make_vocab_size_divisible_by)."""
    if weight.shape[0] > padded_rows:
        raise ValueError(f"vocabulary of {weight.shape[0]} rows does not fit the model's {padded_rows}")
    if weight.shape[0] == padded_rows:
        return weight
    pad = weight.new_zeros(padded_rows - weight.shape[0], *weight.shape[1:])
    return cat([weight, pad])


def full_shape(shape: torch.Size, axis: int | None, size: int) -> torch.Size:
    """The shape of the full tensor whose TP shards (over ``size`` ranks, on ``axis``) have ``shape``."""
    if axis is None:
        return torch.Size(shape)
    dims = list(shape)
    dims[axis] *= size
    return torch.Size(dims)


def shard(full: torch.Tensor, axis: int | None, rank: int, size: int) -> torch.Tensor:
    """This rank's TP chunk of a full Megatron tensor (``axis=None``: replicated)."""
    if axis is None or size == 1:
        return full
    if full.shape[axis] % size:
        raise ValueError(f"dim {axis} of shape {tuple(full.shape)} is not divisible by the TP size {size}")
    return full.chunk(size, dim=axis)[rank]
