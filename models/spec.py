"""Megatron layer specs per backend: TransformerEngine's or Megatron's local modules (which one:
:meth:`parallel.device.Device.layer_backend`).

The local spec is Megatron's own, with modules substituted through the spec (its intended extension point):

* norms: Megatron's ``WrappedTorchNorm`` asserts that sequence parallelism is off; :class:`TorchNorm` builds the
  same torch norm and tags its parameters ``sequence_parallel`` so ``finalize_model_grads`` all-reduces their
  gradients over TP, as it does for TransformerEngine's norms;
* core attention: :class:`models.attention.SDPAttention` (packed sequences, context parallelism, MLA);
* MLA's down projections: replicated ``Linear`` (as in TransformerEngine's spec) instead of column-parallel;
* routed experts: :class:`models.experts.GroupedExperts` when ``moe_grouped_gemm`` is set;
* Gated DeltaNet layers (``linear_attention_freq``): :class:`models.gated_delta.GatedDeltaNet` in place of
  self-attention, after an input norm of its own, on both backends.

Dense and MoE layers follow ``moe_layer_freq`` (DeepSeek's first dense layers); multi-token-prediction layers
(``mtp_num_layers``) take the last layer's kind, on the last pipeline stage, as Megatron places them.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
    get_gpt_mtp_block_spec_for_backend,
)
from megatron.core.post_training.modelopt.layers import Linear
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from compat.megatron_core import mla_without_te
from models.attention import SDPAttention
from models.experts import GroupedExperts
from models.gated_delta import GatedDeltaNet


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm whose weight is kept as its offset from one (``layernorm_zero_centered_gamma``; Qwen3-Next's norms,
    computed in fp32 as its checkpoints' model does)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class TorchNorm:
    """``torch.nn.RMSNorm``/``LayerNorm`` built from a TransformerConfig, usable with sequence parallelism; a
    zero-centered RMSNorm where the config says so."""

    zero_centered = True  # honours layernorm_zero_centered_gamma

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused):
        kinds = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if config.normalization not in kinds:
            raise ValueError(f"normalization={config.normalization!r}: expected one of {sorted(kinds)}")
        if cls.zero_centered and config.layernorm_zero_centered_gamma:
            if config.normalization != "RMSNorm":
                raise ValueError("layernorm_zero_centered_gamma: supported with RMSNorm only")
            norm = ZeroCenteredRMSNorm(hidden_size, eps)
        else:
            norm = kinds[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class GatedOutputNorm(TorchNorm):
    """Gated DeltaNet's norm of each value head's output: a plain RMSNorm whatever the config (its checkpoints hold
    the weight itself, not an offset from one)."""

    zero_centered = False


class _LocalProvider(LocalSpecProvider):
    """Megatron's local modules with :class:`TorchNorm` (the MTP layers' norms)."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return TorchNorm


def _with_norm(spec: ModuleSpec | type, norm: type) -> ModuleSpec | type:
    return spec if spec is IdentityOp else norm


def _local_layer(config: TransformerConfig, moe: bool) -> ModuleSpec:
    """Megatron's local layer spec with :class:`TorchNorm` norms and :class:`SDPAttention`."""
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts if moe else None,
        moe_grouped_gemm=False,  # the local spec's grouped path needs a CUDA package; see _with_grouped_experts
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
        normalization=config.normalization,
    )
    layer = spec.submodules
    attention = layer.self_attention.submodules
    norms = {
        f.name: _with_norm(getattr(attention, f.name), TorchNorm)
        for f in dataclasses.fields(attention)
        if f.name.endswith("layernorm")  # q/k (or MLA's q/kv latent) norms
    }
    attention = dataclasses.replace(attention, core_attention=SDPAttention, **norms)
    if config.multi_latent_attention:
        # Replicated down projections, as TransformerEngine's spec has them. The local spec's column-parallel
        # ones drop the other TP ranks' share of the rotary key's gradient (k_pos_emb is never reduced).
        attention = dataclasses.replace(attention, linear_q_down_proj=Linear, linear_kv_down_proj=Linear)
    layer = dataclasses.replace(
        layer,
        input_layernorm=TorchNorm,
        pre_mlp_layernorm=TorchNorm,
        self_attention=dataclasses.replace(layer.self_attention, submodules=attention),
    )
    return dataclasses.replace(spec, submodules=layer)


