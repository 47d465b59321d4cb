"""PEFT's LoRA adapter format, as mcore-rl writes it: by ``mcore2hf`` (an adapter directory) and by the adapter-only
weight sync (the same tensors, streamed to an engine that serves LoRA).

A Megatron adapter covers one Megatron weight, which may hold several HF weights (``linear_qkv``: q/k/v,
``linear_fc1``: gate/up). Each of those gets the adapter's ``A``, shared, and its own rows of ``B``, split by the
weight's mapping: ``B A`` restricted to those rows is exactly the HF weight's share of the update.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from converters.mapping import Mapping

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's name for the wrapped model


def peft_tensors(
    mapping: Mapping, captures, a: torch.Tensor, b: torch.Tensor, split_over: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(PEFT name, tensor)`` of one Megatron weight's adapter: ``a`` [r, in] and ``b`` [out, r] whole, ``b``'s
    rows laid out as the weight's are when split over ``split_over`` TP ranks (gate/up per rank)."""
    for hf_name, rows in zip(mapping.hf_names(captures), mapping.to_hf(b, split_over), strict=True):
        module = PREFIX + hf_name.removesuffix(".weight")
        yield f"{module}.lora_A.weight", a
        yield f"{module}.lora_B.weight", rows


def target_modules(names) -> list[str]:
    """The ``target_modules`` of an adapter holding the PEFT tensors ``names`` (q_proj, down_proj, ...)."""
    return sorted({name.rsplit(".", 3)[-3] for name in names})


def peft_config(rank: int, alpha: float, modules: list[str], base: str) -> dict:
    """``adapter_config.json`` of a LoRA adapter over the HF model ``base`` (PEFT's defaults otherwise)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
        "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": modules, "use_rslora": False, "init_lora_weights": True,
    }  # fmt: skip
