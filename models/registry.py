"""Bridges keyed by the HF ``architectures[0]`` of a config.json."""

from __future__ import annotations

from pathlib import Path

from converters.hf_io import read_config
from models.bridge import Bridge
from models.deepseek_v3 import DeepseekV3Bridge
from models.llama import LlamaBridge
from models.qwen2 import Qwen2Bridge
from models.qwen3 import Qwen3Bridge
from models.qwen3_moe import Qwen3MoeBridge

FAMILIES = (DeepseekV3Bridge, LlamaBridge, Qwen2Bridge, Qwen3Bridge, Qwen3MoeBridge)
# Causal LMs, and the reward models (score head) of the families that have them: a critic starts from either.
BRIDGES: dict[str, type[Bridge]] = {b.architecture: b for b in FAMILIES} | {
    b.value_architecture: b for b in FAMILIES if b.value_architecture
}


def get_bridge(hf: dict | str | Path) -> Bridge:
    """The bridge for an HF config dict or model directory; an unknown architecture lists the supported ones."""
    config = hf if isinstance(hf, dict) else read_config(hf)
    architectures = config.get("architectures") or []
    if not architectures:
        raise ValueError(f"config has no 'architectures' entry; expected one of {sorted(BRIDGES)}")
    if architectures[0] not in BRIDGES:
        raise ValueError(f"architecture {architectures[0]!r} is not supported; supported: {sorted(BRIDGES)}")
    return BRIDGES[architectures[0]](config)