def _with_grouped_experts(spec: ModuleSpec) -> ModuleSpec:
    """Routed experts as :class:`GroupedExperts` (SequentialMLP's parameters, so one mapping for both backends;
    TransformerEngine's grouped linear would name the weights per expert index instead)."""
    mlp = spec.submodules.mlp
    experts = dataclasses.replace(mlp.submodules.experts, module=GroupedExperts)
    mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, experts=experts))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))


# Gated DeltaNet's submodules, the same on both backends (so one mapping serves both): Megatron's local linears and
# the plain output norm.
GATED_DELTA_NET = ModuleSpec(
    module=GatedDeltaNet,
    submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=GatedOutputNorm, out_proj=RowParallelLinear
    ),
)


def layer_spec(config: TransformerConfig, backend: str, moe: bool, linear: bool = False) -> ModuleSpec:
    """The transformer-layer spec on ``backend`` (``local`` or ``te``); ``moe``: routed experts, else dense MLP;
    ``linear``: Gated DeltaNet (linear attention) in place of self-attention, after an input norm of its own."""
    if config.multi_latent_attention:
        mla_without_te()
    if backend == "te":
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts if moe else None,
            moe_grouped_gemm=False,
            qk_layernorm=config.qk_layernorm,
            multi_latent_attention=config.multi_latent_attention,
        )
    else:
        spec = _local_layer(config, moe)
    if linear:
        norm = TorchNorm
        if backend == "te":
            from megatron.core.extensions.transformer_engine import TENorm

            norm = TENorm
        layer = dataclasses.replace(spec.submodules, input_layernorm=norm, self_attention=GATED_DELTA_NET)
        spec = dataclasses.replace(spec, submodules=layer)
    return _with_grouped_experts(spec) if moe and config.moe_grouped_gemm else spec


def moe_layers(config: TransformerConfig) -> list[bool]:
    """Which of the model's layers are MoE, from ``moe_layer_freq`` (an interval or a 0/1 list, as Megatron)."""
    if not config.num_moe_experts:
        return [False] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(config.num_layers)]
    return [bool(x) for x in freq]


def linear_attention_layers(config: TransformerConfig) -> list[bool]:
    """Which of the model's layers are Gated DeltaNet, from ``linear_attention_freq`` (Megatron's convention: an
    interval N puts one self-attention layer after N - 1 linear ones, or a 0/1 list)."""
    if config.experimental_attention_variant != "gated_delta_net":
        return [False] * config.num_layers
    freq = config.linear_attention_freq
    if isinstance(freq, int):
        return [(i + 1) % freq != 0 for i in range(config.num_layers)]
    return [bool(x) for x in freq]


def block_spec(config: TransformerConfig, backend: str, vp_stage: int | None) -> ModuleSpec:
    """Spec of this rank's (virtual) pipeline stage: its layers and, on the last stage, the final norm."""
    final_norm = TorchNorm
    if backend == "te":
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    window = slice(offset, offset + num_layers)
    kinds = list(zip(moe_layers(config)[window], linear_attention_layers(config)[window], strict=True))
    specs = {kind: layer_spec(config, backend, *kind) for kind in set(kinds)}
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=[specs[kind] for kind in kinds], layer_norm=final_norm),
    )


def mtp_block_spec(config: TransformerConfig, backend: str, vp_stage: int | None):
    """The multi-token-prediction block of this (virtual) pipeline stage, or ``None`` where it has none."""
    if not config.mtp_num_layers:
        return None
    layer = layer_spec(config, backend, moe_layers(config)[-1])
    if backend == "te":
        return get_gpt_mtp_block_spec(config, layer, use_transformer_engine=True, vp_stage=vp_stage)
    return get_gpt_mtp_block_spec_for_backend(config, layer, _LocalProvider(), vp_stage=vp_stage)
