"""Core attention without TransformerEngine: torch ``scaled_dot_product_attention`` for Megatron's layers.

Megatron's local ``DotProductAttention`` supports neither packed sequences, nor context parallelism, nor MLA's
different query/key and value head sizes. :class:`SDPAttention` replaces it through the layer spec
(:mod:`models.spec`) and supports all three:

* padded batches (``sbhd``): one causal SDPA call;
* packed batches (``thd``, ``PackedSeqParams.cu_seqlens_*``): one causal call per sequence, so no token attends
  across a sequence boundary;
* shared-prompt rows (``sbhd`` segments with a mask, :func:`mcore_rl.trainer.packing.share_prompt_rows`): one masked call
  per segment;
* context parallelism: each CP rank holds chunks ``r`` and ``2*CP-1-r`` of every sequence (Megatron's
  load-balanced split, also what its RoPE assumes); keys and values are all-gathered over the CP group (one
  collective for both) and each query attends to the keys at or before its global position;
* sliding windows (``window_size``, on the layers ``window_attn_skip_freq`` picks): each query attends to the
  ``window_size[0]`` keys before it and itself, in padded and packed batches;
* attention sinks (``softmax_type``: a learnable or zero logit per head that joins every softmax with a zero value,
  gpt-oss): one more key that every query sees, as ``softmax_offset`` (Megatron's name and TP split).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    is_layer_window_attention,
    make_sharded_tensors_for_checkpoint,
)

from parallel.comm import all_gather_with_grad
from parallel.context import load_balanced_positions

CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)
# Zero dimensions a sink adds to query and key heads (the first carries its logit): a multiple of 8 keeps fused
# kernels' head-size alignment.
_SINK_DIMS = 8


def _in_global_order(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Every CP rank's local (two-chunk) tensor, ordered by rank -> the whole sequence in order along ``dim``."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        chunks[rank], chunks[2 * cp - 1 - rank] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


class SDPAttention(MegatronModule):
    """Drop-in core attention (same constructor and forward as Megatron's, TE-style MLA arguments included)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group, self.tp_group = pg_collection.cp, pg_collection.tp
        self.cp = torch.distributed.get_world_size(self.cp_group)
        self.attn_mask_type = attn_mask_type
        head_dim = k_channels or config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.window = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            if config.window_size[1] != 0 or config.window_size[0] < 0:
                raise ValueError(f"SDPAttention: window_size={config.window_size}: only causal windows (left, 0)")
            self.window = config.window_size[0]
        heads = config.num_attention_heads // torch.distributed.get_world_size(pg_collection.tp)
        if config.softmax_type == "learnable":
            offset = torch.empty(heads, dtype=config.params_dtype)
            if config.perform_initialization:
                config.init_method(offset)
            self.softmax_offset = torch.nn.Parameter(offset)
        elif config.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads), persistent=False)
        else:
            self.softmax_offset = None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Learned sinks split over TP by head, under Megatron's ``DotProductAttention``'s key (its checkpoints and
        TransformerEngine's load here); without them, Megatron's default."""
        if not isinstance(self.softmax_offset, torch.nn.Parameter):
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return make_sharded_tensors_for_checkpoint(
            {"softmax_offset": self.softmax_offset},
            prefix,
            {"softmax_offset": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"],
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """``sbhd`` [s, b, heads, d] -> [s, b, heads*dv]; ``thd`` [t, heads, d] -> [t, heads*dv]."""
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention: attention_bias is not supported")
        mask_type = attn_mask_type or self.attn_mask_type
        if attention_mask is None and mask_type not in CAUSAL:
            raise NotImplementedError(f"SDPAttention: mask type {mask_type} without a mask is not supported")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "sbhd":
            if attention_mask is None or self.cp > 1 or self.window is not None:
                raise NotImplementedError(
                    "SDPAttention: sbhd segments need a segment mask, no context parallelism and no sliding window"
                )
            out = self._segments(query, key, value, attention_mask, packed_seq_params)
            return out.reshape(out.shape[0], out.shape[1], -1)
        if packed_seq_params is not None:
            if attention_mask is not None:
                raise NotImplementedError("SDPAttention: packed sequences take no attention_mask")
            out = self._packed(query, key, value, packed_seq_params)
            return out.reshape(out.shape[0], -1)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
        if attention_mask is not None:  # Megatron's convention: True = masked out
            if self.cp > 1:
                raise NotImplementedError("SDPAttention: explicit attention masks with context parallelism")
            out = self._sdpa(q, k, v, mask=~attention_mask)
        else:
            out = self._causal(q, k, v, seq_dim=2)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

    def _packed(self, q, k, v, params: PackedSeqParams) -> torch.Tensor:
        """One causal call per sequence of the pack; ``cu_seqlens`` are whole-sequence offsets (as under CP)."""
        bounds = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        local = (bounds // self.cp).tolist()
        kv = self._gather(k, v)  # the whole pack of every CP rank, gathered once
        outs = []
        for start, end in zip(local[:-1], local[1:], strict=True):
            # [t_i, heads, d] -> [1, heads, t_i, d]: with a batch dimension, as CPU's flash kernel needs (3-D
            # inputs take the math kernel, which keeps [heads, t_i, t_i] scores for backward and is 3x slower)
            qi = q[start:end].transpose(0, 1)[None]
            if kv is None:
                ki, vi = (x[start:end].transpose(0, 1)[None] for x in (k, v))
                out = self._sdpa(qi, ki, vi, causal=True)
            else:
                parts = [part[start:end].transpose(0, 1)[None] for part in kv]
                out = self._attend_gathered(qi, parts, k.shape[-1], 2)
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs)

    def _segments(self, q, k, v, mask, params: PackedSeqParams) -> torch.Tensor:
        """Independent segments of one sbhd row (shared-prompt groups): ``cu_seqlens_q`` bounds them and ``mask``
        [1, 1, s, longest segment] masks each position's keys relative to its segment's start; no position
        attends outside its segment, so nothing is computed there."""
        bounds = params.cu_seqlens_q.tolist()
        outs = []
        for start, end in itertools.pairwise(bounds):
            qi, ki, vi = (x[start:end].permute(1, 2, 0, 3) for x in (q, k, v))  # [1, heads, len, d]
            outs.append(self._sdpa(qi, ki, vi, mask=~mask[:, :, start:end, : end - start]).permute(2, 0, 1, 3))
        return torch.cat(outs)

    def _causal(self, q, k, v, seq_dim: int) -> torch.Tensor:
        kv = self._gather(k, v)
        if kv is None:
            return self._sdpa(q, k, v, causal=True)
        return self._attend_gathered(q, list(kv), k.shape[-1], seq_dim)

    def _gather(self, k, v) -> torch.Tensor | None:
        """[cp, *k.shape[:-1], dk+dv] from every CP rank, or None without CP. Keys and values travel together: one
        all-gather per layer, whatever their head sizes (MLA)."""
        return all_gather_with_grad(torch.cat([k, v], dim=-1), self.cp_group) if self.cp > 1 else None

    def _attend_gathered(self, q, kv_parts: list[torch.Tensor], key_dim: int, seq_dim: int) -> torch.Tensor:
        """Attention of this rank's two query chunks to the keys at or before their global positions."""
        k, v = _in_global_order(kv_parts, seq_dim).split([key_dim, kv_parts[0].shape[-1] - key_dim], dim=-1)
        length = k.shape[seq_dim]
        positions = load_balanced_positions(length, self.cp, torch.distributed.get_rank(self.cp_group), q.device)
        visible = torch.arange(length, device=q.device) <= positions[:, None]  # [local, length]
        return self._sdpa(q, k, v, mask=visible)

    def _sdpa(self, q, k, v, mask=None, causal=False) -> torch.Tensor:
        """Attention of ``q`` [b, heads, lq, d] to ``k``/``v``: under ``mask`` (True: attends; Megatron's opposite is
        inverted by the callers) or causal (query i to keys 0..i), within this layer's window, with its sinks."""
        if self.window is not None:
            if not causal:
                raise NotImplementedError("SDPAttention: sliding windows with masks (context parallelism, segments)")
            positions = torch.arange(q.shape[-2], device=q.device)
            distance = positions[:, None] - positions[None, :]  # query minus key position
            mask, causal = (distance >= 0) & (distance <= self.window), False
        first_query = 0
        if self.softmax_offset is not None:
            q, k, v, mask, first_query = self._with_sink(q, k, v, mask, causal)
        value_dim = v.shape[-1]
        if value_dim < q.shape[-1]:
            # MLA's values are narrower than its keys; flash kernels (CPU's among them) need one head size, so v
            # gets zero columns, which only add zero columns to the output
            v = F.pad(v, (0, q.shape[-1] - value_dim))
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=q.shape[-3] != k.shape[-3],
        )
        return out[..., first_query:, :value_dim]

    def _with_sink(self, q, k, v, mask, causal):
        """``q``, ``k``, ``v``, ``mask`` with the sink as key 0, and the index of the first real query.

        The sink logit ``s_h`` of query head h is not a product of two heads' vectors, so every head gets
        ``_SINK_DIMS`` more dimensions: queries hold ``s_h / scale`` in the first, real keys zeros, the sink key a 1
        (its logit is ``s_h`` for every query of head h, also under grouped-query attention, where it is shared) and
        its value zeros. Causal attention is aligned at the first query and key, so a first query row is added as
        well (query i + 1 then sees the sink and keys 0..i) and dropped from the output."""
        b, heads, length, dim = q.shape
        sink = (self.softmax_offset.to(q.dtype) / self.scale).view(1, heads, 1, 1).expand(b, heads, length, 1)
        q = torch.cat([q, sink, q.new_zeros(b, heads, length, _SINK_DIMS - 1)], dim=-1)
        k = F.pad(k, (0, _SINK_DIMS))
        sink_key = k.new_zeros(*k.shape[:2], 1, dim + _SINK_DIMS)
        sink_key[..., dim] = 1
        k = torch.cat([sink_key, k], dim=-2)
        v = torch.cat([v.new_zeros(*v.shape[:2], 1, v.shape[-1]), v], dim=-2)
        if mask is not None:
            return q, k, v, F.pad(mask, (1, 0), value=True), 0
        if causal:
            return torch.cat([q.new_zeros(b, heads, 1, q.shape[-1]), q], dim=-2), k, v, None, 1
        return q, k, v, None, 0
