"""DeepSeek's MoE as its descendants' checkpoints declare it (DeepSeek-V3, Kimi-K2, GLM-4.5): the layers' MLPs and the
multi-token-prediction layers, shared by those families' bridges.

* sigmoid scores, expert bias for selection only (``noaux_tc``: ``e_score_correction_bias`` <-> the router's
  ``expert_bias``), group-limited top-k, top-k renormalised and scaled by ``routed_scaling_factor``;
* ``n_shared_experts`` shared experts beside the routed ones, ``first_k_dense_replace`` dense layers first;
* multi-token-prediction layers (``num_nextn_predict_layers``; ``model.layers.{num_hidden_layers}..``) become
  Megatron's MTP block (:mod:`models.mtp`, mappings: :meth:`models.bridge.Bridge.mtp_mappings`).

RL defaults: no load-balancing loss and no expert-bias updates (the router stays the checkpoint's;
``models.policy_trainer.moe`` turns them on).
"""

from __future__ import annotations

from converters.mapping import Direct, GatedMLP, Mapping
from models.bridge import _HL, _L, ROUTED_EXPERTS, Bridge

SIGMOID_MOE_CONFIG: tuple[tuple[str, str], ...] = (
    ("n_routed_experts", "num_moe_experts"),
    ("num_experts_per_tok", "moe_router_topk"),
    ("moe_intermediate_size", "moe_ffn_hidden_size"),
    ("routed_scaling_factor", "moe_router_topk_scaling_factor"),
)


class SigmoidMoE(Bridge):
    """A bridge whose layers after the first dense ones are DeepSeek's MoE (see the module docstring)."""

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

    def extra_config(self) -> dict:
        hf = self.hf
        layers = hf["num_hidden_layers"]
        groups = hf.get("n_group") or 1
        shared = hf.get("n_shared_experts") or 0
        return dict(
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
