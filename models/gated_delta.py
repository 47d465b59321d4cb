"""Gated DeltaNet (Qwen3-Next's linear attention) in Megatron's layers, on every device and through packed sequences.

Megatron-Core 0.16.1's ``GatedDeltaNet`` holds the parameters (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``,
``out_norm``, ``out_proj``, each sharded over TP by heads) but runs only with flash-linear-attention's CUDA kernels
and refuses packed sequences. :class:`GatedDeltaNet` keeps its parameters and state dict and has its own forward:
the kernel of :func:`compat.fla.gated_delta_rule` (fla's where it imports, plain torch elsewhere), and with THD packs
(``PackedSeqParams.cu_seqlens_q``) each sequence's convolution window and recurrent state start empty at its first
token. Context parallelism is refused by the bridge (Megatron-Core has none for it yet).

Per TP rank, ``in_proj``'s output is ``[q | k | v | z | b | a]`` of the rank's heads (key heads for q/k, value heads
for the rest; each key head serves ``num_value_heads / num_key_heads`` value heads), ``conv1d`` mixes ``[q | k | v]``
channel by channel over the last ``linear_conv_kernel_dim`` tokens, and the output is the rule's, normed per value
head and gated by ``silu(z)``, through ``out_proj``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGatedDeltaNet

from compat.fla import causal_conv1d, gated_delta_rule, l2norm
from compat.megatron_core import gated_delta_net_tensor_parallel, gated_delta_net_without_fla


class GatedDeltaNet(MegatronGatedDeltaNet):
    """Megatron's Gated DeltaNet with the forward described in the module docstring."""

    def __init__(self, *args, **kwargs):
        gated_delta_net_without_fla()
        super().__init__(*args, **kwargs)
        self.rule = gated_delta_rule()
        gated_delta_net_tensor_parallel(self)

    def reset_parameters(self) -> None:
        """Megatron's initialisation, drawn outside its CUDA RNG tracker: on CPU that tracker forks the CPU generator
        itself and warns, once per layer, that the CPU state changed inside it (every checkpoint load overwrites
        these anyway)."""
        if self.config.perform_initialization:
            if self.conv_init is not None:
                torch.nn.init.uniform_(self.conv1d.weight, -self.conv_init, self.conv_init)
            with torch.no_grad():
                self.dt_bias.fill_(1.0)
                self.A_log.copy_(torch.empty_like(self.A_log).uniform_(*self.A_init_range).log())

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        key_value_states=None,
        inference_context=None,
        attention_bias=None,
        packed_seq_params: PackedSeqParams | None = None,
        sequence_len_offset=None,
        **kwargs,
    ):
        """``hidden_states`` [s, b, h] (or [s/tp, b, h] under sequence parallelism) -> (out, bias)."""
        if inference_context is not None:
            raise NotImplementedError("GatedDeltaNet: no inference context (the rollout engine generates)")
        cu_seqlens = None
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise NotImplementedError("GatedDeltaNet: packed sequences are THD only (no shared-prompt rows)")
            padded = packed_seq_params.cu_seqlens_q_padded
            cu_seqlens = (padded if padded is not None else packed_seq_params.cu_seqlens_q).to(torch.long)
        projected, _ = self.in_proj(hidden_states)
        projected = projected.transpose(0, 1)  # [b, s, D/tp]
        batch, length = projected.shape[:2]
        qk, v_dim, heads = self.qk_dim // self.tp_size, self.v_dim // self.tp_size, self.num_v_heads_local_tp
        qkv, gate, beta, alpha = projected.split([2 * qk + v_dim, v_dim, heads, heads], dim=-1)
        weight = self.conv1d.weight.squeeze(1)
        qkv = causal_conv1d(qkv.transpose(1, 2), weight, self.conv1d.bias, cu_seqlens).transpose(1, 2)
        query, key, value = qkv.split([qk, qk, v_dim], dim=-1)
        query, key = (l2norm(x.reshape(batch, length, -1, self.key_head_dim)) for x in (query, key))
        repeats = self.num_value_heads // self.num_key_heads
        query, key = (x.repeat_interleave(repeats, dim=2) for x in (query, key))
        value = value.reshape(batch, length, heads, self.value_head_dim)
        decay = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias.float())
        out, _ = self.rule(query, key, value, g=decay, beta=beta.sigmoid(), cu_seqlens=cu_seqlens)
        gate = gate.reshape(batch, length, heads, self.value_head_dim)
        out = (self.out_norm(out) * F.silu(gate.float())).to(hidden_states.dtype)
        out, bias = self.out_proj(out.reshape(batch, length, -1).transpose(0, 1).contiguous())
        return out, bias
