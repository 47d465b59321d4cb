"""Qwen3_5MoeForCausalLM (Qwen3.5's MoE language models: 35B-A3B, 122B-A10B, 397B-A17B): Qwen3-Next's layers
(:mod:`models.qwen3_next`: Gated DeltaNet interleaved with gated attention, a routed MoE with a gated shared expert
in every layer), so the same Megatron model; its checkpoints differ in three ways.

* Gated DeltaNet's input projection is four tensors, each holding all heads in order (``in_proj_qkv``: every key
  head's queries, then keys, then the values; ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), not Qwen3-Next's two
  grouped by key head: :class:`converters.mapping.PerRankParts` gives each TP rank its heads of all six parts.
* The router always renormalises the top k (the config has no ``norm_topk_prob``).
* RoPE is multimodal (``mrope_section`` splits the rotary frequencies over time, height and width positions); a text
  token's three positions are equal, so for the text this model trains it is RoPE.

The released checkpoints are the vision-language ``Qwen3_5MoeForConditionalGeneration`` (the language model under
``model.language_model.``, beside ``model.visual.``); this bridge takes the language model alone, as transformers
and vLLM save and load it (``Qwen3_5MoeForCausalLM``, ``model_type: qwen3_5_moe_text``).
"""

from compat.vllm import qwen3_5_problem
from converters.mapping import Mapping, PerRankParts
from models.qwen3_next import _A, _HG, Qwen3NextBridge


class Qwen35MoeBridge(Qwen3NextBridge):
    architecture = "Qwen3_5MoeForCausalLM"
    model_type = "qwen3_5_moe_text"

    def check_supported(self) -> None:
        super().check_supported()
        if self.hf.get("norm_topk_prob") is False:
            raise ValueError(f"{self.architecture}: norm_topk_prob=False is not Qwen3.5's routing (it renormalises)")

    def extra_config(self) -> dict:
        return super().extra_config() | dict(moe_router_pre_softmax=False)  # top-k, then softmax over the k

    def in_proj_mapping(self) -> Mapping:
        hf = self.hf
        key = hf["linear_key_head_dim"] * hf["linear_num_key_heads"]
        value = hf["linear_value_head_dim"] * hf["linear_num_value_heads"]
        heads = hf["linear_num_value_heads"]
        names = tuple(_HG + f"in_proj_{part}.weight" for part in ("qkv", "z", "b", "a"))
        return PerRankParts(_A + "in_proj.weight", names, sizes=((key, key, value), (value,), (heads,), (heads,)))

    def engine_problem(self, cuda: bool, dtype: str) -> str | None:
        return super().engine_problem(cuda, dtype) or qwen3_5_problem()
