"""DeepseekV3ForCausalLM (DeepSeek-V3/R1 671B, Moonlight-16B-A3B): multi-latent attention and DeepSeek's MoE.

* MLA: optional query LoRA (``q_lora_rank``; Moonlight has none), a key/value latent of ``kv_lora_rank`` with a
  shared rotary key of ``qk_rope_head_dim``, YaRN or plain RoPE. Rotary rows are interleaved in Megatron and in
  DeepSeek's checkpoints; checkpoints saved with ``rope_interleave=False`` are permuted on the way
  (:class:`converters.mapping.RopeRows`).
* MoE, shared experts, first dense layers and MTP layers: :class:`models.sigmoid_moe.SigmoidMoE`.
"""

from __future__ import annotations

from compat.vllm import mla_engine_args
from converters.mapping import Direct, Mapping, RopeRows
from models.bridge import _HL, _L, DECODER_CONFIG, YARN
from models.sigmoid_moe import SIGMOID_MOE_CONFIG, SigmoidMoE

MLA_CONFIG = (
    DECODER_CONFIG
    + (
        ("q_lora_rank", "q_lora_rank"),
        ("kv_lora_rank", "kv_lora_rank"),
        ("qk_nope_head_dim", "qk_head_dim"),
        ("qk_rope_head_dim", "qk_pos_emb_head_dim"),
        ("v_head_dim", "v_head_dim"),
    )
    + SIGMOID_MOE_CONFIG
)

_A = _L + "self_attention."
_HA = _HL + "self_attn."


class DeepseekV3Bridge(SigmoidMoE):
    architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"
    mla = True
    config_table = MLA_CONFIG
    qk_norm = True  # MLA's latent norms (q_a_layernorm, kv_a_layernorm)
    rope_types = ("default", "yarn")

    def check_supported(self) -> None:
        super().check_supported()
        if self.hf.get("attention_bias"):
            raise ValueError(f"{self.architecture}: attention_bias=True is not supported")

    def extra_config(self) -> dict:
        rope = {"rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
        if self.rope_type == "yarn":
            rope = {"rope_type": "yarn"} | {
                mcore: self.rope_scaling[key] for key, mcore in YARN if key in self.rope_scaling
            }
        return (
            super().extra_config()
            | rope
            | dict(num_query_groups=self.hf["num_attention_heads"], rotary_base=self.rope_theta)
        )

    # ---- mappings -----------------------------------------------------------------------------------------
    def _rope_rows(self, megatron: str, hf: str, period: int, offset: int, tp_axis: int | None = None) -> Mapping:
        if self.hf.get("rope_interleave", True):  # Megatron's own layout
            return Direct(megatron, hf, tp_axis=tp_axis)
        rope = self.hf["qk_rope_head_dim"]
        return RopeRows(megatron, (hf,), tp_axis=tp_axis, period=period, offset=offset, rope_dim=rope)

    def attention_mappings(self) -> list[Mapping]:
        hf = self.hf
        nope, rope = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
        kv_lora = hf["kv_lora_rank"]
        out = [
            self._rope_rows(
                _A + "linear_kv_down_proj.weight", _HA + "kv_a_proj_with_mqa.weight", kv_lora + rope, kv_lora
            ),
            Direct(_A + "kv_layernorm.weight", _HA + "kv_a_layernorm.weight"),
            Direct(_A + "linear_kv_up_proj.weight", _HA + "kv_b_proj.weight", tp_axis=0),
            # TransformerEngine fuses the latent norms into the up projections.
            Direct(_A + "linear_kv_up_proj.layer_norm_weight", _HA + "kv_a_layernorm.weight"),
        ]
        if hf.get("q_lora_rank"):
            return out + [
                Direct(_A + "linear_q_down_proj.weight", _HA + "q_a_proj.weight"),
                Direct(_A + "q_layernorm.weight", _HA + "q_a_layernorm.weight"),
                self._rope_rows(_A + "linear_q_up_proj.weight", _HA + "q_b_proj.weight", nope + rope, nope, tp_axis=0),
                Direct(_A + "linear_q_up_proj.layer_norm_weight", _HA + "q_a_layernorm.weight"),
            ]
        return out + [self._rope_rows(_A + "linear_q_proj.weight", _HA + "q_proj.weight", nope + rope, nope, tp_axis=0)]

    def rollout_engine_args(self, cuda: bool) -> dict:
        return mla_engine_args(cuda, self.rope_type)
