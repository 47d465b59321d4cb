"""Bridges keyed by a config.json's ``architectures[0]`` and ``model_type`` together: one architecture can hold
several families (Kimi-K2 declares DeepSeek-V3's), and a name is never guessed from a substring."""

from __future__ import annotations

from pathlib import Path

from converters.hf_io import read_config
from models.bridge import Bridge
from models.deepseek_v3 import DeepseekV3Bridge
from models.glm4_moe import Glm4MoeBridge
from models.gpt_oss import GptOssBridge
from models.kimi_k2 import KimiK2Bridge
from models.llama import LlamaBridge
from models.qwen2 import Qwen2Bridge
from models.qwen3 import Qwen3Bridge
from models.qwen3_5 import Qwen35MoeBridge
from models.qwen3_moe import Qwen3MoeBridge
from models.qwen3_next import Qwen3NextBridge

FAMILIES = (
    DeepseekV3Bridge,
    Glm4MoeBridge,
    GptOssBridge,
    KimiK2Bridge,
    LlamaBridge,
    Qwen2Bridge,
    Qwen3Bridge,
    Qwen35MoeBridge,
    Qwen3MoeBridge,
    Qwen3NextBridge,
)
# Causal LMs, and the reward models (score head) of the families that have them: a critic starts from either.
BRIDGES: dict[tuple[str, str], type[Bridge]] = {(b.architecture, b.model_type): b for b in FAMILIES} | {
    (b.value_architecture, b.model_type): b for b in FAMILIES if b.value_architecture
}
ARCHITECTURES = sorted({architecture for architecture, _ in BRIDGES})


def get_bridge(hf: dict | str | Path) -> Bridge:
    """The bridge for an HF config dict or model directory; an unknown architecture or model type lists the
    supported ones."""
    config = hf if isinstance(hf, dict) else read_config(hf)
    architectures = config.get("architectures") or []
    if not architectures:
        raise ValueError(f"config has no 'architectures' entry; expected one of {ARCHITECTURES}")
    architecture, model_type = architectures[0], config.get("model_type")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {ARCHITECTURES}")
    if (architecture, model_type) not in BRIDGES:
        types = sorted(t for a, t in BRIDGES if a == architecture)
        raise ValueError(f"{architecture} with model_type {model_type!r} is not supported; expected one of {types}")
    return BRIDGES[architecture, model_type](config)
