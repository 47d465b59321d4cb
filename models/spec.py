"""Megatron layer specs per backend: TransformerEngine on CUDA when installed, Megatron's local modules otherwise.

The local spec is Megatron's own, with one module substituted through the spec (its intended extension point):
the norm. Megatron's ``WrappedTorchNorm`` asserts that sequence parallelism is off; :class:`TorchNorm` builds the
same torch norm and tags its parameters ``sequence_parallel`` so ``finalize_model_grads`` all-reduces their
gradients over TP, as it does for TransformerEngine's norms.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

BACKENDS = ("auto", "local", "te")


class TorchNorm:
    """``torch.nn.RMSNorm``/``LayerNorm`` built from a TransformerConfig, usable with sequence parallelism."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused):
        kinds = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if config.normalization not in kinds:
            raise ValueError(f"normalization={config.normalization!r}: expected one of {sorted(kinds)}")
        norm = kinds[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``te`` on a CUDA machine with TransformerEngine installed, else ``local``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    if backend == "auto":
        has_te = importlib.util.find_spec("transformer_engine") is not None
        return "te" if torch.cuda.is_available() and has_te else "local"
    if backend == "te" and importlib.util.find_spec("transformer_engine") is None:
        raise ValueError("backend='te' needs the transformer-engine package (pip install -e .[gpu])")
    return backend


def _with_norm(spec: ModuleSpec | type, norm: type) -> ModuleSpec | type:
    return spec if spec is IdentityOp else norm


def layer_spec(config: TransformerConfig, backend: str) -> ModuleSpec:
    """The transformer-layer spec for ``config`` on ``backend`` (``local`` or ``te``)."""
    kwargs = dict(num_experts=config.num_moe_experts, qk_layernorm=config.qk_layernorm)
    if backend == "te":
        return get_gpt_layer_with_transformer_engine_spec(moe_grouped_gemm=config.moe_grouped_gemm, **kwargs)
    spec = get_gpt_layer_local_spec(normalization=config.normalization, **kwargs)
    layer = spec.submodules
    attention = layer.self_attention.submodules
    attention = dataclasses.replace(
        attention,
        q_layernorm=_with_norm(attention.q_layernorm, TorchNorm),
        k_layernorm=_with_norm(attention.k_layernorm, TorchNorm),
    )
    layer = dataclasses.replace(
        layer,
        input_layernorm=TorchNorm,
        pre_mlp_layernorm=TorchNorm,
        self_attention=dataclasses.replace(layer.self_attention, submodules=attention),
    )
    return dataclasses.replace(spec, submodules=layer)


def block_spec(config: TransformerConfig, backend: str, vp_stage: int | None) -> ModuleSpec:
    """Spec of this rank's (virtual) pipeline stage: its layers and, on the last stage, the final norm."""
    layer = layer_spec(config, backend)
    final_norm = TorchNorm
    if backend == "te":
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=final_norm),
    )
