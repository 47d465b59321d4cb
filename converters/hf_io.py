"""Reading Hugging Face checkpoint directories (config.json + safetensors, single file or sharded with an index)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; expected a Hugging Face model directory with config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: invalid JSON at line {err.lineno}: {err.msg}") from err


class HFCheckpoint:
    """Lazy, per-tensor access to a checkpoint's safetensors: a rank reads only the tensors it asks for."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index = self.dir / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / SINGLE_FILE).is_file():
            with safe_open(self.dir / SINGLE_FILE, framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
        else:
            raise FileNotFoundError(f"{self.dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, object] = {}

    def names(self) -> set[str]:
        return set(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        file = self.weight_map.get(name)
        if file is None:
            raise KeyError(f"{self.dir}: tensor {name!r} is not in the checkpoint")
        if file not in self._handles:
            path = self.dir / file
            if not path.is_file():
                raise FileNotFoundError(f"{path}: listed in {INDEX_FILE} for {name!r} but missing")
            self._handles[file] = safe_open(path, framework="pt")
        return self._handles[file].get_tensor(name)
