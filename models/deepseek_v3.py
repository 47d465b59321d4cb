"""DeepseekV3ForCausalLM (DeepSeek-V3/R1 671B, Moonlight-16B-A3B): multi-latent attention and DeepSeek MoE.

* MLA: optional query LoRA (``q_lora_rank``; Moonlight has none), a key/value latent of ``kv_lora_rank`` with a
  shared rotary key of ``qk_rope_head_dim``, YaRN or plain RoPE. Rotary rows are interleaved in Megatron and in
  DeepSeek's checkpoints; checkpoints saved with ``rope_interleave=False`` are permuted on the way
  (:class:`converters.mapping.RopeRows`).
* MoE: sigmoid scores, expert bias for selection only (``noaux_tc``: ``e_score_correction_bias`` <-> the router's
  ``expert_bias``), group-limited top-k, top-k renormalised and scaled by ``routed_scaling_factor``, shared
  experts, and ``first_k_dense_replace`` dense layers first.
* RL defaults: no load-balancing loss and no expert-bias updates (the router stays the checkpoint's); they are
  not configurable yet.
* Multi-token-prediction layers (``num_nextn_predict_layers``; ``model.layers.{num_hidden_layers}..``) are
  Megatron's MTP block (:mod:`models.mtp`, mappings: :meth:`models.bridge.Bridge.mtp_mappings`).
"""

from __future__ import annotations

from compat.vllm import mla_engine_args
from converters.mapping import Direct, GatedMLP, Mapping, RopeRows
from models.bridge import _HL, _L, DECODER_CONFIG, ROUTED_EXPERTS, Bridge

MLA_CONFIG = DECODER_CONFIG + (
    ("q_lora_rank", "q_lora_rank"),
    ("kv_lora_rank", "kv_lora_rank"),
    ("qk_nope_head_dim", "qk_head_dim"),
    ("qk_rope_head_dim", "qk_pos_emb_head_dim"),
    ("v_head_dim", "v_head_dim"),
    ("n_routed_experts", "num_moe_experts"),
    ("num_experts_per_tok", "moe_router_topk"),
    ("moe_intermediate_size", "moe_ffn_hidden_size"),
    ("routed_scaling_factor", "moe_router_topk_scaling_factor"),
)

# HF YaRN parameter -> MLATransformerConfig field
YARN = (
    ("factor", "rotary_scaling_factor"),
    ("original_max_position_embeddings", "original_max_position_embeddings"),
    ("beta_fast", "beta_fast"),
    ("beta_slow", "beta_slow"),
    ("mscale", "mscale"),
    ("mscale_all_dim", "mscale_all_dim"),
)

_A = _L + "self_attention."
_HA = _HL + "self_attn."


class DeepseekV3Bridge(Bridge):
    architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"
    mla = True
    config_table = MLA_CONFIG
    qk_norm = True  # MLA's latent norms (q_a_layernorm, kv_a_layernorm)
    rope_types = ("default", "yarn")
    config_aliases = {"num_local_experts": "n_routed_experts"}  # transformers 5's name; released checkpoints differ

    @property
    def num_experts(self) -> int:
        return self.hf["n_routed_experts"]

    @property
    def num_mtp_layers(self) -> int:
        return int(self.hf.get("num_nextn_predict_layers", self.hf.get("num_mtp_layers", 0)) or 0)

    @property
    def first_dense(self) -> int:
        return int(self.hf.get("first_k_dense_replace", 0))

    def check_supported(self) -> None:
        super().check_supported()
        hf = self.hf
        if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"{self.architecture}: only scoring_func='sigmoid' with topk_method='noaux_tc'")
        if not hf.get("norm_topk_prob", True) and hf["num_experts_per_tok"] > 1:
            raise ValueError(f"{self.architecture}: norm_topk_prob=False is not supported (Megatron renormalises)")
        groups = hf.get("n_group") or 1
        if groups > 1 and hf["num_experts_per_tok"] != 2 * hf["topk_group"]:
            # HF scores a group by its top-2 experts; Megatron by its top (topk / topk_group).
            raise ValueError(
                f"{self.architecture}: n_group={groups} needs num_experts_per_tok == 2 * topk_group "
                f"(got {hf['num_experts_per_tok']} and {hf['topk_group']})"
            )
        if hf.get("attention_bias"):
            raise ValueError(f"{self.architecture}: attention_bias=True is not supported")

    def extra_config(self) -> dict:
        hf = self.hf
        layers = hf["num_hidden_layers"]
        groups = hf.get("n_group") or 1
        rope = {"rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
        if self.rope_type == "yarn":
            rope = {"rope_type": "yarn"} | {
                mcore: self.rope_scaling[key] for key, mcore in YARN if key in self.rope_scaling
            }
        shared = hf.get("n_shared_experts") or 0
        return rope | dict(
            num_query_groups=hf["num_attention_heads"],
            rotary_base=self.rope_theta,
            moe_layer_freq=[0] * self.first_dense + [1] * (layers - self.first_dense),
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0,
            moe_router_num_groups=groups if groups > 1 else None,
            moe_router_group_topk=hf["topk_group"] if groups > 1 else None,
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_shared_expert_intermediate_size=hf["moe_intermediate_size"] * shared if shared else None,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=True,
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

    def mlp_mappings(self) -> list[Mapping]:
        shared = _L + "mlp.shared_experts."
        return [
            *super().mlp_mappings(),  # the first_k_dense_replace dense layers
            *ROUTED_EXPERTS,
            Direct(_L + "mlp.router.expert_bias", _HL + "mlp.gate.e_score_correction_bias"),
            GatedMLP(
                shared + "linear_fc1.weight",
                (_HL + "mlp.shared_experts.gate_proj.weight", _HL + "mlp.shared_experts.up_proj.weight"),
            ),
            Direct(shared + "linear_fc2.weight", _HL + "mlp.shared_experts.down_proj.weight", tp_axis=1),
        ]

    def rollout_engine_args(self, cuda: bool) -> dict:
        return mla_engine_args(cuda, self.rope_type)
