"""GptOssForCausalLM (gpt-oss-20b, gpt-oss-120b): grouped-query attention with biases and a learned sink per head,
sliding-window and full attention layers alternating (``layer_types``), YaRN RoPE, and every layer a routed MoE whose
experts carry biases and a clamped, offset SwiGLU.

* Sinks: ``self_attn.sinks`` is Megatron's ``softmax_offset`` (``softmax_type="learnable"``; split over TP by head).
* Windows: HF's ``sliding_window`` W lets a query see itself and W - 1 keys before it: ``window_size=(W - 1, 0)`` on
  the layers ``window_attn_skip_freq`` marks.
* Experts: ``glu = gate * sigmoid(1.702 * gate)`` is Megatron's ``quick_gelu``; ``(up + 1) * glu`` its
  ``glu_linear_offset=1``; the gate clamped above and up both ways at ``swiglu_limit`` its
  ``activation_func_clamp_value``. The checkpoint stacks the experts (``mlp.experts.gate_up_proj`` [E, hidden, 2 *
  ffn], gate and up outputs alternating; :mod:`converters.stacks`) and stores them transposed (``x @ W``); the
  released ones in MXFP4 (``*_blocks``, ``*_scales``), dequantized on load (:class:`converters.hf_io.HFCheckpoint`).
* Routing: a router with a bias, top-k of its logits, softmax over the k (``moe_router_pre_softmax=False``).
* Megatron-Core 0.16.1 puts biases on experts only without expert tensor parallelism (``parallel.etp: 1``); beside TP
  they train right with expert parallelism only (``parallel.ep`` > 1; measured, see :meth:`GptOssBridge.validate_layout`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import torch

from compat.vllm import GPT_OSS_CPU_FP32_TOLERANCE, gpt_oss_problem
from converters.mapping import Direct, InterleavedGatedMLP, Mapping, Transposed
from converters.stacks import ExpertStack, ExpertStacks
from models.bridge import _HL, _L, DENSE_CONFIG, YARN, Bridge
from parallel.config import ParallelConfig

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

GPT_OSS_CONFIG = DENSE_CONFIG + (
    ("num_local_experts", "num_moe_experts"),
    ("num_experts_per_tok", "moe_router_topk"),
    ("router_aux_loss_coef", "moe_aux_loss_coeff"),
)
QUICK_GELU_ALPHA = 1.702  # the sigmoid gain megatron.core.activations.quick_gelu has built in
LAYER_TYPES = ("sliding_attention", "full_attention")

_E = _L + "mlp.experts.local_experts.*."
_HE = _HL + "mlp.experts.*."
_EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


@functools.cache
def yarn_config() -> type[TransformerConfig]:
    """A TransformerConfig with the YaRN fields Megatron-Core 0.16.1's GPTModel reads by ``getattr`` from a config
    that declares none (gpt_model.py:179; attention.py:1102 through ``hasattr``): as fields, they survive
    ``dataclasses.replace``. (Made on first use: the registry imports this module without Megatron-Core.)"""
    from megatron.core.transformer.transformer_config import TransformerConfig

    @dataclasses.dataclass
    class YarnConfig(TransformerConfig):
        yarn_rotary_scaling_factor: float = 1.0
        yarn_original_max_position_embeddings: int = 4096
        yarn_beta_fast: float = 32.0
        yarn_beta_slow: float = 1.0
        yarn_mscale: float | None = None
        yarn_mscale_all_dim: float | None = None
        yarn_correction_range_round_to_int: bool = True

    return YarnConfig


class GptOssBridge(Bridge):
    architecture = "GptOssForCausalLM"
    model_type = "gpt_oss"
    config_table = GPT_OSS_CONFIG
    rope_types = ("default", "yarn")

    @property
    def num_experts(self) -> int:
        return self.hf["num_local_experts"]

    @property
    def attention_bias(self) -> bool:
        return bool(self.hf.get("attention_bias", True))  # transformers' default for this family

    @property
    def layer_types(self) -> list[str]:
        default = [LAYER_TYPES[i % 2] for i in range(self.hf["num_hidden_layers"])]
        return self.hf.get("layer_types") or default

    @property
    def sliding_window(self) -> bool:
        return "sliding_attention" in self.layer_types

    @property
    def swiglu_limit(self) -> float:
        return float(self.hf.get("swiglu_limit", 7.0))  # transformers' default

    @property
    def position_embedding_type(self) -> str:
        return "yarn" if self.rope_type == "yarn" else "rope"

    def check_supported(self) -> None:
        super().check_supported()
        hf = self.hf
        if (alpha := hf.get("swiglu_alpha", QUICK_GELU_ALPHA)) != QUICK_GELU_ALPHA:
            raise ValueError(
                f"{self.architecture}: swiglu_alpha={alpha} is not supported (Megatron's quick_gelu: 1.702)"
            )
        if set(self.layer_types) - set(LAYER_TYPES) or len(self.layer_types) != hf["num_hidden_layers"]:
            raise ValueError(
                f"{self.architecture}: layer_types must name each of the {hf['num_hidden_layers']} layers one of "
                f"{list(LAYER_TYPES)} (got {self.layer_types})"
            )
        if self.sliding_window and not hf.get("sliding_window"):
            raise ValueError(f"{self.architecture}: sliding_attention layers need a sliding_window")

    def validate_layout(self, parallel: ParallelConfig) -> None:
        super().validate_layout(parallel)
        if parallel.expert_tp != 1:
            raise ValueError(
                f"parallel.etp={parallel.expert_tp}: Megatron-Core 0.16.1 has expert biases only without expert tensor "
                "parallelism; set parallel.etp: 1"
            )
        if parallel.tp > 1 and parallel.ep == 1:
            # Measured on the tiny gpt-oss (test_bridges' train step): with ep 1 the experts sit in the dense gradient
            # buffers and the step's gradient norm at TP 2 is not the single rank's (1.1952 vs 1.1968); with ep 2 it is.
            raise ValueError(
                f"parallel.tp={parallel.tp} with ep=1: gpt-oss's expert biases train right beside TP only with expert "
                "parallelism; set parallel.ep > 1 (or tp: 1)"
            )
        if parallel.cp > 1 and self.sliding_window:
            raise ValueError(
                f"parallel.cp={parallel.cp}: sliding-window layers have no context parallelism here; cp: 1"
            )

    def config_class(self) -> type[TransformerConfig]:
        return yarn_config()

    def extra_config(self) -> dict:
        from megatron.core.activations import quick_gelu

        hf = self.hf
        aux = float(hf.get("router_aux_loss_coef", 0.0))
        fields = dict(
            add_bias_linear=True,  # o_proj, the router, the experts
            activation_func=quick_gelu,
            glu_linear_offset=1.0,
            activation_func_clamp_value=self.swiglu_limit,
            bias_activation_fusion=False,
            softmax_type="learnable",
            window_size=(hf["sliding_window"] - 1, 0) if self.sliding_window else None,
            window_attn_skip_freq=[int(t == "sliding_attention") for t in self.layer_types],
            moe_ffn_hidden_size=hf["intermediate_size"],
            moe_router_pre_softmax=False,
            moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=True,
        )
        if self.rope_type == "yarn":
            rope = self.rope_scaling
            fields |= {"yarn_" + mcore: rope[key] for key, mcore in YARN if rope.get(key) is not None}
            if not (rope.get("mscale") and rope.get("mscale_all_dim")):  # HF uses both or neither
                fields |= dict(yarn_mscale=None, yarn_mscale_all_dim=None)
            fields["yarn_correction_range_round_to_int"] = bool(rope.get("truncate", True))
        return fields

    def engine_problem(self, cuda: bool, dtype: str) -> str | None:
        quantized = "quantization_config" in self.hf
        return gpt_oss_problem(self.layer_types, self.swiglu_limit, self.rope_type, quantized)

    def engine_tolerance(self, cuda: bool, dtype: torch.dtype) -> tuple[float, float] | None:
        return GPT_OSS_CPU_FP32_TOLERANCE if not cuda and dtype == torch.float32 else None

    def expert_stacks(self) -> ExpertStacks:
        stacks = [ExpertStack(_HL + "mlp.experts." + name, _HE + name) for name in _EXPERT_TENSORS]
        return ExpertStacks(stacks, self.num_experts)

    def attention_mappings(self) -> list[Mapping]:
        return [
            *super().attention_mappings(),
            Direct(_L + "self_attention.linear_proj.bias", _HL + "self_attn.o_proj.bias"),
            Direct(_L + "self_attention.core_attention.softmax_offset", _HL + "self_attn.sinks", tp_axis=0),
        ]

    def mlp_mappings(self) -> list[Mapping]:
        return [
            Direct(_L + "pre_mlp_layernorm.weight", _HL + "post_attention_layernorm.weight"),
            Direct(_L + "mlp.router.weight", _HL + "mlp.router.weight"),
            Direct(_L + "mlp.router.bias", _HL + "mlp.router.bias"),
            InterleavedGatedMLP(_E + "linear_fc1.weight", (_HE + "gate_up_proj",), transposed=True),
            InterleavedGatedMLP(_E + "linear_fc1.bias", (_HE + "gate_up_proj_bias",)),
            Transposed(_E + "linear_fc2.weight", (_HE + "down_proj",), tp_axis=1),
            Direct(_E + "linear_fc2.bias", _HE + "down_proj_bias"),
        ]
