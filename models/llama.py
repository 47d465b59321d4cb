"""LlamaForCausalLM (Llama 2/3, SmolLM2): the base bridge as is."""

from models.bridge import Bridge


class LlamaBridge(Bridge):
    architecture = "LlamaForCausalLM"
    model_type = "llama"
    value_architecture = "LlamaForSequenceClassification"
