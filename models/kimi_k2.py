"""Kimi-K2 (1T-A32B, Instruct and Thinking): DeepSeek-V3's layers (``architectures: DeepseekV3ForCausalLM``) under
its own ``model_type: kimi_k2``, which a conversion keeps (vLLM reads it to pick Kimi's tool-call ids and reasoning
parser). transformers has no Kimi-K2 model: its layers are transformers' DeepSeek-V3."""

from models.deepseek_v3 import DeepseekV3Bridge


class KimiK2Bridge(DeepseekV3Bridge):
    model_type = "kimi_k2"
    transformers_model_type = "deepseek_v3"
