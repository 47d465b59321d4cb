"""Which Megatron parameters this rank holds, under their global names.

Megatron names layers per pipeline chunk (``decoder.layers.0`` is the chunk's first layer) and experts per EP
rank (``local_experts.0`` is this rank's first expert). Mappings speak global names, so this module renames:
layer i of a chunk -> ``layer_number - 1`` of that layer; local expert j on EP rank r -> ``r * E/EP + j``.
Example: 8 experts, EP=2: rank 1's ``local_experts.3`` is global expert 7.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class LocalParam:
    """One parameter held by this rank.

    Attributes:
        slot: name with the global layer index but the *local* expert index; identical on every EP rank, so
            it is the key under which EP ranks exchange their experts.
        param: the (sharded) parameter.
        is_expert: held by an expert module (sharded over EP and expert-TP instead of TP).
        tp_axis: Megatron's own ``partition_dim`` when the parameter is tensor-parallel, else ``None``.
    """

    slot: str
    param: torch.Tensor
    is_expert: bool
    tp_axis: int | None


def global_expert_name(slot: str, ep_rank: int, num_local_experts: int) -> str:
    return _EXPERT.sub(lambda m: f".local_experts.{ep_rank * num_local_experts + int(m.group(1))}.", slot)


ADAPTERS = "lora."  # the module of a chunk's LoRA adapters (their parameters' and checkpoint keys' prefix)
MTP = "mtp."  # Megatron's multi-token-prediction block (its parameters' and checkpoint keys' prefix; models/mtp.py)


def adapter_key(slot: str) -> str:
    """The key of the LoRA adapter of the linear ``slot`` (its global name) in its chunk's ``lora`` module, where
    names hold no dots; :func:`adapted_slot` inverts it (Megatron's names hold no double underscores)."""
    return slot.replace(".", "__")


def adapted_slot(key: str) -> str:
    return key.replace("__", ".")


def router_copy(key: str) -> bool:
    """Whether the checkpoint key ``key`` holds a trained router's copy as loaded (``lora.<router key>.weight``, ...:
    models.lora.RouterCopy) rather than an adapter's factor (``lora.<key>.a``/``.b``)."""
    return key.startswith(ADAPTERS) and key.rsplit(".", 1)[-1] not in ("a", "b")


# Buffers that HF checkpoints hold as weights: the router's expert bias (DeepSeek's e_score_correction_bias).
_CHECKPOINTED_BUFFERS = ("expert_bias",)


def _checkpointed_buffers(chunk: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, b) for n, b in chunk.named_buffers() if n.rsplit(".", 1)[-1] in _CHECKPOINTED_BUFFERS]


def local_params(chunks: list[torch.nn.Module]) -> list[LocalParam]:
    """Every parameter (and checkpointed buffer) of this rank's model chunks (unwrapped GPTModels), keyed by slot;
    LoRA adapters are not the model's."""
    out = []
    for chunk in chunks:
        experts = {id(p) for m in chunk.modules() if getattr(m, "is_expert", False) for p in m.parameters()}
        layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
        for name, param in [*chunk.named_parameters(), *_checkpointed_buffers(chunk)]:
            if name.startswith(ADAPTERS):  # LoRA's (models/lora.py): trained beside the model, not its tensors
                continue
            match = _LAYER.match(name)
            if match:
                layer_number = layers[int(match.group(1))].layer_number
                name = f"decoder.layers.{layer_number - 1}." + name[match.end() :]
            tp_axis = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
            out.append(LocalParam(name, param, id(param) in experts, tp_axis))
    return out
