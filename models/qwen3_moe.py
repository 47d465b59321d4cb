"""Qwen3MoeForCausalLM (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention, every layer a routed MoE.

Routing: softmax over all experts, top-k, and (``norm_topk_prob``) renormalised over the chosen k; in Megatron
that is top-k first, then softmax over the chosen (``moe_router_pre_softmax=False``). Without renormalisation
it is softmax first (``pre_softmax=True``).
"""

from converters.mapping import Direct, Mapping
from models.bridge import _HL, _L, DENSE_CONFIG, ROUTED_EXPERTS, Bridge

MOE_CONFIG = (
    ("num_experts", "num_moe_experts"),
    ("num_experts_per_tok", "moe_router_topk"),
    ("moe_intermediate_size", "moe_ffn_hidden_size"),
    ("router_aux_loss_coef", "moe_aux_loss_coeff"),
)


class Qwen3MoeBridge(Bridge):
    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"
    value_architecture = "Qwen3MoeForSequenceClassification"
    qk_norm = True
    config_table = DENSE_CONFIG + MOE_CONFIG
    config_aliases = {"num_local_experts": "num_experts"}  # transformers 5's name; released checkpoints differ

    @property
    def num_experts(self) -> int:
        return self.hf["num_experts"]

    def check_supported(self) -> None:
        super().check_supported()
        if self.hf.get("mlp_only_layers") or self.hf.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"{self.architecture}: dense layers (mlp_only_layers, decoder_sparse_step) unsupported")

    def extra_config(self) -> dict:
        aux = float(self.hf.get("router_aux_loss_coef", 0.0))
        return dict(
            moe_router_pre_softmax=not self.hf.get("norm_topk_prob", False),
            moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=True,
            # Megatron requires it; every layer is MoE, so it only matters when config.json omits it.
            ffn_hidden_size=self.hf.get("intermediate_size", self.hf["moe_intermediate_size"]),
        )

    def mlp_mappings(self) -> list[Mapping]:
        return [
            Direct(_L + "pre_mlp_layernorm.weight", _HL + "post_attention_layernorm.weight"),
            *ROUTED_EXPERTS,
        ]
