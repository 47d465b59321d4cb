"""Qwen2ForCausalLM (Qwen2, Qwen2.5): Llama layout with biases on q/k/v (no config flag for them)."""

from models.bridge import Bridge


class Qwen2Bridge(Bridge):
    architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"
    value_architecture = "Qwen2ForSequenceClassification"
    qkv_bias = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.hf.get("use_sliding_window", False):
            raise ValueError("Qwen2ForCausalLM: use_sliding_window=True is not supported")
