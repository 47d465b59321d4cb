"""PEFT's LoRA adapter format, as mcore-rl writes it: by ``mcore2hf`` (an adapter directory) and by the adapter-only
weight sync (the same tensors, streamed to an engine that serves LoRA).

A Megatron adapter covers one Megatron weight, which may hold several HF weights (``linear_qkv``: q/k/v,
``linear_fc1``: gate/up). Each of those gets the adapter's ``A``, shared, and its own rows of ``B``, split by the
weight's mapping: ``B A`` restricted to those rows is exactly the HF weight's share of the update. Read back
(:class:`PeftAdapter`, for ``hf2mcore --peft``), an adapter must have that form: every HF weight of an adapted
Megatron weight adapted, with one ``A``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from converters.mapping import Mapping, MappingTable

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


# PEFT settings whose other values change what the adapter computes (mcore-rl's adapters are plain LoRA)
_PLAIN = {"use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "bias": "none", "rank_pattern": {},
          "alpha_pattern": {}, "modules_to_save": None, "layers_to_transform": None}  # fmt: skip
_FACTORS = (".lora_A.weight", ".lora_B.weight")


class PeftAdapter:
    """A PEFT LoRA adapter directory read onto a model's Megatron weights (``weights``: their global names, as the
    mappings of ``table`` speak): ``adapted`` maps each adapted Megatron weight to its HF modules. Every problem
    found (settings, names, factors that cannot form mcore-rl's adapters) is one ``ValueError`` naming the
    directory."""

    def __init__(self, directory: Path, table: MappingTable, weights: list[str]):
        self.dir, self.table = directory, table
        try:
            config = json.loads((directory / CONFIG).read_text())
            self._file = safe_open(str(directory / WEIGHTS), "pt")
        except (OSError, ValueError) as err:
            raise ValueError(f"{directory}: not a readable PEFT adapter ({err})") from None
        self.rank, self.alpha = int(config.get("r", 0)), float(config.get("lora_alpha", 0))
        problems = [f"{CONFIG}: peft_type {config.get('peft_type')!r}, expected 'LORA'"]
        problems = problems if config.get("peft_type") != "LORA" else []
        problems += [
            f"{CONFIG}: {key}={config[key]!r}, expected {plain!r} (mcore-rl's adapters are plain LoRA)"
            for key, plain in _PLAIN.items()
            if config.get(key) not in (None, plain)
        ]
        if self.rank < 1 or self.alpha <= 0:
            problems.append(f"{CONFIG}: r={self.rank}, lora_alpha={self.alpha}; expected r >= 1 and lora_alpha > 0")
        modules = set()
        for name in self._file.keys():
            if name.startswith(PREFIX) and name.endswith(_FACTORS):
                modules.add(name.removeprefix(PREFIX).rsplit(".", 2)[0])
            else:
                problems.append(f"{name}: not a LoRA factor ({PREFIX}<module>.lora_A.weight or .lora_B.weight)")
        self.adapted: dict[str, list[str]] = {}
        for weight in weights:
            mapping, captures = table.resolve(weight)
            hf = [n.removesuffix(".weight") for n in mapping.hf_names(captures)]
            present = [m for m in hf if m in modules]
            if present and present != hf:
                missing = [m for m in hf if m not in present]
                problems.append(f"{weight}: adapts {present} but not {missing}; its HF weights are adapted together")
            elif present:
                self.adapted[weight] = hf
        covered = {m for hf in self.adapted.values() for m in hf}
        problems += [f"{m}: no weight of this model that mcore-rl adapts" for m in sorted(modules - covered)]
        for weight, hf in self.adapted.items():
            if len(hf) > 1 and not all(torch.equal(self._get(hf[0], "A"), self._get(m, "A")) for m in hf[1:]):
                problems.append(f"{weight}: the lora_A of {hf} differ; mcore-rl's adapter of it has one A")
        if problems:
            raise ValueError(f"{directory}: cannot continue from this PEFT adapter:\n  " + "\n  ".join(problems))

    def _get(self, module: str, factor: str) -> torch.Tensor:
        return self._file.get_tensor(f"{PREFIX}{module}.lora_{factor}.weight")

    def dtype(self, weight: str) -> torch.dtype:
        return self._get(self.adapted[weight][0], "A").dtype

    def factor(self, weight: str, factor: str, shape: torch.Size) -> torch.Tensor:
        """``a`` (shared by the weight's HF modules) or ``b`` (their rows, laid out as the weight's) of ``weight``."""
        modules = self.adapted[weight]
        if factor == "a":
            return self._get(modules[0], "A")
        mapping, _ = self.table.resolve(weight)
        return mapping.to_megatron([self._get(m, "B") for m in modules], 1, shape)
