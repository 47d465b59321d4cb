"""Glm4MoeForCausalLM (GLM-4.5 355B-A32B, GLM-4.5-Air 106B-A12B, GLM-4.6): grouped-query attention with q/k/v biases,
RoPE on part of each head (``partial_rotary_factor``, rotate-half on its first dims, as Megatron's
``rotary_percent``), optional q/k norms (``use_qk_norm``), and DeepSeek's MoE with shared experts, first dense layers
and MTP layers (:class:`models.sigmoid_moe.SigmoidMoE`)."""

from models.bridge import DENSE_CONFIG
from models.sigmoid_moe import SIGMOID_MOE_CONFIG, SigmoidMoE


class Glm4MoeBridge(SigmoidMoE):
    architecture = "Glm4MoeForCausalLM"
    model_type = "glm4_moe"
    config_table = DENSE_CONFIG + SIGMOID_MOE_CONFIG

    @property
    def qk_norm(self) -> bool:
        return bool(self.hf.get("use_qk_norm", False))
