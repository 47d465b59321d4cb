"""Qwen3NextForCausalLM (Qwen3-Next-80B-A3B): Gated DeltaNet (linear attention) layers, every ``full_attention_interval``
-th layer gated self-attention instead, every layer a routed MoE with a gated shared expert.

* Gated DeltaNet (``layer_types`` "linear_attention"): Megatron's ``experimental_attention_variant`` with
  ``linear_attention_freq``, run by :class:`models.gated_delta.GatedDeltaNet` (packed sequences, plain-torch kernels
  where fla is absent). The checkpoint groups ``in_proj_qkvz`` and ``in_proj_ba`` by key head; Megatron holds
  ``[q | k | v | z | b | a]`` of its heads per TP rank (:class:`converters.mapping.GatedDeltaInProj`).
* Self-attention layers: queries with a sigmoid output gate per head (``attention_output_gate``), q/k norms, RoPE on
  ``partial_rotary_factor`` of each head.
* Norms are zero-centered (``1 + weight``, ``layernorm_zero_centered_gamma``), but Gated DeltaNet's output norm.
* MoE: Qwen3-MoE's (:class:`models.qwen3_moe.Qwen3MoeBridge`: softmax routing, top-k renormalised, every layer
  MoE), and a shared expert scaled by ``sigmoid`` of its own gate (``moe_shared_expert_gate``).
* The checkpoint's multi-token-prediction layers (``mtp.*``) are not loaded: no Megatron mapping yet, so a
  conversion back to HF holds none.
"""

from compat.vllm import gated_delta_net_problem
from converters.mapping import Direct, GatedDeltaInProj, GatedMLP, GatedQKV, Mapping, PerRankParts
from models.bridge import _HL, _L, DENSE_CONFIG
from models.qwen3_moe import MOE_CONFIG, Qwen3MoeBridge
from parallel.config import ParallelConfig

LINEAR_ATTENTION_CONFIG = tuple(
    (key, key)
    for key in (
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
    )
)
SHARED_EXPERT_CONFIG = (("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"),)

_A = _L + "self_attention."
_HG = _HL + "linear_attn."


class Qwen3NextBridge(Qwen3MoeBridge):
    """Qwen3-MoE's routing and config (every layer MoE), with the layers above."""

    architecture = "Qwen3NextForCausalLM"
    model_type = "qwen3_next"
    value_architecture = None
    config_table = DENSE_CONFIG + LINEAR_ATTENTION_CONFIG + MOE_CONFIG + SHARED_EXPERT_CONFIG

    @property
    def layer_types(self) -> list[str]:
        interval = self.hf.get("full_attention_interval", 4)
        default = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(self.layers)]
        return self.hf.get("layer_types") or default

    @property
    def linear_attention(self) -> bool:
        return "linear_attention" in self.layer_types

    @property
    def layers(self) -> int:
        return self.hf["num_hidden_layers"]

    def check_supported(self) -> None:
        super().check_supported()
        if self.hf.get("attention_bias"):
            raise ValueError(f"{self.architecture}: attention_bias=True is not supported")
        unknown = set(self.layer_types) - {"linear_attention", "full_attention"}
        if unknown or len(self.layer_types) != self.layers:
            raise ValueError(
                f"{self.architecture}: layer_types must name each of the {self.layers} layers 'linear_attention' or "
                f"'full_attention' (got {self.layer_types})"
            )

    def validate_layout(self, parallel: ParallelConfig) -> None:
        super().validate_layout(parallel)
        if parallel.cp > 1:
            raise ValueError(
                f"parallel.cp={parallel.cp}: Gated DeltaNet has no context parallelism in Megatron-Core 0.16.1; "
                "use cp: 1"
            )
        for key in ("linear_num_key_heads", "linear_num_value_heads"):
            if self.hf[key] % parallel.tp:
                raise ValueError(f"{key}={self.hf[key]} is not divisible by tp={parallel.tp}")

    def extra_config(self) -> dict:
        return super().extra_config() | dict(
            layernorm_zero_centered_gamma=True,
            attention_output_gate=True,
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=[int(t == "linear_attention") for t in self.layer_types],
            moe_shared_expert_gate=True,
        )

    def attention_mappings(self) -> list[Mapping]:
        hf = self.hf
        qkv = tuple(_HL + f"self_attn.{p}_proj.weight" for p in "qkv")
        key = hf["linear_key_head_dim"] * hf["linear_num_key_heads"]
        value = hf["linear_value_head_dim"] * hf["linear_num_value_heads"]
        return [
            GatedQKV(
                _A + "linear_qkv.weight",
                qkv,
                num_attention_heads=hf["num_attention_heads"],
                num_query_groups=hf["num_key_value_heads"],
                head_dim=hf["head_dim"],
            ),
            # TransformerEngine fuses the pre-attention norm into linear_qkv.
            Direct(_A + "linear_qkv.layer_norm_weight", _HL + "input_layernorm.weight"),
            Direct(_A + "q_layernorm.weight", _HL + "self_attn.q_norm.weight"),
            Direct(_A + "k_layernorm.weight", _HL + "self_attn.k_norm.weight"),
            self.in_proj_mapping(),
            PerRankParts(_A + "conv1d.weight", (_HG + "conv1d.weight",), sizes=((key, key, value),)),
            Direct(_A + "dt_bias", _HG + "dt_bias", tp_axis=0),
            Direct(_A + "A_log", _HG + "A_log", tp_axis=0),
            Direct(_A + "out_norm.weight", _HG + "norm.weight"),
            Direct(_A + "out_proj.weight", _HG + "out_proj.weight", tp_axis=1),
        ]

    def in_proj_mapping(self) -> Mapping:
        """Gated DeltaNet's input projection: the checkpoint's ``in_proj_qkvz`` and ``in_proj_ba``."""
        hf = self.hf
        return GatedDeltaInProj(
            _A + "in_proj.weight",
            (_HG + "in_proj_qkvz.weight", _HG + "in_proj_ba.weight"),
            key_heads=hf["linear_num_key_heads"],
            value_heads=hf["linear_num_value_heads"],
            key_dim=hf["linear_key_head_dim"],
            value_dim=hf["linear_value_head_dim"],
        )

    def mlp_mappings(self) -> list[Mapping]:
        shared, hf_shared = _L + "mlp.shared_experts.", _HL + "mlp.shared_expert."
        return [
            *super().mlp_mappings(),  # the pre-MLP norm, router and routed experts
            GatedMLP(shared + "linear_fc1.weight", (hf_shared + "gate_proj.weight", hf_shared + "up_proj.weight")),
            Direct(shared + "linear_fc2.weight", hf_shared + "down_proj.weight", tp_axis=1),
            Direct(shared + "gate_weight", _HL + "mlp.shared_expert_gate.weight"),
        ]

    def engine_problem(self, cuda: bool, dtype: str) -> str | None:
        heads = (self.hf["linear_key_head_dim"], self.hf["linear_value_head_dim"])
        return gated_delta_net_problem(cuda, dtype, heads)

    def ignored_hf_tensors(self) -> list[str]:
        return [*super().ignored_hf_tensors(), r"^mtp\."]
