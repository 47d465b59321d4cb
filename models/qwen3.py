"""Qwen3ForCausalLM: Llama layout with RMSNorm on each head's queries and keys (qk-norm)."""

from models.bridge import Bridge


class Qwen3Bridge(Bridge):
    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    value_architecture = "Qwen3ForSequenceClassification"
    qk_norm = True
